"""A stage runner: one Keras layer run as a pure function on its device.

Remat (re-materialization) is one of its options, and the reason the
runner is built the way it is:

Stock `tf.recompute_grad` and `keras.remat` run the layer's `call` again in
the backward pass, and with it every state update inside: BatchNormalization
updates its moving statistics a second time, and Dropout advances its seed
generator and draws a *different* mask, so the gradient belongs to another
network than the forward pass. They also refuse keyword arguments such as
`training` inside `tf.function` (`tf.custom_gradient` does).

Here a stage runs as a pure function of its inputs, its trainable values and
its state (every non-trainable variable, seed generators included) under a
`keras.StatelessScope`:

    outputs, new_state, losses = stage(inputs; params, state)

The forward pass returns `new_state`; the pipeline assigns it once per
micro-batch. The recompute calls the same function with the *same* `state`
it saw in the forward pass, so it draws the same dropout mask and computes
the same batch statistics, and its own `new_state` is thrown away.
`training` is bound in Python, never passed through a custom gradient.

The backward pass of a rematerialized stage is one traced function of the
stage, `(inputs, params, state, output gradients, running sums) -> (input
gradients, new running sums)`: it recomputes the stage under a
`tf.GradientTape`, takes the gradient and adds the weight gradients to
their sums. Like the forward function it is traced once and called once per
micro-batch, under the stage's `tf.device`, so the graph grows by one op per
(micro-batch, stage) and gradient ops run on the stage's device (a tape over
the whole step would put them all on one device). A stage's last backward
call of a step is split instead (`backward_input` recomputes, and
`backward_weight` runs in place: `keras_pipe.engine.weight_calls`). Without
remat, the gradient comes from a tape that recorded the forward call. A backward call
waits for its incoming gradient, so the recompute runs in the backward pass
and not eagerly next to the forward pass.
"""

import contextlib
import dataclasses

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import attached, keyed_random
from keras_pipe.engine.gradients import add_gradients
from keras_pipe.engine.tensors import (
    exact_spec,
    float_leaves,
    is_float,
    pairs,
    relaxed_spec,
)
from keras_pipe.engine.weight_grad import SplitBackward

__all__ = ["Stage", "StageRun"]






@dataclasses.dataclass
class StageRun:
    """What the forward pass of one (micro-batch, stage) left for backward."""

    inputs: object      # nested structure, gradient-stopped
    params: list        # trainable values, gradient-stopped
    state: list         # state values the forward pass started from
    outputs: object     # nested structure
    losses: list        # scalar losses added by the stage's layers
    remat: bool
    tape: object = None  # records the forward's ops when remat is off
    ops: list = None     # those ops, when a split backward pass follows
    stand_ins: dict = None  # {op: the op it replaced} (transposed kernels)


