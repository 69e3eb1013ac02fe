"""A worker's server on TF's C++ runtime alone: its definition and its cluster.

The process behaviour (no TF Python module in a worker, its idle resident
size) is in `tests/test_worker_memory.py`; serving is in
`tests/test_cluster.py` and `tests/test_local.py`.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.distributed import runtime
from keras_pipe.distributed import worker as worker_lib
from tests.support.ports import free_port


def _expected(cluster, job, task, intra=None, inter=None):
    """The ServerDef `tf.distribute.Server` makes of the same arguments."""
    config = tf.compat.v1.ConfigProto()
    if intra is not None:
        config.intra_op_parallelism_threads = intra
    if inter is not None:
        config.inter_op_parallelism_threads = inter
    return tf.train.ServerDef(
        cluster=tf.train.ClusterSpec(cluster).as_cluster_def(),
        job_name=job, task_index=task, protocol="grpc",
        default_session_config=config)


@pytest.mark.parametrize("cluster, job, task, intra, inter", [
    ({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 1, 1, 2),
    ({"worker": ["127.0.0.1:2222"]}, "worker", 0, None, None),
    ({"worker": {3: "[::1]:70"}, "ps": ["10.0.0.1:300"]}, "worker", 3,
     4, None),
    ({"worker": [f"127.0.0.1:{20000 + k}" for k in range(200)]}, "worker",
     199, 300, 129),  # multi-byte lengths and varints
])
def test_server_def_is_the_one_tf_makes(cluster, job, task, intra, inter):
    tasks = worker_lib._tasks(cluster)
    made = tf.train.ServerDef.FromString(
        runtime.server_def(tasks, job, task, intra, inter))
    assert made == _expected(cluster, job, task, intra, inter), made


def test_threads_that_outnumber_the_cpus_do_not_spin():
    # local_workers' 4 intra-op threads on one core: a spinning idle
    # thread would take the core from the one with work.
    assert worker_lib.thread_spinning(4, 1) is False
    assert worker_lib.thread_spinning(2, 2) is True
    assert worker_lib.thread_spinning(None, 1) is True
    tasks = worker_lib._tasks({"worker": ["127.0.0.1:2222"]})
    made = tf.train.ServerDef.FromString(runtime.server_def(
        tasks, "worker", 0, 4, None, thread_spinning=False))
    expected = _expected({"worker": ["127.0.0.1:2222"]}, "worker", 0, 4)
    expected.default_session_config.experimental.disable_thread_spinning = \
        True
    assert made == expected, made


def test_serve_stops_spinning_where_threads_outnumber_its_cpus(
        monkeypatch):
    made = []

    class Server:
        def __init__(self, definition):
            made.append(tf.train.ServerDef.FromString(definition))
            self.target = "grpc://127.0.0.1:2222"

        def start(self):
            pass

    monkeypatch.setattr(runtime, "Server", Server)
    monkeypatch.setattr(runtime, "load", lambda: None)
    monkeypatch.setattr(worker_lib.bind_lib, "pin", lambda bind: None)
    monkeypatch.setattr(worker_lib, "listening_hosts",
                        lambda port: ["127.0.0.1"])
    monkeypatch.setattr(worker_lib.heap_lib, "configure", lambda heap: None)
    cpu = min(os.sched_getaffinity(0))
    port = free_port()
    before = os.sched_getaffinity(0)
    try:
        for threads in (4, 1):
            worker_lib.serve({"worker": [f"127.0.0.1:{port}"]}, 0,
                             intra_op_threads=threads, cpu_affinity=[cpu])
    finally:
        os.sched_setaffinity(0, before)
    config = [m.default_session_config for m in made]
    assert [c.intra_op_parallelism_threads for c in config] == [4, 1]
    assert [c.experimental.disable_thread_spinning for c in config] == [
        True, False]


def test_cluster_forms_without_tensorflow():
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    expected = {"worker": {0: addresses[0], 1: addresses[1]}}
    config = {"cluster": {"worker": addresses},
              "task": {"type": "worker", "index": 0}}
    for given in ({"worker": addresses}, tf.train.ClusterSpec(
            {"worker": addresses}), config, json.dumps(config),
            {"worker": {"0": addresses[0], "1": addresses[1]}}):
        assert worker_lib._tasks(given) == expected, given
    with pytest.raises(TypeError, match="must be a tf.train.ClusterSpec"):
        worker_lib._tasks(["127.0.0.1:1"])
    with pytest.raises(TypeError, match="list of addresses"):
        worker_lib._tasks({"worker": "127.0.0.1:1"})
    with pytest.raises(ValueError, match="task indices of job 'worker'"):
        worker_lib._tasks({"worker": {"a": "127.0.0.1:1"}})
    with pytest.raises(ValueError, match="no task"):
        worker_lib._tasks({"worker": []})


_LEAN = """
import sys
import keras_pipe
import keras_pipe.distributed.worker
print(sorted({m.split(".")[0] for m in sys.modules} & {"keras", "tensorflow"}))
"""


def test_the_package_and_the_worker_import_neither_keras_nor_tensorflow():
    # A worker (`python -m keras_pipe.distributed.worker`) imports the
    # package first: its public names load on first use (PEP 562).
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _LEAN], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_public_names_load_on_first_use():
    assert set(keras_pipe.__all__) <= set(dir(keras_pipe))
    for name in keras_pipe.__all__:
        assert getattr(keras_pipe, name) is not None
    assert keras_pipe.verify.__name__ == "verify"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        keras_pipe.nope  # noqa: B018
