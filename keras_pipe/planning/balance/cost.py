"""Cost models: one cost per layer call, to balance pipeline stages by.

* `parameter_counts`: weights per call (DeepSpeed's "parameters");
* `flops`: forward floating-point operations estimated from the calls'
  input and output shapes, without running anything (lingvo's cost);
* `memory`: bytes a call adds to its stage when training: weights,
  gradients and optimizer slots, plus its activations, kept for every
  micro-batch without remat and for one micro-batch with it;
* `time`: measured forward time per call on a device, after a warm-up run
  (torchgpipe's `balance_by_time`).

Each takes a `keras_pipe.planning.graph.Graph` and returns a list with one number per
call. A variable used by several calls (a shared layer) counts at its first
call only.
"""

import contextlib
import math
import time as time_lib

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _validation
from keras_pipe.planning.balance.blockpartition import block_partition

__all__ = ["parameter_counts", "flops", "activation_bytes", "memory", "time",
           "tensor_bytes", "variable_bytes"]

_NORMALIZATION = (keras.layers.BatchNormalization,
                  keras.layers.LayerNormalization,
                  keras.layers.GroupNormalization,
                  keras.layers.UnitNormalization)
_TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
               keras.layers.Conv3DTranspose)


def dims(shape, batch_size):
    """A shape with the batch dimension set and other unknowns set to 1."""
    return [batch_size if k == 0 and d is None else (1 if d is None else d)
            for k, d in enumerate(shape)]


def shape_of(kt, shapes=None):
    """`kt`'s shape, or the one `keras_pipe.planning.balance.shapes` inferred."""
    return (shapes or {}).get(id(kt), kt.shape)


def _elements(kt, batch_size=1, shapes=None):
    return math.prod(dims(shape_of(kt, shapes), batch_size))


def tensor_bytes(kt, batch_size=1, shapes=None):
    """Bytes of a tensor like KerasTensor `kt` with `batch_size` rows.

    `shapes` (`{id(KerasTensor): shape}`, see
    `keras_pipe.planning.balance.shapes.infer_shapes`) overrides `kt.shape`.
    """
    return _elements(kt, batch_size, shapes) * tf.as_dtype(kt.dtype).size


def _first_use(graph, attribute):
    """Per call, the variables (by `attribute`) no earlier call used."""
    seen, result = set(), []
    for call in graph.calls:
        own = []
        for v in getattr(call.operation, attribute, None) or []:
            if id(v) not in seen:
                seen.add(id(v))
                own.append(v)
        result.append(own)
    return result


def _size(variable):
    return math.prod(variable.shape)


def variable_bytes(variable):
    """Bytes of a variable's value."""
    return _size(variable) * tf.as_dtype(variable.dtype).size


def parameter_counts(graph):
    """Number of weights (trainable or not) each call adds."""
    return [sum(_size(v) for v in own) for own in _first_use(graph, "weights")]


def _channels_axis(op):
    data_format = getattr(op, "data_format", "channels_last")
    return 1 if data_format == "channels_first" else -1


def _positions(kt, axis, shapes=None):
    """Elements per example of `kt` divided by its channel count."""
    shape = dims(shape_of(kt, shapes), 1)
    channels = shape[axis] if len(shape) > 1 else 1
    return math.prod(shape[1:]) // max(channels, 1)


def _call_flops(call, shapes=None):
    """Forward FLOPs of one call for one example."""
    op = call.operation
    inputs, outputs = call.inputs, call.outputs
    out_elements = sum(_elements(x, 1, shapes) for x in outputs)
    in_elements = sum(_elements(x, 1, shapes) for x in inputs)
    params = sum(_size(v) for v in getattr(op, "weights", None) or [])
    if isinstance(op, keras.layers.Embedding):
        return out_elements
    if isinstance(op, _NORMALIZATION):
        return 5 * out_elements
    if isinstance(op, keras.layers.MultiHeadAttention):
        query = dims(shape_of(inputs[0], shapes), 1)
        value = dims(shape_of(inputs[1], shapes), 1) if len(
            inputs) > 1 else query
        t_q, t_v = math.prod(query[1:-1]), math.prod(value[1:-1])
        heads, key_dim = op.num_heads, op.key_dim
        value_dim = op.value_dim or key_dim
        scores = 2 * heads * t_q * t_v * (key_dim + value_dim)
        return 2 * params * max(t_q, t_v) + scores + 3 * heads * t_q * t_v
    if isinstance(op, keras.layers.RNN) and inputs:
        steps = dims(shape_of(inputs[0], shapes), 1)[1]
        return 2 * params * steps
    if params and outputs:
        if isinstance(op, _TRANSPOSED) and inputs:
            positions = _positions(inputs[0], _channels_axis(op), shapes)
        else:
            positions = _positions(outputs[0], _channels_axis(op), shapes)
        return 2 * params * positions + out_elements
    return max(in_elements, out_elements)


def flops(graph, batch_size=1, shapes=None):
    """Estimated forward FLOPs of each call for `batch_size` examples.

    Layers with weights cost two FLOPs per weight per output position (a
    multiply-add per kernel entry: Dense, convolutions, depthwise and
    separable convolutions, EinsumDense), attention adds its score and
    weighting products, normalization ~5 per element, embeddings and
    weightless layers one per element they read or write. Shapes come from
    `shapes` (`keras_pipe.planning.balance.shapes.infer_shapes`) where given; other
    unknown dimensions than the batch count as 1.
    """
    return [batch_size * _call_flops(call, shapes) for call in graph.calls]


