"""PipelineModel: a Keras model whose stages run as a GPipe pipeline."""

import contextlib
import dataclasses

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_pipe import cluster
from keras_pipe import export as export_lib
from keras_pipe import losses as losses_lib
from keras_pipe import microbatch
from keras_pipe import placement
from keras_pipe import replicas as replicas_lib
from keras_pipe import saving
from keras_pipe import schedule as schedule_lib
from keras_pipe import validation
from keras_pipe import timeline as timeline_lib
from keras_pipe.remat import Stage, sum_gradients

__all__ = ["PipelineModel"]


# The executor is plain Python that builds a graph; it has no tensor-dependent
# control flow for AutoGraph to convert (and conversion costs build time).
_not_autograph = tf.autograph.experimental.do_not_convert


@contextlib.contextmanager
def _eager_scope():
    """Leaves Keras' symbolic/stateless scopes and any FuncGraph.

    Keras builds a model inside `backend.compute_output_spec`, where new
    variables are deferred and later created outside any `tf.device` scope.
    Stages must be built eagerly under their device instead.
    """
    names = ("stateless_scope", "symbolic_scope")
    saved = {n: global_state.get_global_attribute(n) for n in names}
    for n in names:
        global_state.set_global_attribute(n, None)
    try:
        with tf.init_scope():
            yield
    finally:
        for n, value in saved.items():
            global_state.set_global_attribute(n, value)


def _is_shape(value):
    return isinstance(value, (tuple, list)) and all(
        d is None or isinstance(d, int) for d in value)


def _to_spec(shapes):
    """Turns a nested structure of shapes into KerasTensors (float32)."""
    if _is_shape(shapes):
        return keras.KerasTensor(tuple(shapes))
    if isinstance(shapes, dict):
        return {k: _to_spec(v) for k, v in shapes.items()}
    if isinstance(shapes, (tuple, list)):
        return type(shapes)(_to_spec(v) for v in shapes)
    raise TypeError(f"Cannot read an input shape from {shapes!r}.")


def _describe(spec):
    return keras.tree.map_structure(
        lambda t: (tuple(t.shape), t.dtype) if hasattr(t, "shape") else t,
        spec)


def _known_input_spec(layer):
    """The input KerasTensors of a Functional/Sequential stage, else None."""
    try:
        inputs = layer.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    if isinstance(inputs, (list, tuple)) and len(inputs) == 1:
        return inputs[0]
    return inputs


def _validate(stages, devices, num_micro_batches, remat, schedule="gpipe"):
    """Checks the arguments; returns (stages, resolved devices)."""
    if isinstance(stages, keras.layers.Layer) or not isinstance(
            stages, (list, tuple)):
        raise TypeError(
            "stages must be a list of Keras layers or models, one per stage. "
            f"Received: stages={stages!r}")
    if not stages:
        raise ValueError("stages must not be empty: pass at least one Keras "
                         "layer or model. Received: stages=[]")
    for j, stage in enumerate(stages):
        if not isinstance(stage, keras.layers.Layer):
            raise TypeError(
                f"stages[{j}] must be a Keras layer or model. Received: "
                f"{stage!r} of type {type(stage).__name__}")
    for j, stage in enumerate(stages):
        for jj in range(j):
            if stages[jj] is stage:
                raise ValueError(
                    f"stages[{jj}] and stages[{j}] are the same layer "
                    f"{stage.name!r}: a stage can live on one device only. "
                    "Pass a distinct layer for each stage.")
    if isinstance(num_micro_batches, bool) or not isinstance(
            num_micro_batches, int):
        raise TypeError(
            "num_micro_batches must be an int. Received: "
            f"num_micro_batches={num_micro_batches!r}")
    if num_micro_batches < 1:
        raise ValueError(
            "num_micro_batches must be >= 1. Received: "
            f"num_micro_batches={num_micro_batches}")
    if schedule not in schedule_lib.SCHEDULES:
        raise ValueError(
            f"schedule must be one of {schedule_lib.SCHEDULES}. Received: "
            f"schedule={schedule!r}")
    validation.check_remat(remat, len(stages))
    if devices is None:
        resolved = placement.default_devices(len(stages))
    else:
        if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
            raise TypeError(
                "devices must be a list of device strings, one per stage. "
                f"Received: devices={devices!r}")
        if len(devices) != len(stages):
            raise ValueError(
                f"devices must name one device per stage: got "
                f"{len(devices)} devices for {len(stages)} stages. Received: "
                f"devices={list(devices)}")
        resolved = placement.resolve_devices(devices)
    _check_known_shapes(stages)
    return list(stages), resolved


