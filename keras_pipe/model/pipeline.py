"""PipelineModel: a Keras model whose stages run as a GPipe pipeline."""

import keras
import tensorflow as tf

from keras_pipe import _validation, reporting
from keras_pipe.engine import building, in_place, placement, release
from keras_pipe.engine import executor as executor_lib
from keras_pipe.engine import losses as losses_lib
from keras_pipe.engine.schedule import schedule_names
from keras_pipe.engine.stage import Stage
from keras_pipe.model import first_batch, sampling
from keras_pipe.model.building import BuiltFirst
from keras_pipe.model.calls import Calls
from keras_pipe.model.inference import InferenceMethods
from keras_pipe.model.replication import Replication
from keras_pipe.planning import choices, planner
from keras_pipe.saving import files as saving
from keras_pipe.saving import model_io

__all__ = ["PipelineModel"]


# The executor is plain Python that builds a graph; it has no tensor-dependent
# control flow for AutoGraph to convert (and conversion costs build time).
_not_autograph = tf.autograph.experimental.do_not_convert


@keras.saving.register_keras_serializable(package="keras_pipe")
class PipelineModel(first_batch.FirstBatchChoices, model_io.SavingMethods,
                    BuiltFirst, Calls, InferenceMethods, Replication,
                    keras.Model):
    """A Keras model cut into stages that run as a GPipe pipeline.

    Each stage lives on its own device. A mini-batch is cut into
    `num_micro_batches` micro-batches that flow through the stages under a
    schedule inside one `tf.function` training step; gradients are summed
    over micro-batches and the optimizer steps once per mini-batch: the
    unsplit model's training for every layer without batch coupling
    (BatchNormalization normalizes each micro-batch with its own
    statistics, as in GPipe; `keras_pipe.layers.DeferredBatchNormalization`
    updates the moving ones once per mini-batch). Stage insides are
    recomputed in the backward pass (`remat`) without re-running their
    state updates.

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
            of `B < M` rows runs as `B` micro-batches. Defaults to `None`:
            two per stage, no more than the rows of the first batch the
            pipeline sees (`keras_pipe.planning.choices`).
        remat: which micro-batches recompute their stage activations in the
            backward pass instead of keeping them: `"always"`,
            `"except_last"` (all but the last micro-batch, whose backward
            follows at once) or `"never"`; or a list of these, one per
            stage. Defaults to `"except_last"`.
        schedule: the name of a registered schedule
            (`keras_pipe.schedule.schedule_names()`: `"gpipe"`, `"1f1b"`,
            the zero-bubble `"zb_h1"` / `"zb_h2"`, `"interleaved_1f1b"` /
            `"zbv"` with several stages per device, or your own). Every
            schedule gives the same gradients; all but GPipe need a loss
            that is a sum over rows, as every Keras loss is. Defaults to
            `None`: the fastest exact schedule the devices' order allows
            (`"zb_h2"` for one stage per device).
        **kwargs: `keras.Model` arguments (`name`, `dtype`, `trainable`).

    Raises:
        TypeError: if `stages` is not a list of Keras layers, a device is not
            a string, or `num_micro_batches` is not an int.
        ValueError: if `stages` is empty or holds one layer twice, the
            number of devices differs from the number of stages, a device
            does not exist, `num_micro_batches < 1`, `remat` or `schedule`
            is unknown (`"auto"` names `from_model(..., schedule="auto")`),
            or a built stage cannot take the previous stage's output.
    """

    def __init__(self, stages, devices=None, num_micro_batches=None,
                 remat="except_last", schedule=None, **kwargs):
        if isinstance(stages, first_batch.Deferred):  # see `from_model`
            super().__init__(**kwargs)
            self._deferred = stages
            return
        if isinstance(schedule, str) and schedule == "auto":
            raise ValueError(
                'PipelineModel(stages, schedule="auto") cannot choose: the '
                "stages are already cut and placed, and the choice is the "
                "cut, the stages per device and num_micro_batches with the "
                "schedule. Pass the built model to PipelineModel.from_model("
                'model, devices=..., batch_size=..., schedule="auto"), or '
                "name a schedule here "
                f"({', '.join(schedule_names())}). Received: "
                "schedule='auto'")
        stages, resolved, schedule = building.check_stages(
            stages, devices, num_micro_batches, remat, schedule,
            choices.default_schedule)
        super().__init__(**kwargs)
        self._set_stages(stages, devices, num_micro_batches, remat, schedule,
                         resolved)

    def _set_stages(self, stages, devices, num_micro_batches, remat,
                    schedule, resolved=None):
        """Sets the stages and their runners, and places built stages."""
        if resolved is None:
            stages, resolved, schedule = building.check_stages(
                stages, devices, num_micro_batches, remat, schedule,
                choices.default_schedule)
        self._stage_layers = stages
        self._given_devices = list(devices) if devices is not None else list(
            resolved)
        self._resolved_devices = resolved
        self._num_micro_batches = num_micro_batches
        self._remat = list(remat) if isinstance(remat, (list, tuple)) \
            else remat
        self._remat_modes = _validation.check_remat(remat, len(stages))
        self._schedule = schedule
        self._runners = [Stage(s, d, position=(j, len(stages)))
                         for j, (s, d) in enumerate(zip(stages, resolved))]
        self._executor = executor_lib.Executor(
            [self._runners], schedule, building.device_indices(resolved))
        self._step_observer = None  # see `observe_steps`
        for stage, device in zip(stages, resolved):
            if stage.built:
                placement.place_variables(stage, device)
        if all(stage.built for stage in stages) and building.known_input_spec(
                stages[0]) is not None:
            self.built = True

    @classmethod
    def from_model(cls, model, num_stages=None, devices=None,
                   num_micro_batches=None, remat=None, balance=None,
                   memory_budget=None, batch_size=None, input_shape=None,
                   sample_inputs=None, loss=None, **kwargs):
        """Cuts a built Sequential or Functional model into a pipeline.

        The stages reuse `model`'s layers (weights shared, not copied); see
        `keras_pipe.planning.partition` for how cuts carry skip connections,
        several inputs and outputs, and tied layers. `keras_pipe.plan` shows
        the cut without building the pipeline, and chooses as this does.

        With only the model and the devices, the pipeline chooses: the
        schedule, the stages per device, `M`, the cut and each stage's
        remat are planned together (`schedule="auto"`) for the batch size
        of the first `fit`, `evaluate` or `predict` call (or `batch_size`),
        from costs measured on worker processes and GPUs (cached; the first
        plan of a model adds its measurement, `docs/planner.md`) and from
        FLOPs on logical CPU devices. Any choice given is kept, and those
        left `None` take fixed defaults (`keras_pipe.planning.choices`).

        ```python
        pipe = keras_pipe.PipelineModel.from_model(model, devices=devices)
        pipe.compile("adam", "mse")
        pipe.fit(x, y, batch_size=256)      # planned for 256 rows
        print(pipe.plan)                    # what was chosen, and why
        ```

        Args:
            model: a built `keras.Sequential` or Functional `keras.Model`.
            num_stages: number of stages. Defaults to `None`: one per
                device (chosen with the others when nothing else is given).
            devices: one device per stage, as in `PipelineModel`. Defaults
                to `None`.
            num_micro_batches: `M`. Defaults to `None`: chosen.
            remat: as in `PipelineModel`. Defaults to `None`: chosen with
                the others, else `"except_last"`.
            balance: `"params"`, `"flops"`, `"time"`, `"memory"` or a list
                of layer-call counts per stage. Defaults to `None`: chosen
                with the others, else `"params"`.
            memory_budget: bytes per device (or a list, one per stage):
                the cut, `num_micro_batches` and per-stage `remat` are then
                chosen by `keras_pipe.plan` to fit it (see
                `keras_pipe.planning.budget`). Defaults to `None`.
            batch_size, input_shape, sample_inputs: the sizes the plan and
                the cost-based balances cost, as in
                `keras_pipe.planning.partition.split_model`
                (`input_shape={"token_ids": (None, 128)}` for inputs of
                unknown length). `batch_size` plans now instead of at the
                first batch. Default to `None`.
            loss: when the planner chooses, the loss you will compile with,
                so the plan costs the loss head (as `keras_pipe.plan`).
                Defaults to `None`: `model`'s compiled loss, if any.
            **kwargs: `PipelineModel` arguments (`schedule`: a name, or
                `"auto"` to plan as when nothing is given) and
                `keras.Model` arguments (`name`, ...). A planned pipeline
                keeps its `keras_pipe.planning.planner.Plan` as `.plan`
                (None when nothing was planned).

        Returns:
            A `PipelineModel`.

        Raises:
            TypeError, ValueError: see `keras_pipe.planning.partition.split_model`
                and `PipelineModel`.
        """
        options = dict(num_stages=num_stages,
                       num_micro_batches=num_micro_batches, remat=remat,
                       balance=balance, memory_budget=memory_budget,
                       input_shape=input_shape, sample_inputs=sample_inputs,
                       schedule=kwargs.pop("schedule", None), loss=loss)
        if batch_size is None and memory_budget is None and \
                choices.leaves_all(num_micro_batches, options["schedule"],
                                   remat, balance):
            # Planned for the batch size the pipeline first sees.
            return cls(first_batch.Deferred(model, devices, options),
                       **kwargs)
        stages, arguments, chosen = planner.stages_from_model(
            model, devices=devices, batch_size=batch_size, **options)
        pipe = cls(stages, **arguments, **kwargs)
        pipe.plan = chosen
        return pipe

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
        """`M`; when not given, chosen from the first batch size seen."""
        return self.chosen_micro_batches()

    @property
    def remat(self):
        return self._remat

    @property
    def num_stages(self):
        return len(self._stage_layers)

    @property
    def loss_adding_stages(self):
        """Indices of the stages whose layers added a loss (`add_loss`,
        activity regularizers left out) in a traced training step."""
        return [j for j, runner in enumerate(self._runners)
                if runner.adds_losses]

    @property
    def schedule(self):
        """The schedule's name (see `keras_pipe.schedule.schedule_names`)."""
        return self._schedule

    @property
    def output_names(self):
        """The names Keras gives per-output losses and metrics (`a_loss`):
        those of the model the pipeline was cut from, else of its last
        stage (None if it has none)."""
        deferred = self.__dict__.get("_deferred")
        if deferred is not None:  # the same names, before the plan
            return getattr(deferred.model, "output_names", None)
        graph = saving.graph_of(self._stage_layers)
        source = graph.model if graph is not None else self._stage_layers[-1]
        return getattr(source, "output_names", None)

    def clock_ticks(self, num_micro_batches=None):
        """The clock ticks this model follows (`keras_pipe.schedule`); the
        executor also defers W of runs of B (`defer_weight_runs`)."""
        return self._executor.ticks(num_micro_batches or
                                    self.num_micro_batches)

    @property
    def step_observer(self):
        """The factory set by `observe_steps`, or None."""
        return self._step_observer

    def observe_steps(self, factory):
        """Stamps every stage call of the training steps traced from now on
        with `factory()`'s observer (None stops; set by the Timeline)."""
        self._step_observer = factory
        self.make_train_function(force=True)

    def summary_table(self):
        """A text table: stage, device, layer name, parameter count."""
        return reporting.stage_table(self._stage_layers,
                                     self._resolved_devices)

    def summary(self, *args, **kwargs):
        """`keras.Model.summary` (same arguments), then each layer's stage
        and device, through the same `print_fn`."""
        super().summary(*args, **kwargs)
        reporting.print_layer_table(args, kwargs, self._stage_layers,
                                    self._resolved_devices)

    # --------------------------------------------------------------- compile

    def compile(self, *args, jit_compile="auto", run_eagerly=False,
                sampler=None, **kwargs):
        """`keras.Model.compile`, with a colocated optimizer and a sampler.

        XLA cannot compile a step whose variables live on several devices
        (the trap "one-device XLA"): the step runs un-compiled, and
        `jit_compile=True` compiles each device's optimizer update as one
        XLA function (see "Design" in the docs). `model.jit_compile` stays
        False; `model.xla_updates` says whether the updates are compiled.

        ```python
        pipe = keras_pipe.PipelineModel.from_model(gpt2_lm, num_stages=2,
                                                   devices=devices)
        pipe.compile("adam", sampler="greedy")   # generate: greedy
        ```

        Args:
            jit_compile: `True`, `False` or `"auto"` (resolved to False, as
                Keras does on a machine without accelerators). Defaults to
                `"auto"`.
            run_eagerly: must be False. Defaults to `False`.
            sampler: for a pipeline cut from a KerasHub `CausalLM`, the
                sampler of `generate`, as the task's `compile` takes it: a
                name (`"greedy"`, `"top_k"`, ...) or a
                `keras_hub.samplers.Sampler`; it wins over the task's own.
                Defaults to `None`: the task's sampler.

        Raises:
            ValueError: if `jit_compile` is not a bool or `"auto"`,
                `run_eagerly=True` (the per-device backward pass needs graph
                mode), or `sampler` names no KerasHub sampler or runs its
                own loop over the sequence (beam search).
            TypeError: if `sampler` is neither a name nor a Sampler.
        """
        _validation.check_compile_arguments(jit_compile, run_eagerly)
        resolved_sampler = sampling.resolve(sampler)
        super().compile(*args, jit_compile=False, run_eagerly=False, **kwargs)
        self._xla_updates = jit_compile is True
        self._sampler = resolved_sampler
        config = getattr(self, "_compile_config", None)
        if config is not None:  # saved with the model: compiled back alike
            config.config["jit_compile"] = jit_compile
            if sampler is not None:
                config.config["sampler"] = sampling.serialize(
                    sampler, resolved_sampler)
        if self.optimizer is not None:
            placement.colocate_optimizer(self.optimizer,
                                         xla_updates=self._xla_updates)
            self._build_optimizer()

    @property
    def xla_updates(self):
        """Whether each device's optimizer update runs as one XLA function."""
        return getattr(self, "_xla_updates", False)

    # --------------------------------------------------------------- execute
    # `keras_pipe.engine.executor` runs the schedule; this is the Keras side.

    @_not_autograph
    def call(self, inputs, training=False):
        self._remember_input_spec(inputs)
        step = self._executor.start(
            inputs, self.num_micro_batches, bool(training),
            ["never"] * self.num_stages, differentiable=True)
        self._executor.forward(step)
        self._executor.assign_state(step)
        return self._executor.outputs(step)

    @_not_autograph
    def compute_loss_and_gradients(self, x, y=None, sample_weight=None,
                                   training=True, observer=None,
                                   weight_ops=None):
        """One forward and backward pass, without an optimizer step.

        Runs in graph mode (inside a `tf.function`), as `train_step` does,
        with the model's `schedule`. `observer` stamps every stage call
        (the Timeline's recorder). `weight_ops`, a dict or None, is filled
        with the ops that compute only one variable's gradient
        (`Executor.loss_and_gradients`).

        Returns:
            `(loss, y_pred, gradients)`, gradients in the order of
            `self.trainable_variables`.
        """
        self._build_compile_loss(x, y)
        head = losses_lib.loss_head(self, x, y, sample_weight, training)
        weight_losses = [self._aggregate_additional_loss(l)
                         for l in self.losses]
        return self._executor.loss_and_gradients(
            x, self.num_micro_batches, training, self._remat_modes, head,
            self.trainable_variables, placement.device_of,
            weight_loss=tf.add_n(weight_losses) if weight_losses else None,
            observer=observer, weight_ops=weight_ops)

    @_not_autograph
    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._ensure_built(x)
        if not getattr(self, "_batch_norm_warned", False):
            self._batch_norm_warned = reporting.warn_batch_norm(
                self._stage_layers, self.num_micro_batches)
        observer = self._step_observer() if self._step_observer else None
        weight_ops = {}
        loss, y_pred, gradients = self.compute_loss_and_gradients(
            x, y, sample_weight, observer=observer, weight_ops=weight_ops)
        if not getattr(self, "_added_loss_warned", False):
            self._added_loss_warned = reporting.warn_added_losses(
                self.loss_adding_stages, self.num_micro_batches)
        if observer is not None:
            observer.finish()
        batch_size = tf.shape(
            next(t for t in keras.tree.flatten(x) if t is not None))[0]
        self._loss_tracker.update_state(loss, sample_weight=batch_size)
        variables = self.trainable_variables
        if variables:
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            self.optimizer.apply_gradients(zip(gradients, variables))
            update_ops = graph.get_operations()[first:]
            # Each update after the step's uses of its variable's read:
            # in place, not on a copy (engine/in_place.py).
            in_place.update_in_place(update_ops)
            # Each device's weight gradients made one at a time, each
            # after the previous one is applied (engine/release.py).
            release.apply_in_turn(update_ops, gradients, variables,
                                  weight_ops, placement.device_of)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @_not_autograph
    def test_step(self, data):
        self._ensure_built(keras.utils.unpack_x_y_sample_weight(data)[0])
        return super().test_step(data)

    @_not_autograph
    def predict_step(self, data):
        self._ensure_built(keras.utils.unpack_x_y_sample_weight(data)[0])
        return super().predict_step(data)
