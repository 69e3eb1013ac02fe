"""Saving and loading a PipelineModel: config, cut-independent weights, checked files.

Stock Keras saving walks a model's attributes, so a pipeline's weights would
be filed under its stages (`layers/sequential_1/layers/dense/...`) and a file
written with 2 stages would not load into the same network cut into 3. Here
`PipelineModel.layers` is the flat list of the unpipelined model's layers
(nested Sequential and Functional stages opened), so the weights file has the
layout of the plain model, `layers/<layer class>[_k]/vars/<i>`, whatever the
cut; the plain model loads it with `keras.Model.load_weights` as well.

Two more things stock saving loses and a pipeline needs:

* the states of seed generators (Dropout masks), without which training
  after a save and load draws other masks than training straight on; they
  are written under `_seed_states/vars`, in layer order (plain Keras models
  ignore that group);
* devices: a file saved on 4 devices must load in a process with 1, so
  `from_config` falls back, with a warning, to the devices that exist, or
  uses the devices given to `keras_pipe.load_model`.

Loading checks the file first and names it in every error: not a zip,
truncated, damaged, another model class, a stage's weights missing. A failed
`load_weights` restores the values the model had, so a model is never left
half loaded.

Saving is atomic (`write_atomically`): `save` and `save_weights`, and so
Keras' `ModelCheckpoint` and `keras_pipe.BackupAndRestore`, write a
temporary file in the target's folder, fsync it and rename it over the
target. Keras writes in place, so a crash during the save of a large model
would leave a truncated file and no previous copy.

A `.weights.h5` file is first made in memory (`weights_bytes`), then
written with plain Python I/O: when libhdf5 itself meets a full disk it
leaves ids it cannot close, and the process segfaults at exit; a failed
`write()` is a clean `OSError` naming the user's path. The file carries a
SHA-256 checksum of each weight (`keras_pipe.saving.checksums`) that
`load_weights` verifies, so a damaged value is refused
instead of loaded (plain Keras files, without checksums, load as before).
A `.keras` file is a zip whose members carry a CRC-32, checked on loading.
"""

import contextlib
import errno
import io
import json
import os
import threading
import uuid
import warnings
import zipfile
import zlib

import h5py
import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import placement
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.saving import checksums, layout

__all__ = ["load_model", "flat_layers", "weight_paths", "get_config",
           "from_config", "compile_from_config", "load_weights",
           "check_weights", "SeedStates", "write_atomically", "save_model",
           "save_weights", "weights_bytes", "write_weights_file"]

_CONFIG = "config.json"
_WEIGHTS = "model.weights.h5"
_REGISTERED_NAME = "keras_pipe>PipelineModel"
# Per-thread loading context: devices forced by `load_model`, and the last
# weights-layout problem found (to report it without Keras' wrapping).
_LOADING = threading.local()


# ----------------------------------------------------------------- layout

def is_container(layer):
    """Sequential and plain Functional models are opened; other layers are not."""
    return type(layer) in (keras.Sequential, _compat.Functional)


def graph_of(stages):
    """The `keras_pipe.planning.graph.Graph` the stages were cut from, else None.

    Stages made by `PipelineModel.from_model` (`partition.GraphStage`) run
    calls of one original model.
    """
    graphs = {id(getattr(s, "source_graph", None)) for s in stages}
    if len(graphs) != 1 or not all(
            hasattr(s, "calls") and hasattr(s, "source_graph")
            for s in stages):
        return None
    return stages[0].source_graph


def _stage_layers(stage):
    """The layers of one stage, nested Sequential/Functional models opened."""
    if isinstance(stage, keras.layers.InputLayer):
        return []
    if hasattr(stage, "calls") and hasattr(stage, "source_graph"):
        ops = [c.operation for c in stage.calls]
        return [leaf for op in ops if isinstance(op, keras.layers.Layer)
                for leaf in _stage_layers(op)]
    if not is_container(stage):
        return [stage]
    return [leaf for layer in stage.layers for leaf in _stage_layers(layer)]


