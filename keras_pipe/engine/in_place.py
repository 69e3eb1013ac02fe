"""Variable updates in place: each update waits for the step's reads.

TensorFlow updates a resource variable in place only when nothing else
holds its buffer: `AssignSubVariableOp`, `ResourceApplyAdam` and the like
copy the whole variable first when a tensor read from it is still alive
(copy-on-write, `PrepareToUpdateVariable` in TF's kernels). A pipeline
step reads each weight once (`Stage.read_params`) and every micro-batch's
forward and backward calls use that read; the optimizer's update of a
variable needs only its summed gradient, so TF's executor may run it
before the last call that uses the read (the input gradient of the last
micro-batch, which does not feed the weight gradient), and the step's
peak then holds a copy of the variable (`tools/allocation_trace.py`
shows it; docs/design.md, "Updates in place").

`update_in_place` adds control edges, after the optimizer built its
updates, from every op that uses a read of a variable (through views of
it: `Identity`, `StopGradient`, `Reshape`, ...) to the ops that write the
variable. The values are the same; only the order changes. An op that
uses the read was built before the optimizer's ops, so it cannot depend
on an update: no edge makes a cycle. Updates compiled with XLA
(`compile(jit_compile=True)`: one function call per device) are not
write ops and are not ordered here.
"""

from keras_pipe import _compat
from keras_pipe.engine.op_types import VIEWS

__all__ = ["read_users", "update_in_place", "writes"]


def writes(op):
    """Whether graph op `op` updates a resource variable in place (its
    first input): `AssignSubVariableOp`, `AssignAddVariableOp`, TF's
    fused `ResourceApply*` / `ResourceSparseApply*` updates and the
    `ResourceScatter*` ops of sparse updates.

    `AssignVariableOp` is not one: it replaces the variable's buffer with
    its value's, and copies nothing.
    """
    return bool(op.inputs) and (
        op.type in ("AssignSubVariableOp", "AssignAddVariableOp")
        or op.type.startswith(("ResourceApply", "ResourceSparseApply",
                            "ResourceScatter")))


def update_in_place(update_ops):
    """Makes each variable's update wait for the step's uses of its reads.

    Call in the traced step right after the optimizer built its updates
    (before other edges are added to the graph).

    Args:
        update_ops: the ops the optimizer created for the step.

    Returns:
        The number of update ops that now wait.
    """
    inside = set(update_ops)
    gated = 0
    for op in update_ops:
        if not writes(op):
            continue
        users = [u for u in read_users(op.inputs[0]) if u not in inside]
        if users:
            _compat.add_control_inputs(op, users)
            gated += 1
    return gated


def read_users(handle):
    """The ops that use a value read from resource `handle`: the readers'
    consumers, through views, and any other op that takes the handle (a
    function call reads inside)."""
    found, stack = [], []
    for op in handle.consumers():
        if op.type == "ReadVariableOp":
            stack.extend(op.outputs)
        else:
            found.append(op)
    while stack:
        for op in stack.pop().consumers():
            found.append(op)
            if op.type in VIEWS:
                stack.extend(op.outputs)
    return found
