"""Reading a `.keras` archive, checked: its members, their CRC-32, its weights."""

import io
import json
import os
import zipfile
import zlib

import h5py

__all__ = ["CONFIG", "WEIGHTS", "read_archive"]


CONFIG = "config.json"
WEIGHTS = "model.weights.h5"


def read_archive(path):
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
            missing = [n for n in (CONFIG, WEIGHTS) if n not in names]
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
            config = json.loads(zf.read(CONFIG))
            weights = zf.read(WEIGHTS)
    except (zipfile.BadZipFile, zlib.error, EOFError,
            json.JSONDecodeError) as exc:
        raise ValueError(
            f"Cannot load {path!r}: the archive is damaged: {exc}") from exc
    try:
        h5 = h5py.File(io.BytesIO(weights), "r")
    except OSError as exc:
        raise ValueError(
            f"Cannot load {path!r}: its {WEIGHTS} is not a readable HDF5 "
            f"file: {exc}") from exc
    return config, h5
