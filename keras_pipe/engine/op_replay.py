"""Rebuilding a traced op on new inputs, through `tf.raw_ops`.

The weight-gradient call of a split backward pass (`weight_grad`) runs a
stage's ops again on stashed values: the same op type with the same
attributes, built by the op's generated `tf.raw_ops` wrapper. An op that
cannot be rebuilt that way (control flow, a function call, a custom
gradient, a stateful op, a wrapper whose arguments do not match the op's
definition) is reported, not replayed.
"""

import inspect

import tensorflow as tf

__all__ = ["is_stateful", "replay", "replay_mixing", "unreplayable"]

_CALLS = frozenset([
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
    "RemoteCall"])


def unreplayable(op, label, check_state):
    """Why W cannot replay `op` (a custom gradient, a call, ...), or []."""
    if "_gradient_op_type" in op.node_def.attr:
        return [f"{label} has a custom gradient ({op.type})"]
    if op.type in _CALLS:
        return [f"{label} is control flow or a function call ({op.type})"]
    if check_state and is_stateful(op):
        return [f"{label} is stateful ({op.type})"]
    return _replay_problems(op)


def _replay_problems(op):
    """Why `replay` cannot rebuild `op` ([] if it can)."""
    if op.type == "Const":
        return []
    if getattr(tf.raw_ops, op.type, None) is None:
        return [f"op {op.name!r} ({op.type}) has no tf.raw_ops wrapper"]
    if _wrapper_names(op) is None:
        return [f"op {op.name!r} ({op.type}): the arguments of "
                f"tf.raw_ops.{op.type} do not match its op_def"]
    return []


def _wrapper_names(op):
    """`tf.raw_ops` argument names for the op's input args and attrs.

    The generated wrapper takes the input args in op_def order, then the
    attrs not inferred from inputs, those without a default first, then
    `name`; it may rename both (Sum's `reduction_indices` is `axis`,
    Squeeze's `squeeze_dims` is `axis`). Returns None if the counts differ.
    """
    names = list(inspect.signature(getattr(tf.raw_ops, op.type)).parameters)
    op_def = op.op_def
    inferred = {getattr(arg, field) for arg in op_def.input_arg
                for field in ("type_attr", "number_attr", "type_list_attr")}
    attrs = [a for a in op_def.attr if a.name not in inferred]
    attrs = ([a for a in attrs if not a.HasField("default_value")] +
             [a for a in attrs if a.HasField("default_value")])
    if names[-1:] != ["name"] or (
            len(names) != len(op_def.input_arg) + len(attrs) + 1):
        return None
    num_inputs = len(op_def.input_arg)
    return (list(zip(op_def.input_arg, names[:num_inputs])),
            list(zip(attrs, names[num_inputs:-1])))


def replay(op, inputs):
    """Builds the op again on `inputs`; returns its outputs."""
    if op.type == "Const":
        return [tf.constant(tf.make_ndarray(op.get_attr("value")),
                            dtype=op.outputs[0].dtype)]
    input_names, attr_names = _wrapper_names(op)
    inputs, kwargs = iter(inputs), {}
    for arg, name in input_names:
        if arg.number_attr:
            count = op.get_attr(arg.number_attr)
        elif arg.type_list_attr:
            count = len(op.get_attr(arg.type_list_attr))
        else:
            kwargs[name] = next(inputs)
            continue
        kwargs[name] = [next(inputs) for _ in range(count)]
    for attr, name in attr_names:
        kwargs[name] = op.get_attr(attr.name)
    return tf.nest.flatten(getattr(tf.raw_ops, op.type)(**kwargs))


def replay_mixing(op, inputs):
    """`replay` for W's mixing ops, a `BiasAdd` as a broadcast `AddV2`.

    Why: with oneDNN (`TF_ENABLE_ONEDNN_OPTS=1`, the default on Intel CPUs)
    TF's graph rewrite merges a `Conv2DBackpropFilter` and a `BiasAddGrad`
    into one node; in a W that replays a convolution and its bias over
    several micro-batches the merged node closes a cycle, and the step
    fails with "N nodes in a cycle". The gradient of `x + b` with respect to
    `b` is the same sum over every axis but the channels' (as `BiasAddGrad`
    computes it, up to the order of float additions), and leaves nothing
    to merge.
    """
    if op.type != "BiasAdd":
        return replay(op, inputs)
    x, bias = inputs
    if op.get_attr("data_format").decode().startswith("NC"):
        bias = tf.reshape(bias, [-1] + [1] * (x.shape.rank - 2))
    return [tf.add(x, bias)]


def is_stateful(op):
    return op.op_def.is_stateful
