"""Split backward: input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism") cut a
stage's backward pass in two actions: B, the gradient w.r.t. the stage's
inputs, which the previous stage waits for, and W, the gradients w.r.t. the
stage's weights, which nobody waits for and which the schedule may run late,
in a bubble. And once W runs late it may run for several micro-batches at
once: the kernel gradient of a Dense layer summed over micro-batches, sum_i
X_i^T dY_i, is one product concat(X)^T concat(dY), so micro-batching no
longer multiplies the number of full-size weight-gradient matrices.

Why per op and not per layer: a stage is any Keras layer run as the pure
function `(inputs, params, state) -> (outputs, new_state, losses)` of
`keras_pipe.engine.stage`; knowing each layer's backward pass would mean a
table of layers. The traced ops of the stage say all that is needed:
`split_plan` sorts them into P (from the params), C (from constants) and X
(the rest), and finds the *mixing ops*, X ops with a float P input, through
which alone the gradient reaches the params. B runs the stage under a
`tf.GradientTape`, takes the gradient w.r.t. the float inputs *and* the
float outputs of every mixing op in one `tape.gradient` (the weight-gradient
ops it also builds feed no output of the function and are pruned when it
runs), and returns as the stash, per mixing op, its X inputs and the
gradients of its outputs. W replays the P chain from the params (the same
ops, through `tf.raw_ops`), replays each mixing op on its stashed X inputs
under a tape and calls `tape.gradient` once with the stashed gradients as
`output_gradients`: the same ops on the same values as the fused backward
pass, so the same gradients, up to the order of float additions.

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

import keras
import tensorflow as tf

from keras_pipe.engine import gradients as gradients_lib
from keras_pipe.engine import op_replay
from keras_pipe.engine.split_plan import SplitPlan, make_plan, structure
from keras_pipe.engine.tensors import (
    exact_spec,
    float_leaves,
    is_float,
    pairs,
    relaxed_spec,
)

__all__ = ["SplitBackward", "SplitPlan", "Stash"]


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
        plan = make_plan(ops, inputs, params, ys, stand_ins)
        grads, stash = _input_gradients(plan, tape, float_leaves(inputs),
                                        params, ys, grad_ys)
        key = ("recorded",) + structure(plan)
        # Micro-batches of the same structure share one plan: W replays
        # the first one's ops on every stash of that key.
        self._plans.setdefault(key, plan)
        grads = iter(grads)
        return ([next(grads) if is_float(t) else None for t in flat_inputs],
                Stash(stash, key))

    def backward_weight(self, params, stashes, totals=None, in_place=False):
        """W: per param, the gradient summed over the stashes' micro-batches.

        Args:
            params: the trainable values (the same as in B).
            stashes: the `Stash`es of `backward_input`, one per micro-batch.
            totals: running sums per param to add to, or None. Defaults to
                `None`.
            in_place: run W's ops in place, not as one call of a traced
                function: each param's gradient then has ops of its own,
                which `keras_pipe.engine.release` can order. After a B
                that ran in place (`backward_recorded`) W always does.
                Defaults to `False`.

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
                                           shared, in_place)
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
            plan = make_plan(ops, inputs, params, ys)
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
                       shared=(), in_place=False):
        """W as a traced function, or (`in_place`, or stashes of a recorded
        B) its body, to run in place.

        After a B that ran in place (`backward_recorded`), W runs in place
        too: a function call op queued behind its device's next call would
        hold back the transfer of B's input gradient (see
        `keras_pipe.engine.executor._handed_over`).
        """
        wkey = ("weight", key, num_micro_batches, dense, shared)
        if wkey in self._functions and not in_place:
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

        if in_place or key[0] == "recorded":
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
            outs = op_replay.replay(op, [values[t.ref()] for t in op.inputs])
            values.update((t.ref(), v) for t, v in zip(op.outputs, outs))
        ys, grad_ys = [], []
        concatenated = _Concatenated(stashes)
        for m in plan.mixing:
            if any(m is o for o in own):
                for stash, (m_ys, m_grads) in zip(stashes, own_ys):
                    outs = op_replay.replay(m.op, [
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
                outs = op_replay.replay_mixing(m.op, inputs)
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


def _relaxed_type_spec(t):
    """The spec W is traced with for stashed `t` (its traced static shape)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlicesSpec(
            tf.TensorShape(tf.get_static_value(t.dense_shape)
                           if t.dense_shape is not None else None),
            t.values.dtype, t.indices.dtype)
    return tf.TensorSpec(t.shape, t.dtype)

