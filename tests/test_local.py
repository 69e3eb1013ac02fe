"""keras_pipe.local_workers: pinned loopback workers started and stopped in one call.

The argument checks are fast (nothing starts). The others start real worker
processes in a child Python (connecting changes a process for good) and
check that none is left running: after the block, after an error in it,
and after a Ctrl-C (SIGINT) that arrives while the block runs.
"""

import os
import signal
import textwrap
import time

import pytest

import keras_pipe
from keras_pipe import _compat
from keras_pipe.distributed import local
from keras_pipe.engine import products
from tests.support import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _enter(**kwargs):
    with keras_pipe.local_workers(**kwargs):
        pass


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_workers": 0}, ValueError, "num_workers must be >= 1"),
    ({"num_workers": 2.0}, TypeError, "num_workers must be an int"),
    ({"num_workers": 10_000}, ValueError,
     "num_workers=10000 needs one core each"),
    ({"num_workers": 2, "cores": [0]}, ValueError,
     r"cores must name one id per worker \(2 workers\)"),
    ({"num_workers": 2, "cores": [0, 0]}, ValueError, "names an id twice"),
    ({"num_workers": 1, "cores": [4096]}, ValueError,
     r"cores names CPUs \[4096\] this process cannot run on"),
    ({"num_workers": 1, "cores": "0"}, TypeError,
     "cores must be a list of ints"),
    ({"num_workers": 2, "gpus": [0]}, ValueError,
     "gpus must name one id per worker"),
    ({"timeout": 0}, ValueError, "timeout must be > 0"),
    ({"intra_op_threads": 0}, ValueError, "intra_op_threads must be >= 1"),
    ({"heap": "fast"}, ValueError,
     r"heap must be one of 'reuse', 'return', 'glibc'.*heap='fast'"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        kwargs, error, match, monkeypatch):
    started = []
    monkeypatch.setattr(local, "_start",
                        lambda *a, **k: started.append(a))
    with pytest.raises(error, match=match):
        _enter(**kwargs)
    assert not started



@pytest.mark.parametrize("environment, onednn, expected", [
    (None, None, True),     # unset: the fast kernels, whatever TF's default
    ("0", None, False),     # the user said otherwise
    ("1", None, True),
    ("true", None, True),
    (None, False, False),   # the argument wins over the environment
    ("0", True, True),
])
def test_workers_run_onednn_unless_told_otherwise_and_size_their_pool(
        environment, onednn, expected, monkeypatch):
    """Each worker runs oneDNN's kernels (TF leaves them off on some CPUs,
    and a micro-batch's small products cost several times more without
    them) unless `onednn=` or `TF_ENABLE_ONEDNN_OPTS` says otherwise; this
    process's own kernels do not decide. Its intra-op pool follows: 1
    thread with oneDNN, 4 with TF's own (`INTRA_OP_THREADS`).
    """
    commands, envs = [], []

    class Stop(Exception):
        pass

    def popen(command, env=None, **kwargs):
        commands.append(command)
        envs.append(env)
        raise Stop

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    # This process's kernels must not matter.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: not expected)
    if environment is None:
        monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    else:
        monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", environment)
    with pytest.raises(Stop):
        _enter(num_workers=1, onednn=onednn)
    command = commands[0]
    threads = int(command[command.index("--intra-op-threads") + 1])
    assert threads == (1 if expected else 4)
    assert envs[0]["TF_ENABLE_ONEDNN_OPTS"] == ("1" if expected else "0")
    assert command[command.index("--cpu-affinity") + 1].isdigit()
    # The client builds the workers' forward products for their kernels.
    assert products.onednn("/job:worker/replica:0/task:0/device:CPU:0") \
        == expected
    assert products.onednn("/device:CPU:0") == (not expected)
    products.set_workers_onednn(True)


@pytest.mark.parametrize("kwargs, environment, error, match", [
    ({"onednn": "yes"}, None, TypeError,
     r"onednn must be True, False or None.*onednn='yes'"),
    ({}, "2", ValueError,
     r"TF_ENABLE_ONEDNN_OPTS='2' in the environment is neither 0 nor 1"),
])
def test_a_bad_kernel_setting_is_named_before_a_worker_starts(
        kwargs, environment, error, match, monkeypatch):
    started = []
    monkeypatch.setattr(local, "_start",
                        lambda *a, **k: started.append(a))
    if environment is not None:
        monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", environment)
    with pytest.raises(error, match=match):
        _enter(num_workers=1, **kwargs)
    assert not started


