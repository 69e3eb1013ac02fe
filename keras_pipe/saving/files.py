"""Saving and loading a PipelineModel: the methods' logic, in parts.

* `layer_paths`: the weights file has the plain model's layout whatever the
  cut, with the seed generators' states;
* `config`: a model's config, loaded on the devices that exist;
* `weights`: weights files checked, checksummed, loaded all or nothing;
* `atomic`: every save is atomic (`save`, `save_weights`, and so Keras'
  `ModelCheckpoint` and `keras_pipe.BackupAndRestore`);
* `archive`: a `.keras` zip, checked member by member.

This module saves a whole model and loads one (`load_model`), and gives
the parts' public names to `PipelineModel` (`saving.model_io`).
"""

import os

import keras

from keras_pipe.engine import placement
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.saving import layout
from keras_pipe.saving.archive import read_archive
from keras_pipe.saving.atomic import is_local_file, write_atomically
from keras_pipe.saving.config import (
    LOADING,
    compile_from_config,
    forced_devices,
    from_config,
    get_config,
)
from keras_pipe.saving.layer_paths import (
    SeedStates,
    flat_layers,
    graph_of,
    is_container,
    weight_paths,
)
from keras_pipe.saving.weights import (
    check_store,
    check_weights,
    load_weights,
    weights_bytes,
    write_weights_file,
)

__all__ = ["SeedStates", "check_store", "check_weights", "compile_from_config",
           "flat_layers", "from_config", "get_config", "graph_of",
           "is_container", "load_model", "load_weights", "save_model",
           "save_weights", "weight_paths", "weights_bytes",
           "write_atomically", "write_weights_file"]


_REGISTERED_NAME = "keras_pipe>PipelineModel"


def save_model(save, filepath, overwrite=True, **kwargs):
    """`PipelineModel.save`: Keras' `save`, atomic for a local file.

    A directory (`zipped=False`) or a remote path is written by Keras as is.
    """
    if kwargs.get("zipped") is False or not is_local_file(filepath):
        return save(filepath, overwrite=overwrite, **kwargs)
    return write_atomically(
        filepath, lambda path: save(path, overwrite=True, **kwargs),
        overwrite)


def save_weights(model, save, filepath, overwrite=True, max_shard_size=None):
    """`PipelineModel.save_weights`: Keras' file, with checksums, atomic.

    Made in memory and written by `write_weights_file`. Sharded weights
    (`max_shard_size`, several files), remote paths, a name Keras refuses
    and an unbuilt model go to Keras' `save` as is (it raises for the
    last two, naming the user's path).
    """
    if (max_shard_size is not None or not is_local_file(filepath)
            or not os.fspath(filepath).endswith(".weights.h5")
            or not model.built):
        return save(filepath, overwrite=overwrite,
                    max_shard_size=max_shard_size)
    return write_weights_file(filepath, model, overwrite=overwrite)



def _check_layout(path, schedule, resolved, devices):
    """Refuses `devices` the saved schedule cannot run, naming what works."""
    if schedule not in schedule_lib.schedule_names():
        return  # A custom schedule not registered yet: Keras' error later.
    order = list(dict.fromkeys(resolved))
    try:
        schedule_lib.check_placement(
            schedule, [order.index(d) for d in resolved])
    except ValueError as exc:
        k = len(resolved)
        counts = layout.device_counts(schedule, k)
        example = layout.stage_devices(schedule, k, counts[-1]) \
            if counts else []
        raise ValueError(
            f"Cannot load {path!r} on devices={list(devices)}: {exc} With "
            f"{k} stages, schedule={schedule!r} runs on {counts} devices "
            f"(device indices in the order {example}); or pass no devices "
            "where fewer exist, and keras_pipe picks a layout (a model cut "
            "by from_model is cut again).") from exc


def load_model(filepath, devices=None, custom_objects=None, compile=True,
               safe_mode=True):
    """Loads a PipelineModel saved with `model.save("....keras")`.

    Like `keras.saving.load_model`, after checking the file, and with the
    stages placed on `devices` if given. Without `devices`, the saved
    devices are used when they exist; otherwise the stages go to the
    devices that exist (GPUs, else CPUs), with a warning.

    ```python
    model.save("model.keras")                       # saved on 4 GPUs
    # later, in a process with 2 GPUs:
    model = keras_pipe.load_model("model.keras",
                                  devices=["/GPU:0", "/GPU:0",
                                           "/GPU:1", "/GPU:1"])
    ```

    Args:
        filepath: path of a `.keras` file written by `PipelineModel.save`.
        devices: one device string per saved stage. Defaults to `None`: the
            saved devices, or a fallback (see above).
        custom_objects: as for `keras.saving.load_model`. Defaults to `None`.
        compile: whether to compile the model as it was saved (loss,
            metrics, optimizer with its state). Defaults to `True`.
        safe_mode: as for `keras.saving.load_model`. Defaults to `True`.

    Returns:
        The `PipelineModel`, with its weights, and its optimizer state if
        `compile`.

    Raises:
        ValueError: naming the file, if it does not exist, is not a zip
            archive, is truncated or damaged, holds another kind of model, or
            lacks the weights of a stage; or if `devices` does not name one
            existing device per saved stage.
        TypeError: if `devices` is not a list of strings.
    """
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(
            "filepath must be the path of a .keras file (a string or "
            f"os.PathLike). Received: filepath={filepath!r} of type "
            f"{type(filepath).__name__}")
    if custom_objects is not None and not isinstance(custom_objects, dict):
        raise TypeError(
            "custom_objects must be a dict {name: class or function}. "
            f"Received: custom_objects={custom_objects!r}")
    path = os.fspath(filepath)
    if not os.path.exists(path):
        raise ValueError(f"Cannot load {path!r}: no such file.")
    config, h5 = read_archive(path)
    h5.close()
    if config.get("registered_name") != _REGISTERED_NAME:
        name = config.get("registered_name") or config.get("class_name")
        raise ValueError(
            f"Cannot load {path!r} with keras_pipe.load_model: it holds a "
            f"{name!r} model, not a keras_pipe PipelineModel. Load it with "
            "keras.saving.load_model().")
    saved = config.get("config", {})
    # Stages cut by from_model are saved as the source model and a balance.
    num_stages = len(saved.get("balance") or saved.get("stages") or [])
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
            raise TypeError(
                "devices must be a list of device strings, one per stage. "
                f"Received: devices={devices!r}")
        if len(devices) != num_stages:
            raise ValueError(
                f"{path!r} holds a {num_stages}-stage model, but "
                f"{len(devices)} devices were given. Received: "
                f"devices={list(devices)}")
        _check_layout(path, saved.get("schedule", "gpipe"),
                      placement.resolve_devices(devices), devices)
    LOADING.problem = None
    try:
        with forced_devices(None if devices is None else list(devices)):
            return keras.saving.load_model(
                path, custom_objects=custom_objects, compile=compile,
                safe_mode=safe_mode)
    except Exception as exc:
        problem = getattr(LOADING, "problem", None)
        raise ValueError(
            f"Cannot load {path!r}: {problem or exc}") from exc
    finally:
        LOADING.problem = None
