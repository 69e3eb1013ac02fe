"""Split backward: input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al., ICLR 2024) cut a stage's backward pass in
two actions: B, the gradient w.r.t. the stage's inputs, which the previous
stage waits for, and W, the gradients w.r.t. the stage's weights, which
nobody waits for and which the schedule may run late, in a bubble. And once
W runs late it may run for several micro-batches at once: the kernel
gradient of a Dense layer summed over micro-batches, sum_i X_i^T dY_i, is
one product concat(X)^T concat(dY), so micro-batching no longer multiplies
the number of full-size weight-gradient matrices.

Why per op and not per layer: a stage is any Keras layer run as the pure
function `(inputs, params, state) -> (outputs, new_state, losses)` of
`keras_pipe.engine.stage`; knowing each layer's backward pass would mean a table of
layers. The traced ops of the stage say all that is needed. Inside the
traced B function, each tensor the stage computes is

    P  derived from the params (and constants) only,
    C  derived from constants only,
    X  everything else (it depends on the inputs, the state, a random op).

An X op with a float P input is a *mixing op*: the gradient reaches the
params only through mixing ops (or through a P tensor that is itself an
output or a loss). B runs the stage under a `tf.GradientTape`, takes the
gradient w.r.t. the float inputs *and* the float outputs of every mixing op
in one `tape.gradient` (the weight-gradient ops it also builds feed no output
of the function and are pruned when it runs), and returns as the stash, per
mixing op, its X inputs and the gradients of its outputs. W replays the
P chain from the params (the same ops, through `tf.raw_ops`), replays each
mixing op on its stashed X inputs under a tape and calls `tape.gradient`
once with the stashed gradients as `output_gradients`: the same ops on the
same values as the fused backward pass, so the same gradients, up to the
order of float additions.

A mixing op takes the micro-batches concatenated (one op for all) where
that is exact: its X inputs have the batch axis first (static size unknown
in the trace) and the op treats rows independently while the P operand is
shared by them (see `_concatenable`): MatMul/BatchMatMul with X as the
first operand, BiasAdd, Conv2D/Conv3D/DepthwiseConv2dNative on X, binary
element-wise ops whose P operand broadcasts over axis 0, Einsum whose X
batch label is not a P label and leads the output, GatherV2 on P params
with X indices (the gradient is IndexedSlices: concatenation is the sum).
Other mixing ops (BatchNormalization's per-channel products, say) are
replayed once per micro-batch. Additive ops (`x + b`, `bias_add`) stash no
X input: the gradient of `b` only reduces dY, so W feeds zeros shaped like
dY; a Dense layer stashes its input and dY, nothing more. A P tensor that is
itself an output or a loss (a penalty on a kernel) gets, in W, the sum of
its stashed gradients.

    B of micro-batch i    (inputs, params, state, dY_i) -> dX_i, stash_i
    W of micro-batches I  (params, stash_i for i in I)  -> sum_i dW_i

A stage that cannot be split this way -- a mixing op (or an op of the
P chain) that is control flow (an RNN's `While`), a function call, has a
custom gradient (`tf.custom_gradient`: replayed, it would get the stock
one), is stateful (`tf.numpy_function`) or has no matching `tf.raw_ops`
wrapper; sparse or ragged inputs -- is reported
(`SplitPlan.splittable=False` and the reason) and runs fused: B computes
all gradients and its stash holds the weight gradients, which W sums. Never
wrong, only not split.
"""

import dataclasses
import inspect

import keras
import tensorflow as tf

from keras_pipe.engine import gradients as gradients_lib
from keras_pipe.engine.tensors import (
    exact_spec,
    float_leaves,
    is_float,
    pairs,
    relaxed_spec,
)

__all__ = ["SplitBackward", "SplitPlan", "Stash"]

_CALLS = frozenset([
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient",
    "RemoteCall"])
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


class Stash(list):
    """B's stash: a flat list of tensors, plus the key of the plan it follows.

    Pass the `Stash` object itself to `backward_weight` (a plain list of its
    tensors loses `key`, which says how W reads them).
    """

    def __init__(self, tensors, key):
        super().__init__(tensors)
        self.key = key


