"""The unpipelined model (to_model) and SavedModel export, portable and pipelined."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import keras_pipe

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

IN_DIM = 5


@pytest.fixture(scope="module")
def trained():
    """Three stages on CPU:1..3 (never CPU:0), BatchNorm and Dropout inside."""
    from tests.conftest import DEVICES
    keras.utils.set_random_seed(3)
    return trained_pipeline(list(DEVICES))


def trained_pipeline(devices):
    inner = keras.Sequential([keras.layers.Dense(6, activation="relu"),
                              keras.layers.BatchNormalization()])
    stages = [keras.Sequential([keras.Input((IN_DIM,)), inner]),
              keras.Sequential([keras.layers.Dropout(0.5),
                                keras.layers.Dense(6, activation="tanh")]),
              keras.layers.Dense(2)]
    model = keras_pipe.PipelineModel(stages, devices=devices[1:4],
                                     num_micro_batches=3)
    model.compile("adam", "mse")
    x = np.random.default_rng(0).normal(size=(12, IN_DIM)).astype("float32")
    model.fit(x, np.ones((12, 2), "float32"), batch_size=6, epochs=2,
              verbose=0)
    return model, x


def saved_devices(path):
    """{function name (or "graph"): set of node device strings}."""
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    found = {"graph": {n.device for n in graph.node}}
    for function in graph.library.function:
        found[function.signature.name] = {n.device for n in function.node_def}
    return found


def test_to_model_is_flat_and_shares_layers(trained):
    model, x = trained
    plain = model.to_model()
    layers = [l for l in plain.layers
              if not isinstance(l, keras.layers.InputLayer)]
    assert layers == model.layers  # the same objects, nested models opened
    assert [type(l).__name__ for l in layers] == [
        "Dense", "BatchNormalization", "Dropout", "Dense", "Dense"]
    assert {id(v) for v in plain.weights} == {id(v) for v in model.weights}
    np.testing.assert_allclose(plain.predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=0, atol=1e-6)


def test_to_model_needs_an_input_shape(devices):
    model = keras_pipe.PipelineModel(
        [keras.layers.Dense(2), keras.layers.Dense(2)], devices=devices[:2])
    with pytest.raises(ValueError, match=r"does not know its input shape.*"
                                         r"model.build\(input_shape\)"):
        model.to_model()
    # The call the message names works.
    model(np.zeros((2, 3), "float32"))
    assert model.to_model().input_shape == (None, 3)


class SubclassedStage(keras.Model):
    """A stage with no Input: its input shape is only known once called."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6, activation="relu")

    def call(self, x):
        return self.dense(x)


def test_subclassed_first_stage_converts_back_after_fit(devices, tmp_path):
    # Broke: after fit and predict, to_model() and export() raised "does
    # not know its input shape", and calling the model did not help.
    model = keras_pipe.PipelineModel(
        [SubclassedStage(), keras.layers.Dense(2)], devices=devices[:2],
        num_micro_batches=2)
    model.compile("adam", "mse")
    x = np.random.default_rng(0).normal(size=(8, IN_DIM)).astype("float32")
    model.fit(x, np.ones((8, 2), "float32"), verbose=0)
    expected = model.predict(x, verbose=0)
    plain = model.to_model()
    assert plain.input_shape == (None, IN_DIM)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)
    path = str(tmp_path / "served")
    model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)  # kept: its functions need it
    np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(),
                               expected, rtol=0, atol=1e-6)


SERVE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    tf.config.set_soft_device_placement(False)
    assert [d.name for d in tf.config.list_logical_devices()] == [
        "/device:CPU:0"]
    loaded = tf.saved_model.load(sys.argv[1])
    x = tf.constant(np.load(sys.argv[2]))
    serve = loaded.serve(x).numpy()
    (signature,) = loaded.signatures["serving_default"](x).values()
    np.save(sys.argv[3], np.stack([serve, signature.numpy()]))
""")


def test_export_loads_on_one_cpu_without_soft_placement(trained, tmp_path):
    model, x = trained
    path = str(tmp_path / "served")
    model.export(path, verbose=False)
    # The same graph here, where all 4 devices exist (the eager model can
    # differ by an ulp: grappler fuses ops in graphs).
    here = tf.saved_model.load(path)
    expected = here.serve(tf.constant(x)).numpy()

    # No op is pinned to a stage device; TF's own save/restore functions pin
    # to CPU:0, which exists everywhere.
    for name, found in saved_devices(path).items():
        assert found <= {"", "/device:CPU:0", "/device:CPU:*"}, (name, found)

    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_SCRIPT, path, str(tmp_path / "x.npy"),
         str(tmp_path / "out.npy")], capture_output=True, text=True, env=env,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    serve, signature = np.load(tmp_path / "out.npy")
    np.testing.assert_array_equal(serve, expected)
    np.testing.assert_array_equal(signature, expected)
    np.testing.assert_allclose(serve, model.predict(x, verbose=0), rtol=0,
                               atol=1e-6)


def test_pipelined_export_keeps_stage_placement(trained, tmp_path):
    model, x = trained
    path = str(tmp_path / "pipelined")
    model.export(path, verbose=False, pipelined=True)
    found = set().union(*saved_devices(path).values())
    for device in ("CPU:1", "CPU:2", "CPU:3"):
        assert any(d.endswith(device) for d in found), (device, found)
    loaded = tf.saved_model.load(path)
    np.testing.assert_array_equal(loaded.serve(tf.constant(x)).numpy(),
                                  model(x, training=False).numpy())
    with pytest.raises(ValueError, match=r"pipelined=True exports a TF "
                                         r"SavedModel only"):
        model.export(str(tmp_path / "x"), format="onnx", pipelined=True)
