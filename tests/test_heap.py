"""The worker heap's settings (`keras_pipe.distributed.heap`), in a child.

What a setting costs is page faults: a big block unmapped when freed is
faulted in afresh by the next allocation of its size (60-100 ms of system
CPU per worker per step on the MLP benchmark job). Counted here on 4 MiB
blocks allocated, written and freed in a loop, as a stage's gradients are.
"""

import json
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
size, rounds = 4 << 20, 20

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


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, heap.__file__],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_reuse_keeps_freed_blocks_for_the_next_allocation():
    result = _faults("reuse")
    assert result["applied"]
    assert result["faults_per_round"] < 0.05 * result["pages"], result


def test_return_gives_freed_blocks_back_and_faults_them_in_again():
    result = _faults("return")
    assert result["applied"]
    assert result["faults_per_round"] > 0.9 * result["pages"], result


def test_a_bad_mode_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"heap='fast'"):
        heap.configure("fast")


# Blocks of a small micro-batch's size (256 KiB: a Transformer's
# activations at 4 rows) freed among small blocks that stay alive (TF's
# own): with a 1 MiB threshold they came from an arena, whose freed chunks
# between live ones stayed resident (a worker held 100 MiB of them after a
# step, `keras_pipe.distributed.heap`).
_FRAGMENTS = _PRELUDE + r"""libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, count = 256 << 10, 200

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = resident()
big, small = [], []
for _ in range(count):
    big.append(libc.malloc(size))
    ctypes.memset(big[-1], 1, size)
    small.append(libc.malloc(1024))
    ctypes.memset(small[-1], 1, 1024)
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
