"""The unpipelined model of a pipeline, and its export for serving.

A pipeline's `call` pins each stage to its device with `tf.device`; a
SavedModel traced from it keeps those pins and does not load where the
devices do not exist (one CPU, soft placement off). For serving, `export`
writes the *logical* model instead: the stages stitched into one Functional
model that shares the pipeline's layers (`to_model`), traced with no device
scope. `export(..., pipelined=True)` keeps the stage placement, for a model
that does not fit on one device.
"""

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.saving import files as saving

__all__ = ["to_model", "export"]


def _input_spec(model):
    """KerasTensors for the model's inputs, from stage 0 or the build shape."""
    stage = model.stages[0]
    try:
        inputs = stage.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        if isinstance(inputs, (list, tuple)) and len(inputs) == 1:
            inputs = inputs[0]
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(t.shape, t.dtype), inputs)
    seen = getattr(model, "_seen_input_spec", None)
    if seen is not None:
        return seen
    shapes = getattr(model, "_build_shapes_dict", None)
    if shapes:
        shape = next(iter(shapes.values()))
        return keras.tree.map_shape_structure(
            lambda s: keras.KerasTensor(tuple(s)), shape)
    raise ValueError(
        f"PipelineModel {model.name!r} does not know its input shape: its "
        "first stage has no Input and the model has not been built or "
        "called. Call the model on a batch (`model(x)`, `fit`, `predict`) "
        "or model.build(input_shape) first.")


def _apply(layer, inputs):
    """Calls `layer` on KerasTensors, opening Sequential/Functional models."""
    if not saving.is_container(layer):
        return layer(inputs)
    if isinstance(layer, keras.Sequential):
        graph = _compat.sequential_graph(layer)
        if graph is not None:
            return _apply(graph, inputs)
        for sub in layer.layers:
            inputs = _apply(sub, inputs)
        return inputs

    def operation_fn(op):
        if saving.is_container(op):
            return lambda x, *args, **kwargs: _apply(op, x)
        return op

    return _compat.run_through_graph(layer, inputs, operation_fn)


def to_model(model, name=None):
    """The pipeline as one plain Keras model, sharing its layers.

    For a pipeline cut by `PipelineModel.from_model` (or loaded from such a
    pipeline's file), this is the model it was cut from, whatever its class:
    a KerasHub `GPT2CausalLM` stays one, with its `generate`. Otherwise it is
    a Functional model of the stages, with Sequential and Functional stages
    opened up, so the result is flat. Either way `to_model(m).layers` are
    `m.layers` (plus the Input layers), and `m.save_weights` files load into
    it with `keras.Model.load_weights`. Variables stay where they are.

    ```python
    plain = pipe.to_model()
    np.testing.assert_allclose(plain.predict(x), pipe.predict(x), atol=1e-6)
    ```

    Args:
        model: a `PipelineModel`.
        name: the name of a new Functional model. Defaults to `None`: the
            pipeline's name, or the model it was cut from, itself.

    Returns:
        A `keras.Model`.

    Raises:
        ValueError: if the input shape is unknown (the first stage has no
            Input and the model was never built).
    """
    graph = saving.graph_of(model.stages)
    if graph is not None and name is None:
        return graph.model  # Cut by from_model: the model it was cut from.
    spec = _input_spec(model)
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype), spec)
    if graph is not None:  # Cut by from_model: the source model's graph.
        x = _apply(graph.functional, inputs)
    else:
        x = inputs
        for stage in model.stages:
            x = _apply(stage, x)
    return keras.Model(inputs, x, name=name or model.name)


def _pipelined_export(model, filepath, verbose, input_signature):
    """SavedModel of the pipeline itself, with its device placement."""

    if input_signature is None:
        spec = _input_spec(model)
        input_signature = [keras.tree.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype), spec)]
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        "serve", lambda *args: model(*args, training=False),
        input_signature)
    options = tf.saved_model.SaveOptions(
        experimental_variable_policy=(
            tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES))
    archive.write_out(filepath, options=options,
                      verbose=True if verbose is None else verbose)


def export(model, filepath, format="tf_saved_model", verbose=None,
           input_signature=None, pipelined=False, **kwargs):
    """Exports a PipelineModel for inference.

    By default the unpipelined model (`to_model`) is exported, through
    `keras.Model.export`: a SavedModel with a `serve` endpoint and a
    `serving_default` signature, without any device assignment, that loads
    and runs on any single device (TF Serving, `tf.saved_model.load`). The
    other `keras.Model.export` formats work the same way.

    ```python
    pipe.export("served")
    reloaded = tf.saved_model.load("served")   # any process, any device
    y = reloaded.serve(x)
    ```

    Args:
        model: a `PipelineModel`.
        filepath: where to write the artifact.
        format: as in `keras.Model.export`. Defaults to `"tf_saved_model"`.
        verbose: as in `keras.Model.export`. Defaults to `None`.
        input_signature: as in `keras.Model.export`. Defaults to `None`
            (from the model's inputs).
        pipelined: export the pipeline with its stage placement and
            micro-batching instead (`"tf_saved_model"` only); the SavedModel
            then needs the same devices where it is loaded. Defaults to
            `False`.
        **kwargs: passed to `keras.Model.export`.

    Raises:
        ValueError: if the input shape is unknown, or `pipelined=True` with
            another format than `"tf_saved_model"`.
    """
    if not isinstance(pipelined, bool):
        raise TypeError(f"pipelined must be True or False. Received: "
                        f"pipelined={pipelined!r}")
    if pipelined:
        if format != "tf_saved_model" or kwargs:
            raise ValueError(
                "pipelined=True exports a TF SavedModel only, without extra "
                f"options. Received: format={format!r}, kwargs={kwargs}")
        return _pipelined_export(model, filepath, verbose, input_signature)
    return to_model(model).export(filepath, format=format, verbose=verbose,
                                  input_signature=input_signature, **kwargs)
