"""Cluster scenarios run as a client process by tests/test_cluster.py.

A client must connect before TensorFlow is initialized otherwise (the test
process already has 4 logical CPUs), so each scenario runs here, in a client
process of its own or one after the other with others (each client process
starts TensorFlow and connects: 6-15 s), against worker processes that the
test started. The last stdout line is a JSON object with the measurements.

    python tests/support/cluster_scenarios.py remote --cluster A0,A1
    python tests/support/cluster_scenarios.py listen,remote --cluster A0,A1
        # several in one process, in order: one JSON object of their results
    python tests/support/cluster_scenarios.py resume --cluster A0,A1 --kill-pid PID \
        --backup DIR    # waits for "go" on stdin after the worker is lost
"""

import argparse
import contextlib
import io
import json
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.python.eager import context as _context  # noqa: E402

import keras_pipe  # noqa: E402
from keras_pipe.distributed.cluster import WorkerUnavailableError  # noqa: E402
from tests.support.data import random_data  # noqa: E402

LOCAL = "/job:localhost/replica:0/task:0/device:CPU:0"


def remote_devices(num_tasks):
    return [f"/job:worker/replica:0/task:{t}/device:CPU:0"
            for t in range(num_tasks)]


def make_model(devices, seed=7):
    """An MLP with BatchNorm and Dropout, one stage per device."""
    keras.utils.set_random_seed(seed)
    # Named as in a fresh process, whatever scenario ran before here.
    stages = [keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                keras.layers.BatchNormalization()],
                               name="sequential"),
              keras.Sequential([keras.layers.Dropout(0.25),
                                keras.layers.Dense(3)], name="sequential_1")]
    model = keras_pipe.PipelineModel(stages, devices=devices,
                                      num_micro_batches=2)
    model.build((None, 8))
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data():
    return random_data(64, (8,), classes=3)


def copy_variables(source, target):
    for a, b in zip(target.variables, source.variables):
        a.assign(b.numpy())


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
               for u, v in zip(a, b))


def values(model):
    return [v.numpy() for v in model.variables] + [
        v.numpy() for v in model.optimizer.variables]


def run_remote(args):
    """fit / evaluate / predict / save on 2 workers vs. one local device."""
    devices_per_task = keras_pipe.connect(args.cluster, timeout=30.0)
    x, y = data()
    remote = make_model(remote_devices(len(args.cluster["worker"])))
    local = make_model([LOCAL, LOCAL])
    copy_variables(remote, local)
    placed = sorted({v.value.device for v in remote.variables})
    results = {}
    for name, model in (("remote", remote), ("local", local)):
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                            verbose=0)
        results[name] = {
            "loss": history.history["loss"],
            "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
            "predict": model.predict(x, batch_size=16, verbose=0),
            "values": values(model)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        remote.save(path)
        loaded = keras.models.load_model(path)
        reloaded_devices = sorted({v.value.device for v in loaded.variables})
        reloaded_diff = max_diff(
            loaded.predict(x, batch_size=16, verbose=0)[None],
            results["remote"]["predict"][None])
    r, l = results["remote"], results["local"]
    print(json.dumps({
        "devices_per_task": devices_per_task,
        "variable_devices": placed,
        "weights_max_diff": max_diff(r["values"], l["values"]),
        "num_values": len(r["values"]),
        "loss_remote": r["loss"], "loss_local": l["loss"],
        "evaluate_remote": r["evaluate"], "evaluate_local": l["evaluate"],
        "predict_max_diff": max_diff([r["predict"]], [l["predict"]]),
        "reloaded_devices": reloaded_devices,
        "reloaded_predict_max_diff": reloaded_diff,
        "thread_spinning_disabled": _context.context().config.experimental
        .disable_thread_spinning,
    }))


def run_placed(args):
    """Array data batched on the first stage's worker: where each fit /
    evaluate built its pipeline, and the same results as a local model."""
    from keras_pipe import placed_data
    keras_pipe.connect(args.cluster, timeout=30.0)
    built = []
    original = placed_data.PlacedArrays.get_tf_dataset

    def recording(self):
        dataset = original(self)
        built.append(dataset.dataset._variant_tensor.device)
        return dataset

    placed_data.PlacedArrays.get_tf_dataset = recording
    x, y = data()
    remote = make_model(remote_devices(len(args.cluster["worker"])))
    local = make_model([LOCAL, LOCAL])
    copy_variables(remote, local)
    default = remote.data_device  # None: this process, as Keras does
    remote.data_device = local.data_device = "auto"
    results, devices = {}, {}
    for name, model in (("remote", remote), ("local", local)):
        keras.utils.set_random_seed(3)  # the same shuffles for both
        before = len(built)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=True,
                            validation_split=0.25,
                            class_weight={0: 1.0, 1: 2.0, 2: 0.5}, verbose=0)
        fit_devices = built[before:]
        evaluated = model.evaluate(x, y, batch_size=12, verbose=0)
        devices[name] = {"fit": fit_devices,
                         "evaluate": built[before + len(fit_devices):]}
        results[name] = {"history": history.history,
                         "evaluate": evaluated, "values": values(model)}
    chosen = [remote.data_device, local.data_device]
    remote.data_device = None  # batched in this process again
    before = len(built)
    remote.evaluate(x, y, batch_size=12, verbose=0)
    r, l = results["remote"], results["local"]
    print(json.dumps({
        "data_device": chosen, "default": default,
        "devices": devices, "opted_out": built[before:],
        "history_remote": r["history"], "history_local": l["history"],
        "evaluate_remote": r["evaluate"], "evaluate_local": l["evaluate"],
        "weights_max_diff": max_diff(r["values"], l["values"])}))


