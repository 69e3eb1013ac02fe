"""keras_pipe.verify: the pipeline's steps against plain Keras, per variable.

Tolerance: verify's default, 1e-3 of each variable's update after 2 steps
(float rounding shows as ~1e-6, a different step as ~1).
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_pipe
from keras_pipe.verification import BATCH_NORM

pytestmark = pytest.mark.slow  # trains models: the full suite's tier

CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(middle=None):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    if middle is not None:
        h = middle(h)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    h = keras.layers.Dense(8, activation="tanh", name="second")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _batch():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(8, 6)).astype("float32"),
            (np.arange(8) % 3).astype("int32"))


class BatchCentered(keras.layers.Layer):
    """Subtracts the batch mean: couples rows, with no known cause named."""

    def call(self, x):
        return x - ops.mean(x, axis=0, keepdims=True)


def test_equal_model_is_ok_and_weights_are_put_back(devices):
    model = _mlp()
    x, y = _batch()
    start = [v.numpy() for v in model.weights]
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               num_micro_batches=4, schedule="1f1b",
                               devices=devices[:2])
    assert report.ok, report
    assert not report.flagged and not report.causes
    assert report.largest < 1e-4
    assert report.set_aside == ["drop.rate=0.5"]
    assert model.get_layer("drop").rate == 0.5
    assert len(report.variables) == 6
    assert all(v.update > 0 for v in report.variables)
    np.testing.assert_allclose(report.losses_pipeline, report.losses_keras,
                               rtol=1e-5)
    for v, s in zip(model.weights, start):
        np.testing.assert_array_equal(v.numpy(), s)
    text = str(report)
    assert text.startswith("keras_pipe.verify: OK")
    assert "first/kernel" in text and "set aside: drop.rate=0.5" in text


def test_batch_norm_at_several_micro_batches_is_named(devices):
    x, y = _batch()
    model = _mlp(keras.layers.BatchNormalization(name="bn"))
    with pytest.warns(UserWarning, match=r"num_micro_batches=2 \(stage"):
        report = keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd",
                                   num_micro_batches=2, devices=devices[:2])
    assert not report.ok
    assert report.causes == [BATCH_NORM]
    assert not report.flagged
    assert report.largest > 0.01
    assert "DIFFERENT (explained" in str(report)
    assert "num_micro_batches=1 is exact" in str(report)
    # M=1: the unsplit statistics, nothing to explain.
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd",
                               num_micro_batches=1, devices=devices[:2])
    assert report.ok and not report.causes, report


def test_unexplained_difference_is_flagged(devices):
    x, y = _batch()
    model = _mlp(BatchCentered(name="centered"))
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               devices=devices[:2])
    assert not report.ok and not report.causes
    assert "first/kernel" in report.flagged
    assert "DIFFERENT (unexplained)" in str(report)


def test_pipeline_model_is_run_as_it_is(devices):
    stages = [keras.Sequential([keras.Input((6,)), keras.layers.Dense(8)]),
              keras.layers.Dense(3)]
    pipe = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                    num_micro_batches=4, schedule="zb_h2")
    pipe.compile("rmsprop", CE)
    x, y = _batch()
    report = keras_pipe.verify(pipe, x, y)
    assert report.ok, report
    assert (report.num_micro_batches, report.schedule) == (4, "zb_h2")
    with pytest.raises(ValueError, match=r"leave out \['num_stages'\]"):
        keras_pipe.verify(pipe, x, y, num_stages=3)


def test_bad_arguments(devices):
    x, y = _batch()
    model = _mlp()
    with pytest.raises(ValueError, match="needs a loss: pass loss="):
        keras_pipe.verify(model, x, y, optimizer="sgd")
    with pytest.raises(ValueError, match="needs an optimizer"):
        keras_pipe.verify(model, x, y, loss=CE)
    with pytest.raises(ValueError, match="steps=0"):
        keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd", steps=0)
    with pytest.raises(TypeError, match="Received: 3"):
        keras_pipe.verify(3, x, y)


class TracesCounted(keras.layers.Layer):
    """Identity that counts the graphs it is traced into in training."""

    traces = 0

    def call(self, x, training=False):
        if training and not isinstance(x, np.ndarray) and (
                not hasattr(x, "numpy")):
            TracesCounted.traces += 1
        return x


def test_plain_keras_steps_are_traced_once(devices):
    # verify's reference: Keras' train function, traced once for its steps
    # (the optimizer's slots made inside the first trace made TF trace it
    # again: half of the reference's time on small models).
    from keras_pipe.verification import _train, _Unsplit  # noqa: PLC0415
    x, y = _batch()
    TracesCounted.traces = 0
    reference = _Unsplit(_mlp(TracesCounted(name="counted")))
    losses = _train(reference, CE, "adam", x, y, None, 3)
    assert len(losses) == 3 and losses[2] < losses[0]
    assert TracesCounted.traces == 1


class DropPath(keras.layers.Layer):
    """Stochastic depth as KerasHub's DropPath: a per-row mask."""

    def __init__(self, drop_prob, **kwargs):
        super().__init__(**kwargs)
        self.drop_prob = drop_prob
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x, training=None):
        if not training or self.drop_prob == 0.0:
            return x
        mask = ops.floor(1.0 - self.drop_prob + keras.random.uniform(
            (ops.shape(x)[0], 1), seed=self.seed_generator))
        return x / (1.0 - self.drop_prob) * mask