def _check_known_shapes(stages):
    """Checks stage j against stage j - 1 where both are already built."""
    spec = _known_input_spec(stages[0])
    for j, stage in enumerate(stages):
        if spec is None or not stage.built:
            return
        try:
            out = stage.compute_output_spec(spec)
        except Exception as exc:  # Keras raises many types here.
            raise ValueError(_mismatch_message(stages, j, spec, exc)) from exc
        spec = out


def _mismatch_message(stages, j, spec, exc):
    source = (f"the output of stages[{j - 1}] ({stages[j - 1].name!r})"
              if j else "the model input")
    fix = (f"Make stage {j}'s input match stage {j - 1}'s output" if j
           else "Make stage 0 accept the model input")
    return (f"stages[{j}] ({stages[j].name!r}) cannot take {source}: "
            f"{_describe(spec)}. {fix}. Error: {exc}")


@dataclasses.dataclass
class _Step:
    """What one pipelined step has issued so far (see `PipelineModel`)."""

    micro_batches: list
    training: bool
    remat: list         # per stage: "always" | "except_last" | "never"
    differentiable: bool
    params: dict        # id(runner) -> trainable values
    state: list         # per stage: current state values
    changed: list       # per stage: which state variables were updated
    runs: list          # runs[i][j]: StageRun of micro-batch i on stage j
    previous: dict = dataclasses.field(default_factory=dict)
    output_grads: dict = dataclasses.field(default_factory=dict)
    loss_grads: dict = dataclasses.field(default_factory=dict)
    sums: dict = dataclasses.field(default_factory=dict)  # see _backward_op
    loss_parts: object = None  # 1F1B: a `_LossParts`, set at the first loss


@dataclasses.dataclass
class _LossParts:
    """What 1F1B needs to split the compiled loss over micro-batches."""

    rows: list          # per micro-batch: (targets, sample weights)
    total_rows: object  # rows of the batch
    sums: list          # `keras_pipe.losses.weight_sums` of the batch

    NONE = ()  # falsy: the loss does not split; use the zero-padded batch

    @classmethod
    def of(cls, model, compile_loss, step, y, sample_weight):
        if compile_loss is None or y is None or (
                type(model).compute_loss is not keras.Model.compute_loss):
            return cls.NONE
        parts = microbatch.scatter((y, sample_weight),
                                   len(step.micro_batches))
        try:
            sums = losses_lib.weight_sums(
                compile_loss, y, step.runs[0][-1].outputs, sample_weight)
        except losses_lib.NotSplittable:
            return cls.NONE
        return cls(rows=[p.inputs for p in parts],
                   total_rows=sum(mb.size for mb in step.micro_batches),
                   sums=sums)


def _is_float(t):
    return t is not None and t.dtype.is_floating


def _alone(outputs, sizes, i, micro_batch):
    """Micro-batch `i`'s outputs at their rows of a batch of zeros."""
    before, after = sum(sizes[:i]), sum(sizes[i + 1:])

    def place(t):
        rest = tf.shape(t)[1:]
        zeros = [tf.zeros(tf.concat([[n], rest], 0), t.dtype)
                 for n in (before, after)]
        return tf.concat([zeros[0], t, zeros[1]], 0)

    return keras.tree.map_structure(place, micro_batch.real_rows(outputs))


def _finish_mini_batch(stage):
    """Calls `finish_mini_batch()` on each layer of `stage` that has it.

    The hook runs once per training step, after the state of every
    micro-batch has been assigned: a layer that accumulates statistics over
    micro-batches (`keras_pipe.layers.DeferredBatchNormalization`) applies
    them here, once per mini-batch.
    """
    for layer in stage._flatten_layers():
        finish = getattr(layer, "finish_mini_batch", None)
        if callable(finish):
            finish()


def _shares(micro_batches, dtype):
    """Each micro-batch's share of the batch's rows (0 for a padding slot)."""
    sizes = [tf.cast(mb.size, dtype) for mb in micro_batches]
    total = tf.add_n(sizes) if len(sizes) > 1 else sizes[0]
    return [size / total for size in sizes]


