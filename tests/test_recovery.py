"""A fit that goes on after a lost worker (`keras_pipe.distributed.recovery`).

The fast tests check the parts in this process: the step deadline, what the
callbacks are shown of a replay, the record of a restarted process, the
supervisor, and the metrics' running totals put back by a same-process
resume. The slow ones run `tests/support/recovery_scenarios.py` in a client
process of its own, with two `local_workers(restart=True)`: a worker
SIGKILLed mid-epoch (each task), killed during the backup's own save, or
stopped (SIGSTOP); the same fit call ends with the weights, history and
epoch events of an uninterrupted run. Figures (time to the first step
after the fault) are in docs/reliability.md, not asserted here.
"""

import json
import os
import pathlib
import subprocess
import time

import keras
import numpy as np
import pytest

import keras_pipe
from keras_pipe.distributed import cluster, exits, local, recovery
from tests.support import warm
from tests.support.recovery_scenarios import StopAt

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCENARIOS = str(ROOT / "tests" / "support" / "recovery_scenarios.py")


# ----------------------------------------------------------- in this process


def test_step_deadline_follows_the_measured_step_within_bounds():
    clock = recovery.StepClock()
    assert clock.deadline() == cluster.HUNG_AFTER  # nothing measured yet
    clock.steps = [0.01, 0.02, 0.01]
    assert clock.deadline() == recovery.MIN_STEP_DEADLINE
    clock.steps = [1.0, 1.0, 9.0]
    assert clock.deadline() == recovery.STEP_DEADLINE_FACTOR * 1.0
    clock.steps = [60.0] * 3
    assert clock.deadline() == cluster.HUNG_AFTER


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(f"epoch_begin {epoch}")

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(f"epoch_end {epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(f"batch {batch}")


class _Backup:
    resumed_steps = 0


def test_a_replay_shows_each_epoch_once_and_the_replayed_batches_again():
    backup, seen, user = _Backup(), recovery._Seen(None), _Recorder()
    seen.begun, seen.ended = {0, 1}, {0}
    replayed = recovery._Replayed(user, backup, seen)
    backup.resumed_steps = 5  # the backup was written after batch 4 of epoch 1
    replayed.on_train_begin()
    replayed.on_epoch_begin(1)
    for batch in range(8):
        replayed.on_train_batch_end(batch)
    backup.resumed_steps = 0  # reset at the epoch's end
    replayed.on_epoch_end(1)
    replayed.on_epoch_begin(2)
    replayed.on_train_batch_end(0)
    assert user.events == ["batch 5", "batch 6", "batch 7", "epoch_end 1",
                           "epoch_begin 2", "batch 0"]


def test_the_ended_process_of_a_restarted_task_is_named(tmp_path):
    task = "/job:test/replica:0/task:9"
    old = subprocess.Popen(["sleep", "60"])
    new = subprocess.Popen(["sleep", "60"])
    try:
        old.kill()
        old.wait()
        (tmp_path / "old.log").write_text("serving\n")
        exits.started(task, new, tmp_path / "new.log")
        exits.restarted(task, old, tmp_path / "old.log")
        why = exits.why_ended(task, wait=0.1)
        assert why.startswith(f"its process (pid {old.pid}) was killed by "
                              "SIGKILL"), why
        assert why.endswith(f"it was started again as pid {new.pid}"), why
        exits.recovered(task)
        assert exits.why_ended(task, wait=0.1) is None  # new one runs on
    finally:
        exits.stopped(task)
        new.kill()
        new.wait()


def test_the_supervisor_starts_an_ended_worker_again_and_stops(tmp_path):
    started = []

    def start(task):
        (tmp_path / f"worker{task}.log").write_text("log\n")
        proc = subprocess.Popen(["sleep", "60"])
        started.append(proc)
        return proc

    procs = [start(0), start(1)]
    supervisor = local._Supervisor(procs, tmp_path, start)
    try:
        assert exits.is_supervised("/job:worker/replica:0/task:1")
        first = procs[1]
        first.kill()
        deadline = time.monotonic() + 60
        while procs[1] is first:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert procs[1].poll() is None and procs[0] is started[0]
        assert (tmp_path / "worker1.1.log").read_text() == "log\n"
    finally:
        supervisor.stop()
        local._stop(procs)
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    count = len(started)
    procs[0].wait()
    time.sleep(3 * local._Supervisor.POLL)
    assert len(started) == count  # none started after stop()
    assert not exits.is_supervised("/job:worker/replica:0/task:1")


def test_restart_must_be_a_bool():
    with pytest.raises(TypeError, match="restart must be True or False. "
                       "Received: restart='yes'"):
        with keras_pipe.local_workers(1, restart="yes"):
            pass


def test_a_same_process_resume_puts_the_metrics_running_totals_back(
        devices, tmp_path):
    # Broke: the resumed epoch's loss and accuracy averaged only the batches
    # after the backup (its skipped batches return no logs).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 3, size=(96,)).astype("int32")

    def make():
        keras.utils.set_random_seed(3)
        model = keras_pipe.PipelineModel(
            [keras.Sequential([keras.layers.Dense(8, activation="relu")]),
             keras.Sequential([keras.layers.Dropout(0.2),
                               keras.layers.Dense(3)])],
            devices=devices[:2], num_micro_batches=2)
        model.build((None, 8))
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), metrics=["accuracy"])
        return model

    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = make().fit(x, y, **fit).history
    model = make()
    backup = keras_pipe.BackupAndRestore(str(tmp_path / "b"), save_freq=5)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, callbacks=[backup, StopAt(8, RuntimeError)], **fit)
    history = model.fit(x, y, callbacks=[backup], **fit).history
    assert history["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert history["accuracy"] == pytest.approx(expected["accuracy"],
                                                abs=1e-6)


