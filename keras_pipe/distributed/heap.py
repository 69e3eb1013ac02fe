"""The C heap of a worker process: how freed tensor buffers are kept.

TensorFlow allocates CPU tensors with glibc's `malloc`. glibc gives each
thread that allocates its own arena (up to 8 per core) and serves blocks
below a moving threshold (up to 32 MiB) from those arenas, where a freed
block stays resident for reuse. A worker runs ~100 threads (gRPC, inter-
and intra-op pools), and the big blocks of a pipeline stage are
short-lived: values received at build, each micro-batch's weight
gradients, tensors in transit. Measured on the MLP of
`tools/worker_memory.py` (7 x Dense(3584), 2 workers, M=2, SGD): stage 0's
resident peak was 624 MiB above an idle worker with glibc's defaults, 1.07x
the unsplit process's, where its weights, summed gradients and one layer's
gradient make ~400.

Three settings (`HEAP_MODES`), chosen with `mallopt` before the process
starts its threads (the environment variables `MALLOC_ARENA_MAX` and
`MALLOC_MMAP_THRESHOLD_` do the same, set before the process starts):

* `"reuse"`: at most 2 arenas; a freed block stays resident and serves the
  next allocation. Resident peaks 348 and 312 MiB on that MLP's two
  workers.
* `"return"`: 2 arenas, and blocks of `RETURN_THRESHOLD` (128 KiB) or
  more are mapped on their own and unmapped when freed: 310 and 252 MiB
  (with 1 MiB then). Each such allocation then faults its pages in afresh:
  on the 8 x Dense(1024) benchmark job (batch 512, 2 workers) that is
  60-100 ms of system CPU per worker per step and 1.15-1.25x the step
  time of `"reuse"` (`docs/capacity.md`, measured with 1 MiB).
* `"glibc"`: glibc's own settings.

Why 128 KiB (glibc's own starting threshold, which glibc raises as mapped
blocks are freed and `"return"` pins): with 1 MiB, the blocks between
(a micro-batch's activations when micro-batches are small: 256-512 KiB
on the Transformer of `tools/memory_model.py --workers` at M = 4) came from
the arenas, whose freed chunks, fragmented among long-lived small blocks
of TF's, stayed resident: after two steps of Adam, M = 4, its worker 0
held 184 MiB above idle of which `malloc_trim(0)` gave back 100 (glibc's
`mallinfo2`: 102 MiB free in the arenas), and the resident peak grew from
step to step (214 MiB after 2 steps, 249-282 after 30). With 128 KiB: 161
MiB, 4 MiB free in the arenas, steady (166 after 30 steps with 64 KiB). The
price is more page faults: that configuration's step took 1.31-1.33 s
against 1.00-1.05 s with 1 MiB (the least of 12 steps, two runs each,
interleaved, load 3-4 on 2 cores). Measured with `python
tools/heap_probe.py transformer adam 4 gpipe never` (1 MiB: add `--heap
glibc --env MALLOC_ARENA_MAX=2 --env MALLOC_MMAP_THRESHOLD_=1048576`).
"""

import ctypes
import ctypes.util

__all__ = ["HEAP_MODES", "RETURN_THRESHOLD", "check_mode", "configure"]

HEAP_MODES = ("reuse", "return", "glibc")
# `"return"`'s mmap threshold: blocks of this many bytes or more are mapped
# on their own and unmapped when freed (the module says why this size).
RETURN_THRESHOLD = 128 << 10

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


def check_mode(mode):
    """`mode` if it is one of `HEAP_MODES`; else a ValueError naming it."""
    if mode not in HEAP_MODES:
        raise ValueError(
            f"heap must be one of {', '.join(map(repr, HEAP_MODES))}: "
            f"'reuse' (fast, freed buffers stay resident for reuse), "
            f"'return' (freed big buffers go back to the OS: lower resident "
            f"peaks, slower steps), 'glibc' (untouched). Received: "
            f"heap={mode!r}")
    return mode


def configure(mode, arena_max=2, mmap_threshold=RETURN_THRESHOLD):
    """Sets this process's heap to `mode` (one of `HEAP_MODES`).

    Call before TensorFlow starts its threads. A no-op (returns `False`)
    where the C library is not glibc, and for `"glibc"`.

    Args:
        mode: `"reuse"`, `"return"` or `"glibc"` (see the module).
        arena_max: the most malloc arenas (`"reuse"`, `"return"`).
            Defaults to `2`.
        mmap_threshold: with `"return"`, blocks of at least this many
            bytes are mapped on their own and unmapped when freed.
            Defaults to `RETURN_THRESHOLD` (128 KiB).

    Returns:
        Whether the settings were applied.

    Raises:
        ValueError: for a `mode` not in `HEAP_MODES`.
    """
    check_mode(mode)
    libc = _libc()
    if libc is None or mode == "glibc":
        return False
    applied = bool(libc.mallopt(_M_ARENA_MAX, int(arena_max)))
    if mode == "return":
        applied = applied and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    return applied