def activation_bytes(graph, batch_size=1, shapes=None):
    """Bytes of each call's outputs for `batch_size` examples."""
    return [sum(tensor_bytes(x, batch_size, shapes) for x in call.outputs)
            for call in graph.calls]


def memory(graph, batch_size=1, num_micro_batches=1, remat="except_last",
           optimizer_slots=2, shapes=None):
    """Training memory, in bytes, each call adds to its stage.

    Weights count once; trainable weights also count a gradient and
    `optimizer_slots` optimizer slots (2 for Adam, 0 for plain SGD). Outputs
    of `batch_size` examples (one micro-batch) count `num_micro_batches`
    times with `remat="never"` (every micro-batch keeps them until its
    backward pass) and once otherwise (only the micro-batch being
    recomputed holds them). Boundary tensors kept per micro-batch depend on
    where the cuts fall: `keras_pipe.plan` adds them per stage.

    `remat` may be a list of one mode per stage: a call then counts under
    the mode of the stage it falls in when the calls are cut into
    `len(remat)` blocks of balanced memory (found by a few rounds of
    cutting and re-costing, since the cut depends on the costs).
    """
    modes = _validation.check_remat(remat)
    if isinstance(modes, str):
        return _memory(graph, batch_size, num_micro_batches,
                       [modes] * len(graph.calls), optimizer_slots, shapes)
    num_stages = len(modes)
    n = len(graph.calls)
    stage_of = [min(c * num_stages // max(n, 1), num_stages - 1)
                for c in range(n)]
    for _ in range(4):
        costs = _memory(graph, batch_size, num_micro_batches,
                        [modes[j] for j in stage_of], optimizer_slots,
                        shapes)
        if num_stages > n:
            break
        sizes = block_partition(costs, num_stages)
        new = [j for j, size in enumerate(sizes) for _ in range(size)]
        if new == stage_of:
            break
        stage_of = new
    return costs


def _memory(graph, batch_size, num_micro_batches, call_modes,
            optimizer_slots, shapes=None):
    """`memory` with one remat mode per call."""
    result = []
    for own, out, mode in zip(_first_use(graph, "weights"),
                              activation_bytes(graph, batch_size, shapes),
                              call_modes):
        kept = num_micro_batches if mode == "never" else 1
        weights = 0
        for v in own:
            size = variable_bytes(v)
            weights += size * ((2 + optimizer_slots) if v.trainable else 1)
        result.append(weights + kept * out)
    return result


def sample_input(kt, batch_size, shapes=None):
    """A tensor like `kt`: zeros for integers and booleans, else normal."""
    shape = dims(shape_of(kt, shapes), batch_size)
    dtype = tf.as_dtype(kt.dtype)
    if dtype.is_floating:
        return tf.random.normal(shape, dtype=dtype)
    return tf.zeros(shape, dtype=dtype)


def _timer(call, training):
    """A tf.function running `call` statelessly (model state is untouched)."""

    @tf.function
    def run(*flat):
        values = {id(x): t for x, t in zip(call.inputs, flat)}
        with keras.StatelessScope():
            call.run(values, training=training)
        return [values[id(x)] for x in call.outputs]

    return run


def time(graph, device=None, batch_size=1, repeats=5, training=True,
         shapes=None):
    """Measured forward time of each call, in seconds, for `batch_size` rows.

    Each call runs alone as a `tf.function` on random inputs of its input
    shapes, under a `keras.StatelessScope` so that the model's variables
    (BatchNormalization statistics, seed generators) do not change. The
    first run (tracing, warm-up) is not timed; the result is the median of
    `repeats` timed runs.

    Args:
        graph: a `keras_pipe.planning.graph.Graph`.
        device: the TF device to measure on. Defaults to `None` (TF's
            default device).
        batch_size: rows per input. Defaults to `1`.
        repeats: timed runs per call. Defaults to `5`.
        training: the `training` flag the layers run with. Defaults to
            `True`.
        shapes: `{id(KerasTensor): shape}` to sample inputs of
            (`keras_pipe.planning.balance.shapes.infer_shapes`). Defaults to `None`
            (the graph's shapes, unknown dimensions as 1).

    Returns:
        A list of seconds, one per call.
    """
    result = []
    with tf.device(device) if device else contextlib.nullcontext():
        for call in graph.calls:
            inputs = [sample_input(x, batch_size, shapes) for x in call.inputs]
            run = _timer(call, training)
            _fetch(run(*inputs))
            samples = []
            for _ in range(repeats):
                start = time_lib.perf_counter()
                _fetch(run(*inputs))
                samples.append(time_lib.perf_counter() - start)
            result.append(float(np.median(samples)))
    return result


def _fetch(outputs):
    """Waits for `outputs` (an asynchronous device may still be running)."""
    for t in outputs:
        if t is not None and hasattr(t, "shape") and t.shape.num_elements():
            tf.reshape(t, [-1])[:1].numpy()
            return
