"""Weight gradients released as they are applied: one at a time per device.

A stage whose backward pass is split (`keras_pipe.engine.weight_grad`)
computes its weight gradients in one W call after its last B: every weight
gradient of the stage is ready to run at once, and TensorFlow's executor
runs the ready products before the optimizer's updates that free them. A
worker then holds its weights plus all of its stage's weight gradients,
where the unsplit process, whose backward pass makes the gradients one
after another, frees each soon after it is made. A whole backward call
makes them all at once too (with remat, as one traced call), so each
stage's last backward call is split (`keras_pipe.engine.weight_calls`):
the W call that makes the stage's final sums runs in place, and each
variable's gradient has ops of its own there.

`apply_in_turn` orders it: on each device, the ops that compute only
variable `n`'s weight gradient wait (control edges added to the graph
after the optimizer built its updates) for the update of the variable
before it in the chain, so that at most one weight gradient of the device
is alive at a time. The chain follows the variables in reverse (the order
of a backward pass). The values are the same; only the order of the ops
changes.

No edge is added where it could make a cycle or could not help: an update
that reads several gradients (a global norm, a loss-scale check) makes the
whole chain skipped, and an op already upstream of the previous update in
the chain is not gated.
"""

import tensorflow as tf

from keras_pipe import _compat

__all__ = ["apply_in_turn", "exclusive_ops"]


def exclusive_ops(ops, tensors):
    """Per tensor, the ops among `ops` that only that tensor depends on.

    Args:
        ops: the ops of one call (a W call in place).
        tensors: tensors (or None) computed by those ops.

    Returns:
        A list aligned with `tensors`: the ops of `ops` upstream of that
        tensor and of no other one (empty for None or a tensor from
        elsewhere).
    """
    inside = set(ops)
    owners = {}
    for n, t in enumerate(tensors):
        if not isinstance(t, tf.Tensor) or t.op not in inside:
            continue
        for op in _upstream([t.op], inside):
            owners.setdefault(op, set()).add(n)
    result = [[] for _ in tensors]
    for op in ops:  # creation order
        who = owners.get(op)
        if who is not None and len(who) == 1:
            result[next(iter(who))].append(op)
    return result


def apply_in_turn(update_ops, gradients, variables, weight_ops, device_of):
    """Makes each device's weight gradients wait for the previous update.

    Call in the traced step after the optimizer built its updates.

    Args:
        update_ops: the ops the optimizer created for the step.
        gradients: the gradients passed to the optimizer, aligned with
            `variables`.
        variables: the trainable variables.
        weight_ops: `{id(variable): ops}`, the ops that compute only that
            variable's gradient (`exclusive_ops` of its W call).
        device_of: `device_of(variable)`, the variable's device.

    Returns:
        The number of ops that now wait for an update.
    """
    inside = set(update_ops)
    # The ops of each variable's update: what reads its gradient.
    consumers = {}
    for op in update_ops:
        for t in op.inputs:
            consumers.setdefault(t.ref(), []).append(op)
    updates = {}
    owner = {}
    for n, (g, v) in enumerate(zip(gradients, variables)):
        if not isinstance(g, tf.Tensor) or id(v) not in weight_ops:
            continue
        reached = _downstream(g, consumers, inside)
        for op in reached:
            if owner.setdefault(op, n) != n:
                return 0  # an update reads several gradients: no chain
        if reached:
            updates[n] = reached
    chains = {}
    for n in sorted(updates, reverse=True):
        chains.setdefault(device_of(variables[n]), []).append(n)
    upstream, gated = set(), 0
    for device, chain in chains.items():
        for before, n in zip(chain, chain[1:]):
            with tf.device(device), tf.control_dependencies(
                    list(updates[before])):
                done = tf.no_op(name="applied")
            upstream |= _upstream([done], None, upstream)
            gates = weight_ops[id(variables[n])]
            if any(op in upstream for op in gates):
                continue  # it feeds that update already: a cycle
            # The first ops of the gradient's own computation wait.
            gate_set = set(gates)
            for op in gates:
                if not any(t.op in gate_set for t in op.inputs):
                    _compat.add_control_inputs(op, [done])
                    gated += 1
    return gated


def _upstream(ops, inside, seen=None):
    """The ops upstream of `ops` (included), within `inside` if given;
    `seen` (not re-walked) is counted as upstream already."""
    seen = set() if seen is None else seen
    found, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in found or op in seen or (inside is not None
                                         and op not in inside):
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def _downstream(tensor, consumers, inside):
    """The ops of `inside` downstream of `tensor` (data edges)."""
    found, stack = set(), list(consumers.get(tensor.ref(), []))
    while stack:
        op = stack.pop()
        if op in found or op not in inside:
            continue
        found.add(op)
        for t in op.outputs:
            stack.extend(consumers.get(t.ref(), []))
    return found
