"""PipelineModel: a Keras model whose stages run as a GPipe pipeline."""

import keras
import tensorflow as tf

from keras_pipe import _compat, _validation, inference, placed_data, reporting
from keras_pipe.distributed import cluster
from keras_pipe.engine import building, in_place, placement, release
from keras_pipe.engine import executor as executor_lib
from keras_pipe.engine import losses as losses_lib
from keras_pipe.engine import replicas as replicas_lib
from keras_pipe.engine.schedule import schedule_names
from keras_pipe.engine.stage import Stage
from keras_pipe.saving import files as saving
from keras_pipe.saving import model_io

__all__ = ["PipelineModel"]


# The executor is plain Python that builds a graph; it has no tensor-dependent
# control flow for AutoGraph to convert (and conversion costs build time).
_not_autograph = tf.autograph.experimental.do_not_convert


@keras.saving.register_keras_serializable(package="keras_pipe")
class PipelineModel(model_io.SavingMethods, inference.InferenceMethods,
                    keras.Model):
    """A Keras model cut into stages that run as a GPipe pipeline.

    Each stage lives on its own device. A mini-batch is cut into
    `num_micro_batches` micro-batches that flow through the stages back to
    back, following `keras_pipe.schedule.gpipe`, inside one `tf.function`
    training step; gradients are summed over micro-batches and the
    optimizer steps once per mini-batch, so training is the same as
    training the unsplit model on one device for every layer without batch
    coupling. BatchNormalization is the exception: while training, each
    micro-batch is normalized with its own statistics (as in GPipe), and
    its moving statistics are updated once per micro-batch
    (`keras_pipe.layers.DeferredBatchNormalization` updates them once per
    mini-batch, from the whole mini-batch); with `num_micro_batches=1` it
    is exact too. Stage insides are recomputed in the backward pass
    (`remat`) without re-running their state updates.

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
        schedule: the name of a registered schedule
            (`keras_pipe.schedule.schedule_names()`): `"gpipe"` (all
            forward passes, then all backward passes), `"1f1b"`
            (PipeDream-flush: each stage holds the activations of at most
            `K` micro-batches), the zero-bubble `"zb_h1"` / `"zb_h2"`, or
            `"interleaved_1f1b"` / `"zbv"` with several stages per device;
            or one registered with `keras_pipe.schedule.register_schedule`.
            Every schedule gives the same gradients; all but GPipe need a
            loss that is a sum over rows, as every Keras loss is.
            `from_model(..., schedule="auto")` chooses one. Defaults to
            `"gpipe"`.
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

    def __init__(self, stages, devices=None, num_micro_batches=1,
                 remat="except_last", schedule="gpipe", **kwargs):
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
        stages, resolved = building.check_stages(
            stages, devices, num_micro_batches, remat, schedule)
        super().__init__(**kwargs)
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
                   num_micro_batches=1, remat="except_last", balance="params",
                   memory_budget=None, batch_size=None, input_shape=None,
                   sample_inputs=None, loss=None, **kwargs):
        """Cuts a built Sequential or Functional model into a pipeline.

        The stages reuse `model`'s layers (weights shared, not copied); see
        `keras_pipe.planning.partition` for how cuts carry skip connections, several
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
            memory_budget: bytes per device (or a list, one per stage):
                the cut, `num_micro_batches` and per-stage `remat` are then
                chosen by `keras_pipe.plan` to fit it (see
                `keras_pipe.planning.budget`), and those arguments are ignored.
                Defaults to `None`.
            batch_size, input_shape, sample_inputs: the sizes the cost-based
                balances (and `memory_budget`, which needs `batch_size`)
                cost, as in `keras_pipe.planning.partition.split_model`
                (`input_shape={"token_ids": (None, 128)}` for inputs of
                unknown length). Default to `None`.
            loss: with `schedule="auto"`, the loss you will compile with,
                so the plan costs the loss head (as `keras_pipe.plan`).
                Defaults to `None`: `model`'s compiled loss, if any.
            **kwargs: `PipelineModel` arguments (`schedule`) and
                `keras.Model` arguments (`name`, ...). `schedule="auto"`
                builds the plan of `keras_pipe.plan(..., schedule="auto")`
                (schedule, stages per device, `M`, cut, per-stage remat;
                `devices` one per device, `batch_size` required); the
                model keeps it as `.plan`.

        Returns:
            A `PipelineModel`.

        Raises:
            TypeError, ValueError: see `keras_pipe.planning.partition.split_model`
                and `PipelineModel`.
        """
        # Imported here: the Keras glue needs planning for this call only.
        from keras_pipe.planning import planner  # noqa: PLC0415
        stages, arguments, chosen = planner.stages_from_model(
            model, num_stages=num_stages, devices=devices,
            num_micro_batches=num_micro_batches, remat=remat,
            balance=balance, memory_budget=memory_budget,
            batch_size=batch_size, input_shape=input_shape,
            sample_inputs=sample_inputs,
            schedule=kwargs.pop("schedule", "gpipe"), loss=loss)
        pipe = cls(stages, **arguments, **kwargs)
        if chosen is not None:
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
        return self._num_micro_batches

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

    # ------------------------------------------------------------------ build

    def build(self, input_shape):
        """Builds every stage under its device, from float32 input shapes.

        `fit`, `evaluate` and `predict` build from the first batch instead,
        with its real dtypes.
        """
        self._build_from_spec(building.to_spec(input_shape))

    def _build_from_spec(self, spec):
        self._remember_input_spec(spec)
        try:
            building.build_stages(self._stage_layers, self._resolved_devices,
                                  spec)
        except tf.errors.OpError as error:  # A worker lost (out of memory?)
            cluster.raise_if_lost(self._resolved_devices, "build", error)
            raise
        self.built = True
        self._build_optimizer()

    def _build_optimizer(self):
        """Creates the optimizer's slots now, each on its variable's device
        (created in the traced step, they make TF trace it twice)."""
        optimizer = getattr(self, "optimizer", None)
        if self.built and optimizer is not None and not optimizer.built:
            with _compat.eager_scope():
                optimizer.build(self.trainable_variables)

    def _remember_input_spec(self, inputs):
        """Keeps the first input spec seen, for `to_model` and `export`
        (a subclassed first stage has no `Input` to read it from)."""
        if getattr(self, "_seen_input_spec", None) is None:
            self._seen_input_spec = building.spec_of(inputs)

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
        """`keras.Model.compile`, with a colocated optimizer.

        XLA cannot compile a step whose variables live on several devices
        (trap 4): the step runs un-compiled, and `jit_compile=True`
        compiles each device's optimizer update as one XLA function (see
        "Design" in the docs). `model.jit_compile` stays False;
        `model.xla_updates` says whether the updates are compiled.

        Args:
            jit_compile: `True`, `False` or `"auto"` (resolved to False, as
                Keras does on a machine without accelerators). Defaults to
                `"auto"`.
            run_eagerly: must be False. Defaults to `False`.

        Raises:
            ValueError: if `jit_compile` is not a bool or `"auto"`, or
                `run_eagerly=True` (the per-device backward pass needs graph
                mode).
        """
        _validation.check_compile_arguments(jit_compile, run_eagerly)
        super().compile(*args, jit_compile=False, run_eagerly=False, **kwargs)
        self._xla_updates = jit_compile is True
        config = getattr(self, "_compile_config", None)
        if config is not None:  # saved with the model: compiled back alike
            config.config["jit_compile"] = jit_compile
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

    def _build_compile_loss(self, x, y):
        """Builds the compiled loss (its metrics) outside stateless scopes."""
        compile_loss, _ = _compat.compiled_state(self)
        if compile_loss is not None and not compile_loss.built:
            self._build_compiled([compile_loss], keras.tree.map_structure(
                lambda t: keras.KerasTensor(t.shape, t.dtype.name), x), y)

    def _build_compiled(self, states, x, y):
        """Builds those of `states` (Keras' compiled loss and metrics) not
        built yet, for inputs shaped as the KerasTensors `x` and targets
        `y`, outside stateless scopes."""
        states = [state for state in states
                  if state is not None and not state.built]
        if states:
            y_pred = self.compute_output_spec(x)
            with _compat.eager_scope():
                for state in states:
                    state.build(y, y_pred)

    # ------------------------------------------- built before the first trace
    # A `tf.function` whose first trace made variables is traced again, as a
    # function that makes none; one trace of a pipeline's step costs seconds
    # to minutes. Keras' TF trainer builds the model and the compiled loss
    # and metrics before the first step only under a distribution strategy
    # (from a batch drawn from the data); here they are built from the
    # element spec of the iterator the step is given, which reads no batch.

    def make_train_function(self, force=False):
        """Keras' train function, which first builds what the step would
        create from the spec of its iterator's elements."""
        return self._made_built_first(
            "train_function", super().make_train_function, force)

    def make_test_function(self, force=False):
        """Keras' test function, built first as the train function."""
        return self._made_built_first(
            "test_function", self._make_test_batches, force)

    def _made_built_first(self, name, make, force, wrap=None):
        """The function `self.<name>` that Keras' `make(force=True)` sets,
        wrapped by `wrap` (default `_built_first`; made once unless
        `force`)."""
        if getattr(self, name) is not None and not force:
            return getattr(self, name)
        make(force=True)
        setattr(self, name, (wrap or self._built_first)(getattr(self, name)))
        return getattr(self, name)

    def make_predict_function(self, force=False):
        """Keras' predict function, which first builds the stages from the
        spec of its first batch if they are unbuilt."""

        def wrap(predict):
            def built_first(data):
                if not self.built:
                    self._build_from_data_spec(tf.nest.map_structure(
                        tf.type_spec_from_value, data[0]))
                return predict(data)
            return built_first

        return self._made_built_first(
            "predict_function", self._make_predict_batches, force, wrap)

    def _built_first(self, function):
        """`function(iterator)` that first builds from the element spec of
        the iterator of its first call (`_build_from_data_spec`)."""
        pending = [True]

        def built_first(iterator):
            element_spec = getattr(iterator, "element_spec", None)
            if pending and element_spec is not None:
                self._build_from_data_spec(element_spec)
            pending.clear()
            return function(iterator)

        return built_first

    def _build_from_data_spec(self, element_spec):
        """Builds the stages, the compiled loss and the compiled metrics
        from the spec of a step's data (`building.data_spec`)."""
        data = building.data_spec(element_spec)
        if data is None:
            return  # Built by the step, from its first batch.
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        if not self.built:
            self._build_from_spec(x)
        if y is not None:  # Without targets (`predict`), left to the step.
            self._build_compiled(_compat.compiled_state(self), x, y)

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

    # ------------------------------------------------- data parallel replicas

    @property
    def num_replicas(self):
        return self._executor.num_replicas

    def replicate(self, devices):
        """Runs R copies of the pipeline on `R * K` devices, data parallel.

        Replica `r` runs stage `j` on `devices[r * K + j]` on its shard of
        each global batch (`M` micro-batches of `R * M`); gradients are
        summed over replicas on each variable's device before the one
        optimizer step (see `keras_pipe.engine.replicas`). The first `K` devices
        must be the model's own. `replicate(model.devices)` undoes it.

        ```python
        model = keras_pipe.PipelineModel(stages, devices=devices[:2],
                                         num_micro_batches=4)
        model.replicate(devices[:4])    # 2 replicas x 2 stages
        ```

        Raises:
            TypeError, ValueError: see `keras_pipe.engine.replicas.make_runners`.
        """
        self._executor.replicas = replicas_lib.make_runners(
            self._runners, devices)
        self.train_function = self.test_function = None
        self.predict_function = None

    # A worker lost mid-call ends it with an error naming the task
    # (`cluster.run`); a plain call when every stage is local.

    # Array data of `fit`, `evaluate` and `predict` are batched on `data_device` when
    # one is set (`keras_pipe.placed_data`); the error diagnosis replays
    # the call's own arguments.

    def fit(self, *args, **kwargs):
        _validation.check_data("fit", args, kwargs)
        # TensorBoard(write_graph=True) gets the model config as Keras
        # writes it for a Functional model (`keras_pipe.reporting`).
        args, kwargs = reporting.with_config_writers_in(args, kwargs)
        return cluster.run(self._resolved_devices, "fit", self._placed_fit,
                           *args, **kwargs)

    def _placed_fit(self, *args, **kwargs):
        args, kwargs = placed_data.placed_call(
            "fit", self, self.data_device, args, kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        _validation.check_data("evaluate", args, kwargs)
        return cluster.run(self._resolved_devices, "evaluate",
                           self._placed_evaluate, *args, **kwargs)

    def _placed_evaluate(self, *args, **kwargs):
        args, kwargs = placed_data.placed_call(
            "evaluate", self, self.data_device, args, kwargs)
        return self._inference_call(super().evaluate, *args, **kwargs)

    @property
    def data_device(self):
        """Where `fit`, `evaluate` and `predict` batch array data (numpy arrays,
        tensors; not datasets or generators), or None for this process.

        Defaults to None: this process, as Keras does. `"auto"` batches
        them on the first stage's device if it is on a remote worker
        (`keras_pipe.placed_data`), a device string on that device: each
        batch is then cut there instead of being sent from this process at
        every step, and the arrays are copied there once per call (that
        worker holds them while the call runs, which the memory model and
        `memory_budget` do not count: opt in only for arrays small next to
        that worker's memory). Measured on the MLP benchmark: about 1 ms
        less of this process's CPU per step (of 10-13), and 27 ms less per
        `fit` call (docs/performance.md).
        """
        chosen = getattr(self, "_data_device", None)
        if chosen != "auto":
            return chosen
        first = self._resolved_devices[0]
        return first if cluster.is_remote(first) else None

    @data_device.setter
    def data_device(self, device):
        if device is not None and not isinstance(device, str):
            raise TypeError(
                "data_device must be a device string, 'auto' or None. "
                f"Received: data_device={device!r}")
        self._data_device = device

    def predict(self, *args, **kwargs):
        _validation.check_data("predict", args, kwargs)
        return cluster.run(self._resolved_devices, "predict",
                           self._keras_predict, *args, **kwargs)
