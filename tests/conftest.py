"""Shared test set-up: quiet TF, 4 logical CPU devices, a seed per test."""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# XLA's executables kept on disk for the test session (xdist's workers and
# the children of tests inherit the setting): the tests compile the same
# tiny functions (a tiny GPT-2's decode tick, an optimizer update) many
# times over, each time for a new model.
_XLA_CACHE = None
if "TF_XLA_FLAGS" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="keras_pipe_tests_xla_")
    os.environ["TF_XLA_FLAGS"] = (
        f"--tf_xla_persistent_cache_directory={_XLA_CACHE}")

import keras  # noqa: E402
import pytest  # noqa: E402

import keras_pipe  # noqa: E402
from tests.support.warm import GC_THRESHOLDS  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)  # tests/support/warm.py says why

NUM_DEVICES = 4
# Enough inter-op threads for every stage to wait at once (schedule test).
DEVICES = keras_pipe.logical_cpu_devices(NUM_DEVICES, inter_op_threads=16)


@pytest.fixture
def devices():
    """The logical CPU devices created for the session."""
    return list(DEVICES)


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


# The fast tier (`python -m pytest -q -n 2 -m "not slow" tests`): pure tests,
# argument checks and small transparency checks, under ~90 s on 2 cores.
# A test is fast unless marked: long ones carry `@pytest.mark.slow`, or
# their module `pytestmark = pytest.mark.slow`.


# The longest files, longest first: seconds of one full suite run
# (the README's command with `--junitxml`, summed per file: 983 passed
# in 1399 s wall, 2680 s of tests, at load 4-5 from other work on the
# 2 cores, so about 1.7x a quiet host's). With `--dist loadfile` xdist
# hands out whole files in the order the workers collect them; by
# default it sorts them by their number of tests, which leaves long
# files of few tests (the examples, the snippets) for last. Longest
# first, the two workers end together. test_autoplan and test_generate
# time loops and decode loops: the load stretches them most.
LONGEST_FILES = (
    "test_generate.py",             # 213 s
    "test_zoo.py",                  # 207
    "test_readme_snippets.py",      # 206
    "test_autoplan.py",             # 193
    "test_transparency.py",         # 148
    "test_recovery.py",             # 132
    "test_cluster.py",              # 116
    "test_examples.py",             # 90
    "test_sparse_gradients.py",     # 85
    "test_partition.py",            # 84
    "test_memory_tables.py",        # 83
    "test_saving.py",               # 80
    "test_every_schedule.py",       # 76
    "test_bad_inputs.py",           # 65
    "test_attached.py",             # 64
    "test_inference.py",            # 55
    "test_heap.py",                 # 53
    "test_invariance.py",           # 53
    "test_keras_hub.py",            # 48
    "test_worker_memory.py",        # 46
    "test_benchmark.py",            # 46
    "test_placement.py",            # 41
    "test_budget.py",               # 41
    "test_executor.py",             # 39
    "test_remat.py",                # 34
    "test_timeline.py",             # 32
    "test_verify.py",               # 30
)


def pytest_configure(config):
    """Keeps the file order below under `--dist loadfile` (no re-sort)."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def _longest_first(items):
    """`items` with `LONGEST_FILES` first, then the others by test count."""
    counts = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def key(item):
        name = item.path.name
        if name in LONGEST_FILES:
            return (LONGEST_FILES.index(name), 0, "")
        return (len(LONGEST_FILES), -counts[name], name)

    items.sort(key=key)  # stable: each file's tests keep their order


def pytest_sessionfinish(session):
    """Freezes the heap the tests leave: pytest's last collections (it
    collects several times at the end to report exceptions raised in
    finalizers, as warnings) and the interpreter's then skip every graph the
    process traced instead of walking it again. Removes the XLA cache."""
    gc.freeze()
    if _XLA_CACHE is not None:  # the process that made it
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Leaves out the `zoo` cases unless `-m` names them (`-m zoo`).

    They take no path the suite's zoo cases do not (tests/test_zoo.py);
    the README's test command runs without them. Under xdist, orders the
    files longest first (`LONGEST_FILES`).
    """
    if hasattr(config, "workerinput"):
        _longest_first(items)
    if "zoo" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("zoo") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if item not in kept])
        items[:] = kept
