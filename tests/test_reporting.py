"""What a pipeline says where it happens: summary() stages, the
BatchNormalization warning, the model config for TensorBoard."""

import glob
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe

pytestmark = pytest.mark.slow  # trains models: the full suite's tier


def _pipe(devices, batch_norm=True, num_micro_batches=2):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="first")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(3, name="last")(h)
    model = keras.Model(inputs, outputs)
    pipe = keras_pipe.PipelineModel.from_model(
        model, 2, devices=devices[:2], num_micro_batches=num_micro_batches,
        balance=[1, 2] if batch_norm else [1, 1])
    pipe.compile("sgd", "mse")
    return pipe


def _fit(pipe, **kwargs):
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    pipe.fit(x, np.zeros((8, 3), "float32"), batch_size=4, epochs=2,
             verbose=0, **kwargs)


def test_summary_shows_stage_and_device(devices):
    pipe = _pipe(devices)
    lines = []
    pipe.summary(print_fn=lines.append)
    table = lines[-1].splitlines()
    assert table[0] == "Stages:"
    assert table[2].split() == ["first", "(Dense)", "0", devices[0], "56"]
    assert table[3].split() == ["bn", "(BatchNormalization)", "1",
                                devices[1], "32"]
    assert table[4].split() == ["last", "(Dense)", "1", devices[1], "27"]


def test_batch_norm_warns_once_at_the_first_step(devices):
    pipe = _pipe(devices)
    with pytest.warns(UserWarning) as record:
        _fit(pipe)
    found = [str(w.message) for w in record
             if "BatchNormalization" in str(w.message)]
    assert len(found) == 1  # 2 epochs of 2 steps: once.
    assert "(stage 1: ['bn'])" in found[0]
    assert "defer_batch_norm" in found[0]
    assert "num_micro_batches=1" in found[0]
    for m in (1, 2):  # Nothing to say at M=1, or without BatchNorm.
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            _fit(_pipe(devices, batch_norm=m == 1, num_micro_batches=m))


def _keras_configs(log_dir):
    found = []
    for path in glob.glob(os.path.join(log_dir, "train", "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == \
                        "graph_keras_model":
                    found.append((value.tag, value.tensor.string_val[0]))
    return found


def test_tensorboard_gets_the_model_config(devices, tmp_path):
    # Keras writes it for a Functional model; a PipelineModel wrote none.
    pipe = _pipe(devices, batch_norm=False)
    _fit(pipe, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    (tag, config), = _keras_configs(str(tmp_path))
    assert tag == "keras"
    assert config.decode() == pipe.to_model().to_json()
    # What Keras writes for the unsplit model itself: the same summary.
    plain = pipe.to_model()
    plain.compile("sgd", "mse")
    _fit(plain, callbacks=[keras.callbacks.TensorBoard(
        str(tmp_path / "plain"))])
    (plain_tag, plain_config), = _keras_configs(str(tmp_path / "plain"))
    assert plain_tag == tag
    written, expected = json.loads(config), json.loads(plain_config)
    for c in (written, expected):  # plain was compiled, to_model() not
        c.pop("compile_config", None)
    assert written == expected


class _BalanceLoss(keras.layers.Layer):
    """Adds a product of batch means (a router's load-balancing loss)."""

    def call(self, x):
        share = keras.ops.mean(keras.ops.softmax(x), axis=0)
        self.add_loss(keras.ops.sum(share * share))
        return x


def _loss_pipe(devices, num_micro_batches, added_loss=True):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="first",
                           activity_regularizer="l2")(inputs)
    if added_loss:
        h = _BalanceLoss(name="balance")(h)
    outputs = keras.layers.Dense(3, name="last")(h)
    pipe = keras_pipe.PipelineModel.from_model(
        keras.Model(inputs, outputs), 2, devices=devices[:2],
        num_micro_batches=num_micro_batches,
        balance=[2, 1] if added_loss else [1, 1])
    pipe.compile("sgd", "mse")
    return pipe


def test_added_loss_warns_once_at_the_first_step(devices):
    pipe = _loss_pipe(devices, 2)
    with pytest.warns(UserWarning) as record:
        _fit(pipe)
    found = [str(w.message) for w in record if "add_loss" in str(w.message)]
    assert len(found) == 1  # 2 epochs of 2 steps: once.
    assert found[0].startswith("Layers of stage(s) [0] add a loss")
    assert "num_micro_batches=1" in found[0]
    assert pipe.loss_adding_stages == [0]
    # Nothing to say at M=1, nor for an activity regularizer alone (a
    # mean over samples: exact).
    for m, added in ((1, True), (2, False)):
        pipe = _loss_pipe(devices, m, added)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            _fit(pipe)
        assert pipe.loss_adding_stages == ([0] if added else [])
