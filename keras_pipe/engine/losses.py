"""One micro-batch's exact part of the full-batch compiled loss.

The 1F1B schedule starts the backward pass of micro-batch `i` before later
micro-batches have run forward, so it needs the gradient of the full-batch
loss for micro-batch `i`'s outputs alone. A Keras loss reduces per-element
values `v` with weights `w`:

    reduction "sum":                   sum(w * v)
    "sum_over_batch_size" / "mean":    sum(w * v) / (rows * elements per row)
    "mean_with_sample_weight":         sum(w * v) / sum(w)
    "none":                            w * v (a vector; its gradient sums)

The sum splits over micro-batches and the divisor depends only on the
batch's shape and sample weights, both known before any forward pass. So
micro-batch `i`'s part is `sum(w_i * v_i)` over its own rows divided by the
full batch's divisor, and the loss head runs on `rows_i` rows, not `B`.

`share` does that by standing in, for the length of one call, for each loss
in the model's `CompileLoss`, so Keras still matches outputs, targets, sample
weights and loss weights. A loss it cannot split (a custom `__call__`, values
without a batch axis, a mask) raises `NotSplittable`; the caller then falls
back to the full-batch loss with the other rows set to zero.
"""

import contextlib

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import attached, microbatch
from keras_pipe.engine.executor import LossHead

__all__ = ["NotSplittable", "loss_head", "share", "weight_sums"]

_REDUCTIONS = ("sum", "sum_over_batch_size", "mean", "mean_with_sample_weight",
               "none", None)


class NotSplittable(Exception):
    """A compiled loss that is not a sum over rows with a known divisor."""


def _check(loss):
    if not isinstance(loss, keras.losses.Loss) or (
            type(loss).__call__ is not keras.losses.Loss.__call__):
        raise NotSplittable(f"{loss!r} is not a plain keras.losses.Loss")
    if loss.reduction not in _REDUCTIONS:
        raise NotSplittable(f"unknown reduction {loss.reduction!r}")


@contextlib.contextmanager
def _standing_in(compile_loss, make):
    """Replaces each loss of `compile_loss` by `make(n, loss)` meanwhile.

    Yields the number of losses.
    """
    with _compat.replaced_losses(compile_loss, make) as count:
        with keras.StatelessScope():  # no loss metric updates
            yield count


def weight_sums(compile_loss, y_true, y_pred, sample_weight):
    """Per compiled loss, the sum of its full-batch sample weights (or None).

    `y_pred` only gives the output structure: any micro-batch's outputs.
    """
    sums = {}

    def make(n, loss):
        _check(loss)

        def probe(y_t, y_p, w=None):
            if w is not None:
                sums[n] = keras.ops.sum(keras.ops.cast(w, loss.dtype))
            return keras.ops.zeros((), loss.dtype)
        return probe

    with _standing_in(compile_loss, make) as count:
        compile_loss(y_true, y_pred, sample_weight)
    return [sums.get(n) for n in range(count)]


def share(compile_loss, y_true, y_pred, sample_weight, total_rows, sums):
    """Micro-batch rows' part of `compile_loss` on the full batch.

    Args:
        compile_loss: the model's built `CompileLoss`.
        y_true, y_pred, sample_weight: the micro-batch's rows.
        total_rows: rows of the full batch (int or scalar tensor).
        sums: `weight_sums` of the full batch.

    Raises:
        NotSplittable: the loss is not a sum over rows.
    """
    def make(n, loss):
        _check(loss)

        def part(y_t, y_p, w=None):
            if _compat.get_keras_mask(y_p) is not None:
                raise NotSplittable("masked outputs")
            y_p = keras.tree.map_structure(
                lambda t: keras.ops.convert_to_tensor(t, loss.dtype), y_p)
            y_t = keras.tree.map_structure(
                lambda t: keras.ops.convert_to_tensor(t, loss.dtype), y_t)
            values = loss.call(y_t, y_p)
            if _compat.get_keras_mask(values) is not None or len(
                    values.shape) == 0:
                raise NotSplittable("loss values without a batch axis")
            reduction = loss.reduction
            if reduction in ("none", None):
                return _compat.reduce_weighted_values(
                    values, w, reduction="none", dtype=loss.dtype)
            total = _compat.reduce_weighted_values(
                values, w, reduction="sum", dtype=loss.dtype)
            if reduction == "sum":
                return total
            if reduction == "mean_with_sample_weight" and w is not None:
                divisor = sums[n]
            else:
                per_row = tf.reduce_prod(tf.shape(values)[1:])
                divisor = tf.cast(total_rows, loss.dtype) * tf.cast(
                    per_row, loss.dtype)
            return _compat.scale_loss_for_distribution(
                keras.ops.divide_no_nan(total, divisor))
        return part

    with _standing_in(compile_loss, make):
        return compile_loss(y_true, y_pred, sample_weight)


