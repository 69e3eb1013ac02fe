"""Predicted peak memory of a training step, per stage (per device).

Why a model and not a measurement: the planner (`keras_pipe.planning.budget`) has to
compare thousands of cuts, micro-batch counts and remat modes before
anything is built. The model follows what the executor holds
(`keras_pipe.remat`, `keras_pipe.model`):

* the stage's variables, the optimizer's slots, and one running-sum buffer
  per trainable variable (made by the first backward pass, alive to the
  optimizer step), plus one micro-batch's weight gradients while a backward
  pass runs;
* per micro-batch in flight (forward done, backward not yet): its boundary
  input when it is rematerialized, its boundary input and the activations
  the tape keeps when it is not (per layer type, as measured for Keras
  3.15 on TF 2.21);
* while a backward pass runs: the recomputed activations (remat: the
  tensors some gradient op needs), the incoming and outgoing gradients,
  the largest activation gradients, and the output gradients of the other
  micro-batches in flight, which a next stage running ahead may have sent;
  when the pass reaches a product that broadcasts its kernel over the rows
  (`MultiHeadAttention`'s projections), that kernel's gradient per row
  before its sum (`broadcast_bytes`); with SGD at M = 1 without remat,
  two gradients, not all (each is applied as it is made);
* stage 0 also holds the mini-batch, the last stage the merged outputs and
  their loss gradient (under GPipe only from the merge on: before, the
  outputs of the micro-batches run so far);
* where the executor splits a backward pass without remat
  (`schedule.defer_weight_runs` with `num_stages`, read from the
  schedule's actions by `StageActions.executor_order`: GPipe's runs fed
  back to back, whose W waits for the run's end, and each backward pass
  whose input gradient goes to another device, with its W right after),
  the micro-batch keeps its stash (`Block.stash`: its mixing ops' inputs
  and output gradients) until its W call, which concatenates a run's
  stashes op by op;
* where the executor gives a stage's forward products transposed kernels
  (`keras_pipe.engine.products`: oneDNN on, small micro-batches, its own
  rule `products.transposes`), a transposed copy of each such kernel
  (`Block.transposed`) from the stage's first forward call run in place to
  its last.

Validated per stage against TF's allocator peak by `tools/memory_model.py`
(README, "Fitting a memory budget").

How many micro-batches a stage holds comes from the schedule's clock ticks
(`stage_actions`), not from a formula per schedule: a new schedule plugs in
by name or as a function `(num_micro_batches, num_stages) -> ticks`.
"""

import dataclasses
import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _validation
from keras_pipe.engine import microbatch as microbatch_lib
from keras_pipe.engine import products as products_lib
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning.balance import cost as cost_lib
from keras_pipe.planning.balance import shapes as shapes_lib

__all__ = ["Block", "FEATURES", "FUNCTION_NODE_BYTES", "Profile", "StageMemory",
           "call_nodes", "features", "function_nodes",
           "in_flight", "moments", "predict", "predict_resident",
           "stage_actions", "stage_memory", "update_temporaries",
           "weight_call_transient"]

# Activations whose gradient needs only the output (the tape keeps nothing
# more than the layer's output): other activations also keep their input.
_OUTPUT_ONLY = ("linear", "relu", "tanh", "sigmoid", "softmax", "relu6",
                "elu", "exponential")


def _ticks(schedule, num_micro_batches, num_stages):
    if callable(schedule):
        return schedule(num_micro_batches, num_stages)
    return schedule_lib.get_schedule(schedule).build(
        num_micro_batches, num_stages, num_stages)


class StageActions(list):
    """One stage's passes `(kind, i)` in order (a list), knowing the whole
    schedule: `executor_order` places the weight-gradient calls where the
    executor does."""

    def __init__(self, items, ticks, j, num_stages):
        super().__init__(items)
        self.ticks, self.j, self.num_stages = ticks, j, num_stages
        self._orders = {}

    def executor_order(self, mode, num_micro_batches):
        """The stage's passes as the executor runs them with remat `mode`
        on every stage: `"F"`; `"B"` (input and weight gradients, one
        call); `"Bi"` (input gradients only) and `"Wg"` (its weight
        gradients, a later call) where the executor splits a backward pass
        (`schedule.defer_weight_runs` with `num_stages`, as
        `engine.executor` calls it: right after its `"B"`, or at the end of
        a run fed back to back); `"W"` for a backward pass the schedule
        splits itself (the micro-batch is held until then)."""
        key = (mode, num_micro_batches)
        if key not in self._orders:
            flat = [a for tick in self.ticks for a in tick]
            self._orders[key] = _stage_order(
                flat, self.j, mode, num_micro_batches, self.num_stages)
        return self._orders[key]


def _remat(mode, i, num_micro_batches):
    return mode == "always" or (mode == "except_last"
                                and i < num_micro_batches - 1)


def _stage_order(flat, j, mode, m, num_stages=None):
    """`StageActions.executor_order` of stage `j` among the actions `flat`
    (issue order); `num_stages=None`: every run of two or more backward
    passes deferred, lone ones whole (`defer_weight_runs` without it)."""
    split = {(a.i, a.j) for a in flat if a.kind == "W"}
    added = schedule_lib.defer_weight_runs(
        flat, lambda a: a.j,
        lambda a: (a.i, a.j) not in split and not _remat(mode, a.i, m),
        num_stages)
    weights = {(a.i, a.j) for a in added if a.kind == "W"} - split
    out = []
    for a in added:
        if a.j != j or (a.kind == "B" and (a.i, a.j) in split):
            continue
        if a.kind == "B":
            out.append(("Bi" if (a.i, a.j) in weights else "B", a.i))
        elif a.kind == "W":
            out.append(("W" if (a.i, a.j) in split else "Wg", a.i))
        else:
            out.append((a.kind, a.i))
    return out


def stage_actions(schedule, num_micro_batches, num_stages):
    """Per stage, its passes `("F", i)` / `("B", i)` in the order they run.

    A split backward pass (`"W"` actions, zero-bubble schedules) holds the
    micro-batch until its `"W"`, which is listed as `("W", i)` (its `"B"`
    is not listed). Each list is a `StageActions`, which also knows where
    the executor splits backward passes (`executor_order`).

    ```python
    >>> stage_actions("1f1b", 2, 2)[1]
    [('F', 0), ('B', 0), ('F', 1), ('B', 1)]
    ```
    """
    ticks = _ticks(schedule, num_micro_batches, num_stages)
    split = {(a.i, a.j) for tick in ticks for a in tick if a.kind == "W"}
    actions = [[] for _ in range(num_stages)]
    for tick in ticks:
        for a in tick:
            if a.kind == "F":
                actions[a.j].append(("F", a.i))
            elif (a.kind == "W") == ((a.i, a.j) in split):
                actions[a.j].append((a.kind, a.i))
    return [StageActions(a, ticks, j, num_stages)
            for j, a in enumerate(actions)]


def in_flight(schedule, num_micro_batches, num_stages):
    """Per stage, the most micro-batches whose forward ran and backward not.

    ```python
    >>> in_flight("gpipe", 8, 4), in_flight("1f1b", 8, 4)
    ([8, 8, 8, 8], [4, 3, 2, 1])
    ```
    """
    result = []
    for actions in stage_actions(schedule, num_micro_batches, num_stages):
        live = most = 0
        for kind, _ in actions:
            live += 1 if kind == "F" else -1
            most = max(most, live)
        result.append(most)
    return result


