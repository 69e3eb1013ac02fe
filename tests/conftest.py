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


def pytest_collection_modifyitems(config, items):
    """Leaves out the `zoo` cases unless `-m` names them (`-m zoo`).

    They take no path the suite's zoo cases do not (tests/test_zoo.py);
    the README's test command runs without them.
    """
    if "zoo" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("zoo") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if item not in kept])
        items[:] = kept
