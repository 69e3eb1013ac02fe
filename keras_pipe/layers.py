"""BatchNormalization whose moving statistics see the whole mini-batch.

A pipeline runs each stage once per micro-batch, so a plain
`keras.layers.BatchNormalization` in a `PipelineModel` normalizes with the
statistics of the micro-batch (as GPipe does) and also updates its moving
averages once per micro-batch: `M` momentum steps per training step, each
from `B / M` rows. The moving statistics, and so evaluation, then depend on
`num_micro_batches`.

`DeferredBatchNormalization` (torchgpipe's `DeferredBatchNorm`) still
normalizes with the micro-batch statistics in training, but only
*accumulates* them. The pipeline calls `finish_mini_batch()` once per
training step, after the last micro-batch, which updates the moving averages
once from the statistics of the whole mini-batch: the same moving mean and
variance as one `BatchNormalization` step on the full batch.

    layer                        normalizes with    moving averages updated
    BatchNormalization           micro-batch stats  M times a step, from
      (per micro-batch, GPipe)                      micro-batch stats
    DeferredBatchNormalization   micro-batch stats  once a step, from
                                                    mini-batch stats

The accumulators merge micro-batch means and sums of squared deviations
(Chan et al.'s parallel variance) rather than raw sums of squares, which
lose the variance to cancellation in float32 when the mean is large.
"""

import keras
from keras import ops

from keras_pipe import _compat

__all__ = ["DeferredBatchNormalization", "defer_batch_norm"]


@keras.saving.register_keras_serializable(package="keras_pipe")
class DeferredBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization that updates its moving statistics once a mini-batch.

    In training, each call normalizes its inputs with their own statistics,
    as `keras.layers.BatchNormalization` does, and adds them to accumulator
    variables instead of updating `moving_mean` and `moving_variance`.
    `finish_mini_batch()` then updates the moving statistics once from the
    accumulated statistics (biased variance, as Keras) with the usual rule
    `moving = moving * momentum + batch_stat * (1 - momentum)`, and clears
    the accumulators. A `PipelineModel` calls `finish_mini_batch()` at the end
    of every training step, so that the moving statistics do not depend on
    `num_micro_batches`. Outside a pipeline, call it yourself after the
    calls that make up a batch; without it the moving statistics never
    change. Inference uses the moving statistics, as BatchNormalization.

    ```python
    model = keras_pipe.layers.defer_batch_norm(
        keras.applications.ResNet50(weights=None))
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=4, devices=devices, num_micro_batches=8)
    ```

    Args:
        **kwargs: the arguments of `keras.layers.BatchNormalization`, except
            `renorm=True`.

    Raises:
        ValueError: if `renorm=True` (batch renormalization corrects each
            call with the moving statistics, which a deferred update would
            change).
    """

    def __init__(self, **kwargs):
        if kwargs.get("renorm"):
            raise ValueError(
                "DeferredBatchNormalization does not support renorm=True: "
                "batch renormalization corrects every call with the moving "
                "statistics, which are only updated at the end of the "
                "mini-batch here. Use renorm=False, or "
                "keras.layers.BatchNormalization.")
        super().__init__(**kwargs)

    def build(self, input_shape):
        super().build(input_shape)
        shape = (input_shape[self.axis],)
        # Statistics of the rows seen since the last finish_mini_batch():
        # per channel, the element count, mean and sum of squared deviations.
        self.accumulated_count = self.add_weight(
            shape=shape, name="accumulated_count", initializer="zeros",
            trainable=False, autocast=False)
        self.accumulated_mean = self.add_weight(
            shape=shape, name="accumulated_mean", initializer="zeros",
            trainable=False, autocast=False)
        self.accumulated_m2 = self.add_weight(
            shape=shape, name="accumulated_m2", initializer="zeros",
            trainable=False, autocast=False)

    def _count(self, inputs, mask):
        """Elements per channel in `inputs` (under `mask`), shape (C,)."""
        if mask is None:
            size = 1
            for axis in self._reduction_axes:
                size = size * ops.shape(inputs)[axis]
            return ops.cast(size, inputs.dtype) * ops.ones(
                (ops.shape(inputs)[self.axis],), inputs.dtype)
        weights = ops.broadcast_to(ops.expand_dims(ops.cast(
            mask, inputs.dtype), axis=-1), ops.shape(inputs))
        return ops.sum(weights, self._reduction_axes)

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}")
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        mean, variance = self._moments(inputs, mask)
        count = self._count(inputs, mask)
        self._accumulate(mean, variance, count)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis,
            offset=beta, scale=gamma, epsilon=self.epsilon)
        return ops.cast(outputs, self.compute_dtype)

    def _accumulate(self, mean, variance, count):
        """Merges a call's statistics into the accumulators (Chan et al.)."""
        mean = ops.cast(ops.reshape(mean, (-1,)), "float32")
        variance = ops.cast(ops.reshape(variance, (-1,)), "float32")
        count = ops.cast(count, "float32")
        old_count = self.accumulated_count.value
        old_mean = self.accumulated_mean.value
        total = old_count + count
        share = ops.divide_no_nan(count, total)
        delta = mean - old_mean
        # Every new value is computed before the first assign (an eager
        # variable read is not a snapshot).
        new_mean = old_mean + delta * share
        new_m2 = (self.accumulated_m2.value + variance * count
                  + ops.square(delta) * old_count * share)
        self.accumulated_count.assign(total)
        self.accumulated_mean.assign(new_mean)
        self.accumulated_m2.assign(new_m2)

    def finish_mini_batch(self):
        """Updates the moving statistics from the accumulated ones, once.

        Channels that saw no element keep their moving statistics. The
        accumulators are reset to zero.
        """
        count = self.accumulated_count.value
        seen = count > 0
        variance = ops.divide_no_nan(self.accumulated_m2.value, count)
        momentum = self.momentum
        old_mean = self.moving_mean.value
        old_variance = self.moving_variance.value
        new_mean = ops.where(seen, old_mean * momentum + ops.cast(
            self.accumulated_mean.value, old_mean.dtype) * (1.0 - momentum),
            old_mean)
        new_variance = ops.where(seen, old_variance * momentum + ops.cast(
            variance, old_variance.dtype) * (1.0 - momentum), old_variance)
        self.moving_mean.assign(new_mean)
        self.moving_variance.assign(new_variance)
        for variable in (self.accumulated_count, self.accumulated_mean,
                         self.accumulated_m2):
            variable.assign(ops.zeros_like(variable))