class SplitBackward:
    """The backward pass of a stage as B (input gradients) and W (weights).

    `backward_input` (B) recomputes the stage from `(inputs, params, state)`
    -- the state of the forward pass, so Dropout draws the same mask -- and
    returns the input gradients and a stash; `backward_weight` (W) returns
    the weight gradients summed over the micro-batches of its stashes. Both
    are traced `tf.function`s, not inlined (one op per call), like
    `keras_pipe.engine.stage.Stage`'s; B per input signature with the batch size
    left open (and per pattern of `None` gradients), W per B signature,
    number of micro-batches and pattern of dense running sums. Call them
    under the stage's `tf.device`.

    `splittable` is False (and `reason` says why) once a traced signature
    cannot be split; B then computes every gradient (its stash holds the
    weight gradients) and W sums them, so results stay exact either way.

    ```python
    stage = keras_pipe.engine.stage.Stage(layer, "/device:CPU:0")
    split = SplitBackward(stage.call_inline, training=True)
    stashes = []
    for x, dy in zip(micro_batches, output_grads):
        dx, stash = split.backward_input(x, params, state, [dy], [])
        stashes.append(stash)
    grads = split.backward_weight(params, stashes)  # summed over all
    ```

    Args:
        call: the stage as a pure function `call(inputs, params, state,
            training) -> (outputs, new_state, losses)`, e.g.
            `keras_pipe.engine.stage.Stage.call_inline`.
        training: the `training` flag passed to `call`.

    Raises:
        TypeError: if `call` is not callable.
    """

    def __init__(self, call, training):
        if not callable(call):
            raise TypeError(
                f"`call` must be callable. Received: call={call!r}")
        self.call = call
        self.training = bool(training)
        self._plans = {}
        self._functions = {}

    @property
    def splittable(self):
        """False if any traced signature runs fused; True before any trace."""
        return all(p.splittable for p in self._plans.values())

    @property
    def reason(self):
        """Why some traced signature runs fused, or ""."""
        return "; ".join(sorted({p.reason for p in self._plans.values()
                                 if not p.splittable}))

    def plan(self, inputs, params, state, output_grads, loss_grads):
        """Traces B for these arguments; returns its `SplitPlan`."""
        key, _, _ = self._traced_input(inputs, params, state, output_grads,
                                       loss_grads)
        return self._plans[key]

    def backward_input(self, inputs, params, state, output_grads, loss_grads):
        """B: input gradients of one micro-batch, and the stash for W.

        Args:
            inputs: the stage's inputs (nested structure).
            params: the trainable values, one tensor per trainable variable.
            state: the state values the forward pass started from.
            output_grads: gradients for `tree.flatten(outputs)`, `None`
                where an output does not reach the loss.
            loss_grads: gradients for the stage's `add_loss` scalars.

        Returns:
            `(input_grads, stash)`: gradients aligned with
            `tree.flatten(inputs)` (None for non-float or unconnected
            inputs), and a `Stash` for `backward_weight`.
        """
        flat_inputs = keras.tree.flatten(inputs)
        seeds = [g for g in list(output_grads) + list(loss_grads)
                 if g is not None]
        if not seeds:
            return [None] * len(flat_inputs), Stash([], None)
        key, function, args = self._traced_input(
            inputs, params, state, output_grads, loss_grads)
        grads, stash = function(*args)
        grads = iter(grads)
        return ([next(grads) if is_float(t) else None for t in flat_inputs],
                Stash(stash, key))

    def backward_recorded(self, tape, ops, inputs, params, ys, grad_ys,
                          stand_ins=None):
        """B from a forward pass that `tape` recorded: nothing recomputed.

        The forward pass ran the stage's ops in place (not as a function
        call), under `tape`, which watched the float inputs and the params;
        `ops` are those ops. B takes the gradient w.r.t. the inputs and the
        mixing ops' outputs from that tape, so it reuses the forward
        activations, and stashes the mixing ops' X inputs (forward tensors,
        no copies) and output gradients, like `backward_input`.

        Args:
            tape: the non-persistent `tf.GradientTape` of the forward pass.
            ops: the forward pass's ops, in creation order.
            inputs: the stage's inputs (nested structure).
            params: the trainable values the forward pass read.
            ys: the forward's outputs and losses that have a gradient.
            grad_ys: their gradients.
            stand_ins: `{op: the op it replaced}`: ops built in place of
                another whose outputs the tape records as theirs (a
                product with a transposed kernel,
                `keras_pipe.engine.products`). W replays the replaced op.
                Defaults to `None` (none).

        Returns:
            `(input_grads, stash)` as `backward_input` returns them.
        """
        flat_inputs = keras.tree.flatten(inputs)
        if not ys:
            return [None] * len(flat_inputs), Stash([], None)
        plan = _make_plan(ops, inputs, params, ys, stand_ins)
        grads, stash = _input_gradients(plan, tape, float_leaves(inputs),
                                        params, ys, grad_ys)
        key = ("recorded",) + _structure(plan)
        # Micro-batches of the same structure share one plan: W replays
        # the first one's ops on every stash of that key.
        self._plans.setdefault(key, plan)
        grads = iter(grads)
        return ([next(grads) if is_float(t) else None for t in flat_inputs],
                Stash(stash, key))

    def backward_weight(self, params, stashes, totals=None):
        """W: per param, the gradient summed over the stashes' micro-batches.

        Args:
            params: the trainable values (the same as in B).
            stashes: the `Stash`es of `backward_input`, one per micro-batch.
            totals: running sums per param to add to, or None. Defaults to
                `None`.

        Returns:
            A list per param: `totals` plus the summed gradients (None where
            neither has a gradient; IndexedSlices stay sparse).
        """
        params = list(params)
        totals = [None] * len(params) if totals is None else list(totals)
        groups = {}
        for stash in stashes:
            if stash.key is not None:
                groups.setdefault(stash.key, []).append(stash)
        for key, group in groups.items():
            dense = tuple(isinstance(t, tf.Tensor) for t in totals)
            shared = _shared_slots(self._plans[key], group)
            function = self._traced_weight(key, len(group), params, dense,
                                           shared)
            grads, sums = function(
                params, [list(s) for s in group],
                [t for t, d in zip(totals, dense) if d])
            sums = iter(sums)
            totals = [next(sums) if d else gradients_lib.add_gradients(t, g)
                      for t, g, d in zip(totals, grads, dense)]
        return totals

    def _traced_input(self, inputs, params, state, output_grads, loss_grads):
        given = tuple(g is not None for g in
                      list(output_grads) + list(loss_grads))
        num_outputs = len(output_grads)
        seeds = [g for g in list(output_grads) + list(loss_grads)
                 if g is not None]
        num_output_seeds = sum(given[:num_outputs])
        specs = (keras.tree.map_structure(relaxed_spec, inputs),
                 [exact_spec(p) for p in params],
                 [exact_spec(s) for s in state],
                 [relaxed_spec(g) for g in seeds[:num_output_seeds]] +
                 [exact_spec(g) for g in seeds[num_output_seeds:]])
        key = (repr(specs), given)
        args = (inputs, list(params), list(state), seeds)
        if key in self._functions:
            return key, self._functions[key], args

        def run(inputs, params, state, seeds):
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            float_inputs = float_leaves(inputs)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(float_inputs + list(params))
                outputs, _, losses = self.call(inputs, params, state,
                                               self.training)
            ops = graph.get_operations()[first:]
            seeds = iter(seeds)
            ys, grad_ys = pairs(
                keras.tree.flatten(outputs) + list(losses),
                [next(seeds) if g else None for g in given])
            plan = _make_plan(ops, inputs, params, ys)
            self._plans[key] = plan
            return _input_gradients(plan, tape, float_inputs, params, ys,
                                    grad_ys)

        function = tf.function(
            run, autograph=False,
            experimental_attributes={"_noinline": True},
        ).get_concrete_function(*specs)
        self._functions[key] = function
        return key, function, args

    def _traced_weight(self, key, num_micro_batches, params, dense,
                       shared=()):
        """W as a traced function, or (stashes of a recorded B) in place.

        After a B that ran in place (`backward_recorded`), W runs in place
        too: a function call op queued behind its device's next call would
        hold back the transfer of B's input gradient (see
        `keras_pipe.engine.executor._handed_over`).
        """
        wkey = ("weight", key, num_micro_batches, dense, shared)
        if wkey in self._functions:
            return self._functions[wkey]
        plan = self._plans[key]

        def run(params, stashes, sums):
            if plan.splittable:
                grads = _replayed_gradients(plan, params, stashes, shared)
            else:
                # Stashed weight gradients: their indices are arguments
                # here, so whether they depend on the batch comes from B.
                grads = [None if slot is None
                         else gradients_lib.sum_micro_batches(
                             [s[slot] for s in stashes],
                             batch_independent=(
                                 slot < len(shared) and shared[slot]) or None)
                         for slot in plan.param_slots]
            sums = iter(sums)
            new_sums = [gradients_lib.add_gradients(next(sums), g)
                        for g, d in zip(grads, dense) if d]
            new_sums = [tf.convert_to_tensor(s) for s in new_sums]
            # Gradients summed inside are not returned on their own.
            rest = [None if d else g for g, d in zip(grads, dense)]
            return rest, new_sums

        if key[0] == "recorded":
            return run
        specs = ([exact_spec(p) for p in params],
                 [list(plan.stash_specs)] * num_micro_batches,
                 [exact_spec(p) for p, d in zip(params, dense) if d])
        function = tf.function(
            run, autograph=False,
            experimental_attributes={"_noinline": True},
        ).get_concrete_function(*specs)
        self._functions[wkey] = function
        return function


