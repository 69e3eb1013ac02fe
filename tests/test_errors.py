"""Errors raised inside a stage reach the user as themselves, stage named."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.distributed import diagnosis

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


class CheckFinite(keras.layers.Layer):
    """Raises InvalidArgumentError at run time when its input is not finite."""

    def call(self, x):
        return tf.debugging.check_numerics(x, "stage 1 got a non-finite value")


def _model(devices, extra=()):
    stages = [keras.Sequential([keras.layers.Dense(16, activation="relu")]),
              keras.Sequential([*extra, keras.layers.Dense(3)])]
    model = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                     num_micro_batches=2)
    model.compile("adam", "mse")
    return model


def _calls(model, x, y):
    return {"fit": lambda: model.fit(x, y, batch_size=8, verbose=0),
            "evaluate": lambda: model.evaluate(x, y, batch_size=8, verbose=0),
            "predict": lambda: model.predict(x, batch_size=8, verbose=0)}


def test_wrong_input_width_after_tracing_names_stage_and_shapes(devices):
    # Broke: after two traces Keras relaxes the input shape to (None, None),
    # the width check moves to run time, and TF reported
    # "CancelledError: RecvAsync is cancelled" for fit, evaluate and predict.
    model = _model(devices)
    y = np.ones((16, 3), "float32")
    for rows in (8, 4):  # Two batch sizes: Keras relaxes the traced shapes.
        x = np.ones((16, 8), "float32")
        model.fit(x, y, batch_size=rows, verbose=0)
        model.evaluate(x, y, batch_size=rows, verbose=0)
        model.predict(x, batch_size=rows, verbose=0)
    for action, call in _calls(model, np.ones((16, 9), "float32"), y).items():
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(
            f"Stage 0 ('{model.stages[0].name}') on {devices[0]} failed "
            f"during {action}:"), message
        assert "expected axis -1 of input shape to have value 8" in message
        assert "(8, 9)" in message
        assert (info.value.stage, info.value.device) == (0, devices[0])
        assert isinstance(info.value.__cause__, tf.errors.OpError)
        assert diagnosis.is_derived(info.value.__cause__)


def test_run_time_op_error_keeps_its_type_and_names_stage(devices):
    model = _model(devices, extra=[CheckFinite()])
    x = np.ones((16, 8), "float32")
    y = np.ones((16, 3), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    x[:, 0] = np.inf  # Dense(relu) passes inf on to stage 1.
    for call in _calls(model, x, y).values():
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            call()
        message = info.value.message
        assert message.startswith(
            f"Stage 1 ('{model.stages[1].name}') on {devices[1]}"), message
        assert "stage 1 got a non-finite value" in message
        assert "RecvAsync is cancelled" not in message
        assert info.value.stage == 1
