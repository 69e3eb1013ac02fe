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
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_pipe  # noqa: E402
from keras_pipe.distributed import (
    exits,  # noqa: E402
    recovery,  # noqa: E402
)

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
        self.pid = proc.pid
        os.kill(proc.pid, self.sig)
        self.at = time.monotonic()

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


def run_fault(args):
    sig = {"kill": signal.SIGKILL, "save": signal.SIGKILL,
           "stop": signal.SIGSTOP, "gone": signal.SIGKILL}[args.scenario]
    tmp = tempfile.mkdtemp()
    _record_deadlines()
    with keras_pipe.local_workers(2, restart=args.scenario != "gone",
                                  timeout=240.0) as devices:
        if args.scenario == "gone":
            recovery.RECOVER_TIMEOUT = 10.0
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
        result["deadline_at_loss"] = before[-1] if before else None
        if error is None:
            result["weights_max_diff"] = max_diff(values(model), expected)
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["kill", "save", "stop", "gone"])
    parser.add_argument("--task", type=int, default=1)
    run_fault(parser.parse_args())


if __name__ == "__main__":
    main()