def _layer_losses(runs, micro_batches, dtype):
    """The losses layers added (`add_loss`) during the pipelined forward pass.

    Keras divides an activity regularizer by the batch size, and most
    `add_loss` terms are batch means: the full-batch value is the mean of
    the micro-batch values weighted by micro-batch size.
    """
    shares = _shares(micro_batches, dtype)
    terms = [tf.cast(tf.reduce_sum(l), dtype) * shares[i]
             for i, row in enumerate(runs) for run in row for l in run.losses]
    return tf.add_n(terms) if terms else None


@keras.saving.register_keras_serializable(package="keras_pipe")
class PipelineModel(keras.Model):
    """A Keras model cut into stages that run as a GPipe pipeline.

    Each stage lives on its own device. A mini-batch is cut into
    `num_micro_batches` micro-batches that flow through the stages back to
    back, following `keras_pipe.schedule.gpipe`, inside one `tf.function`
    training step; gradients are summed over micro-batches and the
    optimizer steps once per mini-batch, so training is the same as
    training the unsplit model on one device. Stage insides are recomputed
    in the backward pass (`remat`) without re-running their state updates.

    ```python
    devices = keras_pipe.logical_cpu_devices(2)   # first thing, no GPUs
    model = keras_pipe.PipelineModel(
        stages=[keras.Sequential([keras.layers.Dense(64, "relu")]),
                keras.Sequential([keras.layers.Dense(10)])],
        devices=devices, num_micro_batches=4)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=3)
    ```

    Args:
        stages: list of Keras layers or models; stage `j` takes stage
            `j - 1`'s output (a tensor or a nested structure) as its input.
            Unbuilt stages are built under their device; stages built
            before have their variables moved there.
        devices: one TF device string per stage. Defaults to `None`: one
            GPU per stage, an error if there are not enough GPUs.
        num_micro_batches: `M`, micro-batches per mini-batch, >= 1. A batch
            of `B < M` rows runs as `B` micro-batches. Defaults to `1`.
        remat: which micro-batches recompute their stage activations in the
            backward pass instead of keeping them: `"always"`,
            `"except_last"` (all but the last micro-batch, whose backward
            follows at once) or `"never"`; or a list of these, one per
            stage. Defaults to `"except_last"`.
        schedule: `"gpipe"` (all forward passes, then all backward passes)
            or `"1f1b"` (PipeDream-flush: after filling the pipeline each
            stage alternates one forward and one backward pass, so it holds
            the activations of at most `K` micro-batches instead of `M`;
            needs a loss that is a sum over rows, as every Keras loss is).
            Both give the same gradients. Defaults to `"gpipe"`.
        **kwargs: `keras.Model` arguments (`name`, `dtype`, `trainable`).

    Raises:
        TypeError: if `stages` is not a list of Keras layers, a device is not
            a string, or `num_micro_batches` is not an int.
        ValueError: if `stages` is empty or holds one layer twice, the
            number of devices differs from the number of stages, a device
            does not exist, `num_micro_batches < 1`, `remat` or `schedule`
            is unknown, or a built stage cannot take the previous stage's
            output.
    """

    def __init__(self, stages, devices=None, num_micro_batches=1,
                 remat="except_last", schedule="gpipe", **kwargs):
        stages, resolved = _validate(stages, devices, num_micro_batches,
                                     remat, schedule)
        super().__init__(**kwargs)
        self._stage_layers = stages
        self._given_devices = list(devices) if devices is not None else list(
            resolved)
        self._resolved_devices = resolved
        self._num_micro_batches = num_micro_batches
        self._remat = list(remat) if isinstance(remat, (list, tuple)) \
            else remat
        self._schedule = schedule
        self._runners = [Stage(s, d) for s, d in zip(stages, resolved)]
        self._replicas = [self._runners]
        for stage, device in zip(stages, resolved):
            if stage.built:
                placement.place_variables(stage, device)
        if all(stage.built for stage in stages) and _known_input_spec(
                stages[0]) is not None:
            self.built = True

    @classmethod
    def from_model(cls, model, num_stages, devices=None, num_micro_batches=1,
                   remat="except_last", balance="params", **kwargs):
        """Cuts a built Sequential or Functional model into a pipeline.

        The stages reuse `model`'s layers (weights shared, not copied); see
        `keras_pipe.partition` for how cuts carry skip connections, several
        inputs and outputs, and tied layers. `keras_pipe.plan` shows the cut
        without building the pipeline.

        ```python
        model = keras.applications.ResNet50(weights=None)
        pipe = keras_pipe.PipelineModel.from_model(
            model, num_stages=4, devices=devices, num_micro_batches=16,
            balance="time")
        ```

        Args:
            model: a built `keras.Sequential` or Functional `keras.Model`.
            num_stages: number of stages.
            devices: one device per stage, as in `PipelineModel`. Defaults
                to `None`.
            num_micro_batches: `M`. Defaults to `1`.
            remat: as in `PipelineModel`. Defaults to `"except_last"`.
            balance: `"params"`, `"flops"`, `"time"`, `"memory"` or a list
                of layer-call counts per stage. Defaults to `"params"`.
            **kwargs: `keras.Model` arguments (`name`, ...).

        Returns:
            A `PipelineModel`.

        Raises:
            TypeError, ValueError: see `keras_pipe.partition.split_model`
                and `PipelineModel`.
        """
        # Imported here: the core does not depend on partitioning.
        from keras_pipe import partition  # noqa: PLC0415
        stages = partition.split_model(
            model, num_stages, balance=balance, devices=devices,
            num_micro_batches=num_micro_batches, remat=remat)
        return cls(stages, devices=devices,
                   num_micro_batches=num_micro_batches, remat=remat, **kwargs)

    @property
    def stages(self):
        """The stage layers, in order."""
        return list(self._stage_layers)

    @property
    def devices(self):
        """The device strings as given (or the GPUs chosen by default)."""
        return list(self._given_devices)

    @property
    def num_micro_batches(self):
        return self._num_micro_batches

    @property
    def remat(self):
        return self._remat

    @property
    def num_stages(self):
        return len(self._stage_layers)

    @property
    def schedule(self):
        """The schedule's name: `"gpipe"` or `"1f1b"`."""
        return self._schedule

    def clock_ticks(self, num_micro_batches=None):
        """The clock ticks this model follows (see `keras_pipe.schedule`)."""
        build = (schedule_lib.one_f_one_b if self._schedule == "1f1b"
                 else schedule_lib.gpipe)
        return build(num_micro_batches or self.num_micro_batches,
                     self.num_stages)

    def summary_table(self):
        """A text table: stage, device, layer name, parameter count."""
        rows = [("stage", "device", "layer", "params")]
        for j, (stage, device) in enumerate(
                zip(self._stage_layers, self._resolved_devices)):
            count = sum(int(v.numpy().size) for v in stage.weights)
            rows.append((str(j), device, stage.name, f"{count:,}"))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths))
                         for r in rows)

    # ----------------------------------------------------------------- saving
    # The logic lives in keras_pipe/saving.py and keras_pipe/export.py.

    @property
    def layers(self):
        """The unpipelined model's layers, stage after stage.

        Nested Sequential/Functional stages are opened up, so that weights
        files have the plain model's layout whatever the cut.
        """
        return saving.flat_layers(self._stage_layers)

    @property
    def _seed_states(self):
        # Walked by Keras saving: seed generator states (Dropout masks).
        return saving.SeedStates(self.layers)

    def get_config(self):
        return saving.get_config(self, super().get_config())

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return saving.from_config(cls, config, custom_objects)

    def compile_from_config(self, config):
        saving.compile_from_config(self, config)

    def load_own_variables(self, store):
        saving.check_store(self, store)
        super().load_own_variables(store)

    def save(self, filepath, overwrite=True, **kwargs):
        """Same as `keras.Model.save`, atomic: a crash keeps the old file."""
        return saving.save_model(super().save, filepath, overwrite, **kwargs)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Same as `keras.Model.save_weights`, atomic like `save`."""
        return saving.save_weights(super().save_weights, filepath, overwrite,
                                   max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Same as `keras.Model.load_weights`, checked and all or nothing."""
        saving.load_weights(
            self, filepath, skip_mismatch=skip_mismatch,
            load=lambda: super(PipelineModel, self).load_weights(
                filepath, skip_mismatch=skip_mismatch, **kwargs))

    def to_model(self, name=None):
        """The unpipelined Functional model, sharing this model's layers."""
        return export_lib.to_model(self, name=name)

    def export(self, filepath, format="tf_saved_model", verbose=None,
               input_signature=None, pipelined=False, **kwargs):
        """Exports the model for serving; see `keras_pipe.export.export`."""
        return export_lib.export(self, filepath, format=format,
                                 verbose=verbose,
                                 input_signature=input_signature,
                                 pipelined=pipelined, **kwargs)

    # ------------------------------------------------------------------ build

    def build(self, input_shape):
        """Builds every stage under its device, from float32 input shapes.

        `fit`, `evaluate` and `predict` build from the first batch instead,
        with its real dtypes.
        """
        self._build_from_spec(_to_spec(input_shape))

    def _build_from_spec(self, spec):
        first = _known_input_spec(self._stage_layers[0])
        if first is not None:
            spec = first
        with _eager_scope():
            for j, (stage, device) in enumerate(
                    zip(self._stage_layers, self._resolved_devices)):
                with tf.device(device):
                    try:
                        out = stage.compute_output_spec(spec) if stage.built \
                            else stage(spec)
                    except Exception as exc:
                        raise ValueError(_mismatch_message(
                            self._stage_layers, j, spec, exc)) from exc
                placement.place_variables(stage, device)
                spec = out
        self.built = True
        self._build_optimizer()

    def _build_optimizer(self):
        """Creates the optimizer's slots now, each on its variable's device.

        Left to the first training step, slot creation inside the traced
        step makes TensorFlow trace the whole step a second time.
        """
        optimizer = getattr(self, "optimizer", None)
        if self.built and optimizer is not None and not optimizer.built:
            with _eager_scope():
                optimizer.build(self.trainable_variables)

    def _ensure_built(self, x):
        """Builds from a batch (Keras' TF trainer builds on first trace)."""
        if not self.built:
            self._build_from_spec(keras.tree.map_structure(
                lambda t: keras.KerasTensor((None,) + tuple(t.shape[1:]),
                                            dtype=t.dtype.name), x))

    def compute_output_spec(self, inputs, training=False):
        spec = inputs
        for stage in self._stage_layers:
            spec = stage.compute_output_spec(spec)
        return spec

    # --------------------------------------------------------------- compile

    def compile(self, *args, jit_compile="auto", run_eagerly=False,
                **kwargs):
        """Same as `keras.Model.compile`, with XLA off and a colocated optimizer.

        Raises:
            ValueError: if `jit_compile=True` (XLA cannot compile a function
                whose variables live on several devices) or
                `run_eagerly=True` (the per-device backward pass needs
                graph mode).
        """
        if jit_compile is True:
            raise ValueError(
                "jit_compile=True is not supported by PipelineModel: XLA "
                "compiles one function for one device, and a pipeline's "
                "variables live on several devices. Use jit_compile=False "
                "or 'auto' (which PipelineModel resolves to False).")
        if run_eagerly:
            raise ValueError(
                "run_eagerly=True is not supported by PipelineModel: its "
                "per-device backward pass uses tf.gradients, which needs "
                "graph mode. Use run_eagerly=False.")
        super().compile(*args, jit_compile=False, run_eagerly=False, **kwargs)
        if self.optimizer is not None:
            placement.colocate_optimizer(self.optimizer)
            self._build_optimizer()

    # --------------------------------------------------------------- execute

    # The executor. A step is a list of stage calls, each issued by
    # `_forward_op` or `_backward_op` in the order of the schedule, and
    # chained on each stage runner so that it runs them in that order.

    def _start(self, inputs, training, remat, differentiable):
        """Splits the batch and reads weights and state once per step."""
        micro_batches = microbatch.scatter(
            inputs, self.num_micro_batches * self.num_replicas)
        m = len(micro_batches)
        state = [r.read_state() for r in self._runners]
        return _Step(
            micro_batches=micro_batches, training=training,
            remat=validation.check_remat(remat, self.num_stages),
            differentiable=differentiable,
            params={id(r): r.read_params(differentiable)
                    for replica in self._replicas for r in replica},
            state=state, changed=[[False] * len(s) for s in state],
            runs=[[None] * self.num_stages for _ in range(m)])

    def _forward_op(self, step, i, j):
        """Issues the forward pass of micro-batch `i` on stage `j`."""
        m = len(step.micro_batches)
        runner = self._runner(i, j, m)
        x = step.micro_batches[i].inputs if j == 0 else \
            step.runs[i][j - 1].outputs
        remat = step.remat[j] == "always" or (
            step.remat[j] == "except_last" and i < m - 1)
        run, new_state = runner.forward(
            x, step.params[id(runner)], step.state[j], step.training, remat,
            step.previous.get(id(runner), []), step.differentiable,
            name=f"stage{j}/mb{i}/forward")
        step.previous[id(runner)] = keras.tree.flatten(run.outputs)[:1]
        valid = step.micro_batches[i].valid
        for s, new in enumerate(new_state):
            if new is None:
                continue
            if valid is not True:
                with tf.device(runner.device):
                    new = tf.where(valid, new, step.state[j][s])
            step.state[j][s] = new
            step.changed[j][s] = True
        step.runs[i][j] = run

    def _finish_forward(self, step):
        """Assigns the final state; returns the merged last-stage outputs."""
        for runner, values, flags in zip(self._runners, step.state,
                                         step.changed):
            with tf.device(runner.device):
                for variable, value, flag in zip(runner.state_variables,
                                                 values, flags):
                    if flag:
                        variable.assign(value)
                if step.training:
                    _finish_mini_batch(runner.layer)
        with tf.device(self._runners[-1].device):
            return microbatch.gather([run[-1].outputs for run in step.runs],
                                     step.micro_batches)

    def _backward_op(self, step, i, j):
        """Issues the backward pass of micro-batch `i` on stage `j`."""
        m = len(step.micro_batches)
        runner, run = self._runner(i, j, m), step.runs[i][j]
        # Running sums of weight gradients, per stage runner (replicas
        # add theirs at the end): one buffer per variable, not one per
        # micro-batch.
        sums = step.sums.setdefault(id(runner), {})
        variables = runner.trainable_variables
        input_grads, totals = runner.backward(
            run, step.output_grads.pop((i, j)),
            [step.loss_grads[id(l)] for l in run.losses], training=True,
            totals=[sums.get(id(v)) for v in variables],
            name=f"stage{j}/mb{i}/backward",
            control_inputs=step.previous.get(id(runner), []))
        step.previous[id(runner)] = [
            g for g in input_grads + totals if g is not None][:1]
        if j:
            step.output_grads[(i, j - 1)] = input_grads
        for variable, total in zip(variables, totals):
            if total is not None:
                sums[id(variable)] = total

    def _seed(self, step, loss, micro_batch_indices):
        """Gradients of `loss` for the given micro-batches' stage outputs.

        Only the loss head is differentiated here; each stage's backward
        runs in `Stage.backward` on its device.
        """
        k = self.num_stages
        outputs = [keras.tree.flatten(step.runs[i][-1].outputs)
                   for i in micro_batch_indices]
        targets = [t for flat in outputs for t in flat if _is_float(t)]
        with tf.device(self._runners[-1].device):
            grads = iter(tf.gradients(loss, targets,
                                      unconnected_gradients="none"))
        for i, flat in zip(micro_batch_indices, outputs):
            step.output_grads[(i, k - 1)] = [
                next(grads) if _is_float(t) else None for t in flat]

    def _seed_layer_losses(self, step, scale, micro_batch_indices):
        """Gradients of the total loss for the stages' `add_loss` terms.

        Each term enters the loss weighted by its micro-batch's share of
        the batch (see `_layer_losses`).
        """
        shares = _shares(step.micro_batches, tf.float32)
        for i in micro_batch_indices:
            for run in step.runs[i]:
                for l in run.losses:
                    step.loss_grads[id(l)] = scale(
                        tf.ones_like(l) * tf.cast(shares[i], l.dtype))

    def _collect_gradients(self, step, scale):
        """Sums each variable's gradients; adds weight regularization.

        Regularization losses of weights (`self.losses`) reach the
        variables directly and are differentiated on their own: asking
        `tf.gradients` for the variables of the total loss would walk the
        whole forward graph again.
        """
        variables = self.trainable_variables
        parts = {id(v): [sums[id(v)] for sums in step.sums.values()
                         if id(v) in sums] for v in variables}
        weight_losses = [self._aggregate_additional_loss(l)
                         for l in self.losses]
        if weight_losses:
            direct = tf.gradients(scale(tf.add_n(weight_losses)), variables,
                                  unconnected_gradients="none")
            for variable, g in zip(variables, direct):
                if g is not None:
                    parts[id(variable)].append(g)
        gradients = []
        for variable in variables:
            if not parts[id(variable)]:
                gradients.append(None)
                continue
            with tf.device(placement.device_of(variable)):
                gradients.append(sum_gradients(parts[id(variable)]))
        return gradients

    def _forward(self, inputs, training, remat, differentiable):
        """Runs all micro-batches through all stages (GPipe forward).

        Returns:
            `(outputs, step)`: the merged outputs of the last stage and the
            step, whose `runs[i][j]` is the `StageRun` of micro-batch `i`
            on stage `j`.
        """
        step = self._start(inputs, training, remat, differentiable)
        for tick in schedule_lib.gpipe(len(step.micro_batches),
                                       self.num_stages):
            for i, j in tick:
                self._forward_op(step, i, j)
        return self._finish_forward(step), step

    @_not_autograph
    def call(self, inputs, training=False):
        outputs, _ = self._forward(inputs, bool(training), remat="never",
                                   differentiable=True)
        return outputs

    @_not_autograph
    def compute_loss_and_gradients(self, x, y=None, sample_weight=None,
                                   training=True):
        """One forward and backward pass, without an optimizer step.

        Runs in graph mode (inside a `tf.function`), as `train_step` does,
        with the model's `schedule`.

        Returns:
            `(loss, y_pred, gradients)`, gradients in the order of
            `self.trainable_variables`.
        """
        scale = (self.optimizer.scale_loss if self.optimizer is not None
                 else (lambda value: value))
        if self.schedule == "1f1b":
            step = self._one_f_one_b(x, y, sample_weight, training, scale)
            y_pred = self._finish_forward(step)
        else:
            y_pred, step = self._forward(x, training, remat=self.remat,
                                         differentiable=False)
        with tf.device(self._runners[-1].device):
            loss = self._compute_loss(x=x, y=y, y_pred=y_pred,
                                      sample_weight=sample_weight,
                                      training=training)
            extra = _layer_losses(step.runs, step.micro_batches, loss.dtype)
            if extra is not None:
                loss = loss + extra
        if self.schedule == "gpipe":
            m = len(step.micro_batches)
            self._seed(step, scale(loss), range(m))
            self._seed_layer_losses(step, scale, range(m))
            for tick in reversed(schedule_lib.gpipe(m, self.num_stages)):
                for i, j in reversed(tick):
                    self._backward_op(step, i, j)
        return loss, y_pred, self._collect_gradients(step, scale)

    def _one_f_one_b(self, x, y, sample_weight, training, scale):
        """Forward and backward passes interleaved as `schedule.one_f_one_b`.

        The backward pass of micro-batch `i` starts before the forward pass
        of later micro-batches, so it needs the gradient of the full-batch
        loss for micro-batch `i`'s outputs alone (`_micro_batch_loss`). For
        a loss that is a sum over rows with a divisor that depends on shapes
        or sample weights only (every Keras loss and reduction), that
        gradient is exactly the full-batch one.
        """
        step = self._start(x, training, self.remat, differentiable=False)
        m, k = len(step.micro_batches), self.num_stages
        self._build_compile_loss(x, y)
        for tick in schedule_lib.one_f_one_b(m, k):
            for kind, i, j in tick:
                if kind == "B":
                    self._backward_op(step, i, j)
                    continue
                self._forward_op(step, i, j)
                if j < k - 1:
                    continue
                # The loss head joins the last stage's chain of calls.
                last = self._runner(i, j, m)
                with tf.device(last.device), tf.control_dependencies(
                        step.previous.get(id(last), [])):
                    loss_i = self._micro_batch_loss(step, i, x, y,
                                                    sample_weight, training)
                self._seed(step, scale(loss_i), [i])
                self._seed_layer_losses(step, scale, [i])
                step.previous[id(last)] = [
                    g for g in step.output_grads[(i, k - 1)]
                    if g is not None][:1]
        return step

    def _micro_batch_loss(self, step, i, x, y, sample_weight, training):
        """A loss whose gradient for micro-batch `i`'s outputs is exact.

        Where the compiled loss splits over rows (`keras_pipe.losses`), it
        is micro-batch `i`'s part of the full-batch loss, computed on its
        own rows. Otherwise (a `compute_loss` override, a loss with its own
        `__call__`) it is the full-batch loss with every other micro-batch's
        outputs replaced by zeros, which costs a full-batch loss head per
        micro-batch. Neither updates loss metrics.
        """
        micro_batch = step.micro_batches[i]
        outputs = step.runs[i][-1].outputs
        compile_loss = getattr(self, "_compile_loss", None)
        if step.loss_parts is None:
            step.loss_parts = _LossParts.of(self, compile_loss, step, y,
                                            sample_weight)
        if step.loss_parts:
            parts = step.loss_parts
            y_pred, y_i, w_i = micro_batch.real_rows(
                (outputs,) + tuple(parts.rows[i]))
            try:
                return losses_lib.share(compile_loss, y_i, y_pred, w_i,
                                        parts.total_rows, parts.sums)
            except losses_lib.NotSplittable:
                step.loss_parts = _LossParts.NONE
        rows = [mb.size for mb in step.micro_batches]
        alone = _alone(outputs, rows, i, micro_batch)
        with keras.StatelessScope():
            return self._compute_loss(x=x, y=y, y_pred=alone,
                                      sample_weight=sample_weight,
                                      training=training)

    def _build_compile_loss(self, x, y):
        """Builds the compiled loss (its metrics) outside stateless scopes."""
        compile_loss = getattr(self, "_compile_loss", None)
        if compile_loss is not None and not compile_loss.built:
            spec = self.compute_output_spec(keras.tree.map_structure(
                lambda t: keras.KerasTensor(t.shape, t.dtype.name), x))
            with _eager_scope():
                compile_loss.build(y, spec)

    @_not_autograph
    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        self._ensure_built(x)
        buffer = getattr(self, "_timeline_buffer", None)
        recorder = None
        if buffer is not None:  # keras_pipe.timeline.Timeline is recording
            recorder = timeline_lib.Recorder(buffer.shape[1], buffer.shape[2])
        for runner in self._runners:
            runner.recorder = recorder
        try:
            loss, y_pred, gradients = self.compute_loss_and_gradients(
                x, y, sample_weight)
        finally:
            for runner in self._runners:
                runner.recorder = None
        if recorder is not None:
            buffer.assign(recorder.stacked())
        batch_size = tf.shape(
            next(t for t in keras.tree.flatten(x) if t is not None))[0]
        self._loss_tracker.update_state(loss, sample_weight=batch_size)
        variables = self.trainable_variables
        if variables:
            self.optimizer.apply_gradients(zip(gradients, variables))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @_not_autograph
    def test_step(self, data):
        self._ensure_built(data_adapter_utils.unpack_x_y_sample_weight(data)[0])
        return super().test_step(data)

    @_not_autograph
    def predict_step(self, data):
        self._ensure_built(data_adapter_utils.unpack_x_y_sample_weight(data)[0])
        return super().predict_step(data)

    # ------------------------------------------------- data parallel replicas

    @property
    def num_replicas(self):
        return len(self._replicas)

    def replicate(self, devices):
        """Runs R copies of the pipeline on `R * K` devices, data parallel.

        Replica `r` runs stage `j` on `devices[r * K + j]` on its shard of
        each global batch (`M` micro-batches of `R * M`); gradients are
        summed over replicas on each variable's device before the one
        optimizer step (see `keras_pipe.replicas`). The first `K` devices
        must be the model's own. `replicate(model.devices)` undoes it.

        ```python
        model = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                         num_micro_batches=4)
        model.replicate(devices[:4])    # 2 replicas x 2 stages
        ```

        Raises:
            TypeError, ValueError: see `keras_pipe.replicas.make_runners`.
        """
        self._replicas = replicas_lib.make_runners(self, devices)
        self.train_function = self.test_function = None
        self.predict_function = None

    def _runner(self, i, j, m):
        """The runner of micro-batch `i` (of `m`) on stage `j`."""
        replica = replicas_lib.replica_of(i, m, self.num_replicas)
        return self._replicas[replica][j]

    # A worker lost mid-call ends it with an error naming the task
    # (`keras_pipe.cluster.run`); a plain call when every stage is local.

    def fit(self, *args, **kwargs):
        return cluster.run(self._resolved_devices, "fit", super().fit, *args,
                           **kwargs)

    def evaluate(self, *args, **kwargs):
        return cluster.run(self._resolved_devices, "evaluate", super().evaluate, *args,
                           **kwargs)

    def predict(self, *args, **kwargs):
        return cluster.run(self._resolved_devices, "predict", super().predict, *args,
                           **kwargs)
