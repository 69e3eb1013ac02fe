"""State-safe re-materialization of a stage.

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

The backward pass of a stage is taken from a `tf.GradientTape` of that one
stage call, under the stage's `tf.device`, so gradient and recompute ops run
on the stage's device (a tape over the whole step would put them all on one
device). The
recompute waits for the incoming gradient (a control dependency), so it runs
in the backward pass and not eagerly next to the forward pass.
"""

import contextlib
import dataclasses

import keras
import tensorflow as tf

__all__ = ["REMAT_MODES", "Stage", "StageRun"]

REMAT_MODES = ("always", "except_last", "never")


def _is_float(t):
    return t is not None and t.dtype.is_floating


def _float_leaves(structure):
    return [t for t in keras.tree.flatten(structure) if _is_float(t)]


@dataclasses.dataclass
class StageRun:
    """What the forward pass of one (micro-batch, stage) left for backward."""

    inputs: object      # nested structure, gradient-stopped
    params: list        # trainable values, gradient-stopped
    state: list         # state values the forward pass started from
    outputs: object     # nested structure
    losses: list        # scalar losses added by the stage's layers
    remat: bool
    tape: object = None  # records the forward call when remat is off


class Stage:
    """A Keras layer run as a pure function on a fixed device."""

    def __init__(self, layer, device):
        self.layer = layer
        self.device = device
        self._functions = {}
        # A `keras_pipe.timeline.Recorder` while a step is traced for the
        # Timeline callback, else None.
        self.recorder = None

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
        signature = (
            keras.tree.map_structure(
                lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]),
                                        t.dtype), inputs),
            [tf.TensorSpec.from_tensor(p) for p in params],
            [tf.TensorSpec.from_tensor(s) for s in state])
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
        """`call` without the traced function: the layer's ops, in place."""
        mapping = list(zip(self.trainable_variables, params))
        mapping += list(zip(self.state_variables, state))
        with keras.StatelessScope(state_mapping=mapping,
                                  collect_losses=True) as scope:
            before = [scope.get_current_value(v) for v in self.state_variables]
            outputs = self.layer(inputs, training=training)
        new_state = [None if new is old else new for new, old in zip(
            (scope.get_current_value(v) for v in self.state_variables), before)]
        return outputs, new_state, list(scope.losses)

    def forward(self, inputs, params, state, training, remat,
                control_inputs=(), differentiable=False, name="forward"):
        """Forward pass of one micro-batch; returns (StageRun, new_state).

        `control_inputs` make this micro-batch wait for the previous one on
        the same stage. With `differentiable=False`, gradients do not flow
        through `inputs`: `backward` computes them stage by stage, from a
        tape that records this call alone (`remat=False`) or the recompute.
        """
        tape = None
        with tf.device(self.device), tf.name_scope(name):
            if not differentiable:
                inputs = keras.tree.map_structure(
                    lambda t: None if t is None else tf.stop_gradient(t),
                    inputs)
            state = [tf.stop_gradient(s) for s in state]
            control_inputs = list(control_inputs)
            if self.recorder is not None:
                control_inputs = [self.recorder.start(
                    name, keras.tree.flatten(inputs) + control_inputs)]
            with tf.control_dependencies(control_inputs):
                inputs = keras.tree.map_structure(
                    lambda t: None if t is None else tf.identity(t), inputs)
            if not differentiable and not remat:
                tape = tf.GradientTape(watch_accessed_variables=False)
            with tape or contextlib.nullcontext():
                if tape is not None:
                    tape.watch(_float_leaves(inputs) + list(params))
                outputs, new_state, losses = self.call(
                    inputs, params, state, training)
                outputs = keras.tree.map_structure(
                    lambda t: None if t is None else tf.identity(t), outputs)
                losses = [tf.identity(l) for l in losses]
            if self.recorder is not None:
                self.recorder.end(name, keras.tree.flatten(outputs) + losses)
        run = StageRun(inputs, params, state, outputs, losses, remat, tape)
        return run, new_state

    def backward(self, run, output_grads, loss_grads, training,
                 name="backward", control_inputs=()):
        """Backward pass of one micro-batch, on the stage's device.

        Gradients come from a `tf.GradientTape` of this one stage call,
        taken under the stage's `tf.device`, so the gradient ops run there.
        (A tape over the whole pipeline would put them all on one device,
        and `tf.gradients` would search the whole graph for every call.)

        Args:
            run: the `StageRun` of the forward pass.
            output_grads: gradients for `tree.flatten(run.outputs)`, `None`
                where an output does not reach the loss.
            loss_grads: gradients for `run.losses`.
            training: the `training` flag of the forward pass.
            name: the name scope.
            control_inputs: tensors to wait for: the previous backward pass
                on this stage, so that micro-batches run (and hold their
                recomputed activations) one at a time.

        Returns:
            `(input_grads, param_grads)`: gradients for
            `tree.flatten(run.inputs)` (None for non-float inputs) and for
            each trainable variable (None where it gets none).
        """
        with tf.device(self.device), tf.name_scope(name):
            inputs, params = run.inputs, run.params
            outputs, losses, tape = run.outputs, run.losses, run.tape
            flat_inputs = keras.tree.flatten(inputs)
            seeds = [g for g in output_grads + loss_grads if g is not None]
            if not seeds:
                return [None] * len(flat_inputs), [None] * len(params)
            seeds += list(control_inputs)
            recorder = self.recorder
            if run.remat:
                if recorder is not None:
                    seeds = [recorder.start(name + "/recompute", seeds)]
                with tf.control_dependencies(seeds), tf.name_scope("recompute"):
                    inputs = keras.tree.map_structure(
                        lambda t: None if t is None else tf.identity(t),
                        inputs)
                    flat_inputs = keras.tree.flatten(inputs)
                    with tf.GradientTape(
                            watch_accessed_variables=False) as tape:
                        tape.watch(_float_leaves(inputs) + list(params))
                        outputs, _, losses = self.call(
                            inputs, params, run.state, training)
                if recorder is not None:
                    recorder.end(name + "/recompute",
                                 keras.tree.flatten(outputs) + losses)
            ys, grad_ys = [], []
            for y, g in zip(keras.tree.flatten(outputs) + losses,
                            output_grads + loss_grads):
                if g is not None and _is_float(y):
                    ys.append(y)
                    grad_ys.append(g)
            float_inputs = _float_leaves(inputs)
            after = list(control_inputs)
            if recorder is not None:
                after = [recorder.start(name, grad_ys + ys + after)]
            with tf.control_dependencies(after):
                grads = tape.gradient(
                    ys, float_inputs + list(params), output_gradients=grad_ys,
                    unconnected_gradients=tf.UnconnectedGradients.NONE)
            if recorder is not None:
                recorder.end(name, [g for g in grads if g is not None])
            input_grads = iter(grads[:len(float_inputs)])
            return ([next(input_grads) if _is_float(t) else None
                     for t in flat_inputs], grads[len(float_inputs):])