def _dtype_size(dtype):
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).size


def _variable_bytes(v):
    return math.prod(v.shape) * _dtype_size(v.dtype)


# Inside the traced recompute-and-backward function a tensor stays alive
# only if a gradient op needs it: a call's output when its own gradient
# needs it (relu, tanh, ...) or a consumer's gradient needs its input
# (layers with weights, products, max pooling); sums, reshapes, average
# pooling need neither.
_NEEDS_NOTHING = (keras.layers.Add, keras.layers.Subtract,
                  keras.layers.Average, keras.layers.Concatenate,
                  keras.layers.Flatten, keras.layers.Reshape,
                  keras.layers.Identity, keras.layers.Dropout,
                  keras.layers.GlobalAveragePooling1D,
                  keras.layers.GlobalAveragePooling2D,
                  keras.layers.AveragePooling2D, keras.layers.ReLU,
                  keras.layers.Softmax, keras.layers.Activation)


def _gradient_needs(op):
    """(needs its input, needs its output) for the gradient of a layer."""
    activation = getattr(op, "activation", None)
    name = getattr(activation, "__name__", "linear")
    output_only = name in _OUTPUT_ONLY and name != "linear"
    if isinstance(op, (keras.layers.ReLU, keras.layers.Softmax)):
        return False, True
    if isinstance(op, _NEEDS_NOTHING) and not getattr(op, "weights", None):
        if isinstance(op, keras.layers.Activation) and not output_only:
            return True, False
        return False, output_only
    return True, output_only


_TRACED = weakref.WeakKeyDictionary()
# Per operation and input signature: graph nodes of the traced call
# (`_traced_inner`): `(forward, forward and backward)`.
_NODES = weakref.WeakKeyDictionary()
# Per operation and input signature: bytes per row of the broadcast kernel
# gradients of the traced call (`_broadcast_gradients`), the largest first,
# and of its kept tensors freed before them (`_freed_before_broadcast`).
_BROADCAST = weakref.WeakKeyDictionary()
# Ops whose outputs a gradient reads without them holding memory of their
# own: the function's arguments, constants, views of variables, shapes.
_NOT_HELD = ("Placeholder", "Const", "ReadVariableOp", "VarHandleOp",
             "Shape", "ShapeN", "Size", "Rank", "Identity")
# Ops whose output shares its input's buffer.
_VIEWS = ("Reshape", "ExpandDims", "Squeeze", "Identity", "StopGradient")
# Gradient ops that read only a tensor's shape: they run as soon as the
# tensor is made and do not keep it alive.
_READS_SHAPE = ("Shape", "ShapeN", "Size", "Rank")


def _buffer_of(t, inside):
    """The tensor whose buffer `t` shares: through reshapes, identities and
    transposes that keep the order (TF forwards the input buffer)."""
    while t.op in inside:
        if t.op.type == "Transpose":
            perm = tf.get_static_value(t.op.inputs[1])
            if perm is None or list(perm) != sorted(perm):
                break
        elif t.op.type not in _VIEWS:
            break
        t = t.op.inputs[0]
    return t


def _folded_transpose(t):
    """Whether `t` is a 2-D transpose that only matrix products read:
    grappler's arithmetic optimizer folds it into them (`MatMul`'s
    `transpose_a/b`, "FoldTransposeIntoMatMul"), so the step's graph
    holds no transposed copy. The tied output layer of GPT-2
    (`ReversibleEmbedding(reverse=True)`: `matmul(x, transpose(table))`):
    TF's profiler found no transposed table alive at the worker GPT-2's
    stage-1 peak (Adam, M = 4, GPipe, never), where the model counted one
    per micro-batch held (15.6 MiB each; the stage +19% on its logical
    device, 282.0 / 236.7 MiB, its worker +19-20%)."""
    if t.op.type != "Transpose" or t.shape.rank != 2:
        return False
    perm = tf.get_static_value(t.op.inputs[1])
    return perm is not None and list(perm) == [1, 0] and all(
        c.type == "MatMul" for c in t.consumers())


# Batched products whose operand without the batch dimension is broadcast
# (`tf.matmul` of a 3-D input by a 2-D kernel: Keras' `einsum` for
# `EinsumDense`, the projections of `MultiHeadAttention`).
_BATCHED_PRODUCTS = ("BatchMatMulV2", "BatchMatMulV3")


def _broadcast_gradients(graph, inside):
    """Bytes per row of each broadcast kernel's gradient before its sum: TF's
    gradient of a batched product (`_BatchMatMulV2Grad`) makes the kernel's
    gradient per row, `[rows, ...kernel]`, then sums it over the rows."""
    found = []
    for op in graph.get_operations():
        if op in inside or op.type not in _BATCHED_PRODUCTS:
            continue
        t = op.outputs[0]
        dims = t.shape.as_list() if t.shape.rank is not None else []
        # Summed over the rows and reshaped to the kernel's shape, known
        # whole (the input gradient's `Sum`, over broadcast axes, keeps
        # the batch dimension).
        if len(dims) < 3 or dims[0] is not None or None in dims[1:] or \
                not any(c.type == "Sum" and any(
                    r.type == "Reshape" and r.outputs[0].shape.is_fully_defined()
                    for r in c.outputs[0].consumers()) for c in t.consumers()):
            continue
        found.append(t.dtype.size * math.prod(dims[1:]))
    return sorted(found, reverse=True)


def _signature(call, shapes=None):
    """The specs a call is traced with (batch dimension unknown) and their
    cache key."""
    specs = []
    for x in call.inputs:
        shape = cost_lib.dims(cost_lib.shape_of(x, shapes), 1)
        specs.append(tf.TensorSpec([None] + shape[1:], x.dtype))
    return specs, tuple((tuple(s.shape), s.dtype) for s in specs)


def call_nodes(call, shapes=None):
    """`(forward, forward and backward)`: graph nodes of one call of
    `call` in a training step, from its traced gradient graph
    (`_traced_inner`); `(0, 0)` for a call without an operation."""
    if not isinstance(call.operation, keras.Operation):
        return 0, 0
    _traced_inner(call, shapes)
    return _NODES[call.operation][_signature(call, shapes)[1]]


def broadcast_bytes(call, shapes=None):
    """Bytes per row of the broadcast kernels' gradients one backward pass
    of `call` holds at once, before their sums over the rows: the
    `CONCURRENT_KERNELS` largest of its traced gradient graph
    (`_broadcast_gradients`; 0 for most layers).

    A 3-D input times a 2-D kernel is a batched product that broadcasts the
    kernel (Keras' `einsum` for `EinsumDense`: `MultiHeadAttention`'s four
    projections); TF's gradient makes the kernel's gradient per row,
    `[rows, ...kernel]`, and sums it. TF's profiler
    (`tools/allocation_trace.py transformer sgd 1 gpipe never 0`, the
    worker Transformer's stage 0, 16 rows) found two `[16, 512, 512]`
    gradients (query and value, 16 MiB each) alive at the stage's
    allocator peak, made by the inter-op pool's two threads at once."""
    if not isinstance(call.operation, keras.Operation):
        return 0
    _traced_inner(call, shapes)
    found, _ = _BROADCAST[call.operation][_signature(call, shapes)[1]]
    return sum(found[:CONCURRENT_KERNELS])


