"""BatchNormalization across micro-batches: per-micro-batch and deferred."""

import keras
import numpy as np
import pytest

import keras_pipe
from keras_pipe.layers import DeferredBatchNormalization, defer_batch_norm

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

BATCH, NUM_CLASSES = 10, 3


def _model(seed=0):
    """Conv + BatchNorm + Dense: BN statistics over batch and space."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 4, 2))
    x = keras.layers.Conv2D(3, 1, name="conv")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8, name="bn")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(NUM_CLASSES, name="head")(x)
    model = keras.Model(inputs, outputs)
    bn = model.get_layer("bn")
    rng = np.random.default_rng(seed)
    bn.moving_mean.assign(rng.normal(size=3).astype("float32"))
    bn.moving_variance.assign(rng.uniform(0.5, 2, size=3).astype("float32"))
    return model


def _data(rows=BATCH, seed=1):
    rng = np.random.default_rng(seed)
    # A large mean: raw sums of squares would lose the variance in float32.
    x = (rng.normal(size=(rows, 4, 4, 2)) * 2 + 30).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(rows,)).astype("int32")
    return x, y


def _fit(model, devices, x, y, num_micro_batches, batch_size=BATCH):
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=2, devices=devices[:2],
        num_micro_batches=num_micro_batches)
    pipe.compile(keras.optimizers.SGD(0.1),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pipe.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return pipe


def _stats(layer):
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def test_deferred_statistics_equal_full_batch(devices):
    # 10 rows in 4 micro-batches of 3, 3, 2, 2 rows.
    model = _model()
    deferred = defer_batch_norm(model)
    x, y = _data()
    model(x, training=True)  # The unpipelined model, on the full batch.
    expected = _stats(model.get_layer("bn"))
    pipe = _fit(deferred, devices, x, y, num_micro_batches=4)
    got = _stats(deferred.get_layer("bn"))
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)
    layer = deferred.get_layer("bn")
    np.testing.assert_array_equal(layer.accumulated_count.numpy(), 0.0)
    # Evaluation reads the moving statistics and accumulates nothing.
    pipe.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_array_equal(_stats(layer)[1], got[1])
    np.testing.assert_array_equal(layer.accumulated_count.numpy(), 0.0)


def test_deferred_statistics_with_short_last_batch(devices):
    # 13 rows, batch size 10: the second batch (3 rows) runs 4 micro-batch
    # slots with a padding slot, whose statistics must not count.
    model = _model()
    deferred = defer_batch_norm(model)
    x, y = _data(rows=13)
    bn = model.get_layer("bn")
    conv = model.get_layer("conv")
    pipe = keras_pipe.PipelineModel.from_model(
        deferred, num_stages=2, devices=devices[:2], num_micro_batches=4)
    pipe.compile(keras.optimizers.SGD(0.0),  # Keep conv fixed for the check.
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pipe.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    bn(conv(x[:10]), training=True)
    bn(conv(x[10:]), training=True)
    got, expected = _stats(deferred.get_layer("bn")), _stats(bn)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)


def test_per_micro_batch_statistics_update_once_per_micro_batch(devices):
    # Plain BatchNormalization in a pipeline (GPipe's default): one momentum
    # step per micro-batch, from that micro-batch's statistics, which
    # differs from the full-batch statistics.
    model = _model()
    x, y = _data()
    reference = keras.layers.BatchNormalization(momentum=0.8)
    reference.build((None, 4, 4, 3))
    reference.set_weights(model.get_layer("bn").get_weights())
    full = keras.layers.BatchNormalization(momentum=0.8)
    full.build((None, 4, 4, 3))
    full.set_weights(model.get_layer("bn").get_weights())
    features = model.get_layer("conv")(x)
    start = 0
    for size in (3, 3, 2, 2):
        reference(features[start:start + size], training=True)
        start += size
    full(features, training=True)
    _fit(model, devices, x, y, num_micro_batches=4)
    got = _stats(model.get_layer("bn"))
    np.testing.assert_allclose(got[0], reference.moving_mean.numpy(),
                               rtol=1e-5)
    np.testing.assert_allclose(got[1], reference.moving_variance.numpy(),
                               rtol=1e-5)
    assert np.max(np.abs(got[1] - full.moving_variance.numpy())) > 1e-2


def test_deferred_statistics_do_not_depend_on_num_micro_batches(devices):
    x, y = _data()
    results = []
    for num_micro_batches in (1, 2, 5):
        deferred = defer_batch_norm(_model())
        _fit(deferred, devices, x, y, num_micro_batches)
        results.append(_stats(deferred.get_layer("bn")))
    for mean, variance in results[1:]:
        np.testing.assert_allclose(mean, results[0][0], rtol=1e-5)
        np.testing.assert_allclose(variance, results[0][1], rtol=1e-5)


def test_finish_mini_batch_outside_a_pipeline():
    layer = DeferredBatchNormalization(momentum=0.5)
    x = np.random.default_rng(0).normal(size=(12, 5)).astype("float32")
    out = layer(x[:7], training=True)
    layer(x[7:], training=True)
    # Normalized with the call's own statistics, as BatchNormalization.
    plain = keras.layers.BatchNormalization(momentum=0.5)
    np.testing.assert_allclose(out, plain(x[:7], training=True), atol=1e-5)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), 0.0)
    layer.finish_mini_batch()
    np.testing.assert_allclose(layer.moving_mean.numpy(),
                               0.5 * x.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(),
                               0.5 + 0.5 * x.var(axis=0), rtol=1e-5)
    # Accumulators cleared; a step without calls changes nothing.
    layer.finish_mini_batch()
    np.testing.assert_allclose(layer.moving_mean.numpy(),
                               0.5 * x.mean(axis=0), rtol=1e-5)


def test_defer_batch_norm_keeps_weights_and_inference_outputs():
    model = _model()
    deferred = defer_batch_norm(model)
    layer = deferred.get_layer("bn")
    assert isinstance(layer, DeferredBatchNormalization)
    assert deferred.get_layer("conv") is model.get_layer("conv")
    for name in ("gamma", "beta", "moving_mean", "moving_variance"):
        np.testing.assert_array_equal(
            getattr(layer, name).numpy(),
            getattr(model.get_layer("bn"), name).numpy())
    x, _ = _data()
    np.testing.assert_allclose(deferred(x), model(x), atol=1e-6)
    assert layer.momentum == 0.8


def test_serialization_round_trip(tmp_path):
    deferred = defer_batch_norm(_model())
    path = str(tmp_path / "m.keras")
    deferred.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("bn"), DeferredBatchNormalization)
    x, _ = _data()
    np.testing.assert_allclose(loaded(x), deferred(x), atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="does not support renorm=True"):
        DeferredBatchNormalization(renorm=True)
    with pytest.raises(TypeError, match="Sequential or Functional"):
        defer_batch_norm(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="is not built"):
        defer_batch_norm(keras.Sequential([keras.layers.Dense(3)]))
    inputs = keras.Input((3,))
    renorm = keras.Model(inputs, keras.layers.BatchNormalization(
        renorm=True, name="rn")(inputs))
    with pytest.raises(ValueError, match=r"\['rn'\] use renorm=True"):
        defer_batch_norm(renorm)


def test_exported_from_package():
    assert keras_pipe.DeferredBatchNormalization is DeferredBatchNormalization
    assert keras_pipe.layers.defer_batch_norm is defer_batch_norm