class _KillAt(keras.callbacks.Callback):
    """Signals a worker process (SIGKILL) before a given batch of an epoch."""

    def __init__(self, pid, epoch, batch, sig=signal.SIGKILL):
        super().__init__()
        self.pid, self.epoch, self.batch, self.sig = pid, epoch, batch, sig
        self.current = None
        self.killed_at = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current, batch) == (self.epoch, self.batch):
            os.kill(self.pid, self.sig)
            self.killed_at = time.monotonic()


class _Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def run_resume(args):
    """Kill a worker mid-fit; after its restart, fit again from the backup."""
    epochs = 4
    x, y = data()
    keras_pipe.connect(args.cluster, timeout=30.0)
    devices = remote_devices(len(args.cluster["worker"]))
    # The uninterrupted run, on the same workers.
    reference = make_model(devices)
    reference.fit(x, y, batch_size=16, epochs=epochs, shuffle=False,
                  verbose=0)
    expected = values(reference)
    del reference

    model = make_model(devices)
    killer = _KillAt(args.kill_pid, epoch=2, batch=1)
    backup = keras_pipe.BackupAndRestore(args.backup)
    error = None
    try:
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False,
                  verbose=0, callbacks=[backup, killer])
    except WorkerUnavailableError as exc:
        error = exc
    seconds = (time.monotonic() - killer.killed_at
               if killer.killed_at is not None else None)
    lost = {"error": type(error).__name__ if error else None,
            "message": str(error) if error else None,
            "tasks": error.tasks if error else None,
            "seconds_to_error": seconds}
    print("LOST " + json.dumps(lost), flush=True)
    if error is None:
        return
    if sys.stdin.readline().strip() != "go":
        return
    start = time.monotonic()
    keras_pipe.connect(args.cluster, timeout=30.0)
    reconnect = time.monotonic() - start
    model = make_model(devices, seed=99)  # Weights come from the backup.
    seen = _Epochs()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras_pipe.BackupAndRestore(args.backup), seen])
    print(json.dumps({"lost": lost, "reconnect_seconds": reconnect,
                      "resumed_epochs": seen.epochs,
                      "weights_max_diff": max_diff(values(model), expected),
                      "num_values": len(expected)}))


def own_listeners():
    """`[host]` of every TCP socket of this process in the LISTEN state."""
    from keras_pipe.distributed.bind import listening_sockets
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return sorted({f"{host}:{port}" for host, port, inode
                   in listening_sockets() if inode in inodes})


def run_listen(args):
    """Connects, runs one remote op; lists this client's listening sockets."""
    before = own_listeners()
    keras_pipe.connect(args.cluster, timeout=30.0)
    import tensorflow as tf
    with tf.device(remote_devices(1)[0]):
        value = float(tf.reduce_sum(tf.ones([3])))
    print(json.dumps({"before": before, "after": own_listeners(),
                      "value": value}))


def compute_threads(pid):
    """How many threads of process `pid` are TF inter-op pool threads."""
    names = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue  # a thread that ended meanwhile
    return sum(name.startswith("tf_Compute") for name in names)


