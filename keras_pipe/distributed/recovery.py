"""A `fit` that goes on after a worker is lost: wait, place again, replay.

A remote stage's variables live in its worker's process. When that process
dies (or hangs and is killed) they are gone: the client's handles, and
every traced function that captured them, point at nothing, and
`keras_pipe.distributed.cluster.run` ends the call with a
`WorkerUnavailableError` naming the task. A worker started again at the
same address (`local_workers(..., restart=True)`, or its host's
supervisor) is an empty process. Given a `keras_pipe.BackupAndRestore`
with a number of batches as `save_freq`, `fit` here goes on in the same
call:

1. the lost task must answer again within `RECOVER_TIMEOUT` seconds (a
   hung worker that this client started is killed first, so that its
   supervisor starts it again); else `fit` ends with the error of the
   loss, which says how long it waited;
2. this process connects to the cluster again (`keras_pipe.connect`, same
   addresses, same client port), which gives every worker a new context;
3. every variable of the model, its optimizer and its metrics that lives
   on a worker is created again on its device, the optimizer's tables
   are pointed at them and the traced step is dropped (`replace`);
4. `fit` is called again with the same arguments: the backup restores the
   weights, the optimizer state, the seed states and the metrics' running
   totals of its last save, and skips the batches done before it
   (`keras_pipe.callbacks.BackupAndRestore`). The batches between the
   backup and the loss run again, with the same data and Dropout masks
   (keyed by the seed state, `keras_pipe.engine.keyed_random`).

What the other callbacks see: `on_train_begin` once, each epoch's
`on_epoch_begin` and `on_epoch_end` once, the batches skipped by the
backup once; the batches between the backup and the loss twice, with the
same batch numbers (their logs of the replay equal those of the first
run). The returned `History` holds one entry per epoch. A loss that comes
again before the run wrote a new backup ends `fit` (no progress); so does
a loss before any backup exists, which is why a backup is written when
training begins.

The data must be drawn again from the backup's batch: arrays, a
`tf.data.Dataset` or a `keras.utils.PyDataset` are; an iterator or a
generator is not, and a `fit` given one is not recovered. As for a resume
in a new process, the data order must depend on the epoch only
(`shuffle=False`, or a shuffle with a fixed seed).

A hung worker (stopped, or deadlocked) answers no probe. The watchdog
counts it lost after a silence derived from the measured step time
(`StepClock`): `STEP_DEADLINE_FACTOR` times the median step, at least
`MIN_STEP_DEADLINE` and at most `cluster.HUNG_AFTER` seconds.
"""

import collections.abc
import logging
import os
import statistics
import threading
import time

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.distributed import cluster, exits, probes

__all__ = ["RECOVER_TIMEOUT", "STEP_DEADLINE_FACTOR", "MIN_STEP_DEADLINE",
           "StepClock", "fit", "replace"]

# Seconds a lost worker gets to answer again before `fit` gives up.
RECOVER_TIMEOUT = 120.0
# A task silent for this many median steps (within the bounds below) is hung.
STEP_DEADLINE_FACTOR = 20.0
MIN_STEP_DEADLINE = 10.0
_CALLBACKS_ARG = 5  # `callbacks` is the 6th positional argument of fit


def fit(model, devices, placed_fit, args, kwargs):
    """`model.fit(*args, **kwargs)` through `cluster.run`, recovering from a
    lost worker when a `keras_pipe.BackupAndRestore` is among the callbacks
    and the data can be drawn again (see the module docstring)."""
    callbacks = list(kwargs.get("callbacks") or (
        args[_CALLBACKS_ARG] if len(args) > _CALLBACKS_ARG else None) or [])
    backup = _backup_of(callbacks)
    data = args[0] if args else kwargs.get("x")
    if backup is None or not cluster.remote_tasks(devices) or isinstance(
            data, collections.abc.Iterator):
        return cluster.run(devices, "fit", placed_fit, *args, **kwargs)
    history = next((c for c in callbacks
                    if isinstance(c, keras.callbacks.History)), None)
    if history is None:
        history = keras.callbacks.History()
        callbacks.append(history)
    seen, clock = _Seen(backup), StepClock()
    attempt = callbacks + [seen, clock]
    progress = None
    while True:
        try:
            call_args, call_kwargs = _with_callbacks(args, kwargs, attempt)
            cluster.run(devices, "fit", placed_fit, *call_args,
                        silence=clock.deadline, **call_kwargs)
        except (cluster.WorkerUnavailableError,
                tf.errors.UnavailableError) as error:
            # An `UnavailableError` that `cluster.run` could not pin on a
            # task (a worker started again before its port was looked at)
            # is recovered the same way: every remote variable is created
            # again, whichever task was lost.
            if not os.path.exists(backup.weights_path):
                error.add_note("keras_pipe: fit cannot go on: no backup "
                               f"exists at {backup.weights_path!r}.")
                raise
            if backup.saves == progress:
                error.add_note("keras_pipe: fit cannot go on: no backup "
                               "was written since the last loss.")
                raise
            progress = backup.saves
            start = time.monotonic()
            _recover(model, devices, error)
            seconds = time.monotonic() - start
            logging.getLogger(__name__).warning(
                "keras_pipe: lost %s during fit; connected again after %.1f "
                "s, going on from the backup of optimizer step %s.",
                cluster.describe_tasks(getattr(error, "tasks", None) or
                                       cluster.remote_tasks(devices)),
                seconds,
                backup.saved_iterations, extra={"recovery_seconds": seconds})
            attempt = [c if c is backup else _Replayed(c, backup, seen)
                       for c in callbacks] + [seen, clock]
            continue
        model.history = history
        return history


