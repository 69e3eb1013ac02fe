"""Sums of gradients: running sums that keep IndexedSlices sparse and exact.

Keras' TF optimizers apply the rows of an `IndexedSlices` gradient one by
one, non-linearly: Adam, RMSprop and clipping by norm treat two rows of one
index differently from one row holding their sum. So a sum of sparse
gradients must have exactly the rows the unsplit model's gradient has (the
gradient of one forward pass over the whole batch), not only its dense value.

* Micro-batches of one read (`add_gradients`, `sum_micro_batches`). A
  gather whose indices do not depend on the batch's data -- a position
  table, `take(table, arange(T))`; T5's relative attention bias,
  `take(table, buckets)` with a [T, T] bucket matrix computed from
  `arange(T)`, every bucket repeated -- gives every micro-batch the same
  indices, and the unsplit gradient has those indices once (repeats
  included), their values summed over the batch: the values are added, the
  indices of micro-batch 0 kept. A lookup over the batch -- an `Embedding`
  over token ids, segment ids that happen to be all 0, ids that happen to
  be the same in every micro-batch -- gives each micro-batch its own rows,
  and the unsplit gradient is all of them, one per lookup: they are
  concatenated.
* Different reads of a variable (`sum_gradients`: stages that share a
  layer, a regularization term): the unsplit model's tape concatenates
  their rows too, so they are concatenated.

Whether indices depend on the batch is decided when the step is traced
(`depends_on_batch`): the ops that produce them are walked backwards,
into the functions they come out of (a stage's traced backward pass, a
`tf.custom_gradient`, the split backward's B and W functions) and, from a
function's argument, back to what its caller passed. The indices depend on
the batch if a path reaches the traced step's data: an argument of the
graph being traced that is not a captured variable or constant, or an
input pipeline op. Shape-only ops (`Shape`, `Size`, `Rank`), variable
reads and constants end a path: `arange(shape(x)[1])` does not depend on
the batch. Batch-independent indices are still compared at run time before
their values are added (a micro-batch of another size, or a random draw,
may give other indices: those are concatenated).

Limits: indices computed from shapes of the batch axis
(`arange(shape(x)[0])`) count as batch-independent yet differ between
micro-batches of different sizes; they are concatenated (the runtime
comparison), which is not the unsplit model's rows either. Indices that
come out of control flow (`While`, `If`) or of a function known only by its
FunctionDef count as batch-dependent when any input of that op does.
Inside a function being traced on its own (`tf.function` over stashed
gradients), its arguments count as data: callers that know better pass
`batch_independent=` (`keras_pipe.engine.weight_grad`). In eager mode
there is no graph to walk, and a runtime rule stands in: the same indices,
in the same order, each index once, add their values (right for a position
table; a relative bias with repeated buckets is concatenated, and a lookup
whose micro-batches hold the same distinct ids is added).
"""

import functools

import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import op_types

__all__ = ["add_gradients", "depends_on_batch", "sum_gradients",
           "sum_micro_batches"]

# Ops whose output is no data of the batch: variables and constants (and
# the shape-only ops of `op_types.SHAPE_ONLY`).
_NOT_DATA = frozenset(["ReadVariableOp", "VarHandleOp", "Const",
                       "ResourceGather"])


def depends_on_batch(tensor):
    """Whether a graph tensor's value may depend on the traced step's data.

    Walks the ops producing `tensor` backwards (see the module docstring):
    into the function graphs of call ops, from a function's argument to its
    caller's input, from a captured tensor to the graph that captured it.

    Args:
        tensor: a symbolic `tf.Tensor` (not an eager one).

    Returns:
        True if a path reaches an argument of the outermost graph walked
        (not a captured variable or constant), an input pipeline op or a
        stateful random op; False if every path ends at a constant, a
        variable read or a shape-only op.
    """
    stack = [(tensor, ())]
    seen = set()
    while stack:
        t, callers = stack.pop()
        key = (t.ref(), callers)
        if key in seen:
            continue
        seen.add(key)
        op = t.op
        if op.type in op_types.SHAPE_ONLY or op.type in _NOT_DATA:
            continue
        if "Iterator" in op.type or "Random" in op.type:
            return True
        if op.type == "Placeholder":
            source = _argument_source(t, callers)
            if source is True:
                return True
            if source is not None:
                stack.append(source)
            continue
        called = _compat.called_graph(op)
        if called is not None and len(called.outputs) == len(op.outputs):
            stack.append((called.outputs[t.value_index], callers + (op,)))
            continue
        stack.extend((x, callers) for x in op.inputs)
    return False