class Stage:
    """A Keras layer run as a pure function on a fixed device.

    `position=(j, num_stages)` makes it stage `j` of a pipeline: its
    outputs leave as `keras_pipe.engine.attached.keep(outputs)` (their masks, and
    on the last stage the logits behind a softmax or sigmoid, beside them)
    and, unless `j == 0`, its inputs arrive so and get their masks back
    before the layer runs. With `position=None` inputs and outputs are the
    layer's own.
    """

    def __init__(self, layer, device, position=None):
        self.layer = layer
        self.device = device
        self.position = position
        self._functions = {}
        self._split = {}  # training flag -> `SplitBackward`
        self._kinds = None
        # Whether a training call's layers added losses (`add_loss`)
        # beyond their activity regularizers: set when traced.
        self.adds_losses = False

    @property
    def trainable_variables(self):
        return self.layer.trainable_variables

    @property
    def state_variables(self):
        return self.layer.non_trainable_variables

    def read_params(self, differentiable=False):
        """Reads the trainable values once per step, on the stage's device.

        With `differentiable=False` (the pipeline's own backward pass) the
        values are cut from the variables, so that only `Stage.backward`
        computes their gradients; with `True`, an outer `tf.GradientTape`
        sees the reads.
        """
        with tf.device(self.device):
            values = [tf.convert_to_tensor(v.value)
                      for v in self.trainable_variables]
            if differentiable:
                return values
            return [tf.stop_gradient(v) for v in values]

    @property
    def state_kinds(self):
        """Per state variable, how a step combines micro-batches' updates.

        `("seed", None)`: a seed generator's state. Random draws are keyed
        by row (`call_inline`), so every micro-batch starts from the state
        of the step's start and the state advances once per step.
        `("ema", momentum)`: a BatchNormalization moving statistic, updated
        as `m * momentum + x * (1 - momentum)`; replicas thread it on their
        own and the step merges them (`keras_pipe.engine.executor`).
        `("chain", None)`: anything else, threaded from one micro-batch to
        the next in issue order.
        """
        if self._kinds is None:
            seeds = {id(v) for v in keyed_random.seed_state_variables(
                self.layer)}
            ema = {}
            for sub in _compat.flatten_layers(self.layer):
                if (isinstance(sub, keras.layers.BatchNormalization)
                        and not getattr(sub, "renorm", False)
                        and not hasattr(sub, "finish_mini_batch")
                        and getattr(sub, "moving_mean", None) is not None):
                    for v in (sub.moving_mean, sub.moving_variance):
                        ema[id(v)] = float(sub.momentum)
            self._kinds = [
                ("seed", None) if id(v) in seeds else
                ("ema", ema[id(v)]) if id(v) in ema else ("chain", None)
                for v in self.state_variables]
        return self._kinds

    def read_state(self):
        with tf.device(self.device):
            return [tf.convert_to_tensor(v.value)
                    for v in self.state_variables]

    def call(self, inputs, params, state, training):
        """Runs the layer statelessly: returns (outputs, new_state, losses).

        The stage is traced once per `training` flag and input structure
        (batch size left open) into a function, and every micro-batch calls
        it: the graph grows with `M + K` traced stages, not `M * K`, and the
        gradient of the call is the function's gradient, built once.
        `new_state[k]` is `None` where the call leaves state variable `k`
        unchanged.
        """
        function, changed = self._traced(inputs, params, state, training)
        outputs, new_state, losses = function(inputs, params, state)
        new_state = [new if c else None for new, c in zip(new_state, changed)]
        return outputs, new_state, losses

    def _traced(self, inputs, params, state, training):
        signature = (keras.tree.map_structure(relaxed_spec, inputs),
                     [exact_spec(p) for p in params],
                     [exact_spec(s) for s in state])
        key = (bool(training), repr(signature))
        if key not in self._functions:
            changed = []

            def run(inputs, params, state):
                outputs, new_state, losses = self.call_inline(
                    inputs, params, state, training)
                changed[:] = [new is not None for new in new_state]
                return outputs, [old if new is None else new
                                 for new, old in zip(new_state, state)], losses

            # Not inlined: the call is one op that ends when the whole stage
            # has run, which is what the schedule's control dependencies
            # wait for (inlined, they would only wait for its first ops).
            function = tf.function(
                run, autograph=False,
                experimental_attributes={"_noinline": True},
                ).get_concrete_function(*signature)
            self._functions[key] = (function, list(changed))
        return self._functions[key]

    def call_inline(self, inputs, params, state, training):
        """`call` without the traced function: the layer's ops, in place.

        `state` holds one value per state variable and, optionally, one
        more: `[offset, total]`, the micro-batch's first row in the global
        batch and the global batch size, which keys random draws by row
        (`keras_pipe.engine.keyed_random.keyed_random`).
        """
        n = len(self.state_variables)
        rows = state[n] if len(state) > n else None
        mapping = list(zip(self.trainable_variables, params))
        mapping += list(zip(self.state_variables, state[:n]))
        keyed = (keyed_random.keyed_random(rows, _static_batch(inputs))
                 if rows is not None else contextlib.nullcontext())
        if self.position is not None and self.position[0] > 0:
            inputs = attached.view(inputs)
        with keyed, keras.StatelessScope(state_mapping=mapping,
                                         collect_losses=True) as scope:
            before = [scope.get_current_value(v) for v in self.state_variables]
            outputs = self.layer(inputs, training=training)
        if self.position is not None:
            j, num_stages = self.position
            outputs = attached.keep(outputs, logits=j == num_stages - 1)
        new_state = [None if new is old else new for new, old in zip(
            (scope.get_current_value(v) for v in self.state_variables),
            before)]
        if training and len(scope.losses) > _activity_regularized(
                self.layer):
            self.adds_losses = True
        return outputs, new_state, list(scope.losses)

    def forward(self, inputs, params, state, training, remat,
                control_inputs=(), differentiable=False, name="forward",
                observer=None, split=False, kernels=None):
        """Forward pass of one micro-batch; returns (StageRun, new_state).

        `control_inputs` make this micro-batch wait for the previous one on
        the same stage. With `differentiable=False`, gradients do not flow
        through `inputs`: `backward` computes them stage by stage, from a
        tape that records this call alone (`remat=False`) or the recompute.
        `observer` (the Timeline's recorder, or None) stamps the call's
        start and end.

        Without remat (and not differentiable), the layer's ops run in
        place under that tape rather than as a function call, so that the
        backward pass reuses the forward activations. `split=True` (a split
        backward pass follows, B then W) also keeps those ops, so that B can
        take gradients w.r.t. the ops inside the stage (`backward_input`),
        and leaves the inputs' batch size open in them, as in the traced
        call, so that W may concatenate micro-batches. `kernels` (a
        `keras_pipe.engine.products.TransposedKernels` of this stage and
        step, or None) makes the in-place forward products multiply by
        kernels transposed once per step.
        """
        tape = ops = None
        stand_ins = {}
        with tf.device(self.device), tf.name_scope(name):
            if not differentiable:
                inputs = keras.tree.map_structure(
                    lambda t: None if t is None else tf.stop_gradient(t),
                    inputs)
            state = [tf.stop_gradient(s) for s in state]
            control_inputs = list(control_inputs)
            if observer is not None:
                control_inputs = [observer.start(
                    name, keras.tree.flatten(inputs) + control_inputs)]
            if not differentiable and not remat:
                tape = tf.GradientTape(watch_accessed_variables=False)
            # The call (one op, or the stage's ops in place) waits.
            with tape or contextlib.nullcontext(), tf.control_dependencies(
                    control_inputs):
                if tape is None:
                    outputs, new_state, losses = self.call(
                        inputs, params, state, training)
                else:
                    if split:
                        inputs = keras.tree.map_structure(_open_batch,
                                                          inputs)
                        graph = tf.compat.v1.get_default_graph()
                        first = len(graph.get_operations())
                    tape.watch(float_leaves(inputs) + list(params))
                    with (kernels.rewriting(stand_ins) if kernels is not None
                          else contextlib.nullcontext()):
                        outputs, new_state, losses = self.call_inline(
                            inputs, params, state, training)
                    if split:
                        ops = graph.get_operations()[first:]
            if observer is not None:
                observer.end(name, keras.tree.flatten(outputs) + losses)
        run = StageRun(inputs, params, state, outputs, losses, remat, tape,
                       ops, stand_ins)
        return run, new_state

    def backward(self, run, output_grads, loss_grads, training, totals,
                 name="backward", control_inputs=(), observer=None):
        """Backward pass of one micro-batch, on the stage's device.

        With remat, the recompute and the backward pass are one traced
        function of the stage (traced once, one op per micro-batch) that
        also adds the weight gradients to their running sums. Without
        remat, gradients come from the `tf.GradientTape` that recorded the
        forward call. Either way the ops run under the stage's `tf.device`.
        (A tape over the whole pipeline would put them all on one device,
        and `tf.gradients` would search the whole graph for every call.)

        Args:
            run: the `StageRun` of the forward pass.
            output_grads: gradients for `tree.flatten(run.outputs)`, `None`
                where an output does not reach the loss.
            loss_grads: gradients for `run.losses`.
            training: the `training` flag of the forward pass.
            totals: per trainable variable, the sum of its gradients from
                earlier micro-batches on this stage, or None.
            name: the name scope.
            control_inputs: tensors to wait for: the previous backward pass
                on this stage, so that micro-batches run (and hold their
                recomputed activations) one at a time.
            observer: stamps start and end (the Timeline), or None.

        Returns:
            `(input_grads, totals)`: gradients for `tree.flatten(run.inputs)`
            (None for non-float inputs) and the new running sums.
        """
        flat_inputs = keras.tree.flatten(run.inputs)
        if all(g is None for g in output_grads + loss_grads):
            return [None] * len(flat_inputs), list(totals)
        with tf.device(self.device), tf.name_scope(name):
            if run.remat:
                grads, totals = self._fused_backward(
                    run, output_grads, loss_grads, training, totals, name,
                    control_inputs, observer)
            else:
                grads = self._taped_backward(run, output_grads, loss_grads,
                                             name, control_inputs, observer)
                totals = [add_gradients(t, g) for t, g in zip(
                    totals, grads[len(float_leaves(run.inputs)):])]
            input_grads = iter(grads)
            return ([next(input_grads) if is_float(t) else None
                     for t in flat_inputs], totals)

    def backward_input(self, run, output_grads, loss_grads, training,
                       name="backward", control_inputs=(), observer=None):
        """B of a split backward pass: input gradients now, a stash for W.

        Recomputes the stage from the state of the forward pass (see
        `keras_pipe.engine.weight_grad`), on the stage's device.

        Returns:
            `(input_grads, stash)`: gradients for `tree.flatten(run.inputs)`
            (None for non-float inputs) and what `backward_weight` needs.
        """
        split = self._split.setdefault(
            bool(training), SplitBackward(self.call_inline, training))
        with tf.device(self.device), tf.name_scope(name):
            after = list(control_inputs)
            if observer is not None:
                after = [observer.start(name, [g for g in output_grads
                                               if g is not None] + after)]
            with tf.control_dependencies(after):
                if run.ops is not None:
                    ys, grad_ys = pairs(
                        keras.tree.flatten(run.outputs) + run.losses,
                        list(output_grads) + list(loss_grads))
                    grads, stash = split.backward_recorded(
                        run.tape, run.ops, run.inputs, list(run.params), ys,
                        grad_ys, stand_ins=run.stand_ins)
                else:
                    grads, stash = split.backward_input(
                        run.inputs, list(run.params), list(run.state),
                        list(output_grads), list(loss_grads))
            if observer is not None:
                observer.end(name, [g for g in grads if g is not None] +
                             list(stash))
        return grads, stash

    def splits(self, training):
        """False once a split backward pass of this stage ran fused."""
        split = self._split.get(bool(training))
        return split is None or split.splittable

    def backward_weight(self, params, stashes, totals, training,
                        name="weight", control_inputs=(), observer=None,
                        in_place=False):
        """W of a split backward pass: weight gradients of several
        micro-batches in one call, added to the running `totals`; with
        `in_place`, its ops run in place (`SplitBackward.backward_weight`)."""
        split = self._split.setdefault(
            bool(training), SplitBackward(self.call_inline, training))
        with tf.device(self.device), tf.name_scope(name):
            after = list(control_inputs)
            if observer is not None:
                after = [observer.start(name, [t for s in stashes for t in s]
                                        + after)]
            with tf.control_dependencies(after):
                totals = split.backward_weight(list(params), stashes,
                                               list(totals), in_place)
            if observer is not None:
                observer.end(name, [t for t in totals if t is not None])
        return totals

    def _taped_backward(self, run, output_grads, loss_grads, name,
                        control_inputs, observer):
        ys, grad_ys = pairs(keras.tree.flatten(run.outputs) + run.losses,
                             output_grads + loss_grads)
        after = list(control_inputs)
        if observer is not None:
            after = [observer.start(name, grad_ys + ys + after)]
        with tf.control_dependencies(after):
            grads = run.tape.gradient(
                ys, float_leaves(run.inputs) + list(run.params),
                output_gradients=grad_ys,
                unconnected_gradients=tf.UnconnectedGradients.NONE)
        if observer is not None:
            observer.end(name, [g for g in grads if g is not None])
        return grads

    def _fused_backward(self, run, output_grads, loss_grads, training,
                        totals, name, control_inputs, observer):
        """Recompute + backward + running sums as one call of a function."""
        # Dense running sums are added inside; sparse ones (IndexedSlices)
        # and first gradients are summed here.
        dense = [isinstance(t, tf.Tensor) for t in totals]
        given = [g is not None for g in output_grads + loss_grads]
        stamp = observer.stamp if observer is not None else None
        args = (run.inputs, list(run.params), list(run.state),
                [g for g in output_grads + loss_grads if g is not None],
                [t for t, d in zip(totals, dense) if d])
        function = self._traced_backward(args, len(output_grads), training,
                                         tuple(given), tuple(dense), stamp)
        with tf.control_dependencies(list(control_inputs)):
            grads, sums, stamps = function(*args)
        if stamp is not None:
            observer.put(name + "/recompute", stamps[0], stamps[1])
            observer.put(name, stamps[1], stamps[2])
        n = len(float_leaves(run.inputs))
        sums = iter(sums)
        new_totals = [next(sums) if d else add_gradients(t, g)
                      for t, g, d in zip(totals, grads[n:], dense)]
        return grads[:n], new_totals

    def _traced_backward(self, args, num_outputs, training, given, dense,
                         stamp):
        inputs, params, state, seeds, sums = args
        num_output_grads = sum(given[:num_outputs])  # the rest: losses
        exact = exact_spec
        specs = (keras.tree.map_structure(relaxed_spec, inputs),
                 [exact(p) for p in params], [exact(t) for t in state],
                 [relaxed_spec(g) for g in seeds[:num_output_grads]] +
                 [exact(g) for g in seeds[num_output_grads:]],
                 [exact(t) for t in sums])
        key = ("backward", bool(training), repr(specs), given, dense,
               stamp is not None)
        if key in self._functions:
            return self._functions[key]

        def run(inputs, params, state, seeds, sums):
            start = _stamp_or_none(stamp, seeds)
            with tf.GradientTape(watch_accessed_variables=False) as tape, \
                    tf.name_scope("recompute"):
                tape.watch(float_leaves(inputs) + list(params))
                outputs, _, losses = self.call_inline(inputs, params, state,
                                                      training)
            seeds = iter(seeds)
            grad_of = [next(seeds) if g else None for g in given]
            ys, grad_ys = pairs(keras.tree.flatten(outputs) + losses,
                                 grad_of)
            middle = _stamp_or_none(stamp, ys)
            grads = tape.gradient(
                ys, float_leaves(inputs) + list(params),
                output_gradients=grad_ys,
                unconnected_gradients=tf.UnconnectedGradients.NONE)
            n = len(float_leaves(inputs))
            sums = iter(sums)
            new_sums = [add_gradients(next(sums), g)
                        for g, d in zip(grads[n:], dense) if d]
            end = _stamp_or_none(stamp, [g for g in grads if g is not None])
            # Gradients summed inside are not returned on their own.
            rest = [None if d else g for g, d in zip(grads[n:], dense)]
            return grads[:n] + rest, new_sums, [start, middle, end]

        function = tf.function(
            run, autograph=False,
            experimental_attributes={"_noinline": True},
        ).get_concrete_function(*specs)
        self._functions[key] = function
        return function






def _open_batch(t):
    """`t` with its static batch size unknown (the same values)."""
    if not isinstance(t, tf.Tensor) or t.shape.rank in (None, 0) or (
            t.shape[0] is None):
        return t
    return tf.raw_ops.PlaceholderWithDefault(
        input=t, shape=tf.TensorShape([None]).concatenate(t.shape[1:]))


def _stamp_or_none(stamp, after):
    return None if stamp is None else stamp(after)



def _static_batch(inputs):
    """The batch size of `inputs` if known at trace time, else None."""
    for t in keras.tree.flatten(inputs):
        if t is not None and len(t.shape) and t.shape[0] is not None:
            return int(t.shape[0])
    return None


def _activity_regularized(layer):
    """How many of `layer`'s layers have an activity regularizer."""
    return sum(getattr(sub, "activity_regularizer", None) is not None
               for sub in _compat.flatten_layers(layer))