def _with_callbacks(args, kwargs, callbacks):
    """`(args, kwargs)` of fit with `callbacks` in place of the given ones."""
    if len(args) > _CALLBACKS_ARG:
        return [*args[:_CALLBACKS_ARG], callbacks,
                *args[_CALLBACKS_ARG + 1:]], kwargs
    return list(args), {**kwargs, "callbacks": callbacks}


def _backup_of(callbacks):
    """The `keras_pipe.BackupAndRestore` with a batch `save_freq`, or None.

    Known by what it adds to Keras' (`save_if_missing`, the exact resume):
    this package does not import the callbacks above it.
    """
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore) and hasattr(
                callback, "save_if_missing") and isinstance(
                callback.save_freq, int):
            return callback
    return None


def _recover(model, devices, error):
    """Waits for the lost tasks, connects again and re-creates the
    variables; re-raises `error` (with how long it waited) if a task does
    not answer within `RECOVER_TIMEOUT` seconds."""
    tasks = cluster.remote_tasks(devices)
    lost = getattr(error, "tasks", {})
    for name in lost:
        proc = exits.process(name)
        if proc is None:
            continue  # not started here: its host may start it again
        if not exits.is_supervised(name):
            error.add_note(
                f"keras_pipe: fit cannot go on: {name} was started by "
                "local_workers(restart=False), which does not start it "
                "again; pass restart=True.")
            raise error
        if proc.poll() is None:
            proc.kill()  # hung: its supervisor starts it again
    down = probes.unreachable(tasks, RECOVER_TIMEOUT)
    if down:
        raise cluster.WorkerUnavailableError(
            f"{error} {cluster.describe_tasks(down)} did not answer again "
            f"within {RECOVER_TIMEOUT:g} s (keras_pipe.distributed.recovery."
            "RECOVER_TIMEOUT), so fit cannot go on from its backup.",
            down) from error
    cluster.reconnect()
    replace(model)
    for name in lost:
        exits.recovered(name)


def replace(model):
    """Creates every variable of `model` (and of its optimizer and metrics)
    that lives on a remote worker again on its device, as zeros, and drops
    the traced functions that captured the old ones.

    Returns:
        The number of variables created again.
    """
    from keras_pipe.engine.placement import device_of
    optimizer = model.optimizer
    variables = {}
    for variable in [*model.variables, *model.metrics_variables,
                     *(optimizer.variables if optimizer is not None else [])]:
        variables.setdefault(id(variable), variable)
    keys, replaced = {}, 0
    for variable in variables.values():
        device = device_of(variable)
        if not cluster.is_remote(device):
            continue
        replaced += 1
        old = (_compat.variable_key(optimizer, variable)
               if optimizer is not None else None)
        with tf.device(device):
            _compat.reinitialize_variable(
                variable, tf.zeros(variable.shape, variable.dtype))
        if old is not None:
            keys[old] = _compat.variable_key(optimizer, variable)
    if optimizer is not None:
        _compat.rekey_optimizer(optimizer, keys)
    model.train_function = model.test_function = None
    model.predict_function = None
    return replaced


class StepClock(keras.callbacks.Callback):
    """Measures the training steps; `deadline()` is the silence after which
    a task counts as hung (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.steps = []
        self._start = None
        self._lock = threading.Lock()

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is not None:
            with self._lock:
                self.steps = (self.steps + [time.monotonic() - self._start])[
                    -50:]

    def deadline(self):
        with self._lock:
            steps = list(self.steps)
        if len(steps) < 3:
            return cluster.HUNG_AFTER
        return min(cluster.HUNG_AFTER, max(
            MIN_STEP_DEADLINE, STEP_DEADLINE_FACTOR * statistics.median(steps)))


class _Seen(keras.callbacks.Callback):
    """The epochs whose begin and end the callbacks were shown; a first
    backup at the start, so that a loss before the first save recovers."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self.begun, self.ended = set(), set()

    def on_train_begin(self, logs=None):
        self.backup.save_if_missing()

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.add(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.ended.add(epoch)


class _Replayed(keras.callbacks.Callback):
    """A user's callback in the call that goes on after a loss: shown
    what it was not shown yet, and the batches that run again."""

    def __init__(self, callback, backup, seen):
        super().__init__()
        self.callback, self.backup, self.seen = callback, backup, seen

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs=None):
        pass  # shown at the start of the fit call

    def on_epoch_begin(self, epoch, logs=None):
        if epoch not in self.seen.begun:
            self.callback.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if epoch not in self.seen.ended:
            self.callback.on_epoch_end(epoch, logs)

    def _skipped(self, batch):
        return batch < self.backup.resumed_steps

    def on_train_batch_begin(self, batch, logs=None):
        if not self._skipped(batch):
            self.callback.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if not self._skipped(batch):
            self.callback.on_train_batch_end(batch, logs)

    def on_train_end(self, logs=None):
        self.callback.on_train_end(logs)

    def on_test_begin(self, logs=None):
        self.callback.on_test_begin(logs)

    def on_test_end(self, logs=None):
        self.callback.on_test_end(logs)

    def on_test_batch_begin(self, batch, logs=None):
        self.callback.on_test_batch_begin(batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self.callback.on_test_batch_end(batch, logs)
