"""SHA-256 checksums of the weights in a `.weights.h5` file.

Keras' weights files carry no checksum: a file damaged on disk or in a
copy (8 flipped bytes inside a kernel) loads, and a value is off by 5e26.
keras_pipe writes the SHA-256 of each dataset's dtype, shape and values as
an attribute of the dataset, and of the sorted list of (path, digest) on
the file's root, both named `keras_pipe_sha256`; Keras ignores attributes,
so plain Keras loads these files, and files without the root attribute
(written by plain Keras) are not checked. It finds damage, not tampering:
whoever edits the file can write new checksums.
"""

import hashlib

import h5py
import numpy as np

__all__ = ["add", "verify"]

# Attribute of each dataset (its SHA-256) and of the root (of the list).
_CHECKSUM = "keras_pipe_sha256"


def _datasets(h5):
    """`[(path, dataset)]` of every dataset in `h5`, sorted by path."""
    found = []
    h5.visititems(lambda name, obj: found.append((name, obj)) if isinstance(
        obj, h5py.Dataset) else None)
    return sorted(found, key=lambda item: item[0])


def _digest(dataset):
    """SHA-256 of a dataset's dtype, shape and values, as hex."""
    value = np.asarray(dataset[()])
    digest = hashlib.sha256(f"{value.dtype.str} {value.shape}".encode())
    if value.dtype.kind == "O":
        digest.update(repr(value.tolist()).encode())
    else:
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _list_digest(entries):
    text = "\n".join(f"{path} {digest}" for path, digest in entries)
    return hashlib.sha256(text.encode()).hexdigest()


def add(h5):
    """Writes the SHA-256 of each dataset, and of their list, into `h5`."""
    entries = []
    for path, dataset in _datasets(h5):
        digest = _digest(dataset)
        dataset.attrs[_CHECKSUM] = digest
        entries.append((path, digest))
    h5.attrs[_CHECKSUM] = _list_digest(entries)


def verify(h5, source):
    """Checks the checksums `add` wrote; `False` if there are none.

    Args:
        h5: an open weights file (root group).
        source: how to name the file in the message.

    Returns:
        `True` if the file has checksums and every one matches, `False` for
        a file without them (written by plain Keras).

    Raises:
        ValueError: naming the file and the damaged weights, if a value
            differs from its checksum or weights were added or removed.
    """
    expected = h5.attrs.get(_CHECKSUM)
    if expected is None:
        return False
    damaged, entries = [], []
    for path, dataset in _datasets(h5):
        stored = dataset.attrs.get(_CHECKSUM)
        try:
            digest = _digest(dataset)
        except (OSError, ValueError):  # Unreadable: damaged too.
            digest = None
        if stored is not None and digest != stored:
            damaged.append(path)
        entries.append((path, stored))
    fix = ("Use an intact copy of the file, or save the weights again; a "
           "file written by plain Keras has no checksum and is not checked")
    if damaged:
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        raise ValueError(
            f"Cannot load {source}: the values of {damaged[:3]}{more} do not "
            "match the SHA-256 checksums keras_pipe wrote with them (the file "
            f"was damaged or edited after it was saved). {fix}.")
    if any(stored is None for _, stored in entries) or \
            _list_digest(entries) != expected:
        added = [path for path, stored in entries if stored is None]
        raise ValueError(
            f"Cannot load {source}: its list of weights does not match the "
            "checksum keras_pipe wrote with it (weights were added or "
            f"removed after it was saved{f': {added[:3]}' if added else ''})."
            f" {fix}.")
    return True
