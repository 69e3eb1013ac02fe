"""1F1B's per-micro-batch loss: exact, and computed on the micro-batch's rows.

Tolerances as in test_transparency: rtol=1e-5, atol=1e-6 (float32; only
the order of sums changes).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from tests.support import helpers
from tests.test_transparency import check_one_step, close, compile_both

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

BATCH, M = 10, 4  # micro-batches of 3, 3, 2, 2


def _two_output_model():
    x = keras.Input((helpers.IN_DIM,))
    h = keras.layers.Dense(8, activation="tanh", name="body")(x)
    h = keras.layers.Dense(8, activation="tanh", name="neck")(h)
    seq = keras.layers.Reshape((4, 3))(keras.layers.Dense(12, name="seq")(h))
    cls = keras.layers.Dense(helpers.NUM_CLASSES, name="cls")(h)
    return keras.Model(x, {"seq": seq, "cls": cls})


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum",
                                       "mean_with_sample_weight"])
def test_dict_outputs_loss_weights_and_per_output_sample_weights(devices,
                                                                 reduction):
    # "seq" has loss values of shape (rows, 4): the divisor counts elements.
    model = _two_output_model()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    pipe = keras_pipe.PipelineModel.from_model(
        model, 2, devices=devices[:2], num_micro_batches=M, remat="always",
        schedule="1f1b")
    losses = {"seq": keras.losses.MeanSquaredError(reduction=reduction),
              "cls": keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True, reduction=reduction)}
    for m in (pipe, reference):
        m.compile("sgd", loss=losses, loss_weights={"seq": 0.3, "cls": 2.0})
    x, y_cls, w = helpers.data(BATCH)
    rng = np.random.default_rng(1)
    y = {"seq": rng.normal(size=(BATCH, 4, 3)).astype("float32"),
         "cls": y_cls}
    # Per-element weights for "seq" (rows, 4), per-row for "cls".
    sample_weight = {"seq": rng.uniform(0.1, 2.0, size=(BATCH, 4)).astype(
        "float32"), "cls": w}
    check_one_step(pipe, reference, x, y, sample_weight)


def test_losses_that_do_not_split_fall_back_exactly(devices):
    # A function returning one value per batch (no batch axis), and a loss
    # with its own __call__: 1F1B uses the zero-padded full batch for them.
    def batch_mean(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred - tf.one_hot(
            tf.cast(y_true, tf.int32), helpers.NUM_CLASSES)))

    class Doubled(keras.losses.Loss):
        def __call__(self, y_true, y_pred, sample_weight=None):
            return 2.0 * super().__call__(y_true, y_pred, sample_weight)

        def call(self, y_true, y_pred):
            return keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True)

    for loss in (batch_mean, Doubled()):
        pipe, reference = helpers.pipeline_and_reference(
            3, M, "except_last", devices, schedule="1f1b")
        compile_both(pipe, reference, loss=loss)
        x, y, sample_weight = helpers.data(BATCH)
        check_one_step(pipe, reference, x, y, sample_weight)


def test_overridden_compute_loss_falls_back_exactly(devices):
    class Custom(keras_pipe.PipelineModel):
        def compute_loss(self, x=None, y=None, y_pred=None,
                         sample_weight=None, training=True):
            return 0.5 * super().compute_loss(x, y, y_pred, sample_weight,
                                              training)

    pipe = Custom(helpers.dense_stages(2), devices=devices[:2],
                  num_micro_batches=M, schedule="1f1b")
    pipe.build((None, helpers.IN_DIM))
    x, y, _ = helpers.data(BATCH)
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    loss, _, grads = helpers.pipeline_loss_and_gradients(pipe, x, y)
    plain = keras_pipe.PipelineModel(pipe.stages, devices=devices[:2],
                                     num_micro_batches=M)
    plain.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    ref_loss, _, ref_grads = helpers.pipeline_loss_and_gradients(plain, x, y)
    close(loss, 0.5 * ref_loss)
    for g, ref_g in zip(grads, ref_grads):
        close(g, 0.5 * ref_g)


def _full_batch_tensors(pipe, x, y, width):
    """Ops in the traced step that output a (BATCH, width) float tensor."""
    function = tf.function(lambda: pipe.compute_loss_and_gradients(x, y))
    graph = function.get_concrete_function().graph
    return [op for op in graph.get_operations()
            for t in op.outputs if t.dtype == tf.float32
            and t.shape.as_list() == [BATCH, width]]


def test_loss_head_runs_on_micro_batch_rows(devices):
    # The head of a splittable loss never builds a full-batch tensor per
    # micro-batch; an overridden compute_loss (the fallback) builds M.
    width = 7  # no other tensor in the step has this shape
    x = np.random.default_rng(0).normal(size=(BATCH, helpers.IN_DIM))
    x = tf.constant(x, tf.float32)
    y = tf.zeros((BATCH, width))

    def pipeline(cls):
        pipe = cls([keras.Sequential([keras.layers.Dense(5)]),
                    keras.Sequential([keras.layers.Dense(width)])],
                   devices=devices[:2], num_micro_batches=M, schedule="1f1b")
        pipe.build((None, helpers.IN_DIM))
        pipe.compile("sgd", "mse")
        return pipe

    class Custom(keras_pipe.PipelineModel):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    split = _full_batch_tensors(pipeline(keras_pipe.PipelineModel), x, y,
                                width)
    padded = _full_batch_tensors(pipeline(Custom), x, y, width)
    # Split: only the merged outputs and the logged full-batch loss; no
    # seed gradient is taken at full-batch size. Padded: one per micro-batch.
    def seeds(ops):
        return {op.name.split("/")[0] for op in ops
                if op.name.startswith("gradients")}

    assert not seeds(split), [op.name for op in split]
    assert len(seeds(padded)) == M, [op.name for op in padded]
