"""Pipelined inference: predict, evaluate and validation equal the unsplit
model's, one stream of micro-batches per step function call."""

import os
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe import placed_data
from keras_pipe.distributed import cluster
from tests.support import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The schedule families and the device of each stage (2 or 4 stages).
LAYOUTS = {"gpipe": (0, 1), "1f1b": (0, 1), "zb_h1": (0, 1),
           "interleaved_1f1b": (0, 1, 0, 1), "zbv": (0, 1, 1, 0)}


def _layers(num_layers=4):
    return [keras.layers.Dense(16, activation="relu")
            for _ in range(num_layers - 1)] + [keras.layers.Dense(3)]


def _pair(devices, schedule="gpipe", num_micro_batches=2, **compile_args):
    """An unsplit model and a pipeline sharing its layers, both compiled."""
    layers = _layers()
    plain = keras.Sequential([keras.Input((8,))] + layers)
    order = LAYOUTS[schedule]
    per = len(layers) // len(order)
    stages = [keras.Sequential(layers[j * per:(j + 1) * per])
              for j in range(len(order))]
    pipe = keras_pipe.PipelineModel(
        stages, devices=[devices[d] for d in order],
        num_micro_batches=num_micro_batches, schedule=schedule)
    pipe.build((None, 8))
    for model in (plain, pipe):
        model.compile("sgd", "mse", metrics=["mae"], **compile_args)
    return plain, pipe


def _data(rows=37):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, 8)).astype("float32"),
            rng.normal(size=(rows, 3)).astype("float32"))


# Inference runs every schedule in GPipe order (`model/inference.py`): what
# differs is the stages' layout. The fast tier takes each layout once
# (gpipe for the three of 2 stages); the full suite every schedule.
_SAME_LAYOUT_AS_GPIPE = {"1f1b", "zb_h1"}


@pytest.mark.parametrize("schedule", [
    pytest.param(s, marks=pytest.mark.slow if s in _SAME_LAYOUT_AS_GPIPE
                 else ()) for s in sorted(LAYOUTS)])
