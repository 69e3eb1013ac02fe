"""Re-materialization neither repeats state updates nor changes randomness.

Stock `tf.recompute_grad`/`keras.remat` re-run BatchNormalization's moving
average update and draw a new Dropout mask in the recompute; these tests
fail for any remat that does.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from tests.support import helpers

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


def train(devices, remat, steps=3, schedule="gpipe"):
    keras.utils.set_random_seed(7)
    pipe = keras_pipe.PipelineModel(
        helpers.dense_stages(3, batch_norm=True, dropout=0.4),
        devices=devices[:3], num_micro_batches=4, remat=remat,
        schedule=schedule)
    pipe.build((None, helpers.IN_DIM))
    pipe.compile(keras.optimizers.Adam(0.05),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, _ = helpers.data(22)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(11)
    history = pipe.fit(dataset, epochs=steps, verbose=0)
    return pipe, history.history["loss"]


def test_all_remat_modes_train_identically_with_batchnorm_and_dropout(
        devices):
    never, never_loss = train(devices, "never")
    # rtol 1e-5, atol 1e-5 (float32): 1F1B adds the micro-batch gradients
    # in another order; without remat the forward ops run in place in the
    # step's graph, with remat inside the recompute function, and grappler
    # fuses the two differently: weights 2.2e-6 apart after three Adam(0.05)
    # steps.
    # Each stage's last backward call is split (B recomputes, W in place):
    # zb_h1 splits every one, its W calls after a recompute.
    for remat, schedule, rtol in [("always", "gpipe", 1e-5),
                                  ("except_last", "gpipe", 1e-5),
                                  ("always", "1f1b", 1e-5),
                                  ("except_last", "1f1b", 1e-5),
                                  ("always", "zb_h1", 1e-5),
                                  ("never", "1f1b", 1e-5)]:
        pipe, loss = train(devices, remat, schedule=schedule)
        np.testing.assert_allclose(loss, never_loss, rtol=rtol)
        # Weights, BatchNorm moving statistics and dropout seed states.
        for v, ref in zip(pipe.variables, never.variables):
            np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=rtol,
                                       atol=1e-5, err_msg=v.path)


@pytest.mark.parametrize("remat", ["always", "except_last", "never"])
def test_moving_statistics_update_once_per_micro_batch(devices, remat):
    momentum = 0.5
    norm = keras.layers.BatchNormalization(momentum=momentum)
    pipe = keras_pipe.PipelineModel(
        [keras.Sequential([norm]),
         keras.Sequential([keras.layers.Dense(2)])],
        devices=devices[:2], num_micro_batches=3, remat=remat)
    pipe.build((None, 4))
    pipe.compile("sgd", "mse")
    rng = np.random.default_rng(3)
    x = rng.normal(2.0, 3.0, size=(9, 4)).astype("float32")
    pipe.train_on_batch(x, np.zeros((9, 2), "float32"))

    mean, var = np.zeros(4), np.ones(4)
    for part in np.split(x.astype("float64"), 3):  # one update per part
        mean = momentum * mean + (1 - momentum) * part.mean(0)
        var = momentum * var + (1 - momentum) * part.var(0)
    np.testing.assert_allclose(norm.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(norm.moving_variance.numpy(), var, rtol=1e-5)


def test_recompute_uses_the_forward_dropout_mask(devices):
    def gradients(remat):
        keras.utils.set_random_seed(11)
        pipe = helpers.compiled_pipeline(devices, 2, 2, remat, dropout=0.5)
        x, y, _ = helpers.data(8)
        return pipe, x, helpers.pipeline_loss_and_gradients(pipe, x, y)

    pipe, x, (loss, y_pred, grads) = gradients("always")
    _, _, (ref_loss, _, ref_grads) = gradients("never")
    # Dropout is active in the training pass (outputs differ from inference).
    assert np.abs(y_pred - pipe.predict(x, verbose=0)).max() > 1e-3
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, ref_g in zip(grads, ref_grads):
        np.testing.assert_allclose(g, ref_g, rtol=1e-6, atol=1e-7)


class Shift(keras.layers.Layer):
    """Adds 1 in training, 0 in inference: shows `training` arrived."""

    def call(self, inputs, training=None):
        return inputs + (1.0 if training else 0.0)


def test_training_keyword_reaches_rematerialized_stages(devices):
    pipe = keras_pipe.PipelineModel(
        [Shift(), keras.layers.Dense(1, kernel_initializer="ones",
                                     use_bias=False)],
        devices=devices[:2], num_micro_batches=2, remat="always")
    pipe.build((None, 3))
    pipe.compile("sgd", "mse")
    x = np.zeros((4, 3), "float32")
    _, y_pred, grads = helpers.pipeline_loss_and_gradients(
        pipe, x, np.zeros((4, 1), "float32"))
    np.testing.assert_allclose(y_pred, np.full((4, 1), 3.0))
    # d/dw of mean((sum_k w_k * 1)^2) = 2 * 3 * 1 for each weight.
    np.testing.assert_allclose(grads[0], np.full((3, 1), 6.0), rtol=1e-6)
    np.testing.assert_allclose(pipe.predict(x, verbose=0), np.zeros((4, 1)))


def test_batch_smaller_than_num_micro_batches_with_batchnorm(devices):
    # A dataset's last batch (2 rows) is smaller than M = 4: the step must
    # run 2 micro-batches of 1 row, never an empty one (BatchNormalization
    # would put NaN into its moving statistics).
    momentum = 0.5
    norm = keras.layers.BatchNormalization(momentum=momentum)
    pipe = keras_pipe.PipelineModel(
        [keras.Sequential([norm]), keras.Sequential([keras.layers.Dense(2)])],
        devices=devices[:2], num_micro_batches=4, remat="always")
    pipe.compile("sgd", "mse")
    rng = np.random.default_rng(5)
    x = rng.normal(1.0, 2.0, size=(10, 3)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(
        (x, np.zeros((10, 2), "float32"))).batch(8)  # batches of 8 and 2
    history = pipe.fit(dataset, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])

    mean, var = np.zeros(3), np.ones(3)
    for part in np.split(x[:8].astype("float64"), 4) + [x[8:9], x[9:10]]:
        mean = momentum * mean + (1 - momentum) * part.mean(0)
        var = momentum * var + (1 - momentum) * part.var(0)
    np.testing.assert_allclose(norm.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(norm.moving_variance.numpy(), var, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("remat", ["always", "never"])
def test_backward_reads_forward_activations_only_without_remat(devices,
                                                               remat):
    # Remat is real: with remat="always", no backward call consumes an
    # output (activation) of a forward stage call; it consumes the
    # recompute's. With remat="never", the backward consumes the forward's.
    pipe = helpers.compiled_pipeline(devices, 2, 2, remat, dropout=0.2)
    step = tf.function(pipe.compute_loss_and_gradients)
    graph = step.get_concrete_function(
        tf.TensorSpec((8, helpers.IN_DIM)), tf.TensorSpec((8,), tf.int32),
    ).graph
    # Each call's ops live in its name scope: one function call op with
    # remat; without, the stage's own ops run in place and the tape that
    # recorded them names their gradients "gradient_tape/<forward scope>".
    scopes = {}
    for op in graph.get_operations():
        match = re.match(r"(gradient_tape/)?(stage\d/mb\d)/(forward|"
                         r"backward)/", op.name)
        if match:
            kind = "backward" if match[1] else match[3]
            scopes.setdefault((match[2], kind), set()).add(op)
    backward = {call for call, kind in scopes if kind == "backward"}
    assert len(backward) == 4  # 2 stages x 2 micro-batches
    # A backward call may read its stage's input (the previous stage's
    # output, kept at the boundary, cut by a StopGradient in the forward's
    # scope), never what its own forward call computed from it.
    from_forward = {
        call for call in backward for op in scopes[call, "backward"]
        for t in op.inputs
        if t.op in scopes[call, "forward"] and t.op.type != "StopGradient"}
    if remat == "always":
        assert from_forward == set()
    else:
        assert from_forward == backward


def test_stage_functions_are_traced_a_fixed_number_of_times(devices):
    # One call op per (micro-batch, stage): the forward function and the
    # fused recompute + backward function of each stage are traced a number
    # of times that does not grow with M (build time, benchmark part d).
    counts = {}
    for m in (2, 8):
        pipe = helpers.compiled_pipeline(devices, 3, m, "always")
        x, y, _ = helpers.data(16)
        pipe.train_on_batch(x, y)
        counts[m] = [sorted(str(key[0]) for key in runner._functions)
                     for runner in pipe._executor.replicas[0]]
    assert counts[2] == counts[8]
    # forward (training), first backward, backward adding to running sums
    assert all(len(keys) <= 3 for keys in counts[8]), counts[8]
