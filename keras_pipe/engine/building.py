"""Checks a list of stages and builds each stage under its device.

`PipelineModel.__init__` validates everything here before a variable is
created or placed; `build` (or the first batch) builds each stage eagerly
under its `tf.device`, so that its variables live there.
"""

import keras
import tensorflow as tf

from keras_pipe import _compat, _validation
from keras_pipe.engine import placement
from keras_pipe.engine import schedule as schedule_lib

__all__ = ["build_stages", "check_stages", "data_spec", "device_indices",
           "known_input_spec", "spec_of", "to_spec"]


def _is_shape(value):
    return isinstance(value, (tuple, list)) and all(
        d is None or isinstance(d, int) for d in value)


def to_spec(shapes):
    """Turns a nested structure of shapes into KerasTensors (float32)."""
    if _is_shape(shapes):
        return keras.KerasTensor(tuple(shapes))
    if isinstance(shapes, dict):
        return {k: to_spec(v) for k, v in shapes.items()}
    if isinstance(shapes, (tuple, list)):
        return type(shapes)(to_spec(v) for v in shapes)
    raise TypeError(f"Cannot read an input shape from {shapes!r}.")


def spec_of(inputs):
    """KerasTensors with an open batch size, shaped and typed as `inputs`."""
    def one(t):
        if t is None:
            return None
        shape = tuple(t.shape)
        dtype = keras.backend.standardize_dtype(t.dtype)
        return keras.KerasTensor((None,) + shape[1:] if shape else shape,
                                 dtype=dtype)
    return keras.tree.map_structure(one, inputs)


def data_spec(element_spec):
    """KerasTensors shaped and typed as a dataset's elements, or None.

    `None` stands for an empty `tf.experimental.Optional` (what Keras'
    step reads as a missing target or weight). None when an element holds
    a sparse, ragged or other composite value, or one of unknown rank:
    Keras' step then builds from the first batch, as before.
    """
    leaves = tf.nest.flatten(element_spec)
    if not all(type(s) is tf.TensorSpec and s.shape.rank is not None
               or isinstance(s, tf.OptionalSpec) for s in leaves):
        return None
    return tf.nest.pack_sequence_as(element_spec, [
        None if isinstance(s, tf.OptionalSpec) else spec_of(s)
        for s in leaves])


def _describe(spec):
    return keras.tree.map_structure(
        lambda t: (tuple(t.shape), t.dtype) if hasattr(t, "shape") else t,
        spec)


def known_input_spec(layer):
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


def check_stages(stages, devices, num_micro_batches, remat, schedule="gpipe",
                 default_schedule=None):
    """Checks the arguments; returns (stages, resolved devices, schedule).

    `num_micro_batches` may be None (chosen later); a `schedule` of None
    is `default_schedule(device indices)`.
    """
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
    if num_micro_batches is not None:
        _validation.check_positive_int("num_micro_batches", num_micro_batches)
    if schedule is not None:
        schedule_lib.get_schedule(schedule)
    _validation.check_remat(remat, len(stages))
    if devices is None:
        resolved = placement.default_devices(len(stages))
    else:
        _validation.check_device_list(devices, len(stages))
        resolved = placement.resolve_devices(devices)
    indices = device_indices(resolved)
    if schedule is None:
        schedule = default_schedule(indices)
    schedule_lib.check_placement(schedule, indices)
    schedule_lib.build_ticks(schedule, num_micro_batches or 1, len(stages),
                             1 + max(indices))
    _check_known_shapes(stages)
    return list(stages), resolved, schedule


def device_indices(devices):
    """Per stage, its device's index in order of first appearance."""
    order = list(dict.fromkeys(devices))
    return [order.index(d) for d in devices]


def _check_known_shapes(stages):
    """Checks stage j against stage j - 1 where both are already built."""
    spec = known_input_spec(stages[0])
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


def build_stages(stages, devices, spec):
    """Builds each stage under its device from `spec`; places its variables.

    A stage whose Functional inputs are known builds from those instead.

    Raises:
        ValueError: naming the stage that cannot take the previous
            stage's output.
    """
    first = known_input_spec(stages[0])
    if first is not None:
        spec = first
    with _compat.eager_scope():
        for j, (stage, device) in enumerate(zip(stages, devices)):
            with tf.device(device):
                try:
                    out = stage.compute_output_spec(spec) if stage.built \
                        else stage(spec)
                except tf.errors.OpError:
                    raise  # The runtime failed (a worker lost), not a shape.
                except Exception as exc:  # Keras raises many types here.
                    raise ValueError(_mismatch_message(
                        stages, j, spec, exc)) from exc
            placement.place_variables(stage, device)
            spec = out
