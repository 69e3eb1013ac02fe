"""Models that call models: from_model and plan cut inside nested models.

Tolerances as in tests/test_partition.py: predictions rtol = atol = 1e-5;
one SGD step: loss rtol 1e-5, weights rtol 1e-5, atol 1e-6.
"""

import warnings

import h5py
import keras
import numpy as np
import pytest
from keras import layers

import keras_pipe
from keras_pipe.planning.graph import read_graph
from keras_pipe.saving import files as saving
from tests.support.data import random_data
from tests.test_partition import _assert_predictions_match, _assert_step_matches

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

MSE = keras.losses.MeanSquaredError()


def _nested():
    """Two levels of nesting; the middle model is called twice (shared)."""
    inner = keras.Sequential([keras.Input((8,)),
                              layers.Dense(8, activation="relu", name="in1"),
                              layers.Dense(8, name="in2")], name="inner")
    i = keras.Input((8,))
    h = inner(layers.Dense(8, activation="tanh", name="mid1")(i))
    mid = keras.Model(i, layers.Add(name="mid_add")([h, i]), name="mid")
    x = keras.Input((5,))
    h = mid(mid(layers.Dense(8, name="stem")(x)))
    return keras.Model(x, layers.Dense(3, name="head")(h), name="outer")


def _data(n=8):
    return random_data(n, (5,), y_dim=3)


def _keys(path):
    found = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.append(name) if isinstance(
            obj, h5py.Dataset) else None)
    return sorted(found)


def test_nested_calls_are_opened_at_any_depth():
    names = [c.name for c in read_graph(_nested()).calls]
    assert names == [
        "stem", "mid/mid1", "mid/inner/in1", "mid/inner/in2", "mid/mid_add",
        "mid/mid1#2", "mid/inner/in1#2", "mid/inner/in2#2", "mid/mid_add#2",
        "head"]


def test_cut_inside_nested_models_trains_like_original(devices):
    model = _nested()
    x, y = _data()
    # Stage 1 starts inside 'inner' of the first call of 'mid'; the second
    # call of 'mid' reuses its weights in stage 2 (tied, gradients summed).
    pipe = _assert_step_matches(model, x, y, MSE, devices, 3, 2,
                                balance=[3, 4, 3])
    assert [[c.name for c in s.calls] for s in pipe.stages][1] == [
        "mid/inner/in2", "mid/mid_add", "mid/mid1#2", "mid/inner/in1#2"]
    assert sorted(map(id, pipe.weights)) == sorted(map(id, model.weights))
    _assert_predictions_match(model, pipe, x)


def test_weight_files_keep_the_nested_layout(devices, tmp_path):
    model = _nested()
    x, _ = _data()
    pipe = keras_pipe.PipelineModel.from_model(model, 3, devices=devices[:3],
                                               num_micro_batches=2)
    pipe_path = str(tmp_path / "pipe.weights.h5")
    plain_path = str(tmp_path / "plain.weights.h5")
    pipe.save_weights(pipe_path)
    model.save_weights(plain_path)
    # The original's layout, nested models under layers/functional/...
    # (no Dropout here, so no seed generator states either).
    assert _keys(pipe_path) == _keys(plain_path)
    assert "layers/functional/layers/sequential/layers/dense/vars/0" in (
        _keys(pipe_path))
    expected = pipe.predict(x, verbose=0)
    other = _nested()
    other.load_weights(pipe_path)  # stock Keras, nested model
    # The unsplit model runs the batch whole, the pipeline in 2 micro-batches:
    # equal up to float32 rounding (seen: 3e-7), as the transparency tests.
    np.testing.assert_allclose(other.predict(x, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    for v in pipe.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    pipe.load_weights(plain_path)  # and back
    np.testing.assert_array_equal(pipe.predict(x, verbose=0), expected)
    assert [p for _, _, p in saving.weight_paths(pipe.stages)][:3] == [
        "layers/dense", "layers/functional/layers/dense",
        "layers/functional/layers/sequential/layers/dense"]


def test_frozen_sub_model_with_batch_norm_steps_like_original(devices):
    # `base(x, training=False)`: Keras 3 lets the outer call's training
    # flag win (the statistics do move in the original); the pipeline runs
    # the opened calls the same way.
    base = keras.Sequential([keras.Input((5,)), layers.Dense(4, name="d"),
                             layers.BatchNormalization(name="bn")],
                            name="base")
    x_in = keras.Input((5,))
    h = base(x_in, training=False)
    model = keras.Model(x_in, layers.Dense(3, name="head")(h))
    assert read_graph(model).calls[1].training == (False,)
    x, y = _data()
    _assert_step_matches(model, x, y, MSE, devices, 2, 1, balance=[1, 2])


class Block(layers.Layer):
    """A subclassed layer around two Dense layers: its call() is Python."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = layers.Dense(6, activation="relu")
        self.b = layers.Dense(6)

    def call(self, x):
        return x + self.b(self.a(x))


def _with_block():
    x = keras.Input((6,))
    return keras.Model(x, layers.Dense(2, name="head")(Block(name="block")(x)),
                       name="blocky")


def test_subclassed_layer_stays_whole_and_plan_names_it(devices):
    model = _with_block()
    p = keras_pipe.plan(model, 2)
    assert p.opaque == [("block", "Block",
                         "a layer with its own call() around 2 sublayer(s)")]
    assert "opaque: 'block' (Block) runs whole, no cut inside" in str(p)
    pipe = keras_pipe.PipelineModel.from_model(model, 2, devices=devices[:2])
    _assert_predictions_match(model, pipe,
                              np.random.rand(4, 6).astype("float32"))


def test_too_few_calls_says_which_layers_run_whole():
    with pytest.raises(ValueError, match=(
            r"num_stages=3 is larger than the number of layer calls of "
            r"'blocky' \(2\).*cannot be cut inside: 'block' \(Block: a layer "
            r"with its own call\(\).*Use num_stages <= 2")):
        keras_pipe.plan(_with_block(), 3)


def test_stage_without_weights_is_warned_about():
    x = keras.Input((4,))
    h = layers.Dropout(0.1, name="drop")(layers.Dense(4, name="d1")(x))
    model = keras.Model(x, layers.Dense(2, name="d2")(h), name="m")
    with pytest.warns(UserWarning, match=(
            r"stage 1 of 'm' \(drop..drop, 1 call\(s\)\) has no weights.*"
            r"Use fewer stages \(num_stages=2\)")):
        keras_pipe.plan(model, 3, balance=[1, 1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        keras_pipe.plan(model, 2, balance=[2, 1], num_micro_batches=8)


def test_too_many_stages_for_a_layer_with_state_says_why():
    x = keras.Input((4,))
    norm = layers.BatchNormalization(name="shared_bn")
    h = norm(layers.Dense(4, name="d1")(x))
    h = norm(layers.Dense(4, name="d2")(h))
    model = keras.Model(x, layers.Dense(2, name="d3")(h), name="tied_bn")
    with pytest.raises(ValueError, match=(
            r"Cannot cut 'tied_bn' into 4 stages: only 3 stages are "
            r"possible.*'shared_bn' span most of the model. Use "
            r"num_stages <= 3")):
        keras_pipe.plan(model, 4)
