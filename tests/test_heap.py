"""The worker heap's settings (`keras_pipe.distributed.heap`), in a child.

What a setting costs is page faults: a big block unmapped when freed is
faulted in afresh by the next allocation of its size (60-100 ms of system
CPU per worker per step on the MLP benchmark job). Counted here on 4 MiB
blocks allocated, written and freed in a loop, as a stage's gradients are.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from keras_pipe.distributed import heap

# The child loads heap.py by its path: `keras_pipe.distributed.heap` would
# run keras_pipe/__init__ and import Keras and TensorFlow (15-30 s of CPU)
# for a module that needs only ctypes.
_PRELUDE = r"""
import ctypes, importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[2])
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
applied = heap.configure(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
"""
_CHILD = _PRELUDE + r"""libc.free.argtypes = [ctypes.c_void_p]
size, rounds = int(sys.argv[3]), 20

def round_():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

for _ in range(3):  # glibc's dynamic threshold settles
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds):
    round_()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults_per_round": faults / rounds,
                  "pages": size // resource.getpagesize()}))
"""


def _faults(mode, size=4 << 20):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, heap.__file__, str(size)],
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_reuse_keeps_freed_blocks_for_the_next_allocation():
    result = _faults("reuse")
    assert result["applied"]
    assert result["faults_per_round"] < 0.05 * result["pages"], result


def test_reuse_gives_back_blocks_of_its_threshold():
    # A big weight gradient's size: glibc alone would serve it from an
    # arena after the first one freed (its threshold rises to 32 MiB).
    result = _faults("reuse", heap.REUSE_THRESHOLD + (4 << 20))
    assert result["applied"]
    assert result["faults_per_round"] > 0.9 * result["pages"], result
    assert _faults("glibc", heap.REUSE_THRESHOLD + (4 << 20))[
        "faults_per_round"] < 0.05 * result["pages"]


def test_return_gives_freed_blocks_back_and_faults_them_in_again():
    result = _faults("return")
    assert result["applied"]
    assert result["faults_per_round"] > 0.9 * result["pages"], result


def test_a_bad_mode_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"heap='fast'"):
        heap.configure("fast")


# The children's resident size, and `count` blocks of `size` bytes each
# followed by a 1 KiB block that stays alive (TF's own small blocks), all
# written.
_INTERLEAVE = r"""libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def interleave(size, count):
    big, small = [], []
    for _ in range(count):
        big.append(libc.malloc(size))
        ctypes.memset(big[-1], 1, size)
        small.append(libc.malloc(1024))
        ctypes.memset(small[-1], 1, 1024)
    return big, small
"""

# Blocks of a small micro-batch's size (256 KiB: a Transformer's
# activations at 4 rows) freed among small blocks that stay alive (TF's
# own): with a 1 MiB threshold they came from an arena, whose freed chunks
# between live ones stayed resident (a worker held 100 MiB of them after a
# step, `keras_pipe.distributed.heap`).
_FRAGMENTS = _PRELUDE + _INTERLEAVE + r"""size, count = 256 << 10, 200
before = resident()
big, small = interleave(size, count)
held = resident() - before
for block in big:
    libc.free(block)
print(json.dumps({"applied": applied, "held": held,
                  "kept": resident() - before, "bytes": size * count}))
"""


def test_return_gives_back_small_micro_batch_blocks_among_live_ones():
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTS, "return", heap.__file__],
        capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["applied"]
    assert result["held"] > 0.9 * result["bytes"], result
    assert result["kept"] < 0.1 * result["bytes"], result


# Blocks under the threshold (64 KiB) freed among small live ones stay in
# the arena: glibc returns only free space at an arena's top. A worker held
# 15.7 MiB of them from a ResNet stage's build on (`heap.trim_when_idle`).
_TRIMMED = _PRELUDE + _INTERLEAVE + r"""import time
size, count = 64 << 10, 400
thread = heap.trim_when_idle(0.2) if sys.argv[3] == "trim" else None
before = resident()
big, small = interleave(size, count)
for block in big:
    libc.free(block)
kept = resident() - before
# Busy for 1 s (the trim waits for the process to go idle), then idle.
end = time.process_time() + 1.0
while time.process_time() < end:
    pass
busy = resident() - before
# A trim is due 0.2 s after: 30 s for a loaded host; without the thread
# nothing trims, and 2 s shows it.
deadline = time.monotonic() + (30 if thread else 2)
while resident() - before > 0.1 * size * count \
        and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # idle on: no second trim without work between
