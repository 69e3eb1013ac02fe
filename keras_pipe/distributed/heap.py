"""The C heap of a worker process: freed tensor buffers go back to the OS.

TensorFlow allocates CPU tensors with glibc's `malloc`. glibc gives each
thread that allocates its own arena (up to 8 per core) and serves blocks
below a moving threshold (up to 32 MiB) from those arenas, where a freed
block stays resident. A worker runs ~100 threads (gRPC, inter- and
intra-op pools), and the big blocks of a pipeline stage are short-lived:
values received at build, each micro-batch's weight gradients, tensors in
transit. Measured on the MLP of `tools/worker_memory.py` (7 x
Dense(3584), 2 workers, M=2, SGD): stage 0's resident peak was 624 MiB
above an idle worker with glibc's defaults, 1.07x the unsplit process's,
where its weights, summed gradients and one layer's gradient make ~400.

`return_freed_memory` fixes the two knobs with `mallopt` before the
process starts its threads: blocks of `mmap_threshold` bytes or more are
mapped on their own and unmapped when freed, and at most `arena_max`
arenas exist. Same effect as the environment variables
`MALLOC_MMAP_THRESHOLD_` and `MALLOC_ARENA_MAX`, which must be set before
the process starts.
"""

import ctypes
import ctypes.util

__all__ = ["return_freed_memory"]

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc():
    """glibc, or None on another C library (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


def return_freed_memory(mmap_threshold=1 << 20, arena_max=2):
    """Makes glibc give freed big blocks back to the OS in this process.

    Call before TensorFlow starts its threads. A no-op (returns `False`)
    where the C library is not glibc.

    Args:
        mmap_threshold: blocks of at least this many bytes are mapped on
            their own and unmapped when freed. Defaults to `1 << 20`.
        arena_max: the most malloc arenas. Defaults to `2`.

    Returns:
        Whether both settings were applied.
    """
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))
                and libc.mallopt(_M_ARENA_MAX, int(arena_max)))
