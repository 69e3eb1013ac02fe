"""What one call's backward pass holds besides the layers' outputs.

The training step is one traced function: a tensor of the forward pass
stays alive after the pass if and only if a gradient op reads it. So each
call is traced once (batch dimension unknown) with its gradients, and the
forward tensors those ops read are counted (`kept_inside`). The same trace
gives the call's graph nodes (`call_nodes`) and the kernel gradients a
batched product makes per row before summing them (`broadcast_bytes`). A
convolution's gradient kernels also allocate a scratch buffer of their own
(`backward_workspace`).
"""

import math
import weakref

import keras
import tensorflow as tf

from keras_pipe.engine import op_types
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["CONCURRENT_KERNELS", "backward_workspace", "broadcast_bytes",
           "call_nodes", "freed_before_broadcast", "kept_inside",
           "kept_inside_bytes"]


_TRACED = weakref.WeakKeyDictionary()
# Per operation and input signature: graph nodes of the traced call
# (`kept_inside`): `(forward, forward and backward)`.
_NODES = weakref.WeakKeyDictionary()
# Per operation and input signature: bytes per row of the broadcast kernel
# gradients of the traced call (`_broadcast_gradients`), the largest first,
# and of its kept tensors freed before them (`freed_before_broadcast`).
_BROADCAST = weakref.WeakKeyDictionary()
# Ops whose outputs a gradient reads without them holding memory of their
# own: the function's arguments, constants, views of variables, shapes.
_NOT_HELD = ("Placeholder", "Const", "ReadVariableOp", "VarHandleOp",
             "Shape", "ShapeN", "Size", "Rank", "Identity")


def _buffer_of(t, inside):
    """The tensor whose buffer `t` shares: through reshapes, identities and
    transposes that keep the order (TF forwards the input buffer)."""
    while t.op in inside:
        if t.op.type == "Transpose":
            perm = tf.get_static_value(t.op.inputs[1])
            if perm is None or list(perm) != sorted(perm):
                break
        elif t.op.type not in op_types.VIEWS:
            break
        t = t.op.inputs[t.value_index]
    return t


def _folded_transpose(t):
    """Whether `t` is a 2-D transpose that only matrix products read:
    grappler's arithmetic optimizer folds it into them (`MatMul`'s
    `transpose_a/b`, "FoldTransposeIntoMatMul"), so the step's graph
    holds no transposed copy (a tied output layer,
    `ReversibleEmbedding(reverse=True)`: `matmul(x, transpose(table))`,
    keeps no transposed table per micro-batch)."""
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
    (`kept_inside`); `(0, 0)` for a call without an operation."""
    if not isinstance(call.operation, keras.Operation):
        return 0, 0
    kept_inside(call, shapes)
    return _NODES[call.operation][_signature(call, shapes)[1]]


def broadcast_bytes(call, shapes=None):
    """Bytes per row of the broadcast kernels' gradients one backward pass
    of `call` holds at once, before their sums over the rows: the
    `CONCURRENT_KERNELS` largest of its traced gradient graph
    (`_broadcast_gradients`; 0 for most layers).

    A 3-D input times a 2-D kernel is a batched product that broadcasts the
    kernel (Keras' `einsum` for `EinsumDense`: `MultiHeadAttention`'s four
    projections); TF's gradient makes the kernel's gradient per row,
    `[rows, ...kernel]`, and sums it; the inter-op pool makes
    `CONCURRENT_KERNELS` of them at once (TF's profiler:
    `tools/allocation_trace.py`)."""
    if not isinstance(call.operation, keras.Operation):
        return 0
    kept_inside(call, shapes)
    found, _ = _BROADCAST[call.operation][_signature(call, shapes)[1]]
    return sum(found[:CONCURRENT_KERNELS])


def freed_before_broadcast(call, shapes=None):
    """Bytes per row of the tensors inside `call` that its gradient keeps
    and that the forward pass made from its first kernel-broadcasting
    product on: freed by the backward pass before that product's kernel
    gradient (`broadcast_bytes`) is made (in an opaque layer, such as
    KerasHub's `TransformerDecoder`, the feed-forward part after the
    attention)."""
    if not isinstance(call.operation, keras.Operation):
        return 0
    kept_inside(call, shapes)
    return _BROADCAST[call.operation][_signature(call, shapes)[1]][1]


def kept_inside(call, shapes=None):
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
        if op in inside or op.type in op_types.SHAPE_ONLY:
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


def kept_inside_bytes(call, rows, shapes=None):
    """Tensors inside a call that its gradient keeps (not its output),
    from the call's traced gradient graph (`kept_inside`)."""
    per_row, whole = kept_inside(call, shapes)
    return per_row * rows + whole


# TF's CPU kernels for a 2-D convolution's gradients (Conv2DCustomBackprop-
# Input/Filter, `tensorflow/core/kernels/conv_grad_*_ops.cc`) im2col a shard
# of images into one scratch buffer sized for "the L3 cache" they assume:
# `shard = ceil(30 MiB / sizeof(T) / work_unit)` images, whatever the batch.
_CONV_WORKING_SET = 30 << 20


# Backward kernels with a scratch buffer that run at once: a conv's input
# and filter gradients are ready together (and a W call's filter gradients
# all at once), and TF's inter-op pool runs two kernels together (its
# threads, one per core on the machines the model was fitted on; one
# inter-op thread holds one buffer fewer). A backward call of input
# gradients only (`"Bi"`) holds none: only the filter gradient
# (Conv2DBackpropFilter) allocates the buffer.
CONCURRENT_KERNELS = 2


def backward_workspace(call, shapes=None):
    """Bytes of the scratch buffer the gradient of `call` allocates (0 for
    most layers): a `Conv1D`/`Conv2D`'s im2col buffer, as TF's CPU kernel
    sizes it (one shard of images, `_CONV_WORKING_SET`), independent of the
    micro-batch size."""
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
    size = tf.as_dtype(op.compute_dtype).size
    filter_total = math.prod(kernel) * in_depth
    unit = image * filter_total + image * out_depth + filter_total * out_depth
    shard = -(-(_CONV_WORKING_SET // size) // unit)
    return shard * image * filter_total * size