print(json.dumps({"kept": kept, "busy": busy, "after": resident() - before,
                  "bytes": size * count, "trims": thread and thread.trims,
                  "daemon": bool(thread and thread.daemon)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("trim", [False, True])
def test_return_trims_free_pages_between_live_blocks_when_idle(trim):
    out = subprocess.run(
        [sys.executable, "-c", _TRIMMED, "return", heap.__file__,
         "trim" if trim else "none"],
        capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    # Freed but resident without the trim (what the trim is for) ...
    assert result["kept"] > 0.9 * result["bytes"], result
    # ... and while the process works (a build, a step: nothing trimmed).
    assert result["busy"] > 0.9 * result["bytes"], result
    if trim:
        assert result["daemon"], result
        assert result["after"] < 0.1 * result["bytes"], result
        assert result["trims"] == 1, result
    else:
        assert result["after"] > 0.9 * result["bytes"], result


def _spell(samples, quiet=0.5):
    spell = heap.IdleSpell(quiet)
    return [spell.observe(wall, cpu) for wall, cpu in samples]


def test_a_trim_is_due_once_per_idle_spell_after_work():
    # 0.1 s polls: busy to 0.3 s, idle from there; busy again at 1.5 s.
    cpu = [0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3,
           0.3, 0.3, 0.3, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]
    due = _spell([(k / 10, c) for k, c in enumerate(cpu)])
    assert [k for k, d in enumerate(due) if d] == [8, 20]


def test_no_trim_while_the_process_works_a_little_every_poll():
    # 10% of each poll's time: a run of steps with millisecond gaps.
    due = _spell([(k / 10, k / 100) for k in range(100)])
    assert not any(due)


def test_a_trims_own_cpu_is_not_work():
    spell = heap.IdleSpell(0.5)
    due = [spell.observe(k / 10, 0.0) for k in range(7)]
    spell.trimmed(0.65, 0.1)  # 0.1 s of CPU in the trim itself
    due += [spell.observe(0.7 + k / 10, 0.1) for k in range(20)]
    assert sum(due) == 1


def test_a_process_idle_from_its_start_trims_once():
    due = _spell([(k / 10, 1.0) for k in range(30)])
    assert [k for k, d in enumerate(due) if d] == [5]


def test_a_bad_quiet_time_is_named():
    with pytest.raises(ValueError, match=r"quiet=0"):
        heap.trim_when_idle(0)
    with pytest.raises(ValueError, match=r"quiet=True"):
        heap.trim_when_idle(True)


@pytest.mark.parametrize("mode,trims", [("return", 1), ("reuse", 1),
                                        ("glibc", 0)])
def test_a_worker_trims_its_heap_unless_glibc(monkeypatch, mode, trims):
    from keras_pipe.distributed import worker

    started = []

    class Stop(Exception):
        pass

    def load():
        raise Stop

    monkeypatch.setattr(worker.heap_lib, "configure", lambda mode: True)
    monkeypatch.setattr(worker.heap_lib, "trim_when_idle",
                        lambda: started.append(True))
    monkeypatch.setattr(worker.runtime, "load", load)
    with socket.socket() as probe:  # a free port: serve checks it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Stop):
        worker.serve({"worker": [f"127.0.0.1:{port}"]}, task=0, heap=mode)
    assert len(started) == trims


# Starts one oneDNN worker with heap "return", makes and frees a 100 MB
# variable on it, and prints the worker's resident MiB idle, holding it and
# after (in a child: a process connects to one cluster only).
_ONEDNN_CHILD = r"""
import gc, json, os, pathlib, sys, time
import tensorflow as tf
import keras_pipe

def workers():
    pids = []
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            text, command = status.read_text(), (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        mine = f"\nPPid:\t{os.getpid()}\n" in text
        if b"keras_pipe.distributed.worker" in command and mine:
            pids.append(int(status.parent.name))
    return pids

def resident(pid):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

with keras_pipe.local_workers(1, heap="return", onednn=True) as devices:
    (pid,) = workers()
    with tf.device(devices[0]):
        tf.ones([4]).numpy()
    idle = resident(pid)
    with tf.device(devices[0]):
        variable = tf.Variable(tf.zeros([5000, 5000]))
    held = resident(pid)
    del variable
    gc.collect()
    with tf.device(devices[0]):  # the deletion reaches the worker
        tf.ones([4]).numpy()
    deadline = time.monotonic() + (10 if sys.argv[1] == "wait" else 1)
    while resident(pid) > idle + 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    print(json.dumps([idle, held, resident(pid)]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("environment,given_back", [(None, True), ("0", False)])
def test_return_reaches_onednns_allocator(environment, given_back):
    """A oneDNN worker with heap "return" gives a freed 100 MB variable
    back; with oneDNN's own allocator left on (the environment says 0, as
    before `configure` set it), the worker keeps it."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop(heap.ONEDNN_SYSTEM_ALLOCATOR, None)
    if environment is not None:
        env[heap.ONEDNN_SYSTEM_ALLOCATOR] = environment
    # Waits up to 10 s for the memory to come back where it should, 1 s
    # where it should not.
    wait = "wait" if given_back else "glance"
    out = subprocess.run([sys.executable, "-c", _ONEDNN_CHILD, wait], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    idle, held, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert held > idle + 80, (idle, held)
    assert (after < idle + 50) == given_back, (idle, held, after)