def _source_layers(graph):
    """The layers of the model a pipeline was cut from, without Inputs."""
    return [layer for layer in graph.model.layers
            if not isinstance(layer, keras.layers.InputLayer)]


def flat_layers(stages):
    """The layers of the unpipelined model, stage after stage.

    For stages cut by `PipelineModel.from_model`, the layers of the model
    they were cut from, as that model lists them (`model.layers`: a nested
    model is one entry), so that weight files have that model's layout.
    Otherwise Sequential and Functional stages (and models nested in them)
    are opened up; any other layer, a subclassed model included, is one
    entry. Input layers are left out.
    """
    graph = graph_of(stages)
    if graph is not None:
        return _source_layers(graph)
    seen, result = set(), []
    for stage in stages:
        for layer in _stage_layers(stage):
            if id(layer) not in seen:
                seen.add(id(layer))
                result.append(layer)
    return result


def _snake_names(layers):
    """Keras' names for list entries (`_save_container_state`)."""
    used, names = {}, []
    for layer in layers:
        name = _compat.to_snake_case(type(layer).__name__)
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        names.append(name)
    return names


def _nested_paths(layers, prefix, stage_of, seen, result):
    """Paths of `layers` as Keras saves them: nested models under `layers/`."""
    for layer, name in zip(layers, _snake_names(layers)):
        if id(layer) in seen:
            continue  # Keras saves a layer where it first meets it.
        seen.add(id(layer))
        path = f"{prefix}/{name}"
        if _compat.object_type(layer) in ("Functional", "Sequential"):
            _nested_paths(layer.layers, f"{path}/layers", stage_of, seen,
                          result)
        elif not isinstance(layer, keras.layers.InputLayer):
            result.append((stage_of.get(id(layer), 0), layer, path))


def weight_paths(stages):
    """`[(stage index, layer, path in the weights file)]`, in file order.

    Mirrors Keras' naming of list entries (`_save_container_state`): the
    snake-case class name, `_1`, `_2`... for repeats. It depends on the
    order of the layers, never on where the stages are cut. Stages cut by
    `from_model` have the layout of the model they were cut from, nested
    models included (`layers/functional/layers/dense`).
    """
    graph = graph_of(stages)
    if graph is not None:
        stage_of = {}
        for j, stage in enumerate(stages):
            for call in stage.calls:
                stage_of.setdefault(id(call.operation), j)
        result = []
        _nested_paths(_source_layers(graph), "layers", stage_of, set(),
                      result)
        return result
    owned, seen = [], set()
    for j, stage in enumerate(stages):
        layers = [l for l in _stage_layers(stage) if id(l) not in seen]
        seen.update(id(l) for l in layers)
        owned += [(j, layer) for layer in layers]
    names = _snake_names([layer for _, layer in owned])
    return [(j, layer, f"layers/{name}")
            for (j, layer), name in zip(owned, names)]


class SeedStates(_compat.KerasSaveable):
    """The seed generator states of some layers, as one saveable object.

    Keras saves a layer's own variables only; the state of a
    `keras.random.SeedGenerator` held by a layer (Dropout) is not saved, so
    training after a round trip would draw different masks.
    """

    def __init__(self, layers):
        self._generators = [g for layer in layers
                            for sub in _compat.flatten_layers(layer)
                            for g in _compat.seed_generators(sub)]

    def _obj_type(self):
        return "Operation"

    def save_own_variables(self, store):
        for i, generator in enumerate(self._generators):
            store[str(i)] = generator.state.numpy()

    def load_own_variables(self, store):
        if not len(store.keys()):
            return  # A file of a plain Keras model: keep the current states.
        if len(store.keys()) != len(self._generators):
            raise ValueError(
                f"The file holds {len(store.keys())} seed generator states "
                f"but the model has {len(self._generators)} seed generators: "
                "the file was saved from a different network.")
        for i, generator in enumerate(self._generators):
            generator.state.assign(store[str(i)])


