"""The C heap of a worker process: how freed tensor buffers are kept.

TensorFlow allocates CPU tensors with glibc's `malloc`. glibc gives each
thread that allocates its own arena (up to 8 per core) and serves blocks
below a moving threshold (up to 32 MiB) from those arenas, where a freed
block stays resident for reuse. A worker runs many threads (gRPC, inter-
and intra-op pools), and the big blocks of a pipeline stage are
short-lived (values received at build, each micro-batch's weight
gradients, tensors in transit), so with glibc's defaults a worker's
resident peak is well above the bytes its tensors use at once.

Where TF's oneDNN kernels are on, TF allocates through its oneDNN CPU
allocator instead, which keeps its freed large blocks in a pool of its own
for the life of the process: no `mallopt` setting reaches
those. `"reuse"` and `"return"` therefore also set
`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1` (unless the environment sets it), which
sends them to `malloc` again.

Three settings (`HEAP_MODES`), chosen with `mallopt` before the process
starts its threads (the environment variables `MALLOC_ARENA_MAX` and
`MALLOC_MMAP_THRESHOLD_` do the same, set before the process starts):

* `"reuse"`: at most 2 arenas; a freed block under `REUSE_THRESHOLD`
  stays resident and serves the next allocation while the process works
  (fast), and the free pages go back once it idles (`trim_when_idle`,
  below): what planning or a build freed does not stay with the steps
  that follow. Blocks of `REUSE_THRESHOLD` or more are mapped on their own
  and unmapped when freed, as glibc maps blocks of 32 MiB or more anyway.
* `"return"`: 2 arenas, and blocks of `RETURN_THRESHOLD` or more are
  mapped on their own and unmapped when freed, so resident memory follows
  the allocator's bytes in use (what the memory model predicts,
  `keras_pipe.planning.resident`), oneDNN's allocator included (above).
  Each such allocation faults its pages in afresh: steps are slower. Once
  the process has been idle for `TRIM_AFTER_IDLE` seconds after work, a
  thread gives the free pages inside the arenas back (`malloc_trim`,
  `trim_when_idle`).
* `"glibc"`: glibc's own settings.

Why `RETURN_THRESHOLD` is glibc's own starting threshold (which glibc
raises as mapped blocks are freed, and `"return"` pins): under a higher
one, the blocks between (a micro-batch's activations when micro-batches
are small) come from the arenas, whose freed chunks, fragmented among
TF's long-lived small blocks, stay resident and grow from step to step.
The price of a lower one is more page faults.

Why `"reuse"` pins a threshold as well: glibc raises its threshold to the
size of each mapped block freed, up to 32 MiB, so a model's big weight
gradients (tens of MiB) come from the arenas after the first step, and a
freed one leaves a hole that the next step's blocks only partly fill: a
worker's peak then grows from step to step. At `REUSE_THRESHOLD` they are
mapped and given back; the page faults are a small share of the product
that makes such a block, and blocks of a micro-batch's size stay below.

Why trim as well: blocks under the threshold stay in the arenas, and glibc
gives back only the free space at an arena's top, never the free pages
between blocks in use (what a build's transfers leave behind). Why when
idle, not on a clock: idle, a worker has nothing in transit, so a trim
gives back what transfers left and never cuts into a run of steps. The
measurements behind these choices, with their commands, are in
docs/capacity.md ("The heap: speed against memory").
"""

import ctypes
import ctypes.util
import os
import threading
import time

__all__ = ["HEAP_MODES", "ONEDNN_SYSTEM_ALLOCATOR", "RETURN_THRESHOLD",
           "REUSE_THRESHOLD", "TRIM_AFTER_IDLE", "IdleSpell", "check_mode",
           "configure", "trim_when_idle"]

HEAP_MODES = ("reuse", "return", "glibc")
# `"return"`'s mmap threshold: blocks of this many bytes or more are mapped
# on their own and unmapped when freed (the module says why this size). The
# memory model of a worker's resident memory reads it from here.
RETURN_THRESHOLD = 128 << 10
# `"reuse"`'s mmap threshold: blocks of this many bytes or more are mapped on
# their own (the module says why).
REUSE_THRESHOLD = 16 << 20
# `"reuse"`, `"return"`: a worker trims its heap once it has been idle this
# many seconds after doing work (`trim_when_idle`).
TRIM_AFTER_IDLE = 0.5
# A poll in which the process used less CPU than this share of the time
# between two polls is idle (an idle worker uses about none).
IDLE_CPU_SHARE = 0.05