def _argument_source(placeholder, callers):
    """What a function argument was given: `(tensor, callers)`, None (a
    captured constant) or True (the data of the outermost graph)."""
    graph = placeholder.graph
    position = next((n for n, t in enumerate(getattr(graph, "inputs", []))
                     if t is placeholder), None)
    if callers:
        call = callers[-1]
        if position is None or len(call.inputs) != len(graph.inputs):
            return True
        return call.inputs[position], callers[:-1]
    captures = {internal.ref(): external
                for external, internal in getattr(graph, "captures", [])}
    if placeholder.ref() not in captures:
        return True  # an argument of the traced step (or a v1 placeholder)
    external = captures[placeholder.ref()]
    return (external, ()) if _is_symbolic(external) else None


def add_gradients(total, gradient, batch_independent=None):
    """`total + gradient` over micro-batches; either may be None.

    Two `IndexedSlices` whose indices do not depend on the batch (and are
    equal at run time) add their values and keep `total`'s indices; other
    `IndexedSlices` are concatenated; anything else is added densely.

    Args:
        total: the running sum, or None.
        gradient: the next micro-batch's gradient, or None.
        batch_independent: whether the indices do not depend on the batch,
            if the caller knows (`True`/`False`); `None` decides it from
            the graph (`depends_on_batch`), or in eager mode by the runtime
            rule of the module docstring. Defaults to `None`.
    """
    if total is None:
        return gradient
    if gradient is None:
        return total
    if isinstance(total, tf.IndexedSlices) and isinstance(
            gradient, tf.IndexedSlices):
        return _add_slices(total, gradient, batch_independent)
    return sum_gradients([total, gradient])


def sum_micro_batches(parts, batch_independent=None):
    """`add_gradients` over a list of micro-batch gradients."""
    return functools.reduce(
        lambda t, g: add_gradients(t, g, batch_independent), parts)


def sum_gradients(parts):
    """Sums the gradients of different reads; IndexedSlices concatenated."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(g, tf.IndexedSlices) for g in parts):
        return _concat(parts)
    return tf.add_n([tf.convert_to_tensor(g) for g in parts])


def _concat(parts):
    return tf.IndexedSlices(tf.concat([g.values for g in parts], 0),
                            tf.concat([g.indices for g in parts], 0),
                            parts[0].dense_shape)


def _is_symbolic(t):
    try:
        t.op  # noqa: B018
    except AttributeError:
        return False
    return True


def _add_slices(a, b, batch_independent):
    """Values added where the indices are shared by micro-batches, else
    concatenated (see the module docstring)."""
    a_rows, b_rows = a.indices.shape, b.indices.shape
    if (a_rows.is_fully_defined() and b_rows.is_fully_defined()
            and a_rows != b_rows) or a.values.dtype != b.values.dtype:
        return _concat([a, b])
    eager = not (_is_symbolic(a.indices) and _is_symbolic(b.indices))
    if batch_independent is None and not eager:
        batch_independent = not (depends_on_batch(a.indices)
                                 or depends_on_batch(b.indices))
    if batch_independent is False:
        return _concat([a, b])
    a_flat = tf.reshape(a.indices, [-1])
    b_flat = tf.cast(tf.reshape(b.indices, [-1]), a_flat.dtype)
    # Shared indices are checked equal at run time (another micro-batch
    # size, a random draw). The eager fallback also wants each index once
    # (segment ids all 0 are the same in every micro-batch, yet a lookup
    # over the batch).
    unique = batch_independent is None
    same = tf.cond(
        tf.equal(tf.size(a_flat), tf.size(b_flat)),
        lambda: _same(a_flat, b_flat, unique),
        lambda: tf.constant(False))
    if eager:
        return (tf.IndexedSlices(a.values + tf.reshape(
            b.values, tf.shape(a.values)), a.indices, a.dense_shape)
                if bool(same) else _concat([a, b]))
    b = tf.IndexedSlices(b.values, tf.cast(b.indices, a.indices.dtype),
                         a.dense_shape)
    values = tf.cond(
        same,
        lambda: a.values + tf.reshape(b.values, tf.shape(a.values)),
        lambda: tf.concat([a.values, b.values], 0))
    indices = tf.cond(same, lambda: a.indices,
                      lambda: tf.concat([a.indices, b.indices], 0))
    return tf.IndexedSlices(values, indices, a.dense_shape)


def _same(a_flat, b_flat, unique):
    equal = tf.reduce_all(tf.equal(a_flat, tf.reshape(b_flat,
                                                      tf.shape(a_flat))))
    if not unique:
        return equal
    return tf.logical_and(equal, tf.equal(tf.size(tf.unique(a_flat).y),
                                          tf.size(a_flat)))
