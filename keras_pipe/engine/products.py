"""Forward products of small micro-batches, with their kernels transposed.

Why this exists: with TF's oneDNN kernels (`TF_ENABLE_ONEDNN_OPTS=1`, one
thread), `x @ w` (a Dense layer's forward product, `w` of shape
`[in, out]`) costs more CPU per row on `MAX_ROWS` rows or fewer than on
more, while the same product with the kernel stored transposed,
`tf.matmul(x, wt, transpose_b=True)` (torch's `Linear` form), does not
(measurements: docs/measurements.md, "Transposed kernels"). The input and
weight gradients, `dy @ w^T` and `x^T @ dy`, are fast forms already.
Micro-batches make exactly those small products, and a stage reads its
kernels once per step for M forward calls.

So within a stage's forward call run in place (`Stage.forward`), a
`MatMul(x, w)` on a 2-D kernel `w` of the stage's params is built as
`MatMul(x, wt, transpose_b=True)`, with `wt = transpose(w)` computed once
per step and stage and shared by its micro-batches (the transpose is paid
once, the gain M times: `worth_it`). `wt` goes through a `Snapshot`:
Grappler folds a `Transpose` that feeds a `MatMul` back into `x @ w`
(ArithmeticOptimizer's FoldTransposeIntoMatMul). Nothing else changes: TF's
op callbacks hand the replacement's output to the gradient tapes as the
original `MatMul(x, w)`'s, so the backward pass keeps its fast forms, and
the split backward (`keras_pipe.engine.weight_grad`) replays the original
op; the original op feeds nothing and TF prunes it before the step runs.
With TF's own kernels (oneDNN off) the transposed form is the slow one:
nothing is rewritten there.
"""

import contextlib

import tensorflow as tf

from keras_pipe import _compat

__all__ = ["MAX_ROWS", "MIN_COLUMNS", "TransposedKernels", "eligible",
           "fits", "onednn", "set_workers_onednn", "transposes", "worth_it"]

# Micro-batches of at most this many rows get the transposed form (above,
# both forms cost the same).
MAX_ROWS = 256
# Kernels narrower than this keep `x @ w` (narrower ones gain nothing).
MIN_COLUMNS = 512


# Whether worker processes run oneDNN's kernels. A worker sets its kernels
# itself (`keras_pipe.distributed.worker` turns oneDNN on unless its
# environment says otherwise); `keras_pipe.local_workers` records the
# setting it starts its workers with.
_WORKERS_ONEDNN = [True]


def set_workers_onednn(onednn):
    """Records whether this process's worker processes run oneDNN."""
    _WORKERS_ONEDNN[0] = bool(onednn)


def onednn(device=None):
    """Whether `device` runs oneDNN's kernels: a device of a cluster job
    (a worker process) as its workers were started, else this process's
    TF (`keras_pipe._compat.onednn_enabled`)."""
    if device is not None and tf.DeviceSpec.from_string(device).job not in (
            None, "localhost"):
        return _WORKERS_ONEDNN[0]
    return _compat.onednn_enabled()


def worth_it(rows, total_rows, device=None):
    """Whether a stage's forward calls of `rows` rows (of `total_rows` in
    the step) on `device` should use transposed kernels: oneDNN on there,
    small micro-batches, and enough rows in the step (`MAX_ROWS` or more)
    to pay for the transposes."""
    return (isinstance(rows, int) and isinstance(total_rows, int)
            and rows <= MAX_ROWS and total_rows >= MAX_ROWS
            and onednn(device))


def transposes(sizes, device=None):
    """Whether a stage's forward calls run in place on `device`, of `sizes`
    rows each (one per micro-batch of the step; ints, or tensors for a
    batch known only when the step runs), get transposed kernels
    (`worth_it` of the largest and the sum); the executor's rule and the
    memory model's."""
    return (bool(sizes) and all(isinstance(n, int) for n in sizes)
            and worth_it(max(sizes), sum(sizes), device))


def fits(rows):
    """Whether a forward `MatMul` of `rows` rows (`None`: unknown) gets the
    transposed form: at most `MAX_ROWS` (more: rows folded into the batch,
    a sequence's tokens)."""
    return rows is None or rows <= MAX_ROWS


def eligible(kernel):
    """Whether a kernel (a variable or a tensor) is transposed for the
    forward products that read it: float32, 2-D, at least `MIN_COLUMNS`
    columns."""
    shape = tuple(kernel.shape)
    return (tf.as_dtype(kernel.dtype) == tf.float32 and len(shape) == 2
            and shape[1] is not None and shape[1] >= MIN_COLUMNS)


class TransposedKernels:
    """One stage's kernels transposed once per step, and the forward calls
    that read them.

    Create one per (step, stage) and pass it to each forward call of the
    stage in that step (`Stage.forward(..., kernels=...)`): the first call
    that multiplies by kernel `w` computes `transpose(w)`, the next ones
    reuse it.

    Args:
        params: the stage's trainable values, as read for the step.
    """

    def __init__(self, params):
        self._params = {p.ref() for p in params if eligible(p)}
        self._transposed = {}
        self.products = 0  # forward products rewritten, all calls

    @contextlib.contextmanager
    def rewriting(self, stand_ins):
        """Within: each `MatMul(x, w)` on an eligible kernel `w` is built as
        `MatMul(x, transpose(w), transpose_b=True)`; `stand_ins` gets
        `{replacement op: original op}` for the split backward."""

        def callback(op_type, inputs, attrs, outputs, op_name=None,
                     graph=None):
            if (op_type != "MatMul" or graph is None or len(inputs) != 2
                    or inputs[1].ref() not in self._params
                    or inputs[0].ref() in self._params):
                return None
            op = outputs[0].op
            x, w = inputs
            if (op.get_attr("transpose_a") or op.get_attr("transpose_b")
                    or (x.shape.rank == 2 and not fits(x.shape[0]))):
                return None  # (rows folded into the batch: a sequence)
            with _compat.stop_recording():
                if w.ref() not in self._transposed:
                    # Through a Snapshot: Grappler folds a Transpose
                    # feeding a MatMul back into `x @ w`
                    # (ArithmeticOptimizer's FoldTransposeIntoMatMul).
                    self._transposed[w.ref()] = tf.raw_ops.Snapshot(
                        input=tf.transpose(w), name="transposed_kernel")
                y = tf.linalg.matmul(x, self._transposed[w.ref()],
                                     transpose_b=True)
            stand_ins[y.op] = op
            self.products += 1
            return [y]

        with _compat.op_callback(callback):
            yield