# ----------------------------------------------------------------- config

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
    graph = graph_of(model.stages)
    if graph is not None:
        config["source_model"] = keras.saving.serialize_keras_object(
            graph.model)
        config["balance"] = [len(s.calls) for s in model.stages]
    else:
        config["stages"] = [keras.saving.serialize_keras_object(s)
                            for s in model.stages]
    return config


@contextlib.contextmanager
def _forced_devices(devices):
    previous = getattr(_LOADING, "devices", None)
    _LOADING.devices = devices
    try:
        yield
    finally:
        _LOADING.devices = previous


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
    devices = getattr(_LOADING, "devices", None)
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


# ---------------------------------------------------------------- weights

def _group_vars(h5, path):
    """The `vars` datasets under `path`, `None` when the group is absent."""
    if path not in h5 or "vars" not in h5[path]:
        return None
    return h5[path]["vars"]


def _has_datasets(group):
    found = []
    group.visititems(lambda _, obj: found.append(1) if isinstance(
        obj, h5py.Dataset) else None)
    return bool(found)


def check_weights(model, h5, source):
    """Checks that `h5` holds weights for every layer of `model`, stage by stage.

    Args:
        model: a built PipelineModel.
        h5: the open root group of a Keras weights file.
        source: how to name the file in the message.

    Raises:
        ValueError: listing, per stage, the layers whose weights are missing
            or have another shape, and the layers in the file that the model
            does not have.
    """
    problems = []
    expected = weight_paths(model.stages)
    by_stage = {}
    for j, layer, path in expected:
        own = _compat.own_variables(layer)
        if not layer.variables:
            continue
        if path not in h5:
            by_stage.setdefault(j, []).append(f"{layer.name!r} ({path})")
            continue
        group = _group_vars(h5, path)
        stored = list(group.keys()) if group is not None else []
        if len(stored) != len(own):
            problems.append(
                f"layer {layer.name!r} of stage {j} has {len(own)} "
                f"variables but {path} holds {len(stored)}")
            continue
        for i, variable in enumerate(own):
            shape = tuple(group[str(i)].shape)
            if shape != tuple(variable.shape):
                problems.append(
                    f"layer {layer.name!r} of stage {j}: variable "
                    f"{variable.name!r} has shape {tuple(variable.shape)} "
                    f"but {path}/vars/{i} has shape {shape}")
    for j, names in sorted(by_stage.items()):
        stage = model.stages[j]
        problems.insert(0, (
            f"the weights of stage {j} ({stage.name!r}) are missing: no "
            f"group for {', '.join(names)}"))
    known = {path.split("/")[1] for _, _, path in expected}  # top level
    if "layers" in h5:
        extra = sorted(f"layers/{name}" for name in h5["layers"]
                       if name not in known
                       and _has_datasets(h5["layers"][name]))
        if extra:
            problems.append(
                f"the file has weights for layers the model does not have: "
                f"{extra}")
    if problems:
        raise ValueError(
            f"{source} does not fit this {model.num_stages}-stage "
            f"PipelineModel {model.name!r}: " + "; ".join(problems) + ". It "
            "was saved from a different network (or edited); weights load "
            "across stage counts only for the same layers in the same order.")


def check_store(model, store):
    """`check_weights` on the root store Keras hands to `load_own_variables`."""
    h5 = getattr(store, "h5_file", None)
    if h5 is None or getattr(store, "_h5_entry_path", None):
        return  # Not an H5 file, or a pipeline nested in another model.
    try:
        check_weights(model, h5, "the weights file")
    except ValueError as exc:
        _LOADING.problem = str(exc)
        raise


def _describe_open_error(path, exc):
    size = os.path.getsize(path)
    return (f"Cannot read {path!r}: it is not a readable HDF5 weights file "
            f"(truncated or damaged? {size} bytes). {exc}")


def _open_weights(path):
    """Opens the weights of a `.weights.h5` or `.keras` file as an h5py File."""
    if not os.path.exists(path):
        raise ValueError(f"Cannot load {path!r}: no such file.")
    if path.endswith(".keras"):
        _, h5 = _read_archive(path)
        return h5
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(_describe_open_error(path, exc)) from exc


