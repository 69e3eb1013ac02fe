"""A PipelineModel's config: saving it, and building a model from it.

A file saved on 4 devices must load in a process with 1, so `from_config`
falls back, with a warning, to the devices that exist, or uses the devices
given to `keras_pipe.load_model` (`forced_devices`).
"""

import contextlib
import threading
import warnings

import keras
import tensorflow as tf

from keras_pipe.engine import placement
from keras_pipe.saving import layer_paths, layout

__all__ = ["LOADING", "compile_from_config", "forced_devices", "from_config",
           "get_config"]


# Per-thread loading context: devices forced by `load_model`, and the last
# weights-layout problem found (to report it without Keras' wrapping).
LOADING = threading.local()

def get_config(model, base_config):
    """The config of `model`: `base_config` plus stages, devices and schedule.

    Stages cut by `PipelineModel.from_model` are saved as the original model
    and the number of layer calls in each stage, and cut again on loading.
    """
    config = {**base_config,
              "devices": model.devices,
              "num_micro_batches": model.num_micro_batches,
              "remat": model.remat,
              "schedule": model.schedule}
    graph = layer_paths.graph_of(model.stages)
    if graph is not None:
        config["source_model"] = keras.saving.serialize_keras_object(
            graph.model)
        config["balance"] = [len(s.calls) for s in model.stages]
    else:
        config["stages"] = [keras.saving.serialize_keras_object(s)
                            for s in model.stages]
    return config


@contextlib.contextmanager
def forced_devices(devices):
    previous = getattr(LOADING, "devices", None)
    LOADING.devices = devices
    try:
        yield
    finally:
        LOADING.devices = previous


def _fallback(saved, config, cut):
    """Devices that exist here for the `saved` ones, with a warning if they
    differ; `config` gets fewer stages if its schedule needs them
    (`keras_pipe.saving.layout`)."""
    try:
        placement.resolve_devices(saved)
        return list(saved)
    except ValueError:
        pass
    num_stages = len(saved)
    available = [d.name for d in tf.config.list_logical_devices("GPU")]
    available = available or [
        d.name for d in tf.config.list_logical_devices("CPU")]
    missing = []
    for device in saved:
        try:
            placement.resolve_devices([device])
        except ValueError:
            missing.append(device)
    schedule = config.get("schedule", "gpipe")
    try:
        new_k, indices = layout.fit(schedule, num_stages, len(available),
                                    can_recut=cut)
    except ValueError as exc:
        raise ValueError(
            f"The saved devices {missing} do not exist in this process "
            f"(available: {available}): {exc}") from exc
    chosen = [available[i] for i in indices]
    recut = ""
    if new_k != num_stages:
        config["balance"] = layout.merged_balance(config["balance"], new_k)
        config["remat"] = layout.merged_remat(
            config.get("remat", "except_last"), num_stages, new_k)
        recut = (f" schedule={schedule!r} cannot run the saved {num_stages} "
                 f"stages on {len(available)} devices: the model is cut "
                 f"again into {new_k} stages (balance={config['balance']}; "
                 "the weights do not depend on the cut).")
    warnings.warn(
        f"keras_pipe: the saved devices {missing} do not exist in this "
        f"process (available: {available}). The {num_stages} stages, saved "
        f"on {list(saved)}, are placed on {chosen} instead.{recut} Pass "
        "devices=[...] to keras_pipe.load_model() to choose.",
        UserWarning, stacklevel=3)
    return chosen


def from_config(cls, config, custom_objects=None):
    """Re-creates a PipelineModel, each stage under its device."""
    config = dict(config)
    cut = "source_model" in config
    needed = ("source_model", "balance", "devices") if cut else (
        "stages", "devices")
    missing = [k for k in needed if k not in config]
    if missing:
        raise ValueError(
            f"A PipelineModel config needs the keys {missing}. Received "
            f"keys: {sorted(config)}")
    saved = config.pop("devices")
    num_stages = len(config["balance"] if cut else config["stages"])
    if not num_stages or len(saved) != num_stages:
        raise ValueError(
            f"A PipelineModel config must list one device per stage: it has "
            f"{num_stages} stages and devices={saved}.")
    devices = getattr(LOADING, "devices", None)
    if devices is None:
        devices = _fallback(saved, config, cut)
        num_stages = len(devices)
    resolved = placement.resolve_devices(devices)
    if cut:
        from keras_pipe.planning import partition  # noqa: PLC0415
        source = keras.saving.deserialize_keras_object(
            config.pop("source_model"), custom_objects=custom_objects)
        stages = partition.split_model(source, num_stages,
                                       balance=config.pop("balance"))
        model = cls(stages=stages, devices=devices, **config)
        return model
    stages = []
    for stage_config, device in zip(config.pop("stages"), resolved):
        with tf.device(device):
            stages.append(keras.saving.deserialize_keras_object(
                stage_config, custom_objects=custom_objects))
    model = cls(stages=stages, devices=devices, **config)
    _build_from_stages(model)
    return model


def _build_from_stages(model):
    """Builds `model` when its stages are built but stage 0 has no Input.

    `fit` builds a pipeline from its first batch, which leaves no build
    config to save; the first stage's own build config has the shape.
    """
    if model.built or not all(s.built for s in model.stages):
        return
    build_config = model.stages[0].get_build_config() or {}
    if "input_shape" in build_config:
        model.build(build_config["input_shape"])


def compile_from_config(model, config):
    """`Model.compile_from_config` for a model whose `compile` is overridden.

    Keras skips compiling (with a warning) when `compile` is overridden, and
    then the optimizer state in the file has nowhere to go.
    """
    config = keras.saving.deserialize_keras_object(config)
    model.compile(**config)
    if model.optimizer is not None and model.built:
        model.optimizer.build(model.trainable_variables)
