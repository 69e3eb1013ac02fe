"""Training does not depend on how the model is cut (issue 15).

Random layers draw, for each row, from the layer's seed at the start of the
step and the row's index in the global batch, so Dropout trains to the same
weights at any `num_micro_batches` M, stage count K, replica count R and
schedule. BatchNormalization normalizes each micro-batch with its own
statistics, so it is invariant where the micro-batches hold the same rows;
replicas thread its moving statistics on their own and the step merges
them as if the micro-batches had run one after another.

Tolerance: rtol 1e-5, atol 1e-6 (float32; only the order of sums changes).
"""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

WIDTH, BLOCKS, BATCH, STEPS = 8, 4, 16, 3


def _blocks(batch_norm, rate=0.3):
    """`BLOCKS` blocks of Dense (+ BN) + Dropout, with fixed seeds."""
    blocks = []
    for b in range(BLOCKS):
        layers = [keras.layers.Dense(WIDTH, activation="tanh")]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization(momentum=0.8))
        layers.append(keras.layers.Dropout(rate, seed=100 + b))
        blocks.append(layers)
    blocks[-1].append(keras.layers.Dense(3))
    return blocks


def _train(devices, k, m, r, schedule, batch_norm, rate=0.3):
    keras.utils.set_random_seed(7)
    blocks = _blocks(batch_norm, rate)
    per_stage = BLOCKS // k
    stages = [keras.Sequential([layer for block in blocks[j * per_stage:
                                                           (j + 1) * per_stage]
                                for layer in block], name=f"s{j}")
              for j in range(k)]
    model = keras_pipe.PipelineModel(
        stages, devices=devices[:k], num_micro_batches=m,
        remat="except_last", schedule=schedule)
    model.build((None, WIDTH))
    if r > 1:
        model.replicate(devices[:k * r])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
    y = rng.integers(0, 3, size=(BATCH * STEPS,)).astype("int32")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def _close(a, b):
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


@functools.cache
def _unsplit_weights(devices, rate):
    """The weights `_train` ends with at K = M = R = 1 (no BatchNorm),
    trained once for the schedules' cases."""
    return _train(list(devices), 1, 1, 1, "gpipe", batch_norm=False,
                  rate=rate).get_weights()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_training_is_the_same_for_every_cut(devices, schedule):
    reference = _unsplit_weights(tuple(devices), 0.3)
    for k, m, r in [(2, 4, 1), (4, 8, 1), (2, 2, 2)]:
        model = _train(devices, k, m, r, schedule, batch_norm=False)
        _close(model.get_weights(), reference)
    # Dropout did act: without it, training ends elsewhere.
    plain = _unsplit_weights(tuple(devices), 0.0)
    assert max(np.abs(a - b).max() for a, b in zip(plain, reference)) > 1e-3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_batch_norm_and_dropout_match_where_micro_batches_do(devices,
                                                           schedule):
    # Micro-batches of BATCH / 4 rows in each configuration.
    runs = [_train(devices, k, m, r, schedule, batch_norm=True)
            for k, m, r in [(2, 4, 1), (4, 4, 1), (2, 2, 2)]]
    reference = runs[0].get_weights()  # includes the moving statistics
    for model in runs[1:]:
        _close(model.get_weights(), reference)


def _ancestors(op):
    """Every op `op` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(
                current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replicas_do_not_wait_for_each_other(devices, schedule):
    # Before, BatchNormalization and Dropout state was threaded through
    # all R x M micro-batches: replica 1's first forward call waited for
    # replica 0's last one on the same stage.
    k, m = 2, 2
    blocks = _blocks(batch_norm=True)
    stages = [keras.Sequential([layer for block in blocks[j * 2:(j + 1) * 2]
                                for layer in block]) for j in range(k)]
    model = keras_pipe.PipelineModel(stages, devices=devices[:k],
                                     num_micro_batches=m, schedule=schedule)
    model.build((None, WIDTH))
    model.replicate(devices[:2 * k])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec((8, WIDTH)), tf.TensorSpec((8,), tf.int32))).graph
    # A stage call is a function call op, or (a forward pass without
    # remat, run in place) the ops of its name scope.
    calls, seen = {}, {0: set(), 1: set()}
    for op in graph.get_operations():
        match = re.match(r"stage(\d)/mb(\d)/(forward|backward)/", op.name)
        if match:
            i = int(match.group(2))
            replica = i // m  # micro-batches 0-1, 2-3
            calls.setdefault(replica, []).append(op)
            seen[replica].add((match.group(1), i % m, match.group(3)))
    assert len(seen[0]) == len(seen[1]) == 2 * k * m  # forward + backward
    assert seen[0] == seen[1]
    for r, own in calls.items():
        others = set(calls[1 - r])
        for op in own:
            assert not _ancestors(op) & others, op.name
    # The check can fail: replica 1's stage-1 calls wait for its stage 0.
    assert _ancestors(calls[1][-1]) & set(calls[1])


class DropPath(keras.layers.Layer):
    """Stochastic depth as KerasHub's `DropPath` (Swin) writes it: a
    `(batch, 1, ...)` mask from `keras.random.uniform` with the layer's
    `SeedGenerator`, the batch read from the static shape when known."""

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, x, training=None):
        if not training or self.rate == 0.0:
            return x
        batch = x.shape[0] or keras.ops.shape(x)[0]
        mask = keras.ops.floor(1.0 - self.rate + keras.random.uniform(
            (batch,) + (1,) * (len(x.shape) - 1), dtype=x.dtype,
            seed=self.seed_generator))
        return x / (1.0 - self.rate) * mask


def _drop_path_step(devices, m, remat, rate=0.5):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(WIDTH, activation="tanh")(inputs)
    branch = DropPath(rate, seed=11)(keras.layers.Dense(WIDTH)(h))
    h = keras.layers.Add()([h, branch])
    outputs = keras.layers.Dense(3)(keras.layers.Dense(WIDTH)(h))
    pipe = keras_pipe.PipelineModel.from_model(
        keras.Model(inputs, outputs), 2, devices=devices[:2],
        num_micro_batches=m, remat=remat)
    pipe.compile(keras.optimizers.SGD(0.1),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, WIDTH)).astype("float32")
    pipe.fit(x, np.arange(BATCH) % 3, batch_size=BATCH, verbose=0)
    return pipe.get_weights()


@pytest.mark.parametrize("remat", ["never", "always"])
def test_drop_path_trains_as_at_any_cut(devices, remat):
    # The mask's batch dimension is static where the stage's ops run in
    # place (remat="never"): it was drawn with a drawn seed tensor passed
    # back to Keras ("Argument `seed` must be ... SeedGenerator").
    reference = _drop_path_step(devices, 1, "never")
    _close(_drop_path_step(devices, 4, remat), reference)
    # DropPath did act: without it, the step ends elsewhere.
    plain = _drop_path_step(devices, 1, "never", rate=0.0)
    assert max(np.abs(a - b).max() for a, b in zip(plain, reference)) > 1e-3
