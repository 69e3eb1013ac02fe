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

Which form is faster depends on the CPU and the kernels oneDNN picks for
it: on some the transposed form is slower at every row count. So the rule
(`worth_it`) also asks the device (`transposed_is_faster`): both forms are
timed there once per process, device and micro-batch size, on a
`PROBE_COLUMNS`-wide kernel, the transpose counted as paid once per step,
and the transposed form is taken only when it is faster by `MARGIN`.
"""

import contextlib
import time

import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import placement

__all__ = ["MARGIN", "MAX_ROWS", "MIN_COLUMNS", "PROBE_COLUMNS",
           "TransposedKernels", "eligible", "fits", "onednn",
           "set_workers_onednn", "transposed_is_faster", "transposes",
           "worth_it"]

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
    if placement.process_of(device) is not None:
        return _WORKERS_ONEDNN[0]
    return _compat.onednn_enabled()


def worth_it(rows, total_rows, device=None):
    """Whether a stage's forward calls of `rows` rows (of `total_rows` in
    the step) on `device` should use transposed kernels: oneDNN on there,
    small micro-batches, enough rows in the step (`MAX_ROWS` or more) to
    pay for the transposes, and the transposed form faster on the device
    (`transposed_is_faster`)."""
    return (isinstance(rows, int) and isinstance(total_rows, int)
            and rows <= MAX_ROWS and total_rows >= MAX_ROWS
            and onednn(device)
            and transposed_is_faster(rows, -(-total_rows // rows), device))


# The probe's kernel is PROBE_COLUMNS x PROBE_COLUMNS; the transposed form
# must be at least MARGIN faster (timing noise decides nothing).
PROBE_COLUMNS = 1024
MARGIN = 0.05
_PROBE_ROUNDS = 5
# `{(device's process, rows, products): bool}`, measured in this process.
_FASTER = {}


def transposed_is_faster(rows, products, device=None):
    """Whether `products` forward products of `rows` rows on one kernel
    cost less on `device` as `x @ transpose(w)^T`, the transpose made once,
    than as `x @ w` (by `MARGIN` at least).

    Timed on `device` (default: this process's CPU) the first time a
    process asks for that device's process, `rows` and `products`, with a
    `PROBE_COLUMNS`-wide square kernel: the least of `_PROBE_ROUNDS` runs
    of each form. Runs eagerly, also when asked while a step is traced.
    Asked for this process before its TF runtime started (a memory
    prediction made before any op ran), it answers True untimed: timing
    would start the runtime and fix its devices, and True predicts the
    larger memory.
    """
    key = (placement.process_of(device), rows, products)
    if key not in _FASTER:
        if key[0] is None and not _compat.runtime_started():
            return True
        with tf.init_scope(), tf.device(device or "/device:CPU:0"):
            _FASTER[key] = _probe(rows, products)
    return _FASTER[key]


def _probe(rows, products):
    w = tf.random.stateless_normal([PROBE_COLUMNS] * 2, seed=[1, 2])
    x = tf.random.stateless_normal([rows, PROBE_COLUMNS], seed=[3, 4])

    # Each product reads its own input (`x + n`): equal products would be
    # computed once.
    @tf.function(autograph=False)
    def plain(x, w):
        return tf.add_n([tf.matmul(x + float(n), w)[0, 0]
                         for n in range(products)])

    @tf.function(autograph=False)
    def transposed(x, w):
        # Through a Snapshot, as in a step (`TransposedKernels`).
        wt = tf.raw_ops.Snapshot(input=tf.transpose(w))
        return tf.add_n([tf.matmul(x + float(n), wt, transpose_b=True)[0, 0]
                         for n in range(products)])

    def least(f):
        f(x, w).numpy()  # traced and warm
        best = float("inf")
        for _ in range(_PROBE_ROUNDS):
            start = time.perf_counter()
            f(x, w).numpy()
            best = min(best, time.perf_counter() - start)
        return best

    return least(transposed) < (1 - MARGIN) * least(plain)


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

