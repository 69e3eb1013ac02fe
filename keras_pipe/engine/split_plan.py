"""Which of a stage's traced ops a split backward pass replays, and how.

Inside the traced B function (`weight_grad`), each tensor the stage
computes is

    P  derived from the params (and constants) only,
    C  derived from constants only,
    X  everything else (it depends on the inputs, the state, a random op).

An X op with a float P input is a *mixing op*: the gradient reaches the
params only through mixing ops (or through a P tensor that is itself an
output or a loss). `make_plan` classifies the ops, finds the mixing ops,
the P and C ops W replays, and which mixing ops take the micro-batches
concatenated (`_concatenable`); a stage it cannot split gets a `SplitPlan`
with `splittable=False` and the reason.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_pipe.engine import op_replay

__all__ = ["SplitPlan", "make_plan", "structure"]

_ELEMENTWISE = frozenset([
    "AddV2", "Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum",
    "SquaredDifference", "DivNoNan", "MulNoNan"])


@dataclasses.dataclass
class _Mixing:
    """A mixing op and where its X inputs and output gradients are stashed."""

    op: object
    x_slots: dict       # input index -> stash slot
    grad_slots: dict    # output index -> stash slot
    concat: bool
    zeros: tuple = ()   # X inputs W feeds as zeros (additive ops)
    outputs: list = None  # what B differentiates: op.outputs, or its
    #                       stand-in's (`keras_pipe.engine.products`)


@dataclasses.dataclass
class SplitPlan:
    """How B and W of one traced signature divide the backward pass."""

    splittable: bool
    reason: str = ""
    params: list = dataclasses.field(default_factory=list)  # placeholders
    replay: list = dataclasses.field(default_factory=list)  # P and C ops
    mixing: list = dataclasses.field(default_factory=list)  # _Mixing
    direct: list = dataclasses.field(default_factory=list)  # (P tensor, slot)
    param_slots: list = dataclasses.field(default_factory=list)  # fused
    stash_specs: list = dataclasses.field(default_factory=list)

    def describe(self):
        """One line: mixing ops, how many concatenated, or the reason."""
        if not self.splittable:
            return f"not splittable: {self.reason}"
        concat = sorted({m.op.type for m in self.mixing if m.concat})
        single = sorted({m.op.type for m in self.mixing if not m.concat})
        return (f"{len(self.mixing)} mixing ops; concatenated: {concat}; "
                f"per micro-batch: {single}; direct P outputs/losses: "
                f"{len(self.direct)}")


def structure(plan):
    """What W's trace depends on: ops, their attributes, stash layout."""
    def attrs(op):
        return tuple(sorted((k, v.SerializeToString())
                            for k, v in op.node_def.attr.items()))

    return (plan.splittable, tuple(plan.param_slots),
            tuple((m.op.type, attrs(m.op), tuple(sorted(m.x_slots.items())),
                   tuple(sorted(m.grad_slots.items())), m.concat, m.zeros)
                  for m in plan.mixing),
            tuple((op.type, attrs(op)) for op in plan.replay),
            tuple(slot for _, slot in plan.direct),
            repr(plan.stash_specs))


