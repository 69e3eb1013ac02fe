"""Building a pipeline before its step function is first traced.

A `tf.function` whose first trace made variables is traced again, as a
function that makes none; one trace of a pipeline's step costs seconds to
minutes. Keras' TF trainer builds the model and the compiled loss and
metrics before the first step only under a distribution strategy (from a
batch drawn from the data); `BuiltFirst` builds them from the element spec
of the iterator the step is given, which reads no batch, and builds every
stage under its device.
"""

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.distributed import cluster
from keras_pipe.engine import building

__all__ = ["BuiltFirst"]


class BuiltFirst:
    """`PipelineModel`'s build: stages, optimizer slots, compiled loss and
    metrics, before the first trace (a mixin before `keras.Model`)."""

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