def defer_batch_norm(model):
    """A copy of `model` whose BatchNormalization layers are deferred.

    Every `keras.layers.BatchNormalization` (at any depth) becomes a
    `DeferredBatchNormalization` with the same configuration and the same
    gamma, beta and moving statistics; other layers are shared with `model`,
    not copied. Cut the result into stages with `PipelineModel.from_model`.

    ```python
    model = keras_pipe.layers.defer_batch_norm(amoebanet)
    pipe = keras_pipe.PipelineModel.from_model(model, num_stages=4, ...)
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.

    Returns:
        A model of the same kind, built.

    Raises:
        TypeError: if `model` is not a Sequential or Functional model.
        ValueError: if `model` is not built, or a BatchNormalization layer
            uses `renorm=True`.
    """
    if not isinstance(model, keras.Model) or not (
            isinstance(model, keras.Sequential)
            or hasattr(model, "_run_through_graph")):
        raise TypeError(
            "defer_batch_norm needs a keras.Sequential or Functional model. "
            f"Received: model={model!r} of type {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: build it (call it on data, "
            "or give it an Input) before defer_batch_norm.")
    renorm = [layer.name for layer in _compat.flatten_layers(model)
              if isinstance(layer, keras.layers.BatchNormalization)
              and layer.renorm]
    if renorm:
        raise ValueError(
            f"BatchNormalization layers {renorm} use renorm=True, which "
            "DeferredBatchNormalization does not support. Use renorm=False.")

    def swap(layer):
        if isinstance(layer, DeferredBatchNormalization) or not isinstance(
                layer, keras.layers.BatchNormalization):
            return layer
        config = layer.get_config()
        config.pop("renorm", None)
        config.pop("renorm_clipping", None)
        config.pop("renorm_momentum", None)
        deferred = DeferredBatchNormalization.from_config(config)
        deferred.build(_compat.build_shapes(layer)["input_shape"])
        for name in ("gamma", "beta", "moving_mean", "moving_variance"):
            source = getattr(layer, name, None)
            if source is not None:
                getattr(deferred, name).assign(source)
        return deferred

    return keras.models.clone_model(model, clone_function=swap,
                                    recursive=True)