class _Rows:
    """What `head.part` needs to split the compiled loss over micro-batches."""

    NONE = ()  # falsy: the loss does not split; use the zero-padded batch

    def __init__(self, rows, total_rows, sums):
        self.rows = rows              # per micro-batch: (targets, weights)
        self.total_rows = total_rows  # rows of the batch
        self.sums = sums              # `weight_sums` of the batch

    @classmethod
    def of(cls, model, compile_loss, step, y, sample_weight):
        if compile_loss is None or y is None or (
                type(model).compute_loss is not keras.Model.compute_loss):
            return cls.NONE
        parts = microbatch.scatter((y, sample_weight),
                                   step.num_micro_batches)
        try:
            sums = weight_sums(compile_loss, y,
                               attached.view(step.cells[0][-1].run.outputs),
                               sample_weight)
        except NotSplittable:
            return cls.NONE
        return cls(rows=[p.inputs for p in parts],
                   total_rows=sum(mb.size for mb in step.micro_batches),
                   sums=sums)


def _alone(outputs, sizes, i, micro_batch):
    """Micro-batch `i`'s outputs at their rows of a batch of zeros."""
    before, after = sum(sizes[:i]), sum(sizes[i + 1:])

    def place(t):
        rest = tf.shape(t)[1:]
        zeros = [tf.zeros(tf.concat([[n], rest], 0), t.dtype)
                 for n in (before, after)]
        return tf.concat([zeros[0], t, zeros[1]], 0)

    return keras.tree.map_structure(place, micro_batch.real_rows(outputs))


_MASKED_PARTS = (
    "The model's outputs carry a Keras mask (e.g. from "
    "Embedding(mask_zero=True)), and with schedule={schedule!r} and "
    "{replicas} replica(s) a micro-batch's backward pass starts from its own "
    "part of the loss before every micro-batch has run forward; a masked "
    "loss is divided by the unmasked positions of the whole batch, which "
    "are not known then. Use schedule='gpipe' without replicas for a model "
    "with masked outputs.")


def loss_head(model, x, y, sample_weight, training):
    """The `keras_pipe.engine.executor.LossHead` of `model` for one batch.

    `full` is the model's compiled loss of the merged outputs (it updates
    the loss metrics). `part(step, i)` is a loss whose gradient for
    micro-batch `i`'s outputs is exact: where the compiled loss splits over
    rows, micro-batch `i`'s part of the full-batch loss on its own rows
    (`share`); otherwise (a `compute_loss` override, a loss with its own
    `__call__`) the full-batch loss with every other micro-batch's outputs
    replaced by zeros, which costs a full-batch loss head per micro-batch.
    Parts update no metric.
    """
    rows = []  # filled once per step, at the first part

    def full(y_pred):
        return _compat.compute_loss(model, x=x, y=y, y_pred=y_pred,
                                   sample_weight=sample_weight,
                                   training=training)

    def part(step, i):
        micro_batch = step.micro_batches[i]
        # The last stage's outputs with their masks and logits beside them
        # (`keras_pipe.engine.attached`), viewed once cut to the rows the loss
        # reads.
        outputs = step.cells[i][-1].run.outputs
        if attached.masks(outputs):
            raise ValueError(_MASKED_PARTS.format(
                schedule=model.schedule, replicas=model.num_replicas))
        compile_loss, _ = _compat.compiled_state(model)
        if not rows:
            # Every micro-batch's rows: outside the caller's control
            # dependencies, or every part would wait for this one's stage.
            with tf.control_dependencies(None):
                rows.append(_Rows.of(model, compile_loss, step, y,
                                     sample_weight))
        if rows[0]:
            parts = rows[0]
            y_pred, y_i, w_i = micro_batch.real_rows(
                (outputs,) + tuple(parts.rows[i]))
            y_pred = attached.view(y_pred)
            try:
                return share(compile_loss, y_i, y_pred, w_i,
                             parts.total_rows, parts.sums)
            except NotSplittable:
                rows[0] = _Rows.NONE
        sizes = [mb.size for mb in step.micro_batches]
        alone = attached.view(_alone(outputs, sizes, i, micro_batch))
        with keras.StatelessScope():
            return full(alone)

    scale = (model.optimizer.scale_loss if model.optimizer is not None
             else (lambda value: value))
    return LossHead(full=full, part=part, scale=scale)