def _freed_before_broadcast(call, shapes=None):
    """Bytes per row of the tensors inside `call` that its gradient keeps
    and that the forward pass made from its first kernel-broadcasting
    product on: freed by the backward pass before that product's kernel
    gradient (`broadcast_bytes`) is made (in an opaque layer, such as
    KerasHub's `TransformerDecoder`, the feed-forward part after the
    attention)."""
    if not isinstance(call.operation, keras.Operation):
        return 0
    _traced_inner(call, shapes)
    return _BROADCAST[call.operation][_signature(call, shapes)[1]][1]


def _traced_inner(call, shapes=None):
    """`(bytes per row, bytes)` of the tensors inside an opaque call (a
    layer with its own `call()` around other layers) that its gradient
    reads, from the traced gradient graph.

    The training step is one traced function: a tensor of the forward pass
    stays alive after the pass if and only if a gradient op reads it. So the
    call is traced once (batch dimension unknown) with its gradients with
    respect to its inputs and weights, and the forward tensors those ops
    read are summed, a batch-sized tensor per row, others whole; the call's
    arguments and outputs are counted elsewhere (the boundary, `out`)."""
    specs, key = _signature(call, shapes)
    cache = _TRACED.setdefault(call.operation, {})
    if key in cache:
        return cache[key]
    nodes = _NODES.setdefault(call.operation, {})
    variables = list(getattr(call.operation, "trainable_weights", []))
    floating = [n for n, s in enumerate(specs) if s.dtype.is_floating]

    def gradients(*flat):
        values = {id(x): t for x, t in zip(call.inputs, flat)}
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([flat[n] for n in floating])
            tape.watch([v.value for v in variables])
            call.run(values, training=True)
            outputs = [values[id(x)] for x in call.outputs]
        forward.extend(tf.compat.v1.get_default_graph().get_operations())
        differentiable = [y for y in outputs if y.dtype.is_floating]
        kept.extend(outputs)
        return tape.gradient(
            differentiable, [flat[n] for n in floating]
            + [v.value for v in variables],
            output_gradients=[tf.ones_like(y) for y in differentiable])

    forward, kept = [], []
    with keras.StatelessScope():
        graph = tf.function(gradients, autograph=False).get_concrete_function(
            *specs).graph
    inside = set(forward)
    # Nodes of the call's own ops: not its arguments (placeholders of the
    # inputs and captured variables) nor the seeds (`ones_like`).
    own = [op for op in graph.get_operations()
           if op.type != "Placeholder" and not op.name.startswith("ones_like")]
    nodes[key] = (sum(op.type != "Placeholder" for op in forward), len(own))
    outputs = {id(t) for t in kept}
    found = _broadcast_gradients(graph, inside)
    # Forward ops from the first product that broadcasts a kernel on: the
    # tensors they make are freed by the backward pass before it reaches
    # that product's kernel gradient.
    order = {op: n for n, op in enumerate(forward)}
    first = min((order[op] for op in forward
                 if op.type in _BATCHED_PRODUCTS and any(
                     x.shape.rank == 2 for x in op.inputs)),
                default=len(forward)) if found else len(forward)
    per_row = whole = later = 0
    seen = set()
    for op in graph.get_operations():
        if op in inside or op.type in _READS_SHAPE:
            continue
        for t in op.inputs:
            t = _buffer_of(t, inside)
            if t.op not in inside or id(t) in seen or \
                    t.op.type in _NOT_HELD or id(t) in outputs or \
                    _folded_transpose(t):
                continue
            seen.add(id(t))
            dims = t.shape.as_list() if t.shape.rank is not None else []
            if dims and dims[0] is None:
                size = t.dtype.size * math.prod(d or 1 for d in dims[1:])
                per_row += size
                if order.get(t.op, -1) >= first:
                    later += size
            elif dims and t.dtype.is_floating and all(
                    d is not None for d in dims):
                # Without the batch dimension: a copy made from a weight
                # that a gradient reads (the transposed token embedding of
                # a tied output layer, `ReversibleEmbedding(reverse=True)`;
                # a cast weight), one per call: views of variables
                # (`ReadVariableOp`) are not held.
                whole += t.dtype.size * math.prod(dims)
    cache[key] = per_row, whole
    _BROADCAST.setdefault(call.operation, {})[key] = found, later
    return per_row, whole


def _inner_recompute_bytes(call, rows, shapes=None):
    """Tensors inside a call that its gradient keeps (not its output),
    from the call's traced gradient graph (`_traced_inner`)."""
    per_row, whole = _traced_inner(call, shapes)
    return per_row * rows + whole


def _attention_lengths(call, rows, shapes):
    """A `MultiHeadAttention` call's query and value lengths (tokens)."""
    query = cost_lib.dims(cost_lib.shape_of(call.inputs[0], shapes), rows)
    t_q = t_v = math.prod(query[1:-1])
    if len(call.inputs) > 1:
        t_v = math.prod(cost_lib.dims(
            cost_lib.shape_of(call.inputs[1], shapes), rows)[1:-1])
    return t_q, t_v


# TF's CPU kernels for a 2-D convolution's gradients (Conv2DCustomBackprop-
# Input/Filter, `tensorflow/core/kernels/conv_grad_*_ops.cc`) im2col a shard
# of images into one scratch buffer sized for "the L3 cache" they assume:
# `shard = ceil(30 MiB / sizeof(T) / work_unit)` images, whatever the batch.
_CONV_WORKING_SET = 30 << 20


# Backward kernels with a scratch buffer that run at once: a conv's input
# and filter gradients are ready together (and a W call's filter gradients
# all at once), and TF's inter-op pool (2 threads here: one per core) runs
# two kernels together. Measured, BFC allocator peak of the ResNet stage 0
# of `tools/memory_model.py`, M = 4, remat "always": 58.2 MiB with one
# inter-op thread (`tf.config.threading.set_inter_op_parallelism_threads`),
# 86.9 with the default: one more 27 MiB buffer (M = 1 without remat: 84.7
# and 113.7). A backward call of input gradients only (`"Bi"`) holds none:
# only the filter gradient (Conv2DBackpropFilter) allocates the buffer.
CONCURRENT_KERNELS = 2