def run_threads(args):
    """Connects with `--inter-op` threads; counts the workers' pool threads."""
    pids = [int(p) for p in args.worker_pids.split(",")]
    before = [compute_threads(pid) for pid in pids]
    keras_pipe.connect(args.cluster, timeout=30.0,
                       inter_op_threads=args.inter_op)
    import tensorflow as tf
    for device in remote_devices(len(pids)):
        with tf.device(device):
            float(tf.reduce_sum(tf.ones([3])))
    print(json.dumps({"before": before,
                      "after": [compute_threads(pid) for pid in pids],
                      "client": tf.config.threading
                      .get_inter_op_parallelism_threads()}))


def _outcome(call):
    """`{"error", "message", "tasks"}` of `call()`; error None if it worked."""
    try:
        call()
    except Exception as exc:  # Reported to the test, which checks the type.
        return {"error": type(exc).__name__,
                "is_unavailable": isinstance(exc, WorkerUnavailableError),
                "message": str(exc), "tasks": getattr(exc, "tasks", None)}
    return {"error": None}


def run_restart(args):
    """A worker restarts between calls: the same model, then reconnect."""
    x, y = data()
    keras_pipe.connect(args.cluster, timeout=30.0)
    devices = remote_devices(len(args.cluster["worker"]))
    model = make_model(devices)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    fit = lambda m: m.fit(x, y, batch_size=16, epochs=1, verbose=0)  # noqa
    result = {"same_model": _outcome(lambda: fit(model)),
              "predict": _outcome(lambda: model.predict(x, verbose=0))}
    keras_pipe.connect(args.cluster, timeout=30.0)
    result["reconnected_same_model"] = _outcome(lambda: fit(model))
    result["new_model"] = _outcome(lambda: fit(make_model(devices)))
    print(json.dumps(result))


def run_stage_error(args):
    """A wrong input width after tracing, on worker processes."""
    keras_pipe.connect(args.cluster, timeout=30.0)
    model = make_model(remote_devices(len(args.cluster["worker"])))
    x, y = data()
    for rows in (16, 8):  # Two batch sizes: Keras relaxes the traced shapes.
        model.fit(x, y, batch_size=rows, epochs=1, verbose=0)
    wide = np.concatenate([x, x[:, :1]], axis=1)
    print(json.dumps({"fit": _outcome(
        lambda: model.fit(wide, y, batch_size=16, verbose=0))}))


def run_hang(args):
    """Freeze a worker (SIGSTOP) mid-fit: the watchdog must end the fit.

    A silent task counts as hung after `HUNG_AFTER` seconds (30 by
    default, for busy workers on a loaded host); 4 here, to keep it short.
    """
    from keras_pipe.distributed import cluster as cluster_lib
    cluster_lib.HUNG_AFTER = 4.0
    x, y = data()
    keras_pipe.connect(args.cluster, timeout=30.0)
    model = make_model(remote_devices(len(args.cluster["worker"])))
    freezer = _KillAt(args.kill_pid, epoch=1, batch=1, sig=signal.SIGSTOP)
    error = None
    try:
        model.fit(x, y, batch_size=16, epochs=50, shuffle=False, verbose=0,
                  callbacks=[freezer])
    except WorkerUnavailableError as exc:
        error = exc
    print(json.dumps({
        "error": type(error).__name__ if error else None,
        "message": str(error) if error else None,
        "tasks": error.tasks if error else None,
        "seconds_to_error": time.monotonic() - freezer.killed_at}))
    sys.stdout.flush()
    os._exit(0)  # The stopped worker's RPCs may never return: do not wait.


def run_timeline(args):
    """The Timeline records a step whose stages run on the workers."""
    devices = keras_pipe.connect(args.cluster, timeout=60.0)
    del devices
    model = make_model(remote_devices(2))
    logdir = tempfile.mkdtemp()
    recorder = keras_pipe.callbacks.Timeline(logdir, steps=(1, 2),
                                             verbose=False)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[recorder])
    result = recorder.results[-1]
    print(json.dumps({
        "kinds": sorted({e["kind"] for e in result["events"]}),
        "events": len(result["events"]),
        "stages": sorted({e["stage"] for e in result["events"]}),
        "bubble": result["measured_bubble"],
        "png": os.path.getsize(os.path.join(logdir, "step2.png"))}))