def make_plan(ops, inputs, params, ys, stand_ins=None):
    """Classifies the stage's ops into P, C and X; finds the mixing ops.

    An op of `stand_ins` (`{op: the op it replaced}`) is left out: the op
    it replaced, which nothing runs, is classified in its place, with the
    stand-in's outputs as the ones B differentiates.
    """
    stand_ins = stand_ins or {}
    replaced = {original: new for new, original in stand_ins.items()}
    ops = [op for op in ops if op not in stand_ins]
    for leaf in keras.tree.flatten(inputs):
        if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)):
            return SplitPlan(False, "sparse or ragged inputs")
    param_refs = {p.ref() for p in params}
    kind = {}

    def kind_of(t):
        return kind.get(t.ref(), "P" if t.ref() in param_refs else "X")

    mixing_ops = []
    for op in ops:
        kinds = {kind_of(t) for t in op.inputs}
        if not op.inputs:
            k = "C" if op.type == "Const" else "X"
        elif op_replay.is_stateful(op) or "X" in kinds:
            k = "X"
        else:
            k = "P" if "P" in kinds else "C"
        for t in op.outputs:
            kind[t.ref()] = k
        if k == "X" and any(kind_of(t) == "P" and t.dtype.is_floating
                            for t in op.inputs):
            mixing_ops.append(op)
    problems = []
    for op in mixing_ops:
        problems += op_replay.unreplayable(op, f"mixing op {op.name!r}",
                                  check_state=True)
    direct = [y for y in ys if kind_of(y) == "P"]
    # The P and C ops that W replays: the ancestors of what it needs.
    needed = [t for op in mixing_ops for t in op.inputs
              if kind_of(t) in "PC"] + direct
    wanted, stack = set(), list(needed)
    while stack:
        t = stack.pop()
        if t.ref() in param_refs or t.op in wanted:
            continue
        wanted.add(t.op)
        stack.extend(t.op.inputs)
    replay = [op for op in ops if op in wanted]
    for op in replay:
        problems += op_replay.unreplayable(op, f"op {op.name!r} on the params",
                                  check_state=False)
    if problems:
        return SplitPlan(False, "; ".join(problems))
    mixing = []
    for op in mixing_ops:
        xs = [i for i, t in enumerate(op.inputs) if kind_of(t) == "X"]
        zeros = tuple(xs) if _additive(op, xs) else ()
        mixing.append(_Mixing(
            op, {i: None for i in xs if i not in zeros},
            {k: None for k, t in enumerate(op.outputs)
             if t.dtype.is_floating},
            _concatenable(op, kind_of), zeros,
            list(replaced.get(op, op).outputs)))
    return SplitPlan(True, params=list(params), replay=replay, mixing=mixing,
                     direct=[(y, None) for y in direct])


def _additive(op, xs):
    """Whether the op's P gradient needs only X's shape, which dY has.

    `x + p`, `x - p`, `bias_add(x, p)`: the gradient of p reduces dY, so W
    runs the op on zeros shaped like dY and the stash skips x.
    """
    if op.type not in ("AddV2", "Add", "Sub", "BiasAdd") or len(xs) != 1:
        return False
    x, y = op.inputs[xs[0]], op.outputs[0]
    p = op.inputs[1 - xs[0]]
    return (x.dtype == y.dtype and p.shape.is_fully_defined() and
            x.shape.rank is not None and x.shape[1:].is_fully_defined() and
            x.shape.as_list() == y.shape.as_list())


def _concatenable(op, kind_of):
    """Whether the op on concatenated micro-batches gives the summed grads."""
    xs = [i for i, t in enumerate(op.inputs) if kind_of(t) == "X"]
    if not xs or any(op.inputs[i].shape.rank in (None, 0) or
                     op.inputs[i].shape[0] is not None for i in xs):
        return False
    if any(t.dtype.is_floating and (t.shape.rank in (None, 0) or
                                    t.shape[0] is not None)
           for t in op.outputs):
        return False
    t = op.type
    if t == "MatMul":
        return xs == [0] and not op.get_attr("transpose_a")
    if t in ("BatchMatMulV2", "BatchMatMulV3"):
        return (xs == [0] and op.inputs[1].shape.rank == 2 and
                (op.inputs[0].shape.rank > 2 or not op.get_attr("adj_x")))
    if t in ("BiasAdd", "Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        return xs == [0]
    if t in _ELEMENTWISE:
        if len(xs) != 1 or len(op.inputs) != 2:
            return False
        x, p = op.inputs[xs[0]], op.inputs[1 - xs[0]]
        if p.shape.rank is None or op.outputs[0].shape.rank != x.shape.rank:
            return False
        return p.shape.rank < x.shape.rank or p.shape[0] == 1
    if t == "Einsum":
        if len(op.inputs) != 2 or len(xs) != 1:
            return False
        lhs, out = op.get_attr("equation").decode().replace(" ", "").split(
            "->")
        labels = lhs.split(",")
        x, p = labels[xs[0]], labels[1 - xs[0]]
        return (x[:1].isalpha() and x[0] not in p and out[:1] == x[0])
    if t == "GatherV2":
        axis = tf.get_static_value(op.inputs[2])
        return (xs == [1] and axis is not None and int(axis) == 0 and
                op.get_attr("batch_dims") == 0)
    return False