def test_the_worker_command_turns_onednn_on_unless_its_environment_says(
        monkeypatch):
    """`python -m keras_pipe.distributed.worker` (the documented command for
    remote workers) sets `TF_ENABLE_ONEDNN_OPTS=1` before TF's runtime
    loads, and keeps a setting its environment names."""
    from keras_pipe.distributed import worker

    seen = []

    def serve(*args, **kwargs):
        seen.append(os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
        raise ValueError("stop here")

    monkeypatch.setattr(worker, "serve", serve)
    for environment, expected in ((None, "1"), ("0", "0")):
        if environment is None:
            monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
        else:
            monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", environment)
        with pytest.raises(SystemExit, match="stop here"):
            worker.main(["--task", "0", "--cluster", "127.0.0.1:1"])
        assert seen[-1] == expected


@pytest.mark.parametrize("heap", [None, "return"])
def test_workers_get_the_heap_setting(heap, monkeypatch):
    """Workers reuse freed buffers unless told to return them (`heap`)."""
    commands = []

    class Stop(Exception):
        pass

    def popen(command, **kwargs):
        commands.append(command)
        raise Stop

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        _enter(num_workers=1, **({} if heap is None else {"heap": heap}))
    command = commands[0]
    assert command[command.index("--heap") + 1] == (heap or "reuse")

_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import keras_pipe
    import tensorflow as tf

    # Ctrl-C as a terminal delivers it, however the suite was started (a
    # shell's background job starts with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    mode, pids = sys.argv[1], []
    try:
        with keras_pipe.local_workers(num_workers=2) as devices:
            print("DEVICES", ",".join(devices), flush=True)
            with tf.device(devices[1]):
                value = tf.reduce_sum(tf.ones([3, 4])).numpy()
            print("VALUE", value, flush=True)
            children = [int(p) for t in os.listdir("/proc/self/task")
                        for p in open(f"/proc/self/task/{t}/children").read().split()]
            pids += [p for p in children if b"keras_pipe.distributed.worker" in
                     open(f"/proc/{p}/cmdline", "rb").read()]
            print("PIDS", ",".join(map(str, pids)), flush=True)
            print("AFFINITY", ",".join(
                str(sorted(os.sched_getaffinity(p))) for p in pids), flush=True)
            print("ONEDNN", ",".join(
                dict(v.split(b"=", 1) for v in open(f"/proc/{p}/environ", "rb")
                     .read().split(b"\\0") if b"=" in v)
                .get(b"TF_ENABLE_ONEDNN_OPTS", b"unset").decode()
                for p in pids), flush=True)
            from keras_pipe.distributed import local

            def threads(pid):  # the CPU sets of the worker's threads
                sets = set()
                for t in os.listdir(f"/proc/{pid}/task"):
                    try:
                        sets.add(tuple(sorted(os.sched_getaffinity(int(t)))))
                    except OSError:  # the thread ended
                        pass
                return sorted(sets)

            with local.cores_shared(devices) as shared:
                print("SHARED", shared, [threads(p) for p in pids],
                      flush=True)
            print("REPINNED", [threads(p) for p in pids], flush=True)
            with local.cores_shared(devices[:1]) as shared:
                print("ONE", shared, flush=True)
            if mode == "error":
                raise RuntimeError("boom inside the block")
            if mode == "sigint":
                print("WAITING", flush=True)
                time.sleep(120)
    finally:
        # Checked by this process while it still runs: the workers' parent-
        # death signal has not fired, only the block's own stop counts.
        print("LEFT", ",".join(str(p) for p in pids if alive(p)), flush=True)
    print("DONE", flush=True)
""")


def _run(mode, interrupt=False):
    """Runs the script in a child of the warm process
    (`tests/support/warm.py`); returns (output lines by tag, return code,
    stderr)."""
    env = warm.env()
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)  # the default environment
    child = warm.start(["-c", _SCRIPT, mode], env)
    lines = {}
    try:
        while line := child.readline(timeout=120):
            tag, _, rest = line.strip().partition(" ")
            lines[tag] = rest
            if interrupt and tag == "WAITING":
                os.kill(child.pid, signal.SIGINT)
        _, stderr = child.communicate("", timeout=120)
    finally:
        child.kill()
    return lines, child.returncode, stderr


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone(pids):
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "error", "sigint"])
def test_workers_run_ops_and_none_is_left_running(mode):
    lines, code, stderr = _run(mode, interrupt=mode == "sigint")
    assert lines["DEVICES"] == (
        "/job:worker/replica:0/task:0/device:CPU:0,"
        "/job:worker/replica:0/task:1/device:CPU:0"), stderr
    assert float(lines["VALUE"]) == 12.0
    pids = [int(p) for p in lines["PIDS"].split(",")]
    assert len(pids) == 2
    assert lines["LEFT"] == ""  # stopped by the block, before exit
    # One core each, the first two this process may run on.
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert sorted(lines["AFFINITY"].split(",")) == sorted(
        f"[{c}]" for c in cores)
    # The fast kernels reach the workers without an environment variable.
    assert lines["ONEDNN"] == "1,1"
    # `cores_shared`: every thread of both on both cores, then each
    # worker's on its own again; one worker alone shares nothing.
    both = tuple(cores)
    assert lines["SHARED"] == f"True {[[both], [both]]}", lines
    by_pid = dict(zip(pids, lines["AFFINITY"].split(",")))
    assert lines["REPINNED"] == str(
        [[(int(by_pid[p].strip("[]")),)] for p in pids]), lines
    assert lines["ONE"] == "False"
    _assert_gone(pids)
    if mode == "ok":
        assert code == 0 and "DONE" in lines
    elif mode == "error":
        assert code != 0 and "boom inside the block" in stderr
        assert "DONE" not in lines
    else:
        assert code != 0 and "KeyboardInterrupt" in stderr
        assert "DONE" not in lines

