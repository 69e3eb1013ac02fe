"""Atomic writes: a temporary file in the target's folder, renamed over it.

Keras writes `.keras` and `.weights.h5` files in place, so a crash during
the save of a large model leaves a truncated file and no previous copy
(the "in-place save" trap, docs/design.md). `write_atomically` writes a
temporary file in the target's folder, fsyncs it and renames it over the
target; an error names the user's path, not the temporary one.
"""

import contextlib
import errno
import os
import uuid

from keras_pipe import _compat

__all__ = ["is_local_file", "write_atomically"]


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


def is_local_file(filepath):
    """Whether `filepath` names a file on a local file system."""
    try:
        path = os.fspath(filepath)
    except TypeError:
        return False
    return isinstance(path, str) and "://" not in path
