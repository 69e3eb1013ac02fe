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
# Every other test is marked slow here; the full suite runs them all.
FAST_MODULES = {
    "test_balance", "test_bad_inputs", "test_benchmark", "test_budget",
    "test_internals", "test_memory", "test_microbatch", "test_schedule",
    "test_shapes", "test_structure", "test_validation", "test_weight_grad",
}
FAST_TESTS = {
    ("test_transparency", "test_stages_and_micro_batches"),
    ("test_executor", "test_registered_schedule_is_followed"),
    ("test_executor", "test_per_stage_remat_is_exact"),
}


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        name = item.originalname or item.name
        if module not in FAST_MODULES and (module, name) not in FAST_TESTS:
            item.add_marker(pytest.mark.slow)