def backward_workspace(call, shapes=None):
    """Bytes of the scratch buffer the gradient of `call` allocates (0 for
    most layers): a `Conv1D`/`Conv2D`'s im2col buffer, as TF's CPU kernel
    sizes it (one shard of images, `_CONV_WORKING_SET`), independent of the
    micro-batch size. Measured (BFC allocator peak of one conv's traced
    gradient): 16 x 32 x 32 x 32 -> 32 filters, 3 x 3: 36.0 MiB, of which
    the buffer 27.0 and the tensors 9; 5 x 5: 34.1 / 28.1; 2 x 8 x 8 x
    256, 3 x 3: 9.1 / 6.2."""
    op = call.operation
    if not isinstance(op, (keras.layers.Conv1D, keras.layers.Conv2D)) or \
            isinstance(op, (keras.layers.Conv1DTranspose,
                            keras.layers.Conv2DTranspose,
                            keras.layers.DepthwiseConv2D,
                            keras.layers.SeparableConv1D,
                            keras.layers.SeparableConv2D)):
        return 0
    out = cost_lib.dims(cost_lib.shape_of(call.outputs[0], shapes), 1)
    first = getattr(op, "data_format", "channels_last") == "channels_first"
    image = math.prod(out[2:] if first else out[1:-1])
    out_depth = op.filters
    kernel = op.kernel_size
    in_depth = op.kernel.shape[-2]
    size = _dtype_size(op.compute_dtype)
    filter_total = math.prod(kernel) * in_depth
    unit = image * filter_total + image * out_depth + filter_total * out_depth
    shard = -(-(_CONV_WORKING_SET // size) // unit)
    return shard * image * filter_total * size


def _stashes_output_gradient(op):
    """Whether a split backward pass stashes the gradient of `op`'s
    output for its W: a layer with trainable weights, but not batch
    normalization, which in training scales by the batch's statistics:
    its weights meet only per-channel vectors (`x * (gamma *
    rsqrt(var))`), a stash of vectors."""
    return bool(getattr(op, "trainable_weights", None)) and not isinstance(
        op, keras.layers.BatchNormalization)


def _stash_bytes(call, rows, shapes=None):
    """What a split backward pass (`engine.weight_grad`) keeps of one call
    for its W: per mixing op (an op with a weight operand) its inputs and
    the gradient of its output, so for a call with trainable weights its
    distinct float inputs and its outputs; in attention also the
    projections' outputs (their gradients) and the attended values (the
    output projection's input). Nothing for calls without weights: the
    tape's other tensors (an activation's output, softmax scores) are
    freed when B returns."""
    op = call.operation
    if not _stashes_output_gradient(op):
        return 0
    if isinstance(op, (keras.layers.LayerNormalization,
                       keras.layers.GroupNormalization)):
        # `x * (rsqrt(var) * gamma)`: the product with gamma is per row,
        # the gradient of its output is stashed (its input is a vector).
        return sum(cost_lib.tensor_bytes(x, rows, shapes)
                   for x in call.outputs)
    seen, total = set(), 0
    for x in call.inputs:
        if id(x) in seen or "float" not in str(x.dtype):
            continue
        seen.add(id(x))
        total += cost_lib.tensor_bytes(x, rows, shapes)
    total += sum(cost_lib.tensor_bytes(x, rows, shapes)
                 for x in call.outputs)
    if isinstance(op, keras.layers.MultiHeadAttention):
        t_q, t_v = _attention_lengths(call, rows, shapes)
        value_dim = op.value_dim or op.key_dim
        total += 4 * rows * op.num_heads * (
            t_q * op.key_dim + t_v * op.key_dim + t_v * value_dim
            + t_q * value_dim)
    return total


def _transposed_bytes(call, rows, shapes=None):
    """Bytes of the transposed kernel a `Dense` call's forward product
    reads when the step transposes kernels (`engine.products`): its kernel
    if `products.eligible` and the product's rows (a micro-batch's, times
    the tokens Keras folds into them for a sequence) `products.fits`; the
    product is `MatMul(x, kernel)` only for a `Dense` (`EinsumDense`,
    attention and convolutions build other ops)."""
    op = call.operation
    if not isinstance(op, keras.layers.Dense) or op.kernel is None or \
            not products_lib.eligible(op.kernel):
        return 0
    dims = cost_lib.dims(cost_lib.shape_of(call.inputs[0], shapes), rows)
    if not products_lib.fits(math.prod(dims[:-1])):
        return 0
    return _variable_bytes(op.kernel)


def transposes(mode, batch_size, num_micro_batches):
    """Whether a stage under remat `mode` gets transposed kernels in a step
    of `batch_size` rows (`products.transposes` of its micro-batches run in
    place: not rematerialized), as the executor decides."""
    sizes = microbatch_lib.split_sizes(batch_size, num_micro_batches)
    return products_lib.transposes(
        [n for i, n in enumerate(sizes)
         if not _remat(mode, i, len(sizes))])


@dataclasses.dataclass
class Block:
    """Sizes of a run of calls as one stage; activations per micro-batch."""

    weights: int        # bytes of every variable the calls use
    trainable: int      # bytes of the trainable ones
    inputs: int         # boundary input, one micro-batch
    outputs: int        # boundary output, one micro-batch
    activations: int    # what the tape keeps, one micro-batch
    recompute: int      # alive at once in a recompute, one micro-batch
    largest: int        # the largest single call output, one micro-batch
    largest_variable: int
    mixing: int         # outputs whose gradients a split backward stashes
    workspace: int = 0  # the largest scratch buffer of one backward op
    stash: int = 0      # a split backward's stash, one micro-batch
    seeded: int = 0     # of `mixing`: the last call's output (its gradient
    #                     is the stage's incoming one)
    transposed: int = 0  # kernels whose forward products read a transposed
    #                      copy (`products.eligible`), if the step makes them
    broadcast: int = 0  # broadcast kernels' gradients per row, one call's
    #                     `CONCURRENT_KERNELS` largest (`_broadcast_gradients`)
    after_broadcast: int = 0  # of `recompute`: the calls after the last
    #                           one with `broadcast`'s gradients
    second_variable: int = 0  # the second largest variable (of any call)
    forward_nodes: int = 0  # graph nodes of the calls' forward pass
    nodes: int = 0      # graph nodes of their forward and backward passes


class Profile:
    """Per-call sizes of a model graph for micro-batches of `rows` rows.

    `block(a, b)` gives the sizes of calls `a..b-1` as one stage in O(1)
    (prefix sums), which the planner's search needs.
    """

    def __init__(self, graph, rows, shapes=None):
        self.graph, self.rows = graph, rows
        n = len(graph.calls)
        needs_input = {}
        for call in graph.calls:
            wants = isinstance(call.operation, keras.layers.Layer) and \
                _gradient_needs(call.operation)[0]
            for x in call.inputs:
                needs_input[id(x)] = needs_input.get(id(x), False) or wants
        self.saved, self.recomputed, self.mixed = [0], [0], [0]
        self.stashed, self.transposed = [0], [0]
        self.forward_nodes, self.nodes = [0], [0]
        for call in graph.calls:
            forward_nodes, nodes = call_nodes(call, shapes)
            self.forward_nodes.append(self.forward_nodes[-1] + forward_nodes)
            self.nodes.append(self.nodes[-1] + nodes)
            self.transposed.append(self.transposed[-1] + _transposed_bytes(
                call, rows, shapes))
            self.stashed.append(self.stashed[-1] + _stash_bytes(
                call, rows, shapes))
            # What the tape keeps: the call's outputs and the inner
            # tensors its gradient reads.
            inner = _inner_recompute_bytes(call, rows, shapes)
            self.saved.append(self.saved[-1] + inner + sum(
                cost_lib.tensor_bytes(x, rows, shapes) for x in call.outputs))
            # The output gradients a split backward pass (`"Bi"`) makes
            # and stashes for W: not batch normalization's (a vector).
            self.mixed.append(self.mixed[-1] + (sum(
                cost_lib.tensor_bytes(x, rows, shapes) for x in call.outputs)
                if _stashes_output_gradient(call.operation) else 0))
            kept = inner
            op = call.operation
            own = isinstance(op, keras.layers.Layer) and _gradient_needs(
                op)[1]
            for x in call.outputs:
                if own or needs_input.get(id(x), False):
                    kept += cost_lib.tensor_bytes(x, rows, shapes)
            self.recomputed.append(self.recomputed[-1] + kept)
        self.out = [sum(cost_lib.tensor_bytes(x, rows, shapes) for x in c.outputs)
                     for c in graph.calls]
        self.workspace = [backward_workspace(c, shapes) for c in graph.calls]
        self.broadcast = [rows * broadcast_bytes(c, shapes)
                          for c in graph.calls]
        self.freed = [rows * _freed_before_broadcast(c, shapes)
                      for c in graph.calls]
        self.seeded = [o if _stashes_output_gradient(c.operation) else 0
                       for o, c in zip(self.out, graph.calls)]
        # A variable used by several calls (tied weights) is counted with
        # its last call: each stage's build places the variables of its
        # layers on its device, so the last stage to use one keeps it
        # (`engine.placement.place_variables`).
        own, largest_var, second_var = [(0, 0)] * n, [0] * n, [0] * n
        seen = {}   # variable -> the call it is counted with (its last)
        self._used = []   # per call: (variable, counted with, bytes, trainable)
        for c in reversed(range(n)):
            w = t = 0
            for v in getattr(graph.calls[c].operation, "weights", None) or []:
                size = _variable_bytes(v)
                second_var[c] = max(second_var[c], min(size, largest_var[c]))
                largest_var[c] = max(largest_var[c], size)
                self._used.append((c, id(v), seen.get(id(v), c), size,
                                   v.trainable))
                if id(v) in seen:
                    continue
                seen[id(v)] = c
                w += size
                t += size if v.trainable else 0
            own[c] = (w, t)
        weights, trainable = [0], [0]
        for w, t in own:
            weights.append(weights[-1] + w)
            trainable.append(trainable[-1] + t)
        self.weights, self.trainable = weights, trainable
        self.largest_var, self.second_var = largest_var, second_var
        # Bytes alive across gap g (after call g), per micro-batch.
        made, needed = {}, {}
        for x in graph.inputs:
            made[id(x)] = -1
        for call in graph.calls:
            for x in call.inputs:
                needed[id(x)] = max(needed.get(id(x), -1), call.index)
            for x in call.outputs:
                made[id(x)] = call.index
        for x in graph.outputs:
            needed[id(x)] = n
        sizes = {}
        for x in list(graph.inputs) + [x for c in graph.calls
                                       for x in c.outputs]:
            sizes[id(x)] = cost_lib.tensor_bytes(x, rows, shapes)
        self.gap = [sum(sizes[k] for k in made
                         if made[k] <= g < needed.get(k, -2))
                     for g in range(n - 1)]
        self.input_bytes = sum(cost_lib.tensor_bytes(x, rows, shapes)
                               for x in graph.inputs)
        self.output_bytes = sum(cost_lib.tensor_bytes(x, rows, shapes)
                                for x in graph.outputs)

    def after_broadcast(self, a, b):
        """What the tape keeps of calls `a..b-1` after the last one with
        their largest broadcast kernel gradients (`broadcast_bytes`), and
        of that call after its first such product: freed by the backward
        pass before those gradients are made."""
        return self.after_broadcast_from(a, b)[-1]

    def after_broadcast_from(self, a, n):
        """`after_broadcast(a, b)` for every `b` in `a + 1 .. n`, in one
        pass over the calls (the planner's grid of blocks needs them all)."""
        result, most, last = [], 0, None
        for c in range(a, n):
            if self.broadcast[c] and self.broadcast[c] >= most:
                most, last = self.broadcast[c], c
            result.append(0 if last is None else self.recomputed[c + 1]
                          - self.recomputed[last + 1] + self.freed[last])
        return result

    def block(self, a, b, alone=False):
        """Sizes of calls `a..b-1` as one stage.

        A variable several calls use (tied weights) counts with its last
        call, on the stage that keeps it in a pipeline; `alone=True`: as
        the stage built and run alone (`tools/memory_model.py`), which
        holds every variable its calls use, with its sums and slots.
        """
        n = len(self.graph.calls)
        weights = self.weights[b] - self.weights[a]
        trainable = self.trainable[b] - self.trainable[a]
        if alone:
            later = {v: (size, t) for c, v, owner, size, t in self._used
                     if a <= c < b and owner >= b}
            weights += sum(size for size, _ in later.values())
            trainable += sum(size for size, t in later.values() if t)
        return Block(
            weights=weights,
            trainable=trainable,
            inputs=self.input_bytes if a == 0 else self.gap[a - 1],
            outputs=self.output_bytes if b == n else self.gap[b - 1],
            activations=self.saved[b] - self.saved[a],
            recompute=self.recomputed[b] - self.recomputed[a],
            largest=max(self.out[a:b]),
            largest_variable=max(self.largest_var[a:b]),
            second_variable=int(second_largest(self.largest_var[a:b],
                                               self.second_var[a:b])[-1]),
            mixing=self.mixed[b] - self.mixed[a],
            workspace=max(self.workspace[a:b]),
            broadcast=max(self.broadcast[a:b]),
            after_broadcast=self.after_broadcast(a, b),
            stash=self.stashed[b] - self.stashed[a],
            transposed=self.transposed[b] - self.transposed[a],
            forward_nodes=self.forward_nodes[b] - self.forward_nodes[a],
            nodes=self.nodes[b] - self.nodes[a],
            seeded=self.seeded[b - 1])


@dataclasses.dataclass
class StageMemory:
    """Predicted peak of one stage's device during a training step (bytes).

    `total` is the peak; the other fields say what it is made of at that
    moment.
    """

    weights: int
    optimizer_slots: int
    gradients: int
    boundary: int      # held boundary inputs of micro-batches in flight
    activations: int   # held tape activations, and a recompute's
    transient: int     # gradients passing through, mini-batch, loss head

    @property
    def total(self):
        return (self.weights + self.optimizer_slots + self.gradients
                + self.boundary + self.activations + self.transient)


FEATURES = ("inputs", "outputs", "activations", "recompute", "trainable",
            "largest", "largest_variable", "mixing", "workspace", "stash",
            "seeded", "transposed", "broadcast", "after_broadcast",
            "second_variable")
_CATEGORIES = ("boundary", "activations", "gradients", "transient")


def _unit(name, times=1.0):
    vector = np.zeros(len(FEATURES))
    vector[FEATURES.index(name)] = times
    return vector


def moments(actions, mode, num_micro_batches, first=False, last=False,
            optimizer_slots=0, transposed=False):
    """The moments a stage's peak may fall at, as linear forms of its sizes.

    Each moment is a `(4, len(FEATURES))` array: per category of
    `StageMemory` (boundary, activations, gradients, transient), the
    coefficients of a `Block`'s sizes. The planner evaluates them for every
    candidate block at once. `optimizer_slots` (Adam 2, SGD 0) sets what
    the optimizer step holds (`update_temporaries`); `transposed`: the
    stage's forward products read transposed kernels (`transposes`).
    """
    m = num_micro_batches
    zero = np.zeros(len(FEATURES))
    fixed = zero.copy()
    if first:
        # The mini-batch stays alive all step; micro-batches are its slices.
        fixed = fixed + _unit("inputs", m)
    base = fixed
    if last:
        # Merged outputs and the loss gradient.
        fixed = fixed + _unit("outputs", 2 * m)
    held, sums, result, run = {}, zero, [], []
    released = False
    boundary_of = zero if first else _unit("inputs")

    def remat_of(i):
        return _remat(mode, i, m)

    order = _executor_order(actions, mode, m)
    # The last stage of a schedule whose backward passes start after every
    # forward pass (GPipe) seeds them from the loss of the merged outputs:
    # the loss gradient is one buffer of `m` micro-batches (in `fixed`)
    # whose rows each backward pass reads (slices along the batch share
    # it), not a gradient per micro-batch arriving.
    kinds = [k for k, _ in order]
    whole_seed = last and "F" in kinds and not any(
        k != "F" for k in kinds[:len(kinds) - kinds[::-1].index("F")])
    arriving = zero if whole_seed else _unit("outputs")
    # The gradient of the stage's last call's output is the one arriving
    # (or, seeded whole, a slice of the loss gradient): a split backward's
    # stash holds it without a copy of its own.
    seeded = _unit("seeded")
    done = 0
    starts = []   # per pass of `order`, the index of its first moment
    for n, (kind, i) in enumerate(order):
        starts.append(len(result))
        remat = remat_of(i)
        boundary = sum((v[0] for v in held.values()), zero)
        kept = sum((v[1] for v in held.values()), zero)
        if kind == "F":
            # In place under a tape, a forward pass keeps what the gradient
            # ops need, as a recompute does.
            held[i] = (boundary_of, zero if remat else _unit("recompute"))
            making = _unit("largest", 2) if remat else (
                _unit("recompute") + _unit("largest"))
            # Seeded whole, the loss and its gradient come after every
            # forward pass: until then the last stage holds the outputs of
            # the earlier micro-batches (the one being made is `making`'s).
            result.append(np.stack([
                boundary + boundary_of, kept + making, sums,
                base + _unit("outputs", done) if whole_seed
                else fixed + _unit("outputs")]))
            done += 1
            if whole_seed and done == m:
                # The merge and the loss: the micro-batches' outputs
                # concatenated (at M = 1 the output itself), then the loss
                # gradient; every micro-batch's tape still held.
                result.append(np.stack([
                    boundary + boundary_of, kept + held[i][1], sums,
                    fixed]))
            continue
        if kind == "Wg":
            run.append(i)
            if n + 1 < len(order) and order[n + 1][0] == "Wg":
                continue
            # W: per mixing op, its inputs and output gradients of the
            # run concatenated, one product per weight into the sums.
            grads = _unit("trainable", 2 if sums.any() else 1)
            if not any(k in ("B", "Bi", "W") for k, _ in order[n + 1:]):
                # The stage's last W: each variable's gradient waits for
                # the update of the one before (`engine.release`: a W call
                # whose sums are not summed again), so about one new
                # gradient is alive besides the old sums (measured by
                # `tools/worker_memory.py`: 2.05x the weights before the
                # chain, 1.68x after): the largest two (TF's profiler, the
                # worker ResNet's stage 1, SGD, M = 1, GPipe, never: its
                # 16 MiB kernel's gradient alone at the W call's peak).
                grads = (sums if sums.any() else zero) + _unit(
                    "largest_variable") + _unit("second_variable")
                released = True
            result.append(np.stack([
                boundary, kept, grads,
                fixed + weight_call_transient(len(run))]))
            for r in run:
                held.pop(r, None)
            run, sums = [], _unit("trainable")
            continue
        waiting = arriving * (len(held) - 1)
        if kind == "Bi":
            # Input gradients only; the stash (the mixing ops' inputs, kept
            # anyway, and output gradients) stays for the W call. No
            # scratch buffer: a conv's input gradient (Conv2DBackpropInput)
            # allocates none, only the filter gradient's im2col buffer is
            # one (TF's profiler, the logical ResNet's stage 1, SGD, M = 1,
            # GPipe, never: at the Bi call's peak its 16 MiB input, the
            # tape's and stashed 8 MiB tensors and three of batch norm's
            # gradient, 104.2 MiB for a measured 104.2; the buffer counted
            # here made 131.1).
            result.append(np.stack([
                boundary, kept + _unit("mixing") - seeded, sums,
                fixed + arriving + _unit("largest") + waiting]))
            # Seeded whole, the stashed output gradient is the loss
            # gradient's slice (in `fixed`); else the arrived gradient.
            held[i] = (held[i][0], _unit("stash") - (
                seeded if whole_seed else zero))
            continue
        if remat:
            # One traced call: recompute, backward, and the running sums,
            # `(..., sums) -> (..., new sums)`: the call's inputs stay
            # alive until it returns, so old and new sums coexist (measured
            # on workers: SGD, M = 2, "always": weights + 2 x trainable).
            recompute = _unit("recompute")
            grads = _unit("trainable", 2 if sums.any() else 1)
            passing = arriving + _unit("inputs") + _unit("largest")
        else:
            # The tape returns every weight gradient, then they are added;
            # the micro-batch's kept activations are freed as its
            # gradients are made.
            recompute = zero
            grads = _unit("trainable", 2 if sums.any() else 1)
            passing = arriving + _unit("largest")
        # The next stage may run ahead: gradients for the outputs of the
        # other micro-batches in flight can have arrived and be waiting.
        # One micro-batch, taped, SGD: each update reads only its own
        # gradient, so the step's function applies a gradient as soon as it
        # is made (no sum waits for another micro-batch), as the chain does
        # (measured on workers, the MLP: 113 / 102 MiB; all gradients at
        # once would be 144 / 128). Not measured with Adam at M = 1 without
        # remat: its step keeps the full count.
        released = m == 1 and not remat and not optimizer_slots
        if released:
            # While the backward pass runs, about two gradients are alive:
            # the one being applied and the next being made (TF's
            # profiler, `tools/allocation_trace.py --logical mlp sgd 1
            # gpipe never 0`: at the MLP stage 0's peak two of its three
            # 1 MiB kernel gradients; all three counted made 18.0 MiB for
            # a measured 14.0): the largest two (the worker ResNet's stage
            # 1, SGD, M = 1, GPipe, never: one 16 MiB kernel gradient at
            # its allocator peak of 36.7 MiB, `tools/allocation_trace.py
            # resnet sgd 1 gpipe never 1`; two counted made 48.8).
            grads = _unit("largest_variable") + _unit("second_variable")
        result.append(np.stack([
            boundary, kept + recompute, grads,
            fixed + passing + waiting
            + _unit("workspace", CONCURRENT_KERNELS)]))
        # A broadcast kernel's gradient (`broadcast_bytes`): made when the
        # backward pass reaches its call, once the tape's tensors of the
        # calls after it are freed.
        result.append(np.stack([
            boundary, kept + recompute - _unit("after_broadcast"), grads,
            fixed + passing + waiting + _unit("broadcast")]))
        held.pop(i, None)
        sums = _unit("trainable")
    in_place = [n for n, (kind, i) in enumerate(order)
                if kind == "F" and not remat_of(i)]
    if transposed and in_place:
        # Made by the first forward call run in place, read by each: alive
        # to the last one's products (not its merge and loss).
        for moment in result[starts[in_place[0]]:starts[in_place[-1]] + 1]:
            moment[3] = moment[3] + _unit("transposed")
    if released:
        # Updates in turn, each freeing its gradient: one gradient applied
        # while the next is made, and the update's temporaries. Plain SGD
        # has none: its `lr * g` runs in the gradient's own buffer (TF
        # forwards a buffer to the op that reads it last; BFC peak of a
        # traced SGD step over one 16 MiB variable: 16.0 MiB above the
        # weights, over two: 32.5): the next gradient made is at most the
        # second largest. Adam's are one more variable's size.
        result.append(np.stack([
            zero, zero, _unit("largest_variable"),
            fixed + (_unit("largest_variable", 2) if optimizer_slots
                     else _unit("second_variable"))]))
        return np.unique(np.stack(result), axis=0)
    # The optimizer step: summed gradients and the update's temporaries.
    result.append(np.stack([zero, zero, _unit("trainable"),
                            fixed + update_temporaries(optimizer_slots)]))
    return np.unique(np.stack(result), axis=0)


def second_largest(largest, second):
    """Per prefix of a run of calls, the second largest of their variables,
    from each call's largest and second largest (lists or 1-D arrays):
    after a call, the old largest or the call's own largest (whichever is
    smaller) or its second may be the new second."""
    largest = np.asarray(largest, float)
    before = np.concatenate([[0.0], np.maximum.accumulate(largest)[:-1]])
    return np.maximum.accumulate(np.maximum(
        np.asarray(second, float), np.minimum(largest, before)))


def weight_call_transient(run_length):
    """What a W call (`engine.weight_grad`) over a run of `run_length`
    micro-batches holds besides their stashes (`kept`) and the gradient
    sums, as a linear form of a `Block`'s sizes.

    A W of one micro-batch reads its stash as it is: its products run two
    at a time (`CONCURRENT_KERNELS` scratch buffers). A run of two or more
    concatenates each mixing op's stashed inputs and output gradients
    (one product for the run). A concatenation frees its pieces once made
    (the step's graph holds nothing else of them), so the stash changes
    form, not size: beyond it, one slot is being concatenated (its pieces
    and the result, `run_length` largest outputs) while one product runs
    (one scratch buffer); the executor's second inter-op thread runs the
    concatenations the next products wait for. Measured (TF profiler's
    allocator events, the worker ResNet's stage 0 alone on a logical
    device, Adam, M = 4, GPipe, remat "never", /tmp script of branch
    i30v): at the peak, in W, one `Conv2DBackpropFilter` scratch buffer
    (27.0 MiB), eight concatenated slots and the other slots' pieces
    (112 MiB for a 104 MiB stash) and one weight gradient; the two
    buffers and two copies of a slot counted before gave 187.3 MiB for
    the stage's measured 152.7.
    """
    # A broadcast kernel's gradient (`broadcast_bytes`) is per row of the
    # run's concatenated inputs.
    if run_length > 1:
        return _unit("largest", run_length) + _unit("workspace") + _unit(
            "broadcast", run_length)
    return _unit("workspace", CONCURRENT_KERNELS) + _unit("broadcast")


def update_temporaries(optimizer_slots):
    """What the optimizer step holds besides the summed gradients, as a
    linear form of a `Block`'s sizes.

    The step updates every variable in one traced function; TF's executor
    runs two variables' chains at a time (inter-op threads) and inlines an
    op's consumer, so a plain SGD step holds two products `lr * g`: two
    largest variables. An optimizer with slots (Adam) reads and updates its
    slots per variable in chains the executor starts for every variable
    before it finishes one, so about one buffer per trainable variable is
    alive at once, plus the two in progress. Measured with the BFC
    allocator's peak of `optimizer.apply` in a `tf.function`
    (Keras 3.15, TF 2.21): SGD over 1-16 variables 1-2 largest; Adam over
    n x 16 MiB variables, n = 1, 2, 3, 4, 8: 32, 64, 80, 80, 160 MiB, and
    16 x 4 MiB: 76 MiB (trainable + 2 largest: 48, 64, 80, 96, 160, 72).
    """
    form = _unit("largest_variable", 2)
    if optimizer_slots:
        form = form + _unit("trainable")
    return form


def _executor_order(actions, mode, m):
    """A stage's passes as the executor runs them (`StageActions.
    executor_order`); for a plain list of `(kind, i)` (a stage alone,
    without the schedule), every run of two or more backward passes
    defers its weight gradients to its end."""
    if isinstance(actions, StageActions):
        return actions.executor_order(mode, m)
    flat = [schedule_lib.Action(kind, i, 0) for kind, i in actions]
    return _stage_order(flat, 0, mode, m)


def features(block):
    """A `Block`'s sizes in the order of `FEATURES`."""
    return np.array([getattr(block, name) for name in FEATURES], float)


# glibc's mmap threshold in a worker with heap "return"
# (`keras_pipe.distributed.heap.RETURN_THRESHOLD`, which planning may not
# import: tests/test_memory.py checks the two agree): smaller blocks come
# from arenas.
MMAP_THRESHOLD = 128 << 10


def stage_memory(block, actions, mode, num_micro_batches, optimizer_slots=2,
                 first=False, last=False, resident=False, transposed=False):
    """The predicted peak of one stage running `actions` under remat `mode`.

    Args:
        block: the stage's `Block` (sizes for one micro-batch).
        actions: the stage's passes in order (`stage_actions(...)[j]`).
        mode: `"always"`, `"except_last"` or `"never"`.
        num_micro_batches: `M`.
        optimizer_slots: optimizer variables per trainable weight (Adam 2,
            SGD 0). Defaults to `2`.
        first: the stage takes the mini-batch (stage 0). Defaults to
            `False`.
        last: the stage holds the merged outputs, targets and loss
            gradient (the last stage). Defaults to `False`.
        resident: the peak of a worker's resident memory (heap
            "return"), not of the allocator. Defaults to `False`.
        transposed: the stage's forward products read transposed kernels
            (`transposes`). Defaults to `False`.

    Returns:
        A `StageMemory`.
    """
    forms = moments(actions, mode, num_micro_batches, first, last,
                    optimizer_slots, transposed)
    values = forms @ features(block)          # (moments, categories)
    peak = values[int(np.argmax(values.sum(axis=1)))]
    hidden = block.outputs if first else block.inputs
    if resident and hidden < MMAP_THRESHOLD:
        # A worker's resident memory (`keras_pipe.distributed.heap`,
        # "return"): blocks below the mmap threshold come from glibc's
        # arenas, which keep their high-water mark resident; when a
        # micro-batch's hidden tensors (at the stage's boundary) are that
        # small, the activations' own peak
        # stays resident under the later peak of gradients and updates.
        small = values[:, :2].sum(axis=1)
        big = values[:, 2:].sum(axis=1)
        peak = np.concatenate([values[int(np.argmax(small)), :2],
                               values[int(np.argmax(big)), 2:]])
    return StageMemory(
        weights=block.weights,
        optimizer_slots=optimizer_slots * block.trainable,
        **{name: int(v) for name, v in zip(_CATEGORIES, peak)})


def predict(partition, batch_size, num_micro_batches, remat="except_last",
            schedule="gpipe", optimizer_slots=2, input_shape=None,
            _resident=False):
    """Predicted peak memory of each stage of a `Partition` in training.

    ```python
    part = keras_pipe.planning.partition.cut(model, 4, balance="flops")
    peaks = keras_pipe.planning.memory.predict(part, batch_size=256,
                                      num_micro_batches=8, remat="always",
                                      schedule="1f1b")
    [p.total for p in peaks]
    ```

    Args:
        partition: a `keras_pipe.planning.partition.Partition`.
        batch_size: rows per mini-batch.
        num_micro_batches: `M`.
        remat: a remat mode or a list of one mode per stage. Defaults to
            `"except_last"`.
        schedule: `"gpipe"`, `"1f1b"`, or a function
            `(num_micro_batches, num_stages) -> clock ticks`. Defaults to
            `"gpipe"`.
        optimizer_slots: optimizer variables per trainable weight (2 for
            Adam, 1 for SGD with momentum, 0 for SGD). Defaults to `2`.
        input_shape: the model inputs' shapes, for dimensions the model
            leaves unknown (a sequence length); as in `partition.cut`.
            Defaults to `None`: the shapes the partition was cut with, or
            1 for an unknown dimension.

    Returns:
        A list of `StageMemory`, one per stage.

    Raises:
        TypeError, ValueError: for a bad count, remat mode or schedule.
    """
    return _predict(partition, batch_size, num_micro_batches, remat,
                    schedule, optimizer_slots, input_shape, _resident)[0]


def _predict(partition, batch_size, num_micro_batches, remat, schedule,
             optimizer_slots, input_shape, resident):
    """`predict`'s stages, with what `predict_resident` adds to them: per
    stage its `Block` and remat mode, and the `M` the step runs."""
    _validation.check_positive_int("batch_size", batch_size)
    _validation.check_positive_int("num_micro_batches", num_micro_batches)
    k = partition.num_stages
    modes = _validation.check_remat(remat, k)
    rows = -(-batch_size // num_micro_batches)
    m = min(num_micro_batches, batch_size)
    shapes = partition.shapes
    if input_shape is not None:
        shapes = shapes_lib.infer_shapes(partition.graph, input_shape,
                                         what="the memory prediction")
    profile = Profile(partition.graph, rows, shapes)
    actions = stage_actions(schedule, m, k)
    result, blocks, start = [], [], 0
    for j, size in enumerate(partition.sizes):
        blocks.append(profile.block(start, start + size))
        start += size
        result.append(stage_memory(
            blocks[-1], actions[j], modes[j], m, optimizer_slots,
            first=j == 0, last=j == k - 1, resident=resident,
            transposed=transposes(modes[j], batch_size, m)))
    return result, blocks, modes, m


# Resident bytes per graph node of the step's functions on a worker: TF's
# graphs and executors (node definitions, kernels, their small blocks in
# glibc's arenas). Measured by `tools/function_memory.py` (two workers,
# one-row micro-batches, resident size after two steps minus the idle
# worker, the weights and the slots, against the nodes placed on the
# worker; `--fit docs/benchmarks/function_memory.json`): 25 stages of the
# ResNet, the Transformer and GPT-2, 87-6445 nodes: 4.25 KiB per node
# (least squares; 15.9 MiB at 0 nodes, not counted: residual 5.2 MiB).
FUNCTION_NODE_BYTES = 4352

# A worker's build holds its weights and, of the initial values the client
# sends, about this many times the largest variable in transit (gRPC's
# receive buffers, the received tensor). Measured where the build is a
# worker's peak (`tools/memory_model.py --workers`, heap "return", which
# trims the arenas when the worker idles between the client's layers,
# median of 3 runs): GPT-2's worker 0 (a 15.6 MiB token table, weights
# 0.1 MiB besides) 1.55-1.76, the ResNet's worker 1 (a 16 MiB kernel) 1.47
# above its weights; one 16 MiB variable placed on a fresh worker (6
# runs): 1.35-1.93. Without the trim about 2 (GPT-2's worker 0: 1.95-2.3).
BUILD_TRANSIT = 1.5


def function_nodes(block, mode, num_micro_batches):
    """Graph nodes of a stage's step functions on its worker.

    A micro-batch run in place (no remat) puts the stage's forward and
    backward ops in the step's graph once per micro-batch
    (`Stage.forward`); rematerialized micro-batches call two functions
    traced once: the forward (`forward_nodes`) and the backward, which
    holds the forward twice (TF's forward with its side outputs, and the
    recompute's) and the gradient ops. Measured node counts (ResNet stage
    0: 669 at M = 1 without remat, 3097 at M = 4, 1736 with remat "always";
    predicted 750, 3000, 1746)."""
    m = num_micro_batches
    in_place = sum(not _remat(mode, i, m) for i in range(m))
    nodes = in_place * block.nodes
    if in_place < m:
        nodes += block.forward_nodes + 2 * block.nodes
    return nodes


@dataclasses.dataclass
class ResidentMemory(StageMemory):
    """Predicted resident peak of a stage's worker process (bytes), net of
    the idle worker: the larger of the training step's peak (the fields of
    `StageMemory`) with the step's functions (`functions`) and the build's
    (`build`), which comes before the functions are made.
    """

    build: int = 0   # weights + initial values in transit at build
    functions: int = 0   # TF's graphs and executors of the step's functions

    @property
    def total(self):
        return max(super().total + self.functions, self.build)


def predict_resident(partition, batch_size, num_micro_batches,
                     remat="except_last", schedule="gpipe",
                     optimizer_slots=2, input_shape=None):
    """Predicted resident peak of each stage's worker process in training.

    Net of an idle worker (after a client connected and ran one op), the
    base a memory budget for a worker is net of: TF's own share (~650 MiB
    here: kernels, thread pools, gRPC) is in it. The step's peak is the
    allocator peak of `predict`: with freed blocks of 128 KiB or more
    given back to the OS (`keras_pipe.distributed.heap`, `"return"`),
    resident memory follows the allocator's bytes in use; to it come the
    step's functions, TF's graphs and executors on the worker
    (`functions`: `FUNCTION_NODE_BYTES` per node of `function_nodes`).
    Not counted: the kernels' code paged in (8 MiB on the Transformer
    worker of `tools/memory_model.py --workers`, Adam, M = 4). The build
    can peak on its own (before the functions are made): the weights and
    the initial values the client sends, `BUILD_TRANSIT` times the largest
    variable in transit (`build`); a tied variable counts at build on every stage
    that uses it, since each stage's build places it on its device before
    the last one keeps it.
    Measured by `tools/memory_model.py --workers`. Arguments as in
    `predict`.

    Returns:
        A list of `ResidentMemory`, one per stage.
    """
    result, start = [], 0
    calls = partition.graph.calls
    peaks, blocks, modes, m = _predict(
        partition, batch_size, num_micro_batches, remat, schedule,
        optimizer_slots, input_shape, True)
    for size, peak, block, mode in zip(partition.sizes, peaks, blocks,
                                       modes):
        # At build each stage places every variable its layers use on its
        # device, tied ones too (a later stage moves them on).
        used = {id(v): _variable_bytes(v) for call in calls[start:start + size]
                for v in getattr(call.operation, "weights", None) or []}
        start += size
        result.append(ResidentMemory(
            **vars(peak),
            build=sum(used.values()) + int(
                BUILD_TRANSIT * max(used.values(), default=0)),
            functions=FUNCTION_NODE_BYTES * function_nodes(block, mode, m)))
    return result
