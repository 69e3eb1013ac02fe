"""What a pipeline tells its user where it happens: stages in `summary()`,
the BatchNormalization warning at the first training step, the model config
for TensorBoard.

Keras' `TensorBoard(write_graph=True)` writes the model's config (the
"conceptual graph") only for a `Functional` or `Sequential` model; a
`PipelineModel` is neither, so `fit` adds `ModelConfigWriter`, which writes
the unsplit model's config (`to_model()`) in the same place, once the
pipeline is built.
"""

import os
import warnings

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.saving import files as saving

__all__ = ["ModelConfigWriter", "batch_norm_stages", "layer_table",
           "warn_added_losses", "warn_batch_norm",
           "with_config_writers"]


def layer_table(stages, devices):
    """A text table: per layer, its stage, device and parameter count."""
    rows = [("layer (type)", "stage", "device", "params")]
    for j, (stage, device) in enumerate(zip(stages, devices)):
        for layer in _leaves(stage):
            count = sum(int(v.numpy().size) for v in layer.weights)
            rows.append((f"{layer.name} ({type(layer).__name__})", str(j),
                         device, f"{count:,}"))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths))
                     .rstrip() for r in rows)


def _leaves(layer):
    """The layers a stage runs; Sequential, Functional and cut stages opened."""
    if not (saving.is_container(layer) or hasattr(layer, "calls")):
        return [layer]
    found = []
    for sub in _compat.flatten_layers(layer, include_self=False, recursive=False):
        found += _leaves(sub)
    return found


def batch_norm_stages(stages):
    """`{stage index: [names]}` of plain BatchNormalization layers."""
    from keras_pipe.layers import DeferredBatchNormalization
    found = {}
    for j, stage in enumerate(stages):
        names = [layer.name for layer in _compat.flatten_layers(stage)
                 if isinstance(layer, keras.layers.BatchNormalization)
                 and not isinstance(layer, DeferredBatchNormalization)]
        if names:
            found[j] = names
    return found


ADDED_LOSSES = (
    "a loss added by a layer (add_loss) at M > 1: the pipeline takes the "
    "micro-batches' values averaged by size, which is the unsplit value only "
    "for a mean over samples; a loss that is not (a router's load-balancing "
    "loss, a product of batch means) trains differently; "
    "num_micro_batches=1 is exact")


def warn_added_losses(stage_indices, num_micro_batches):
    """Warns (a UserWarning) if stages' layers added losses at M > 1.

    `stage_indices` are the stages whose training call added a loss other
    than an activity regularizer; True if warned.
    """
    if num_micro_batches <= 1 or not stage_indices:
        return False
    warnings.warn(
        f"Layers of stage(s) {list(stage_indices)} add a loss (add_loss) "
        f"with num_micro_batches={num_micro_batches}: each micro-batch adds "
        "its own value and the pipeline takes their mean weighted by "
        "micro-batch size. That is the unsplit loss only if the loss is a "
        "mean over samples; one that is not (a mixture-of-experts router's "
        "load-balancing loss, a product of batch means) trains another "
        "model than the unsplit one. For the unsplit step, "
        "num_micro_batches=1. keras_pipe.verify(model, x, y) measures the "
        "difference.", UserWarning, stacklevel=3)
    return True


def warn_batch_norm(stages, num_micro_batches):
    """Warns (a UserWarning) if BatchNormalization meets M > 1; True if so."""
    found = batch_norm_stages(stages) if num_micro_batches > 1 else {}
    if not found:
        return False
    where = "; ".join(f"stage {j}: {names}" for j, names in found.items())
    warnings.warn(
        f"BatchNormalization with num_micro_batches={num_micro_batches} "
        f"({where}): each micro-batch is normalized with its own statistics "
        f"and the moving averages take {num_micro_batches} steps per batch, "
        "so this trains another model than the unsplit one. For the "
        "unsplit moving statistics use keras_pipe.layers.defer_batch_norm("
        "model) (DeferredBatchNormalization); for the unsplit step, "
        "num_micro_batches=1. keras_pipe.verify(model, x, y) measures the "
        "difference.", UserWarning, stacklevel=3)
    return True


class ModelConfigWriter(keras.callbacks.Callback):
    """Writes the unsplit model's config where `TensorBoard` writes it.

    The same summary as Keras' `TensorBoard(write_graph=True)` for a
    Functional model (tag "keras", plugin "graph_keras_model", step 0), in
    `<log_dir>/train`, after the first training batch (a pipeline built by
    `fit` is built then).
    """

    def __init__(self, log_dirs):
        super().__init__()
        self.log_dirs = list(log_dirs)
        self.written = False

    def on_train_batch_end(self, batch, logs=None):
        if self.written:
            return
        self.written = True
        plain = self.model.to_model()
        if type(plain).__name__ not in ("Functional", "Sequential"):
            return  # Keras writes none for other classes either.
        config = plain.to_json()
        metadata = tf.compat.v1.SummaryMetadata()
        metadata.plugin_data.plugin_name = "graph_keras_model"
        metadata.plugin_data.content = b"1"
        for log_dir in self.log_dirs:
            writer = tf.summary.create_file_writer(
                os.path.join(log_dir, "train"))
            with writer.as_default():
                tf.summary.write("keras", config, step=0, metadata=metadata)
            writer.close()


def with_config_writers(callbacks):
    """`callbacks` plus a `ModelConfigWriter` if a TensorBoard writes graphs."""
    if callbacks is None:
        return None
    listed = list(callbacks) if isinstance(callbacks, (list, tuple)) else [
        callbacks]
    dirs = [str(c.log_dir) for c in listed
            if isinstance(c, keras.callbacks.TensorBoard) and c.write_graph]
    if not dirs or any(isinstance(c, ModelConfigWriter) for c in listed):
        return callbacks
    return listed + [ModelConfigWriter(dirs)]


def stage_table(stages, devices):
    """A text table: stage, device, layer name, parameter count."""
    rows = [("stage", "device", "layer", "params")]
    for j, (stage, device) in enumerate(zip(stages, devices)):
        count = sum(int(v.numpy().size) for v in stage.weights)
        rows.append((str(j), device, stage.name, f"{count:,}"))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths))
                     for r in rows)


def with_config_writers_in(args, kwargs):
    """`fit`'s `(args, kwargs)` with `with_config_writers` on its callbacks."""
    if len(args) > 5:
        return args[:5] + (with_config_writers(args[5]),) + args[6:], kwargs
    kwargs = dict(kwargs, callbacks=with_config_writers(
        kwargs.get("callbacks")))
    return args, kwargs


def print_layer_table(args, kwargs, stages, devices):
    """Prints `layer_table` with the `print_fn` of a `summary(...)` call."""
    print_fn = kwargs.get("print_fn") or (args[2] if len(args) > 2
                                          else None) or print
    print_fn("Stages:\n" + layer_table(stages, devices))