def _structure(plan):
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


def _input_gradients(plan, tape, float_inputs, params, ys, grad_ys):
    """B's body: input gradients and the stash, from the forward's tape."""
    if not plan.splittable:
        return _fused_input(plan, tape, float_inputs, params, ys, grad_ys)
    sources = [m.outputs[k] for m in plan.mixing for k in m.grad_slots]
    grads = tape.gradient(
        ys, float_inputs + sources, output_gradients=grad_ys,
        unconnected_gradients=tf.UnconnectedGradients.NONE)
    n = len(float_inputs)
    stash = _fill_stash(plan, dict(zip(
        [t.ref() for t in sources], grads[n:])), ys, grad_ys)
    return grads[:n], stash


def _fused_input(plan, tape, float_inputs, params, ys, grad_ys):
    """B of a stage that cannot be split: every gradient, stashed."""
    grads = tape.gradient(
        ys, float_inputs + list(params), output_gradients=grad_ys,
        unconnected_gradients=tf.UnconnectedGradients.NONE)
    n = len(float_inputs)
    stash = [g for g in grads[n:] if g is not None]
    plan.param_slots = [None] * len(params)
    slot = 0
    for j, g in enumerate(grads[n:]):
        if g is not None:
            plan.param_slots[j] = slot
            slot += 1
    plan.stash_specs = [_relaxed_type_spec(g) for g in stash]
    return grads[:n], stash


