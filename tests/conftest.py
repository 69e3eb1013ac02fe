"""Shared test set-up: quiet TF, 4 logical CPU devices, a seed per test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

import keras_pipe  # noqa: E402

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


# The fast tier (`python -m pytest -q -m "not slow" tests`): pure tests,
# argument checks and small transparency checks, under ~90 s on 2 cores.
# A test is fast unless marked: long ones carry `@pytest.mark.slow`, or
# their module `pytestmark = pytest.mark.slow`.


# The longest files, longest first: seconds of one full suite run
# (`-n 2 --dist loadfile --durations=400 --junitxml`, summed per file, on 2
# cores shared with another helper's memory-table runs: 881 passed in
# 956 s wall, 1866 s of tests, at 12cc018, an empty cost cache;
# test_sparse_gradients' 157 s less one 68 s stall of a case that takes
# 1 s alone, not reproduced). With `--dist loadfile` xdist hands out whole
# files in the order the workers collect them; by default it sorts them
# by their number of tests, which leaves long files of few tests (the
# examples, the snippets) for last. Longest first, the two workers end
# together (this run: 932 and 934 s of tests). (*) The snippets run in
# children of a warm process since (tests/support/snippets.py): the file
# alone, back to back on a loaded host, 209 s before and 132 s after.
LONGEST_FILES = (
    "test_zoo.py",                  # 305 s
    "test_cluster.py",              # 144
    "test_readme_snippets.py",      # 211; 132 with the warm process (*)
    "test_memory_tables.py",        # 125
    "test_saving.py",               # 118
    "test_examples.py",             # 116
    "test_transparency.py",         # 108
    "test_generate.py",             # 120 (quiet host, alone)
    "test_sparse_gradients.py",     # 89
    "test_invariance.py",           # 76
    "test_recovery.py",             # 70 (half of 139 on a loaded host)
    "test_heap.py",                 # 60
    "test_every_schedule.py",       # 41
    "test_worker_memory.py",        # 40
    "test_partition.py",            # 38
    "test_attached.py",             # 33
    "test_bad_inputs.py",           # 29
    "test_benchmark.py",            # 27
    "test_placement.py",            # 23
    "test_executor.py",             # 22
    "test_timeline.py",             # 21
    "test_remat_per_stage.py",      # 21
    "test_local.py",                # 20
    "test_keras_hub.py",            # 20
    "test_remat.py",                # 16
    "test_autoplan.py",             # 14
    "test_verify.py",               # 13
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
