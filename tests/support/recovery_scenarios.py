"""A fit that goes on after a lost worker, run as a client process.

Started by tests/test_recovery.py (and by hand for docs/reliability.md's
table). Each run starts its own `local_workers(..., restart=True)`, trains
an uninterrupted reference, then the same fit with a fault, and prints one
JSON line with what the test checks:

    python tests/support/recovery_scenarios.py kill --task 1
    python tests/support/recovery_scenarios.py kill --task 0
    python tests/support/recovery_scenarios.py save --task 1   # during a save
    python tests/support/recovery_scenarios.py stop --task 1   # SIGSTOP
    python tests/support/recovery_scenarios.py gone --task 1   # no restart
    python tests/support/recovery_scenarios.py remote --task 1
        # workers not started by the client, kept up by a shell loop
    python tests/support/recovery_scenarios.py layout --phase first \
        --workers 2 --backup DIR      # reference, then a fit stopped at 8
    python tests/support/recovery_scenarios.py layout --phase resume \
        --workers 3 --backup DIR      # the same fit resumed on 3 stages
"""

import argparse
import contextlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_pipe  # noqa: E402
from keras_pipe.distributed import cluster, exits, recovery  # noqa: E402

ROWS, BATCH, EPOCHS, SAVE_FREQ = 96, 8, 2, 5  # 12 steps per epoch
KILL_STEP = 8  # global step (0-based) before which the fault comes


def make_model(devices, seed=7):
    """Two stages, SGD, Dropout on both."""
    keras.utils.set_random_seed(seed)
    stages = [keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dropout(0.3)]),
              keras.Sequential([keras.layers.Dropout(0.25),
                                keras.layers.Dense(3)])]
    model = keras_pipe.PipelineModel(stages, devices=devices,
                                     num_micro_batches=2)
    model.build((None, 8))
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,)).astype("int32")
    return x, y


def values(model):
    return [v.numpy() for v in model.variables] + [
        v.numpy() for v in model.optimizer.variables]


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


class Fault(keras.callbacks.Callback):
    """Signals a worker before global step `step`, or in the first backup
    save after it (before the save reads the weights)."""

    def __init__(self, task, step, sig, backup=None):
        super().__init__()
        self.task, self.step, self.sig = task, step, sig
        self.seen = 0
        self.begun = 0  # steps started, the one the fault broke included
        self.at = None
        if backup is not None:  # during the backup's own save
            original = backup._save_model

            def save():
                if self.seen >= self.step and self.at is None:
                    self.fire()
                original()

            backup._save_model = save
            self.during_save = True
        else:
            self.during_save = False

    def fire(self):
        proc = exits.process(f"/job:worker/replica:0/task:{self.task}")
        self.pid = proc.pid if proc is not None else LOOPED[self.task]()
        os.kill(self.pid, self.sig)
        self.at = time.monotonic()
        self.wall = time.time()

    def on_train_batch_begin(self, batch, logs=None):
        self.begun += 1
        if not self.during_save and self.seen == self.step \
                and self.at is None:
            self.fire()

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1


class Events(keras.callbacks.Callback):
    """What a user's callback is shown, and when."""

    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(["train_begin"])

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(["epoch_begin", epoch])

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(["epoch_end", epoch, logs["loss"]])

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(["batch_end", batch, time.monotonic(),
                            logs.get("loss")])

    def on_train_end(self, logs=None):
        self.events.append(["train_end"])


def fit(model, backup_dir, extra=()):
    x, y = data()
    backup = keras_pipe.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
    events = Events()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                        verbose=0, callbacks=[backup, events, *extra])
    return backup, events, history


DEADLINES = []  # (time, seconds) of each read of the step deadline


def _record_deadlines():
    original = recovery.StepClock.deadline

    def recorded(self):
        seconds = original(self)
        DEADLINES.append((time.monotonic(), seconds))
        return seconds

    recovery.StepClock.deadline = recorded


class Recoveries(logging.Handler):
    """The recoveries that `keras_pipe.distributed.recovery` logs."""

    def __init__(self):
        super().__init__()
        self.records = []
        logging.getLogger(recovery.__name__).addHandler(self)

    def emit(self, record):
        self.records.append(record)