# ------------------------------------------------------ on worker processes


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow", PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):
        env.pop(name, None)
    return env


def _scenario(*args, timeout=900):
    # A fresh client process, forked from a warm one (tests/support/warm.py).
    result = warm.run([SCENARIOS, *args], _env(), cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_one_consistent_run(result):
    assert result["error"] is None, result["error"]
    assert result["fault_fired"]
    # The same weights and optimizer state as the uninterrupted run.
    assert result["weights_max_diff"] <= 1e-5, result["weights_max_diff"]
    assert result["iterations"] == result["steps"]
    # At most save_freq + 1 steps started twice (the backup's steps and the
    # one the fault broke), and some were.
    twice = result["steps_begun"] - result["steps"]
    assert 1 <= twice <= 6, twice
    # The callbacks' epochs and the history are those of one run.
    epochs = [e for e in result["events"] if e[0] != "batch_end"]
    assert epochs == [e for e in result["reference_events"]
                      if e[0] != "batch_end"]
    for name, values in result["reference_history"].items():
        assert result["history"][name] == pytest.approx(values, abs=1e-6)
    batches = [e[1] for e in result["events"] if e[0] == "batch_end"]
    assert sorted(set(batches)) == list(range(12))


@pytest.mark.slow
@pytest.mark.parametrize("task", [1, 0])
def test_fit_goes_on_after_a_worker_is_killed(task):
    _assert_one_consistent_run(_scenario("kill", "--task", str(task)))


@pytest.mark.slow
def test_fit_goes_on_after_a_worker_is_killed_during_a_backup():
    _assert_one_consistent_run(_scenario("save", "--task", "1"))


@pytest.mark.slow
def test_fit_goes_on_after_a_worker_hangs():
    result = _scenario("stop", "--task", "1")
    _assert_one_consistent_run(result)
    # Found by the step deadline, not today's 30 s of silence.
    assert result["deadline_at_loss"] < cluster.HUNG_AFTER, result


@pytest.mark.slow
def test_a_worker_that_does_not_come_back_ends_fit_naming_it():
    result = _scenario("gone", "--task", "1")
    error = result["error"]
    assert error["type"] == "WorkerUnavailableError", error
    assert list(error["tasks"]) == ["/job:worker/replica:0/task:1"]
    assert "killed by SIGKILL" in error["message"], error
    assert ("was started by local_workers(restart=False), which does not "
            "start it again; pass restart=True") in error["notes"], error


def test_a_remote_worker_that_does_not_answer_again_ends_fit(monkeypatch):
    task = {"/job:worker/replica:0/task:1": "127.0.0.1:1"}
    monkeypatch.setattr(cluster, "remote_tasks", lambda devices: task)
    waited = []
    monkeypatch.setattr(recovery.probes, "unreachable",
                        lambda tasks, timeout: waited.append(timeout) or task)
    lost = cluster.WorkerUnavailableError("Lost task 1 during fit.", task)
    with pytest.raises(cluster.WorkerUnavailableError,
                       match=r"Lost task 1 during fit. "
                       r"/job:worker/replica:0/task:1 at 127.0.0.1:1 did not "
                       r"answer again within 120 s \(keras_pipe.distributed"
                       r".recovery.RECOVER_TIMEOUT\)") as raised:
        recovery._recover(None, ["/job:worker/replica:0/task:1/CPU:0"], lost)
    assert waited == [recovery.RECOVER_TIMEOUT]
    assert raised.value.tasks == task



@pytest.mark.slow
def test_a_backup_from_two_workers_resumes_on_three(tmp_path):
    # The optimizer slots and the data position follow the variables'
    # order and the batch count, not the cut; the metrics' running totals
    # are in the backup (before, the resumed epoch's loss averaged its
    # batches after the backup only).
    backup = str(tmp_path / "backup")
    first = _scenario("layout", "--phase", "first", "--workers", "2",
                      "--backup", backup)
    assert first == {"stages": 2}
    result = _scenario("layout", "--phase", "resume", "--workers", "3",
                       "--backup", backup)
    assert result["stages"] == 3
    assert result["tasks"] == [f"/job:worker/replica:0/task:{t}"
                               for t in range(3)]
    assert result["weights_max_diff"] <= 1e-5, result
    for name, values in result["reference_history"].items():
        assert result["history"][name] == pytest.approx(values, abs=1e-6)


@pytest.mark.slow
def test_the_docs_example_runs():
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## Lost workers: fit goes on", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    result = warm.run(["-c", snippet], _env(), cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_fit_goes_on_after_a_worker_its_host_restarts_is_killed():
    # Workers this client did not start, each under a shell loop that starts
    # it again (docs/reliability.md): the client waits for the task to
    # answer at its address, then goes on as with local_workers.
    _assert_one_consistent_run(_scenario("remote", "--task", "1"))


def test_after_a_lost_connection_a_port_that_closes_soon_is_lost():
    # Broke: TF reported the reset while the killed worker's port still took
    # connections; the task was not counted lost and fit ended with the
    # stage's UnavailableError (once in 3 runs of the shell-loop scenario).
    import socket
    import threading

    import tensorflow as tf

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    task = {"t": f"127.0.0.1:{listener.getsockname()[1]}"}
    closer = threading.Timer(0.5, listener.close)
    closer.start()
    try:
        reset = tf.errors.UnavailableError(None, None, "Connection reset")
        assert cluster._gone_within(task, reset, 10.0) == task
        # Another error is looked at once: the port is closed by now.
        assert cluster._gone_within(task, ValueError(), 10.0) == task
    finally:
        closer.join()
        listener.close()