def _make_plan(ops, inputs, params, ys, stand_ins=None):
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
        elif _is_stateful(op) or "X" in kinds:
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
        problems += _unreplayable(op, f"mixing op {op.name!r}",
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
        problems += _unreplayable(op, f"op {op.name!r} on the params",
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


def _fill_stash(plan, output_grads, ys, grad_ys):
    """Assigns stash slots; returns the stash (drops ops without gradient)."""
    stash, slots, specs = [], {}, []

    def slot_of(t, shape=None):
        if t.ref() not in slots:
            slots[t.ref()] = len(stash)
            stash.append(t)
            # An output gradient given with a static batch size is stashed
            # under the op's own (open) one: one W for every size.
            specs.append(_relaxed_type_spec(t) if shape is None else
                         tf.TensorSpec(shape, t.dtype))
        return slots[t.ref()]

    kept = []
    for m in plan.mixing:
        grads = {k: output_grads[m.outputs[k].ref()] for k in m.grad_slots}
        grads = {k: g for k, g in grads.items() if g is not None}
        if not grads:
            continue
        m.x_slots = {i: slot_of(m.op.inputs[i]) for i in m.x_slots}
        m.grad_slots = {}
        for k, g in grads.items():
            g = tf.convert_to_tensor(g)
            g.set_shape(g.shape.merge_with(m.op.outputs[k].shape))
            m.grad_slots[k] = slot_of(g, m.op.outputs[k].shape)
        kept.append(m)
    plan.mixing = kept
    seeds = {y.ref(): g for y, g in zip(ys, grad_ys)}
    direct = []
    for y, _ in plan.direct:
        direct.append((y, slot_of(seeds[y.ref()])))
    plan.direct = direct
    plan.stash_specs = specs
    return stash


def _shared_slots(plan, stashes):
    """Per stash slot, whether it does not depend on the batch's data.

    Decided on the first stash as the caller's graph sees it (B's outputs,
    walked into B; `keras_pipe.engine.gradients.depends_on_batch`): a
    relative-bias bucket matrix computed from `arange(T)`, a position
    table's `arange(T)`. In eager mode nothing is walked: all False.
    """
    first = stashes[0]
    wanted = set(s for s in plan.param_slots if s is not None)
    wanted |= {slot for m in plan.mixing for slot in m.x_slots.values()}
    shared = []
    for slot, t in enumerate(first):
        t = t.indices if isinstance(t, tf.IndexedSlices) else t
        shared.append(slot in wanted and len(stashes) > 1
                      and _is_symbolic(t)
                      and not gradients_lib.depends_on_batch(t))
    return tuple(shared)


def _is_symbolic(t):
    try:
        t.op  # noqa: B018  (eager tensors have no op)
    except AttributeError:
        return False
    return True


def _replayed_gradients(plan, params, stashes, shared=()):
    """W's body: replays the P chain and the mixing ops, one tape.gradient.

    A mixing op whose stashed X inputs do not depend on the batch (`shared`,
    a gather of `take(table, buckets)`) is replayed per micro-batch and
    differentiated per micro-batch: their gradients are added as
    micro-batches are (`keras_pipe.engine.gradients.add_gradients`: equal
    indices add their values), where one `tape.gradient` would concatenate
    their rows, giving the optimizer each bucket once per micro-batch.
    """
    own = [m for m in plan.mixing if m.x_slots and len(stashes) > 1
           and all(slot < len(shared) and shared[slot]
                   for slot in m.x_slots.values())]
    own_ys = [([], []) for _ in stashes]
    with tf.GradientTape(watch_accessed_variables=False,
                         persistent=bool(own)) as tape:
        tape.watch(list(params))
        values = {ph.ref(): p for ph, p in zip(plan.params, params)}
        for op in plan.replay:
            outs = _replay(op, [values[t.ref()] for t in op.inputs])
            values.update((t.ref(), v) for t, v in zip(op.outputs, outs))
        ys, grad_ys = [], []
        concatenated = _Concatenated(stashes)
        for m in plan.mixing:
            if any(m is o for o in own):
                for stash, (m_ys, m_grads) in zip(stashes, own_ys):
                    outs = _replay(m.op, [
                        stash[m.x_slots[i]] if i in m.x_slots
                        else values[t.ref()]
                        for i, t in enumerate(m.op.inputs)])
                    for k, slot in m.grad_slots.items():
                        m_ys.append(outs[k])
                        m_grads.append(stash[slot])
                continue
            if m.concat and len(stashes) > 1:
                batches = [concatenated]
            else:
                batches = stashes
            for stash in batches:
                inputs = [stash[m.x_slots[i]] if i in m.x_slots else
                          tf.zeros_like(stash[m.grad_slots[0]])
                          if i in m.zeros else values[t.ref()]
                          for i, t in enumerate(m.op.inputs)]
                outs = _replay_mixing(m.op, inputs)
                for k, slot in m.grad_slots.items():
                    ys.append(outs[k])
                    grad_ys.append(stash[slot])
        for y, slot in plan.direct:
            ys.append(values[y.ref()])
            grad_ys.append(tf.add_n([s[slot] for s in stashes]))
    none = tf.UnconnectedGradients.NONE
    grads = (tape.gradient(ys, list(params), output_gradients=grad_ys,
                           unconnected_gradients=none)
             if ys else [None] * len(params))
    if not own:
        return grads
    parts = [tape.gradient(m_ys, list(params), output_gradients=m_grads,
                           unconnected_gradients=none)
             for m_ys, m_grads in own_ys]
    del tape
    for n, per_micro_batch in enumerate(zip(*parts)):
        summed = gradients_lib.sum_micro_batches(list(per_micro_batch),
                                                 batch_independent=True)
        # Other reads of the param (the rest of the stage): concatenated,
        # as one tape over the unsplit stage gives them.
        grads[n] = (summed if grads[n] is None else grads[n]
                    if summed is None else
                    gradients_lib.sum_gradients([grads[n], summed]))
    return grads


class _Concatenated:
    """Stash slots concatenated over micro-batches, each concatenated once."""

    def __init__(self, stashes):
        self._stashes = stashes
        self._values = {}

    def __getitem__(self, slot):
        if slot not in self._values:
            self._values[slot] = tf.concat([s[slot] for s in self._stashes],
                                           0)
        return self._values[slot]


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


def _unreplayable(op, label, check_state):
    """Why W cannot replay `op` (a custom gradient, a call, ...), or []."""
    if "_gradient_op_type" in op.node_def.attr:
        return [f"{label} has a custom gradient ({op.type})"]
    if op.type in _CALLS:
        return [f"{label} is control flow or a function call ({op.type})"]
    if check_state and _is_stateful(op):
        return [f"{label} is stateful ({op.type})"]
    return _replay_problems(op)


def _replay_problems(op):
    """Why `_replay` cannot rebuild `op` ([] if it can)."""
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


def _replay(op, inputs):
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


def _replay_mixing(op, inputs):
    """`_replay` for W's mixing ops, a `BiasAdd` as a broadcast `AddV2`.

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
        return _replay(op, inputs)
    x, bias = inputs
    if op.get_attr("data_format").decode().startswith("NC"):
        bias = tf.reshape(bias, [-1] + [1] * (x.shape.rank - 2))
    return [tf.add(x, bias)]


def _is_stateful(op):
    return op.op_def.is_stateful












def _relaxed_type_spec(t):
    """The spec W is traced with for stashed `t` (its traced static shape)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlicesSpec(
            tf.TensorShape(tf.get_static_value(t.dense_shape)
                           if t.dense_shape is not None else None),
            t.values.dtype, t.indices.dtype)
    return tf.TensorSpec(t.shape, t.dtype)
