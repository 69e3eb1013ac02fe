"""Weights files: checked before loading, made in memory, loaded all or nothing.

Loading checks the file first and names it in every error: not a zip,
truncated, damaged, a stage's weights missing. A failed `load_weights`
restores the values the model had, so a model is never left half loaded.

A `.weights.h5` file is first made in memory (`weights_bytes`), then
written with plain Python I/O: when libhdf5 itself meets a full disk it
leaves ids it cannot close, and the process segfaults at exit; a failed
`write()` is a clean `OSError` naming the user's path. The file carries a
SHA-256 checksum of each weight (`keras_pipe.saving.checksums`) that
`load_weights` verifies, so a damaged value is refused instead of loaded
(plain Keras files, without checksums, load as before).
"""

import io
import os

import h5py
import numpy as np

from keras_pipe import _compat
from keras_pipe.saving import checksums, layer_paths
from keras_pipe.saving.archive import read_archive
from keras_pipe.saving.atomic import write_atomically
from keras_pipe.saving.config import LOADING

__all__ = ["check_store", "check_weights", "load_weights", "weights_bytes",
           "write_weights_file"]


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
    expected = layer_paths.weight_paths(model.stages)
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
        LOADING.problem = str(exc)
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
        _, h5 = read_archive(path)
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