class _InterruptAt(keras.callbacks.Callback):
    """Interrupts after a given number of batches of fit/evaluate/predict.

    `how="sigint"` sends SIGINT to the main thread (Ctrl-C: Python raises it in
    the main thread, not the thread running the steps), then waits up to
    `wait` s in the callback for the interrupt to stop the loop here;
    `how="raise"` raises ValueError from the callback itself.
    """

    def __init__(self, after, how, wait=10.0):
        super().__init__()
        self.after, self.how, self.wait = after, how, wait
        self.seen = 0

    def _batch_end(self):
        self.seen += 1
        if self.seen != self.after:
            return
        if self.how == "raise":
            raise ValueError("callback failed")
        # Ctrl-C, aimed at the main thread as a terminal's usually lands:
        # sent to this thread, CPython 3.11 may see it only much later.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        deadline = time.monotonic() + self.wait
        while time.monotonic() < deadline:
            time.sleep(0.01)

    def on_train_batch_end(self, batch, logs=None):
        self._batch_end()

    def on_test_batch_end(self, batch, logs=None):
        self._batch_end()

    def on_predict_batch_end(self, batch, logs=None):
        self._batch_end()


def _step_threads(wait=0.0):
    """Names of threads still running a call, after waiting `wait` s for none.

    Listed by `threading.enumerate`, not `is_alive`: a KeyboardInterrupt in
    `Thread.join` marks a running thread as stopped (CPython 3.11).
    """
    deadline = time.monotonic() + wait
    while True:
        names = sorted(t.name for t in threading.enumerate()
                       if t.name.startswith("keras_pipe-")
                       and t.name != "keras_pipe-watch")
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.05)


def run_interrupt(args):
    """Ctrl-C (and a failing callback) at step N, then K more steps."""
    keras_pipe.connect(args.cluster, timeout=30.0)
    devices = remote_devices(len(args.cluster["worker"]))
    n, k, rows = 3, 3, 16
    rng = np.random.default_rng(1)
    x = rng.normal(size=((n + k) * rows, 8)).astype("float32")
    y = rng.integers(0, 3, size=((n + k) * rows,)).astype("int32")
    fit = dict(batch_size=rows, epochs=1, shuffle=False, verbose=0)
    reference = make_model(devices)
    reference.fit(x, y, **fit)
    expected = values(reference)
    results = {}
    for how, kind in (("sigint", KeyboardInterrupt), ("raise", ValueError)):
        model = make_model(devices)
        raised = None
        try:
            model.fit(x, y, callbacks=[_InterruptAt(n, how)], **fit)
        except kind as exc:
            raised = type(exc).__name__
        at = int(model.optimizer.iterations.numpy())
        threads = _step_threads()
        _step_threads(wait=20.0)  # A step loop left running ends here.
        later = int(model.optimizer.iterations.numpy())
        model.fit(x[n * rows:], y[n * rows:], **fit)
        results[how] = {"raised": raised, "iterations": at,
                        "iterations_later": later,
                        "threads_left": threads,
                        "weights_max_diff": max_diff(values(model), expected)}
    model = make_model(devices)
    # Three calls of 2 batches each: interrupted at the second call's end.
    model.inference_steps_per_execution = 2
    for action in ("evaluate", "predict"):
        counter = _InterruptAt(2, "sigint")
        raised = None
        try:
            if action == "evaluate":
                model.evaluate(x, y, batch_size=rows, verbose=0,
                               callbacks=[counter])
            else:
                model.predict(x, batch_size=rows, verbose=0,
                              callbacks=[counter])
        except KeyboardInterrupt:
            raised = "KeyboardInterrupt"
        threads = _step_threads()
        _step_threads(wait=20.0)
        results[action] = {"raised": raised, "batches": counter.seen,
                           "threads_left": threads}
    print(json.dumps(results))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", help="a scenario's name, or names "
                        "joined by ',' to run one after the other here")
    parser.add_argument("--cluster", required=True,
                        type=lambda s: {"worker": s.split(",")})
    parser.add_argument("--kill-pid", type=int)
    parser.add_argument("--backup")
    parser.add_argument("--worker-pids")
    parser.add_argument("--inter-op", type=int)
    args = parser.parse_args()
    # Ctrl-C as a terminal delivers it, however the suite was started: a
    # shell's background job starts with SIGINT ignored, and Python then
    # raises no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    names = args.scenario.split(",")
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    if len(names) == 1:
        SCENARIOS[names[0]](args)
        return
    results = {}
    for name in names:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            SCENARIOS[name](args)
        results[name] = json.loads(out.getvalue().strip().splitlines()[-1])
    print(json.dumps(results))


SCENARIOS = {"remote": run_remote, "resume": run_resume, "hang": run_hang,
             "listen": run_listen, "restart": run_restart,
             "stage_error": run_stage_error, "timeline": run_timeline,
             "threads": run_threads, "interrupt": run_interrupt,
             "placed": run_placed}


if __name__ == "__main__":
    main()