def run_fault(args):
    sig = {"kill": signal.SIGKILL, "save": signal.SIGKILL, "remote":
           signal.SIGKILL, "stop": signal.SIGSTOP,
           "gone": signal.SIGKILL}[args.scenario]
    tmp = tempfile.mkdtemp()
    _record_deadlines()
    recoveries = Recoveries()
    started = (workers(2, looped=True) if args.scenario == "remote" else
               keras_pipe.local_workers(2, restart=args.scenario != "gone",
                                        timeout=240.0))
    with started as devices:
        reference = make_model(devices)
        _, ref_events, ref_history = fit(reference, os.path.join(tmp, "ref"))
        expected = values(reference)
        model = make_model(devices)
        backup = keras_pipe.BackupAndRestore(os.path.join(tmp, "run"),
                                             save_freq=SAVE_FREQ)
        fault = Fault(args.task, KILL_STEP - (args.scenario == "save"), sig,
                      backup if args.scenario == "save" else None)
        events = Events()
        x, y = data()
        error = None
        try:
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS,
                                shuffle=False, verbose=0,
                                callbacks=[backup, events, fault])
        except Exception as exc:  # reported to the test, which checks it
            error = {"type": type(exc).__name__, "message": str(exc),
                     "notes": " ".join(getattr(exc, "__notes__", [])),
                     "tasks": getattr(exc, "tasks", None)}
            history = None
        batches = [e for e in events.events if e[0] == "batch_end"]
        after = [e[2] for e in batches if fault.at is not None
                 and e[2] > fault.at]
        result = {
            "error": error,
            "fault_fired": fault.at is not None,
            "batch_ends": len(batches),
            "steps_begun": fault.begun,
            "steps": EPOCHS * ROWS // BATCH,
            "first_step_after_fault_s": (after[0] - fault.at) if after
            else None,
            "events": [e[:2] if e[0] == "batch_end" else e
                       for e in events.events],
            "reference_events": [e[:2] if e[0] == "batch_end" else e
                                 for e in ref_events.events],
            "history": history.history if history else None,
            "reference_history": ref_history.history,
            "iterations": int(model.optimizer.iterations.numpy())
            if error is None else None,
        }
        before = [s for t, s in DEADLINES if after and t < after[0]]
        # No step deadline read: the watchdog's fixed silence was in force.
        result["deadline_at_loss"] = before[-1] if before else \
            cluster.HUNG_AFTER
        result["recoveries"] = [{
            "detected_after_s": r.created - r.recovery_seconds - fault.wall,
            "recovery_s": r.recovery_seconds} for r in recoveries.records]
        if error is None:
            result["weights_max_diff"] = max_diff(values(model), expected)
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


# task -> a function that returns the pid of its worker under a loop
LOOPED = {}


def _child(pid):
    """The pid of the one child process of `pid` (the loop's worker)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
        found = children.read_text().split()
        if found:
            return int(found[0])
        time.sleep(0.1)
    raise RuntimeError(f"process {pid} started no worker")


@contextlib.contextmanager
def workers(num_workers, looped=False):
    """Worker processes on free loopback ports, not pinned (more workers
    than cores); killed at the end. `looped`: each runs under a shell loop
    that starts it again when it ends, as its host's supervisor would
    (docs/reliability.md)."""
    from tests.support.ports import free_port
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
    procs = []
    for task in range(num_workers):
        command = [sys.executable, "-m", "keras_pipe.distributed.worker",
                   "--task", str(task), "--cluster", ",".join(addresses),
                   "--intra-op-threads", "1", "--inter-op-threads", "4"]
        if looped:
            command = ["bash", "-c", "while true; do \"$@\"; sleep 1; done",
                       "loop", *command]
        procs.append(subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        LOOPED[task] = lambda pid=procs[-1].pid: _child(pid)
    try:
        keras_pipe.connect({"worker": addresses}, timeout=240.0)
        yield [f"/job:worker/replica:0/task:{t}/device:CPU:0"
               for t in range(num_workers)]
    finally:
        for proc in procs:  # the loop and its worker: one process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def layout_model(devices):
    """One Sequential model cut into len(devices) stages by from_model."""
    keras.utils.set_random_seed(5)
    layers = keras.layers
    base = keras.Sequential([
        keras.Input((8,)), layers.Dense(16, activation="relu"),
        layers.Dropout(0.2), layers.Dense(16, activation="relu"),
        layers.Dense(16, activation="relu"), layers.Dropout(0.1),
        layers.Dense(3)])
    model = keras_pipe.PipelineModel.from_model(
        base, num_stages=len(devices), devices=devices, num_micro_batches=2)
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class StopAt(keras.callbacks.Callback):
    """Ends fit after `step` steps by raising `error`, as a preemption
    (`KeyboardInterrupt`) or a failing callback would."""

    def __init__(self, step, error=KeyboardInterrupt):
        super().__init__()
        self.step, self.error, self.seen = step, error, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise self.error("interrupted")


def run_layout(args):
    x, y = data()
    fit = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    expected = pathlib.Path(args.backup + ".expected.npz")
    with workers(args.workers) as devices:
        if args.phase == "first":
            reference = layout_model(devices)
            history = reference.fit(x, y, **fit).history
            np.savez(expected, *values(reference))
            expected.with_suffix(".json").write_text(json.dumps(history))
            model = layout_model(devices)
            backup = keras_pipe.BackupAndRestore(args.backup,
                                                 save_freq=SAVE_FREQ)
            with contextlib.suppress(KeyboardInterrupt):
                model.fit(x, y, callbacks=[backup, StopAt(KILL_STEP)], **fit)
            print(json.dumps({"stages": model.num_stages}))
            return
        model = layout_model(devices)
        backup = keras_pipe.BackupAndRestore(args.backup, save_freq=SAVE_FREQ)
        history = model.fit(x, y, callbacks=[backup], **fit).history
        saved = np.load(expected)
        print(json.dumps({
            "stages": model.num_stages,
            "tasks": sorted({v.value.device.split("/device")[0]
                             for v in model.variables}),
            "history": history,
            "reference_history": json.loads(
                expected.with_suffix(".json").read_text()),
            "weights_max_diff": max_diff(
                values(model), [saved[k] for k in saved.files])}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario",
                        choices=["kill", "save", "stop", "gone", "remote",
                                 "layout"])
    parser.add_argument("--task", type=int, default=1)
    parser.add_argument("--phase", choices=["first", "resume"])
    parser.add_argument("--workers", type=int)
    parser.add_argument("--backup")
    args = parser.parse_args()
    if args.scenario == "layout":
        run_layout(args)
    else:
        run_fault(args)


if __name__ == "__main__":
    main()