# TF reads it when its oneDNN CPU allocator first allocates: `"reuse"` and
# `"return"` set it before TF loads (the module says why).
ONEDNN_SYSTEM_ALLOCATOR = "TF_ONEDNN_USE_SYSTEM_ALLOCATOR"

_M_TRIM_THRESHOLD = -1
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

    Call before TensorFlow starts its threads. `"reuse"` and `"return"`
    also set `ONEDNN_SYSTEM_ALLOCATOR` in this process's environment unless
    it is set. Otherwise a no-op (returns `False`) where the C library is
    not glibc, and for `"glibc"`.

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
    if mode != "glibc":
        os.environ.setdefault(ONEDNN_SYSTEM_ALLOCATOR, "1")
    libc = _libc()
    if libc is None or mode == "glibc":
        return False
    applied = bool(libc.mallopt(_M_ARENA_MAX, int(arena_max)))
    if mode == "return":
        return applied and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    # Pinned, the threshold no longer moves glibc's trim threshold with it
    # (twice the mmap threshold): set as glibc would.
    return applied and bool(
        libc.mallopt(_M_MMAP_THRESHOLD, REUSE_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * REUSE_THRESHOLD))


class IdleSpell:
    """When to trim: once per idle spell that follows work.

    Fed samples of (wall clock, the process's CPU time) in seconds
    (`observe`); says a trim is due when the process has used less than
    `IDLE_CPU_SHARE` of the time for `quiet` seconds since it last used
    more, and has used more since the last trim. The first sample starts
    it busy (a worker starts by loading TensorFlow).

    Args:
        quiet: seconds of idle before a trim, > 0.
    """

    def __init__(self, quiet):
        self.quiet = quiet
        self._last = None          # (wall, cpu) of the previous sample
        self._idle_since = None    # wall clock when the idle spell began
        self._worked = True        # work done since the last trim

    def observe(self, wall, cpu):
        """Takes one sample; returns whether a trim is due now."""
        last, self._last = self._last, (wall, cpu)
        if last is None:
            return False
        busy = cpu - last[1] > IDLE_CPU_SHARE * max(wall - last[0], 0.0)
        if busy:
            self._worked, self._idle_since = True, None
            return False
        if self._idle_since is None:
            self._idle_since = last[0]
        if self._worked and wall - self._idle_since >= self.quiet:
            self._worked = False
            return True
        return False

    def trimmed(self, wall, cpu):
        """Takes the sample after a trim: the trim's own CPU is not work."""
        self._last = (wall, cpu)


def trim_when_idle(quiet=TRIM_AFTER_IDLE):
    """Starts a daemon thread that gives the free pages of this process's
    malloc arenas back to the OS (`malloc_trim(0)`) once per idle spell of
    `quiet` seconds after work (`IdleSpell`); a worker starts it with heap
    `"reuse"` or `"return"`. It samples the process's CPU time `5 / quiet`
    times a second.

    A no-op (returns `None`) where the C library is not glibc.

    Args:
        quiet: seconds idle before a trim, > 0. Defaults to
            `TRIM_AFTER_IDLE` (0.5 s).

    Returns:
        The started `threading.Thread` (`.trims`: how many it made so
        far; `.stop`: a `threading.Event` that ends it), or `None`.

    Raises:
        ValueError: for a `quiet` that is not a positive number.
    """
    if isinstance(quiet, bool) or not isinstance(quiet, (int, float)) \
            or not quiet > 0:
        raise ValueError(f"quiet must be a number of seconds > 0, e.g. "
                         f"0.5. Received: quiet={quiet!r}")
    libc = _libc()
    if libc is None:
        return None
    stop = threading.Event()
    spell = IdleSpell(quiet)

    def run():
        while True:
            if spell.observe(time.monotonic(), time.process_time()):
                libc.malloc_trim(0)
                thread.trims += 1
                spell.trimmed(time.monotonic(), time.process_time())
            if stop.wait(quiet / 5):
                return

    thread = threading.Thread(target=run, name="keras_pipe-malloc-trim",
                              daemon=True)
    thread.stop, thread.trims = stop, 0
    thread.start()
    return thread