def test_predict_and_evaluate_equal_unsplit(devices, schedule):
    plain, pipe = _pair(devices, schedule)
    x, y = _data()
    np.testing.assert_allclose(pipe.predict(x, batch_size=8, verbose=0),
                               plain.predict(x, batch_size=8, verbose=0),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        pipe.evaluate(x, y, batch_size=8, verbose=0),
        plain.evaluate(x, y, batch_size=8, verbose=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("micro_batches,steps", [(3, 1), (4, 3), (1, 2),
                                                 ("auto", "auto")])
def test_settings_and_uneven_batches(devices, micro_batches, steps):
    # 37 rows in batches of 10: a last batch of 7, not divisible by M.
    plain, pipe = _pair(devices)
    pipe.inference_micro_batches = micro_batches
    pipe.inference_steps_per_execution = steps
    x, y = _data()
    np.testing.assert_allclose(pipe.predict(x, batch_size=10, verbose=0),
                               plain.predict(x, batch_size=10, verbose=0),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        pipe.evaluate(x, y, batch_size=10, verbose=0),
        plain.evaluate(x, y, batch_size=10, verbose=0), atol=1e-5, rtol=1e-5)


def test_auto_streams_eight_micro_batches_per_stage(devices):
    # S = ceil(8 K / M) batches per call: the bubble at most a ninth of it.
    _, pipe = _pair(devices)  # K = 2 stages, M = 2
    assert pipe._inference_counts() == (2, 8)
    pipe.inference_micro_batches = 3
    assert pipe._inference_counts() == (3, 6)


def test_compiled_steps_per_execution(devices):
    plain, pipe = _pair(devices, steps_per_execution=3)
    x, y = _data()
    pipe.inference_micro_batches = 2
    assert pipe._inference_counts() == (2, 3)
    np.testing.assert_allclose(pipe.predict(x, batch_size=4, verbose=0),
                               plain.predict(x, batch_size=4, verbose=0),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        pipe.evaluate(x, y, batch_size=4, verbose=0),
        plain.evaluate(x, y, batch_size=4, verbose=0), atol=1e-5, rtol=1e-5)


def test_predict_outputs_leave_the_last_stage_batch_by_batch(devices):
    # Each batch's outputs go to this process as soon as the last stage
    # has them: concatenated here, not on the last stage's device (there
    # they would all leave after the last batch, while the stages idle).
    plain, pipe = _pair([devices[1], devices[2]])
    pipe.inference_steps_per_execution = 3
    x, _ = _data()
    np.testing.assert_allclose(pipe.predict(x, batch_size=8, verbose=0),
                               plain.predict(x, batch_size=8, verbose=0),
                               atol=1e-5, rtol=1e-5)
    batch = (tf.constant(x[:8]),)
    step = pipe._make_predict_batches(force=True)  # the tf.function
    graph = step.get_concrete_function([batch] * 3).graph
    concats = [op for op in graph.get_operations() if op.type == "ConcatV2"
               and len(op.inputs) == 4]  # 3 batches and the axis
    assert concats, [op.type for op in graph.get_operations()]
    assert {op.device for op in concats} == {cluster.local_cpu()}
    last = tf.DeviceSpec.from_string(devices[2])
    assert tf.DeviceSpec.from_string(cluster.local_cpu()).device_index \
        != last.device_index


def test_predict_batches_on_data_device(devices, monkeypatch):
    plain, pipe = _pair(devices)
    pipe.data_device = devices[0]
    x, _ = _data()
    made = []
    original = placed_data.PlacedArrays.get_tf_dataset

    def spy(self):
        made.append(self.device)
        return original(self)

    monkeypatch.setattr(placed_data.PlacedArrays, "get_tf_dataset", spy)
    got = pipe.predict(x, batch_size=8, verbose=0)
    assert made and set(made) == {devices[0]}
    np.testing.assert_allclose(got, plain.predict(x, batch_size=8, verbose=0),
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(pipe.predict(x, batch_size=8, verbose=0),
                               plain.predict(x, batch_size=8, verbose=0),
                               atol=1e-5, rtol=1e-5)


def test_one_call_runs_several_batches(devices):
    """Callbacks see one batch end per call of S batches."""
    _, pipe = _pair(devices)
    pipe.inference_steps_per_execution = 3
    ends = []
    callback = keras.callbacks.LambdaCallback(
        on_predict_batch_end=lambda batch, logs: ends.append(
            logs["outputs"].shape[0]))
    pipe.predict(_data()[0], batch_size=4, verbose=0, callbacks=[callback])
    # 37 rows: 9 batches of 4 and one of 1, 3 batches per call.
    assert ends == [12, 12, 12, 1]


def test_validation_in_fit(devices):
    plain, _ = _pair(devices)
    twin = keras.models.clone_model(plain)
    twin.set_weights(plain.get_weights())
    pipe = keras_pipe.PipelineModel.from_model(
        twin, num_stages=2, devices=devices[:2], num_micro_batches=2)
    pipe.compile("sgd", "mse", metrics=["mae"])
    pipe.inference_steps_per_execution = 2
    x, y = _data()
    xv, yv = _data(19)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs = [model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                          shuffle=False, validation_data=(xv, yv),
                          validation_batch_size=4).history
                for model in (plain, pipe)]
    # fit's validation iterator steps S batches per call, as the function.
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(logs[1][key], logs[0][key], atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("name,value", [
    ("inference_micro_batches", 0), ("inference_steps_per_execution", "x")])
def test_bad_settings(devices, name, value):
    _, pipe = _pair(devices)
    with pytest.raises((TypeError, ValueError), match=name):
        setattr(pipe, name, value)


def test_on_batch_methods(devices):
    plain, pipe = _pair(devices)
    x, y = _data(9)  # 9 rows, M = 2: micro-batches of 5 and 4
    np.testing.assert_allclose(pipe.predict_on_batch(x),
                               plain.predict_on_batch(x), atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_allclose(pipe.test_on_batch(x, y),
                               plain.test_on_batch(x, y), atol=1e-5,
                               rtol=1e-5)


_ON_WORKERS = textwrap.dedent('''
    import keras
    import numpy as np
    import keras_pipe

    with keras_pipe.local_workers(num_workers=2) as devices:
        keras.utils.set_random_seed(0)
        plain = keras.Sequential([keras.Input((8,))] + [
            keras.layers.Dense(16, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(3)])
        plain.compile("sgd", "mse")
        pipe = keras_pipe.PipelineModel.from_model(
            plain, num_stages=2, devices=devices, num_micro_batches=2)
        pipe.compile("sgd", "mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(37, 8)).astype("float32")
        y = rng.normal(size=(37, 3)).astype("float32")
        for placed in (None, "auto"):
            pipe.data_device = placed
            np.testing.assert_allclose(
                pipe.predict(x, batch_size=8, verbose=0),
                plain.predict(x, batch_size=8, verbose=0), atol=1e-5)
            np.testing.assert_allclose(
                pipe.evaluate(x, y, batch_size=8, verbose=0),
                plain.evaluate(x, y, batch_size=8, verbose=0), atol=1e-5)
    print("OK")
''')


@pytest.mark.slow  # starts two worker processes
def test_predict_and_evaluate_on_local_workers():
    proc = warm.run(["-c", _ON_WORKERS], warm.env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")
