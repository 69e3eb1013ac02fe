"""Pipeline x data parallelism: R replicas of a K-stage pipeline, one step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import replicas
from tests.support.data import random_data

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


def _stages():
    return [keras.Sequential([keras.layers.Dense(
                16, activation="tanh",
                kernel_regularizer=keras.regularizers.L2(1e-3))]),
            keras.Sequential([keras.layers.Dense(3)])]


def _data(n=70):
    return random_data(n, (8,), classes=3, weights=(0.5, 2.0), seed=3)


def _compile(model, **kwargs):
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **kwargs)


def _replicated(devices, num_micro_batches=2, schedule="gpipe"):
    model = keras_pipe.PipelineModel(_stages(), devices=devices[:2],
                                      num_micro_batches=num_micro_batches,
                                      schedule=schedule)
    model.build((None, 8))
    model.replicate(devices)  # 2 replicas x 2 stages on 4 devices.
    return model


def test_replica_of_shards_contiguously():
    assert [replicas.replica_of(i, 8, 2) for i in range(8)] == [
        0, 0, 0, 0, 1, 1, 1, 1]
    assert [replicas.replica_of(i, 3, 2) for i in range(3)] == [0, 0, 1]
    assert [replicas.replica_of(i, 1, 2) for i in range(1)] == [0]


@pytest.mark.parametrize("schedule,jit_compile", [
    ("gpipe", False), ("1f1b", False), ("gpipe", True)])
def test_two_replicas_equal_single_device_training(devices, schedule,
                                                   jit_compile):
    # jit_compile=True: replica 0's devices hold the variables, and each
    # one's update is an XLA function there.
    model = _replicated(devices, schedule=schedule)
    assert model.num_replicas == 2
    reference = keras.Sequential([keras.Input((8,)), *_stages()])
    for a, b in zip(reference.weights, model.weights):
        a.assign(b.numpy())
    _compile(model, jit_compile=jit_compile)
    _compile(reference)
    x, y, w = _data()
    # 70 rows, batch 32: shards of 16 + 16, then a last batch of 6 rows.
    kwargs = dict(sample_weight=w, batch_size=32, epochs=2, shuffle=False,
                  verbose=0)
    history = model.fit(x, y, **kwargs)
    expected = reference.fit(x, y, **kwargs)
    np.testing.assert_allclose(history.history["loss"],
                               expected.history["loss"], rtol=1e-6)
    for a, b in zip(model.weights, reference.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
    # One set of variables and optimizer slots, on replica 0's devices.
    slots = model.optimizer.variables[2:]  # After iterations, learning rate.
    assert len(slots) == 2 * len(model.trainable_variables)
    assert {tf.DeviceSpec.from_string(v.value.device).device_index
            for v in slots} == {0, 1}
    np.testing.assert_allclose(
        model.predict(x, batch_size=32, verbose=0),
        reference.predict(x, batch_size=32, verbose=0), atol=1e-6)


def test_replicas_run_on_their_own_devices(devices):
    model = _replicated(devices)
    _compile(model)
    x, y, _ = _data(8)
    step = tf.function(lambda x, y: model.compute_loss_and_gradients(x, y))
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    resolved = replicas.placement.resolve_devices(devices)
    calls = {}
    for op in graph.get_operations():
        parts = op.name.split("/")
        # A call op, or (no remat) the stage's own ops in its scope.
        if len(parts) > 3 and parts[2] in ("forward", "backward") and \
                op.type not in ("NoOp", "Const"):
            calls[op.name] = op.device
    # 4 micro-batches: 0, 1 on replica 0 (devices 0, 1); 2, 3 on replica 1.
    for i in range(4):
        for j in range(2):
            device = resolved[2 * (i // 2) + j]
            found = [d for name, d in calls.items()
                     if name.startswith(f"stage{j}/mb{i}/forward")]
            assert found and all(
                tf.DeviceSpec.from_string(d) ==
                tf.DeviceSpec.from_string(device) for d in found), (i, j, found)


def test_replicate_errors(devices):
    model = keras_pipe.PipelineModel(_stages(), devices=devices[:2])
    with pytest.raises(ValueError, match="multiple of num_stages=2: got 3"):
        model.replicate(devices[:3])
    with pytest.raises(ValueError, match="first replica must run on the "
                                         "model's devices"):
        model.replicate(devices[2:4] + devices[:2])
    with pytest.raises(TypeError, match="list of R \\* K device strings"):
        model.replicate("/device:CPU:0")
    assert model.num_replicas == 1