def weights_bytes(model, attributes=None):
    """The `.weights.h5` file of `model`, made in memory, with checksums.

    Args:
        model: a built Keras model (a `PipelineModel` or any other).
        attributes: extra attributes of the file's root (`BackupAndRestore`
            writes its position there). Defaults to `None`.

    Returns:
        A `memoryview` of the file's bytes.
    """
    buffer = io.BytesIO()
    _compat.save_weights_to(model, buffer)
    with h5py.File(buffer, "r+") as h5:
        checksums.add(h5)
        for name, value in (attributes or {}).items():
            h5.attrs[name] = value
    return buffer.getbuffer()


def write_weights_file(filepath, model, attributes=None, overwrite=True):
    """Writes `weights_bytes(model, attributes)` to `filepath`, atomically.

    libhdf5 never writes to the disk: a full disk is an `OSError` naming
    `filepath`, raised by Python's `write()`, and the process exits
    cleanly.
    """
    def write(path):
        data = weights_bytes(model, attributes)
        with open(path, "wb") as f:
            f.write(data)

    return write_atomically(filepath, write, overwrite)


def load_weights(model, filepath, load, skip_mismatch=False):
    """Checks `filepath` against `model`, then calls `load()`; all or nothing.

    On any error the model's and the optimizer's variables get back the
    values they had, and the error names the file.
    """
    path = os.fspath(filepath)
    optimizer = getattr(model, "optimizer", None)
    if path.endswith(".weights.h5") or path.endswith(".keras"):
        h5 = _open_weights(path)
        try:
            if not skip_mismatch:  # First: it names the stage.
                check_weights(model, h5, repr(path))
            checksums.verify(h5, repr(path))
            with_optimizer = "optimizer" in h5
        finally:
            h5.close()
        if (with_optimizer and optimizer is not None and not optimizer.built
                and model.built):
            # Keras would skip the optimizer state of the file (with a
            # warning): create the slots so that training resumes exactly.
            optimizer.build(model.trainable_variables)
    variables = list(model.variables)
    if optimizer is not None:
        variables += list(optimizer.variables)
    snapshot = [(v, np.array(v.numpy())) for v in variables]
    try:
        load()
    except Exception as exc:
        for variable, value in snapshot:
            variable.assign(value)
        raise ValueError(
            f"Cannot load the weights of {path!r} into PipelineModel "
            f"{model.name!r} (its weights are left unchanged): {exc}") from exc


# ------------------------------------------------------------------ files

def _ask_to_overwrite(path):
    """Keras' interactive overwrite prompt (private API, Keras 3.15)."""
    return _compat.ask_to_proceed_with_overwrite(path)


