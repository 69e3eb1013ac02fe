"""Remote stages on worker processes (loopback only), connect errors, faults."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import keras_pipe
from keras_pipe.distributed import cluster as cluster_lib
from keras_pipe.distributed import worker as worker_lib
from tests.support import warm
from tests.support.ports import free_port

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCENARIOS = str(ROOT / "tests" / "support" / "cluster_scenarios.py")


def _stop(pid, timeout=10.0):
    """SIGSTOPs `pid` and returns once every thread of it has stopped.

    `kill` only queues the signal: the kernel wakes one thread to start the
    group stop, and on a loaded machine the others (gRPC's pollers) can
    still answer a request until it runs (seen once in CI: a probe sent
    right after `kill` was answered).
    """
    os.kill(pid, signal.SIGSTOP)
    tasks = pathlib.Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout
    while True:
        states = [_thread_state(stat) for stat in tasks.glob("*/stat")]
        if states and all(state in "tT" for state in states if state):
            return
        assert time.monotonic() < deadline, f"pid {pid} threads: {states}"
        time.sleep(0.01)


def _thread_state(stat):
    """The state letter in a /proc/<pid>/task/<tid>/stat, "" if gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _env():
    """Worker and client env: TF quiet, no TF_CONFIG, nothing preloaded.

    Workers and clients keep their TF ports on loopback by themselves.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
               PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):
        env.pop(name, None)
    return env


class Cluster:
    """Worker processes on free loopback ports, killed by PID at the end."""

    def __init__(self, num_tasks, tmp_path):
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_tasks)]
        self.tmp_path = tmp_path
        self.procs = {}
        self.all_procs = []

    @property
    def spec(self):
        return ",".join(self.addresses)

    def start(self, task):
        log = open(self.tmp_path / f"worker{task}-{len(self.all_procs)}.log",
                   "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "keras_pipe.distributed.worker", "--task", str(task),
             "--cluster", self.spec, "--intra-op-threads", "1",
             "--inter-op-threads", "4"],
            env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        self.procs[task] = proc
        self.all_procs.append(proc)
        return proc

    def wait_ready(self, timeout=90.0):
        deadline = time.monotonic() + timeout
        for task, proc in self.procs.items():
            while not cluster_lib.probe(self.addresses[task], 1.0):
                assert proc.poll() is None, self.log(task)
                assert time.monotonic() < deadline, self.log(task)
                time.sleep(0.2)

    def log(self, task):
        logs = sorted(self.tmp_path.glob(f"worker{task}-*.log"))
        return logs[-1].read_text() if logs else ""

    def kill_all(self):
        for proc in self.all_procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    cluster = Cluster(2, tmp_path_factory.mktemp("workers"))
    try:
        for task in range(2):
            cluster.start(task)
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.kill_all()


def _scenario(*args, timeout=240):
    # A fresh client process, forked from a warm one (tests/support/warm.py).
    result = warm.run([SCENARIOS, *args], _env(), cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# The scenarios that need no connect() setting or worker fault of their own
# run one after the other in one client process (each process starts TF and
# connects, 6-15 s): "listen" first (it lists the client's sockets before
# connect), "stage_error" last (it ends in a failed step).
SHARED = ("listen", "remote", "placed", "timeline", "stage_error")


@pytest.fixture(scope="module")
def shared(workers):
    """`{scenario: result}` of the `SHARED` scenarios, run once."""
    return _scenario(",".join(SHARED), "--cluster", workers.spec,
                     timeout=600)


# ----------------------------------------------------------- in this process


def test_data_device_is_this_process_for_local_stages(devices):
    from tests.support.helpers import dense_stages
    pipe = keras_pipe.PipelineModel(dense_stages(2), devices=devices[:2])
    assert pipe.data_device is None  # Keras' own batching, in this process
    pipe.data_device = devices[1]
    assert pipe.data_device == devices[1]
    pipe.data_device = "auto"
    assert pipe.data_device is None  # the first stage is not remote
    with pytest.raises(TypeError, match=r"data_device must be a device "
                       r"string, 'auto' or None. Received: data_device=1"):
        pipe.data_device = 1


def test_call_is_awaited_in_long_slices_until_a_task_is_lost():
    """The calling thread wakes once a second while the call runs (every
    0.1 s cost the client 0.3-0.5 ms of CPU per MLP step), every 0.1 s
    once the watchdog lost a task, and returns `grace` s after that."""
    waits = []

    class Done:
        def wait(self, timeout):
            waits.append(timeout)
            if len(waits) == 3:
                watchdog.lost_at = time.monotonic() - 0.25
            if len(waits) > 3:
                time.sleep(0.01)
            return False

    class Watchdog:
        lost_at = None

    watchdog = Watchdog()
    cluster_lib._wait(Done(), watchdog, grace=0.5)
    assert waits[:3] == [1.0, 1.0, 1.0]
    assert set(waits[3:]) == {0.1}


def test_cluster_spec_forms(monkeypatch):
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    expected = {"worker": addresses}
    config = {"cluster": expected, "task": {"type": "worker", "index": 0}}
    for given in (tf.train.ClusterSpec(expected), expected, config,
                  json.dumps(config)):
        assert cluster_lib.cluster_spec(given).as_dict() == expected
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert cluster_lib.cluster_spec().as_dict() == expected
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match="TF_CONFIG environment variable"):
        cluster_lib.cluster_spec()
    with pytest.raises(TypeError, match="must be a tf.train.ClusterSpec"):
        cluster_lib.cluster_spec(["127.0.0.1:1"])
    with pytest.raises(ValueError, match="TF_CONFIG JSON"):
        cluster_lib.cluster_spec("127.0.0.1:1")
    with pytest.raises(ValueError, match="timeout must be"):
        keras_pipe.connect(expected, timeout=0)


def test_connect_names_down_and_hung_workers_in_bounded_time():
    down = f"127.0.0.1:{free_port()}"  # Nothing listens there.
    # A hung worker: the kernel accepts TCP connections, nobody answers.
    with socket.socket() as hung_socket:
        hung_socket.bind(("127.0.0.1", 0))
        hung_socket.listen()
        hung = f"127.0.0.1:{hung_socket.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(cluster_lib.WorkerUnavailableError) as info:
            keras_pipe.connect({"worker": [down, hung]}, timeout=2.0)
        seconds = time.monotonic() - start
    message = str(info.value)
    assert f"/job:worker/replica:0/task:0 at {down}" in message
    assert f"/job:worker/replica:0/task:1 at {hung}" in message
    assert "within 2 s" in message
    assert "task:0: connection refused: nothing listens on that port" in \
        message
    assert "task:1: accepts TCP connections but gives no gRPC answer" in \
        message
    assert info.value.tasks == {"/job:worker/replica:0/task:0": down,
                                "/job:worker/replica:0/task:1": hung}
    assert 2.0 <= seconds < 5.0, seconds
    # Nothing was connected: the test process is still a local-only runtime.
    assert context.get_server_def() is None


def test_after_an_error_a_silent_task_is_not_lost_a_closed_port_is():
    """`run` decides after a failed call which tasks are lost. It asked for
    a gRPC answer within 2 s, so a worker too busy to answer (one pinned
    core of a loaded host) turned the call's own error into "Lost ...".
    Now a task is lost there if it takes no TCP connection."""
    down = f"127.0.0.1:{free_port()}"
    with socket.socket() as silent_socket:  # accepts, never answers
        silent_socket.bind(("127.0.0.1", 0))
        silent_socket.listen()
        silent = f"127.0.0.1:{silent_socket.getsockname()[1]}"
        tasks = {"silent": silent, "down": down}
        assert cluster_lib._unreachable(tasks, 1.0) == tasks  # the old rule
        assert cluster_lib._gone(tasks) == {"down": down}


def test_an_abort_tf_flags_as_a_restart_names_the_restarted_task():
    """A fit on a model built before task 1 restarted raised, under load,
    TF's AbortedError as a stage's error ("Stage 1 ('sequential_1') on
    /job:worker/...") instead of a lost worker: its text had none of the
    restart signs. TF flags such errors with a `WorkerPossiblyRestarted`
    payload, and its session and graph managers say "... just restarted"."""
    tasks = {f"/job:worker/replica:0/task:{t}": f"127.0.0.1:{2220 + t}"
             for t in range(2)}
    task_1 = {"/job:worker/replica:0/task:1": "127.0.0.1:2221"}
    payload = {b"type.googleapis.com/tensorflow.distributed_runtime."
               b"WorkerPossiblyRestarted": b""}
    session = tf.errors.AbortedError(
        None, None, "Session handle is not found: 5e1f. Possibly this worker "
        '("/job:worker/replica:0/task:1") just restarted.', payload)
    assert cluster_lib._restarted(session, tasks) == task_1
    # The payload alone: a stage's node, no task and no sign in the text.
    flagged = tf.errors.AbortedError(
        None, None, "Graph execution error:\n\n[[{{node stage1/mb0/forward/"
        "dense/MatMul}}]]", payload)
    assert cluster_lib._restarted(flagged, tasks) == tasks
    graph = tf.errors.AbortedError(
        None, None, "Graph handle is not found: 7. Possibly, this worker just "
        "restarted.")
    assert cluster_lib._restarted(graph, tasks) == tasks
    # An abort that says nothing of a restart stays the stage's error.
    assert cluster_lib._restarted(tf.errors.AbortedError(
        None, None, "[[{{node stage1/mb0/forward/dense/MatMul}}]]"),
        tasks) == {}


def test_watchdog_probe_keeps_its_channel_and_sees_a_stop(workers):
    """One channel per task while it answers; a stopped one is silent in
    time, a port with no server is down."""
    alive = cluster_lib._KeptProbe()
    address = workers.addresses[1]
    down = f"127.0.0.1:{free_port()}"
    victim = workers.procs[1]
    try:
        assert alive(address, 5.0) == "ok"
        channel = alive.channels[address]
        assert alive(address, 5.0) == "ok"
        assert alive.channels[address] is channel
        assert alive(down, 1.0) == "down" and down not in alive.channels
        _stop(victim.pid)  # open connection, no answer
        start = time.monotonic()
        assert alive(address, 1.0) == "silent"
        assert 1.0 <= time.monotonic() - start < 3.0
        assert address not in alive.channels  # dropped: next one is new
        os.kill(victim.pid, signal.SIGCONT)
        assert alive(address, 5.0) == "ok"
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        alive.close()
    assert alive.channels == {}


def test_watchdog_waits_out_a_busy_worker_and_not_a_dead_one(workers):
    """A worker that gives no answer for a few seconds (stopped here, as a
    worker on a loaded host is starved of its core) is not lost before
    `silence`; a task whose port refuses is lost after `misses` probes.
    Before, 2 missed probes of 1 s lost either (a benchmark at load 10-20
    had 5 of 18 configurations cancelled that way)."""
    victim = workers.procs[1]
    busy = {"busy": workers.addresses[1]}
    watch = cluster_lib._Watch(busy, interval=0.5, misses=2, silence=8.0)
    watch.thread.start()
    try:
        _stop(victim.pid)
        time.sleep(3.0)  # 6 probe periods without an answer
        os.kill(victim.pid, signal.SIGCONT)
        time.sleep(1.5)
        assert watch.lost == {}
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        watch.stop.set()
        watch.thread.join(10)
    dead = {"dead": f"127.0.0.1:{free_port()}"}
    watch = cluster_lib._Watch(dead, interval=0.5, misses=2, silence=8.0)
    start = time.monotonic()
    watch.thread.start()
    watch.thread.join(10)
    assert watch.lost == dead
    assert time.monotonic() - start < 3.0


def test_run_is_a_plain_call_for_local_devices(devices):
    import threading
    thread = cluster_lib.run(devices, "fit", threading.current_thread)
    assert thread is threading.current_thread()
    with pytest.raises(KeyError, match="raised"):
        cluster_lib.run(devices, "fit", {}.__getitem__, "raised")


# ------------------------------------------------------- with worker processes


def test_workers_listen_on_loopback_only(workers):
    for address in workers.addresses:
        port = int(address.rsplit(":", 1)[1])
        assert worker_lib.listening_hosts(port) == ["127.0.0.1"]


def test_client_listens_on_loopback_only(shared):
    """After connect(), no socket of the client listens on 0.0.0.0 or ::."""
    result = shared["listen"]
    assert result["value"] == 3.0
    assert result["before"] == []
    # One listener: the client's own TF server, on loopback.
    assert len(result["after"]) == 1, result
    assert result["after"][0].startswith("127.0.0.1:"), result


@pytest.mark.parametrize("bad, error", [(0, ValueError), (2.5, TypeError),
                                        (True, TypeError)])
def test_connect_checks_inter_op_threads_first(bad, error):
    with pytest.raises(error, match="inter_op_threads"):
        keras_pipe.connect({"worker": ["127.0.0.1:1"]},
                           inter_op_threads=bad)


def test_workers_run_client_functions_with_the_clients_thread_pool(
        workers):
    # TF sizes a worker's context for a client's functions from the
    # client's inter-op setting (the workers here say 4 for their own); with
    # one thread, a transfer waits behind the worker's next stage call.
    pids = ",".join(str(workers.procs[t].pid) for t in sorted(workers.procs))
    grown = {}
    for threads in (2, 7):
        result = _scenario("threads", "--cluster", workers.spec,
                           "--worker-pids", pids, "--inter-op", str(threads))
        assert result["client"] == threads
        grown[threads] = [a - b for a, b in zip(result["after"],
                                                result["before"])]
    # Each connection adds a context with a pool of the client's size (and
    # a few threads more whatever that size).
    assert [b - a for a, b in zip(grown[2], grown[7])] == [5, 5], grown


def test_remote_stages_match_single_process(shared):
    result = shared["remote"]
    assert result["devices_per_task"] == {
        f"/job:worker/replica:0/task:{t}":
            [f"/job:worker/replica:0/task:{t}/device:CPU:0"]
        for t in range(2)}
    assert result["variable_devices"] == [
        f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)]
    # Same ops on the same CPU kernels: bit-identical, weights and Adam slots.
    assert result["num_values"] > 10
    assert result["weights_max_diff"] == 0.0
    assert result["loss_remote"] == result["loss_local"]
    assert result["evaluate_remote"] == result["evaluate_local"]
    assert result["predict_max_diff"] == 0.0
    # A .keras file saved from remote stages reloads onto the same workers.
    assert result["reloaded_devices"] == result["variable_devices"]
    assert result["reloaded_predict_max_diff"] == 0.0
    # connect() turns TF's thread spinning off here (and in the contexts
    # the workers run this client's functions in): 0.3-2.4 ms less client
    # CPU per MLP step, the workers' no more (docs/performance.md).
    assert result["thread_spinning_disabled"] is True


def test_array_data_are_batched_on_the_first_stages_worker(shared):
    """With data_device="auto", fit and evaluate build Keras' pipeline of
    array data on the first stage's worker (the client sends every batch
    otherwise: 2 x 2 MiB per step of the MLP benchmark), with the same
    shuffles, validation split and class weights: bit-identical to a model
    on this process. The default is None (this process)."""
    result = shared["placed"]
    first = "/job:worker/replica:0/task:0/device:CPU:0"
    assert result["default"] is None  # opt-in: "auto" places them
    assert result["data_device"] == [first, None]
    assert result["devices"]["remote"] == {"fit": [first],
                                           "evaluate": [first]}
    assert result["devices"]["local"] == {"fit": [], "evaluate": []}
    assert result["opted_out"] == []  # data_device = None: this process
    assert set(result["history_remote"]) == {"loss", "accuracy",
                                             "val_loss", "val_accuracy"}
    assert result["history_remote"] == result["history_local"]
    assert result["evaluate_remote"] == result["evaluate_local"]
    assert result["weights_max_diff"] == 0.0


def test_stage_error_on_a_worker_names_stage_and_device(shared):
    # Broke: "CancelledError: RecvAsync is cancelled" (see test_errors.py).
    # With workers TF sometimes keeps the root error (then its node names
    # the stage) and sometimes only the cancellation (then the replay
    # finds Keras' own shape error): either way the stage's error shows.
    result = shared["stage_error"]["fit"]
    stage = "Stage 0 ('sequential') on /job:worker/replica:0/task:0/device:CPU:0"
    if result["error"] == "ValueError":
        assert result["message"].startswith(f"{stage} failed during fit:"), \
            result
        assert "expected axis -1 of input shape to have value 8" in \
            result["message"], result
    else:
        assert result["error"] == "InvalidArgumentError", result
        assert result["message"].startswith(
            f"{stage} failed in the forward pass of micro-batch"), result
        assert "incompatible" in result["message"], result  # MatMul's
    assert "RecvAsync is cancelled" not in result["message"], result


def test_interrupt_stops_remote_steps_and_fit_continues(workers):
    # Broke: Ctrl-C raised KeyboardInterrupt in the caller while the step
    # loop went on in the thread that runs the call next to the watchdog
    # (trap 12): fit ran to its end, and the next fit trained on top.
    result = _scenario("interrupt", "--cluster", workers.spec)
    for how, raised in (("sigint", "KeyboardInterrupt"),
                        ("raise", "ValueError")):
        case = result[how]
        assert case["raised"] == raised, result
        # Interrupted after step 3: 3 steps done, none started after.
        assert case["iterations"] == case["iterations_later"] == 3, result
        assert case["threads_left"] == [], result
        # 3 more steps on the rest of the data = 6 uninterrupted steps.
        assert case["weights_max_diff"] == 0.0, result
    for action in ("evaluate", "predict"):
        assert result[action] == {"raised": "KeyboardInterrupt", "batches": 2,
                                  "threads_left": []}, result


def assert_lost_task_1(result, workers):
    """The scenario's fit ended with an error naming task 1, in time."""
    assert result["error"] == "WorkerUnavailableError"
    assert result["tasks"] == {
        "/job:worker/replica:0/task:1": workers.addresses[1]}
    # The task, its stages, and where to look for memory (a worker this
    # client did not start: its exit cannot be seen).
    assert re.search(
        rf"Lost /job:worker/replica:0/task:1 at "
        rf"{re.escape(workers.addresses[1])}, which held stages? [\d, ]+ "
        r"\(if it ran out of memory, its log or `dmesg` says so.*\) during "
        r"fit", result["message"]), result["message"]
    # Probes every 1 s, lost after 2 misses, then 5 s of grace.
    assert result["seconds_to_error"] < 15.0, result


def test_worker_restarted_between_calls(workers):
    """Restart task 1 between two fits: a named error, then a clear rebuild."""
    proc = warm.start([SCENARIOS, "restart", "--cluster", workers.spec],
                      _env(), cwd=ROOT)
    try:
        line = proc.readline(timeout=240)
        assert line.strip() == "READY", line + proc.stderr()[-3000:]
        victim = workers.procs[1]
        victim.kill()
        victim.wait(timeout=30)
        workers.start(1)
        workers.wait_ready()
        out, err = proc.communicate("go\n", timeout=240)
        assert proc.returncode == 0, err[-3000:]
    finally:
        proc.kill()
    result = json.loads(out.strip().splitlines()[-1])
    task, address = "/job:worker/replica:0/task:1", workers.addresses[1]
    for key in ("same_model", "predict", "reconnected_same_model"):
        outcome = result[key]
        assert outcome["is_unavailable"], (key, outcome)
        # The restarted task is named; under load TF's message can name the
        # task that was talking to it too (seen once in a full run).
        assert outcome["tasks"].get(task) == address, (key, outcome)
        assert set(outcome["tasks"]) <= {task,
                                         "/job:worker/replica:0/task:0"}
        assert f"{task} at {address}" in outcome["message"], (key, outcome)
        assert "keras_pipe.BackupAndRestore" in outcome["message"], outcome
    assert "keras_pipe.connect()" in result["same_model"]["message"]
    assert "rebuild the model" in result["reconnected_same_model"]["message"]
    assert result["new_model"] == {"error": None}, result


def test_hung_worker_ends_fit_in_bounded_time(workers):
    """SIGSTOP task 1 mid-fit: TF would wait forever; the watchdog does not."""
    victim = workers.procs[1]
    try:
        result = _scenario("hang", "--cluster", workers.spec, "--kill-pid",
                           str(victim.pid))
    finally:  # A stopped worker is useless to the next test: replace it.
        victim.kill()
        victim.wait(timeout=30)
        workers.start(1)
    assert_lost_task_1(result, workers)
    workers.wait_ready()


def test_worker_killed_during_fit_then_resume(workers, tmp_path):
    """Kill task 1 by PID mid-fit; restart it; fit again resumes exactly."""
    victim = workers.procs[1]
    proc = warm.start(
        [SCENARIOS, "resume", "--cluster", workers.spec, "--kill-pid",
         str(victim.pid), "--backup", str(tmp_path / "backup")], _env(),
        cwd=ROOT)
    try:
        line = proc.readline(timeout=240)
        assert line.startswith("LOST "), line + proc.stderr()[-3000:]
        lost = json.loads(line[len("LOST "):])
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert_lost_task_1(lost, workers)
        workers.start(1)
        workers.wait_ready()
        out, err = proc.communicate("go\n", timeout=240)
        assert proc.returncode == 0, err[-3000:]
    finally:
        proc.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["resumed_epochs"] == [2, 3]
    assert result["weights_max_diff"] == 0.0, result


def test_timeline_records_stages_on_workers(shared):
    # Stamps are numpy_functions: they run Python, so they are placed on the
    # client; before, a recorded step on workers failed.
    result = shared["timeline"]
    assert result["stages"] == [0, 1]
    assert set(result["kinds"]) >= {"forward", "backward"}
    # 2 micro-batches x 2 stages, forward and backward (plus recomputes).
    assert result["events"] >= 8
    assert 0.0 < result["bubble"] < 1.0
    assert result["png"] > 1000