def test_stochastic_depth_is_set_aside_as_dropout_is(devices):
    x, y = _batch()
    model = _mlp(DropPath(0.5, name="depth"))
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               num_micro_batches=2, devices=devices[:2])
    assert report.ok, report
    assert report.set_aside == ["depth.drop_prob=0.5", "drop.rate=0.5"]
    assert model.get_layer("depth").drop_prob == 0.5


class BalanceLoss(keras.layers.Layer):
    """Adds a product of batch means (a router's load-balancing loss)."""

    def call(self, x):
        share = ops.mean(ops.softmax(x), axis=0)
        self.add_loss(10.0 * ops.sum(share * share))
        return x


def test_added_loss_at_several_micro_batches_is_warned_and_named(devices):
    from keras_pipe.verification import ADDED_LOSSES  # noqa: PLC0415
    x, y = _batch()
    model = _mlp(BalanceLoss(name="balance"))
    with pytest.warns(UserWarning, match=r"stage\(s\) \[0\] add a loss"):
        report = keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd",
                                   num_micro_batches=2, devices=devices[:2])
    assert not report.ok and not report.flagged
    assert report.causes == [ADDED_LOSSES]
    assert report.largest > 0.01
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd",
                               num_micro_batches=1, devices=devices[:2])
    assert report.ok and not report.causes, report


class FusedAttention(keras.layers.Layer):
    """Self-attention over 4 tokens with a fused q/k/v projection: the key
    part of its bias shifts every score of a query alike, so the softmax
    ignores it and its gradient is float rounding (~1e-9), beside the
    query and value parts' real gradients in the same variable."""

    def build(self, input_shape):
        self.qkv = keras.layers.Dense(3 * 4)
        self.qkv.build((None, 4, 2))

    def call(self, x):
        h = ops.reshape(x, (-1, 4, 2))
        q, k, v = ops.split(self.qkv(h), 3, axis=-1)
        attention = ops.softmax(ops.einsum("bqd,bkd->bqk", q, k), axis=-1)
        return ops.reshape(ops.einsum("bqk,bkd->bqd", attention, v),
                           (-1, 16))


def test_adam_amplified_rounding_is_named_where_gradients_agree(devices):
    from keras_pipe.verification import GRADIENT_TOLERANCE, ROUNDING  # noqa: PLC0415
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = (np.arange(16) % 3).astype("int32")
    inputs = keras.Input((8,))
    h = FusedAttention(name="attention")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                               num_micro_batches=4, devices=devices[:2])
    bias = next(v for v in report.variables if v.path.endswith("bias")
                and v.shape == (12,))
    # Adam's steps on the key bias's rounding-level elements differ by a
    # large share of an update; its gradient equals Keras' to rounding.
    assert bias.relative > 1e-3, report
    assert bias.gradient_relative < GRADIENT_TOLERANCE, report
    assert report.ok and not report.flagged, report
    assert any(c.startswith(ROUNDING) and bias.path in c
               for c in report.causes), report
    # With SGD, the same steps are equal to float precision: no cause.
    report = keras_pipe.verify(model, x, y, loss=CE, optimizer="sgd",
                               num_micro_batches=4, devices=devices[:2])
    assert report.ok and report.largest < 1e-4 and not report.causes, report
