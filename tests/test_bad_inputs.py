"""Bad worker flags, connect() and plan() arguments: clear errors, nothing started.

Each case names the bad value and the fix (README "Bad inputs" counts them).
"""

import os
import socket
import subprocess
import sys

import keras
import pytest

import keras_pipe
from keras_pipe import worker as worker_lib
from tests.support.ports import free_port

NOT_HERE = "192.0.2.1"  # TEST-NET-1: documentation only, on no machine.


def _exit_message(argv, capsys, monkeypatch):
    """Runs the worker's main(argv); returns its exit message."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as info:
        worker_lib.main(argv)
    code = info.value.code
    return code if isinstance(code, str) else capsys.readouterr().err


def _cluster():
    return f"127.0.0.1:{free_port()}"


WORKER_CASES = [
    # (flags, expected text)
    (["--intra-op-threads", "-3"],
     "'-3' is not a thread count; pass an int >= 1"),
    (["--inter-op-threads", "0"], "'0' is not a thread count"),
    (["--intra-op-threads", "two"], "'two' is not a thread count"),
    (["--task", "-1"], "'-1' is not a task index; pass an int >= 0"),
    (["--task", "5"], "Task 5 of job 'worker' is not in the cluster"),
    (["--job", "ps", "--cluster", '{"worker": ["127.0.0.1:2222"]}'],
     "Task 0 of job 'ps' is not in the cluster"),
    (["--cluster", "{'worker': 1"], "--cluster is not valid JSON"),
    (["--cluster", "[1, 2]"], "must be host:port with a port in 1..65535"),
    (["--cluster", "127.0.0.1:99999"], "Received: '127.0.0.1:99999'"),
    (["--cluster", "127.0.0.1"], "must be host:port"),
    (["--cluster", "no-such-host.invalid:2222"], "does not resolve"),
    (["--bind", "localhost"], "not a host name. Received: bind='localhost'"),
    (["--bind", NOT_HERE], f"bind='{NOT_HERE}' is not an address of this "
                           "machine"),
    (["--bind", "127.0.0.2"], "bind='127.0.0.2' differs from this task's "
                              "cluster address"),
    (["--cpu-affinity", "x"], "'x' is not a CPU list"),
    (["--cpu-affinity", "4096"], "cpu_affinity names CPUs [4096] this "
                                 "process cannot run on"),
    ([], "--cluster is required when TF_CONFIG is unset"),
]


@pytest.mark.parametrize("flags, expected", WORKER_CASES,
                         ids=[" ".join(f) or "no-cluster"
                              for f, _ in WORKER_CASES])
def test_bad_worker_flag_is_named(flags, expected, capsys, monkeypatch):
    argv = ["--task", "0"] + flags
    if "--cluster" not in flags and flags:
        argv += ["--cluster", _cluster()]
    if "--task" in flags:
        argv = argv[2:]
    message = _exit_message(argv, capsys, monkeypatch)
    assert expected in message, message


def test_port_in_use_is_named(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = _exit_message(
            ["--task", "0", "--cluster", f"127.0.0.1:{port}"], capsys,
            monkeypatch)
    assert f"Port {port} on 127.0.0.1 is not free" in message, message


def test_negative_thread_count_exits_cleanly_not_abort():
    # Broke: TF's check aborted the process (SIGABRT) on -3 threads.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "keras_pipe.worker", "--task", "0",
         "--cluster", _cluster(), "--intra-op-threads", "-3"],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "is not a thread count; pass an int >= 1" in result.stderr


@pytest.mark.parametrize("bind, error, expected", [
    ("localhost", ValueError, "not a host name"),
    (NOT_HERE, ValueError, "is not an address of this machine"),
    (2222, TypeError, "bind must be an IP address string"),
])
def test_bad_connect_bind_is_named_before_connecting(bind, error, expected):
    with pytest.raises(error, match=expected):
        keras_pipe.connect({"worker": ["127.0.0.1:1"]}, timeout=1.0,
                           bind=bind)


def test_connect_bind_other_than_the_clients_cluster_address():
    cluster = {"worker": ["127.0.0.1:1"], "localhost": ["127.0.0.2:3"]}
    with pytest.raises(ValueError, match="bind='127.0.0.2'"):
        keras_pipe.connect(cluster, timeout=1.0)


def _small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("kwargs, error, expected", [
    ({"optimizer_slots": -1}, ValueError,
     r"optimizer_slots must be >= 0. Received: optimizer_slots=-1"),
    ({"optimizer_slots": 1.5}, TypeError, r"optimizer_slots must be an int"),
    ({"flops_per_second": -1e12}, ValueError,
     r"flops_per_second must be > 0. Received: flops_per_second=-1"),
    ({"flops_per_second": 0}, ValueError, r"flops_per_second must be > 0"),
    ({"flops_per_second": float("nan")}, ValueError,
     r"flops_per_second must be a finite number"),
])
def test_bad_plan_numbers_are_named(kwargs, error, expected):
    # Broke: negative values printed negative times and memory.
    with pytest.raises(error, match=expected):
        keras_pipe.plan(_small_model(), num_stages=2, **kwargs)