def _fsync_directory(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # Not every platform opens directories.
    try:
        os.fsync(fd)
    except OSError:
        pass  # Some file systems do not sync directories; the rename stands.
    finally:
        os.close(fd)


def write_atomically(filepath, write, overwrite=True):
    """Calls `write(temporary path)`, then moves that file onto `filepath`.

    The temporary file is in the same folder (a rename within one file
    system is atomic) and its name ends with the target's name (Keras picks
    the format from the extension). It is fsynced before the rename and the
    folder after it. A crash at any point leaves `filepath` as it was, or
    the complete new file; a failed `write` removes the temporary file.

    Args:
        filepath: the file to write.
        write: a function of one path that writes the file there.
        overwrite: if `False` and `filepath` exists, ask first (Keras'
            prompt). Defaults to `True`.

    Returns:
        What `write` returned, or `None` if the user declined to overwrite.
    """
    shown = os.fspath(filepath)
    path = os.path.abspath(shown)
    if os.path.exists(path) and not overwrite:
        if not _ask_to_overwrite(path):
            return None
    folder, name = os.path.split(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            errno.ENOENT, f"Cannot save {shown!r}: the folder {folder!r} "
            "does not exist. Create it first (os.makedirs)", shown)
    temporary = os.path.join(folder, f".{uuid.uuid4().hex[:8]}.tmp.{name}")
    try:
        result = write(temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        named = _naming_user_path(exc, temporary, shown)
        if named is not None:
            raise named from exc
        raise
    _fsync_directory(folder)
    return result


def _naming_user_path(error, temporary, shown):
    """`error` with the user's path `shown` for `temporary`, else None.

    The file is written under a temporary name first; an error of Keras or
    of the file system must still name the file the user asked for.
    """
    if not isinstance(error, Exception):
        return None
    if isinstance(error, OSError) and error.errno is not None:
        reason = error.strerror or str(error)
        new = type(error)(error.errno, f"Cannot save {shown!r}: {reason}",
                          shown)
        return new
    text = str(error)
    short = os.path.basename(temporary)
    if temporary not in text and short not in text:
        return None
    text = text.replace(temporary, shown).replace(short, shown)
    try:
        return type(error)(text)
    except Exception:  # A type whose constructor takes other arguments.
        return None


def _local_file(filepath):
    """Whether `filepath` names a file on a local file system."""
    try:
        path = os.fspath(filepath)
    except TypeError:
        return False
    return isinstance(path, str) and "://" not in path


def save_model(save, filepath, overwrite=True, **kwargs):
    """`PipelineModel.save`: Keras' `save`, atomic for a local file.

    A directory (`zipped=False`) or a remote path is written by Keras as is.
    """
    if kwargs.get("zipped") is False or not _local_file(filepath):
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
    if (max_shard_size is not None or not _local_file(filepath)
            or not os.fspath(filepath).endswith(".weights.h5")
            or not model.built):
        return save(filepath, overwrite=overwrite,
                    max_shard_size=max_shard_size)
    return write_weights_file(filepath, model, overwrite=overwrite)


def _read_archive(path):
    """Checks a `.keras` zip; returns `(config dict, open h5py File)`."""
    if os.path.isdir(path):
        raise ValueError(
            f"Cannot load {path!r}: it is a directory, not a .keras file. A "
            "SavedModel written by PipelineModel.export() loads with "
            "tf.saved_model.load().")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(4)
        size = os.path.getsize(path)
        if head == b"PK\x03\x04":
            raise ValueError(
                f"Cannot load {path!r}: the .keras zip archive is truncated "
                f"({size} bytes, its central directory is missing). Save the "
                "model again or use an intact copy.")
        raise ValueError(
            f"Cannot load {path!r}: it is not a .keras file (a .keras file "
            f"is a zip archive; this one starts with {head!r}, {size} "
            "bytes).")
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            missing = [n for n in (_CONFIG, _WEIGHTS) if n not in names]
            if missing:
                raise ValueError(
                    f"Cannot load {path!r}: the archive has no {missing} "
                    f"(it holds {names}); it was not written by "
                    "model.save().")
            bad = zf.testzip()
            if bad is not None:
                raise ValueError(
                    f"Cannot load {path!r}: the member {bad!r} of the "
                    "archive is damaged (CRC mismatch).")
            config = json.loads(zf.read(_CONFIG))
            weights = zf.read(_WEIGHTS)
    except (zipfile.BadZipFile, zlib.error, EOFError,
            json.JSONDecodeError) as exc:
        raise ValueError(
            f"Cannot load {path!r}: the archive is damaged: {exc}") from exc
    try:
        import io
        h5 = h5py.File(io.BytesIO(weights), "r")
    except OSError as exc:
        raise ValueError(
            f"Cannot load {path!r}: its {_WEIGHTS} is not a readable HDF5 "
            f"file: {exc}") from exc
    return config, h5


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
    config, h5 = _read_archive(path)
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
    _LOADING.problem = None
    try:
        with _forced_devices(None if devices is None else list(devices)):
            return keras.saving.load_model(
                path, custom_objects=custom_objects, compile=compile,
                safe_mode=safe_mode)
    except Exception as exc:
        problem = getattr(_LOADING, "problem", None)
        raise ValueError(
            f"Cannot load {path!r}: {problem or exc}") from exc
    finally:
        _LOADING.problem = None
