"""Pinned worker processes on this machine, started and stopped in one call.

Logical CPU devices (`keras_pipe.logical_cpu_devices`) share one process's
thread pool: they show placement and schedule, not speed. The speed-up of a
pipeline on one multi-core (or multi-GPU) machine needs each stage in its
own process on its own core (or GPU). `local_workers` starts those
processes (`python -m keras_pipe.distributed.worker`, listening on loopback only, each
pinned to its core or given its one GPU), connects this process to them
(`keras_pipe.connect`) and stops them when the `with` block ends, on an
error or a `KeyboardInterrupt` too. A worker also ends if this process dies
without unwinding (Linux: it is started with a parent-death signal).
`cores_shared` lets the pinned workers' threads share their cores for the
length of a call that hands small tensors between them many times a second
(`PipelineModel.generate`).
"""

import contextlib
import ctypes
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from keras_pipe import _validation
from keras_pipe.distributed import exits
from keras_pipe.distributed import heap as heap_lib
from keras_pipe.distributed.worker import ONEDNN_VARIABLE

__all__ = ["local_workers", "cores_shared"]

_PR_SET_PDEATHSIG = 1

# Threads of each worker's intra-op pool, all on the worker's one core, by
# the kernels it runs. A micro-batch makes small matrix products: oneDNN's
# run fastest on one thread, TF's own (Eigen) cost more per row below a few
# hundred rows unless several threads share them (docs/performance.md,
# "Kernels and threads").
INTRA_OP_THREADS = {"onednn": 1, "eigen": 4}


def default_intra_op_threads(onednn):
    """The intra-op pool of a one-core worker that runs oneDNN or not."""
    return INTRA_OP_THREADS["onednn" if onednn else "eigen"]


def workers_onednn(onednn=None):
    """Whether local workers run oneDNN's kernels: `onednn` if given, else
    what `TF_ENABLE_ONEDNN_OPTS` in this environment says, else True (the
    fast kernels for small products, whatever TF's default on this CPU)."""
    if onednn is not None:
        if not isinstance(onednn, bool):
            raise TypeError(
                "onednn must be True, False or None (the environment's "
                f"{ONEDNN_VARIABLE}, else on). Received: onednn={onednn!r}")
        return onednn
    text = os.environ.get(ONEDNN_VARIABLE, "").strip().lower()
    if not text:
        return True
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    raise ValueError(
        f"{ONEDNN_VARIABLE}={text!r} in the environment is neither 0 nor 1 "
        "(TensorFlow reads only those, or true/false). Set it to 1 (oneDNN's "
        "kernels) or 0 (TF's own), or unset it.")


def _die_with_parent():
    """In the child before exec: SIGKILL it when its parent thread ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_ids(name, values, num_workers, available=None):
    """`values` as a list of `num_workers` ints (>= 0), checked."""
    if not isinstance(values, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0
            for v in values):
        raise TypeError(f"{name} must be a list of ints >= 0, one per "
                        f"worker. Received: {name}={values!r}")
    if len(values) != num_workers:
        raise ValueError(
            f"{name} must name one id per worker ({num_workers} workers). "
            f"Received: {name}={list(values)}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} names an id twice; each worker needs its "
                         f"own. Received: {name}={list(values)}")
    if available is not None:
        bad = sorted(set(values) - set(available))
        if bad:
            raise ValueError(
                f"{name} names CPUs {bad} this process cannot run on; "
                f"available: {sorted(available)}. Received: "
                f"{name}={list(values)}")
    return list(values)


def _check_args(num_workers, cores, gpus, intra_op_threads,
                inter_op_threads, timeout):
    """Checks `local_workers`' arguments; returns (cores, gpus)."""
    _validation.check_positive_int("num_workers", num_workers)
    if intra_op_threads is not None:
        _validation.check_positive_int("intra_op_threads", intra_op_threads)
    _validation.check_positive_int("inter_op_threads", inter_op_threads)
    _validation.check_positive_number("timeout", timeout)
    available = sorted(os.sched_getaffinity(0))
    if gpus is not None:
        gpus = _check_ids("gpus", gpus, num_workers)
    if cores is None and gpus is None:
        if num_workers > len(available):
            raise ValueError(
                f"num_workers={num_workers} needs one core each, but this "
                f"process may run on {len(available)} CPUs {available}. "
                f"Pass num_workers <= {len(available)}, or gpus=[...] for "
                "one GPU per worker.")
        cores = available[:num_workers]
    elif cores is not None:
        cores = _check_ids("cores", cores, num_workers, available)
    return cores, gpus


@contextlib.contextmanager
def local_workers(num_workers=2, cores=None, gpus=None,
                  intra_op_threads=None, inter_op_threads=2,
                  heap="reuse", timeout=120.0, onednn=None, restart=False):
    """Starts pinned worker processes on this machine and connects to them.

    Each worker is a `python -m keras_pipe.distributed.worker` process that listens on
    127.0.0.1 only, pinned to its own CPU core (or given its own GPU).
    This process connects to them (`keras_pipe.connect`), and the `with`
    block receives one device per worker to place stages on. When the block
    ends, normally, by an error or by a `KeyboardInterrupt`, every worker
    is stopped and waited for: nothing is left running. The workers also
    end if this process is killed (Linux parent-death signal; they end when
    the thread that started them ends, so enter the block in a thread that
    outlives it).

    Call it before TensorFlow runs any op in this process (as
    `keras_pipe.connect`), and build the model inside the block: its
    variables live in the workers and go with them. Array data given to
    the model's `fit` and `evaluate` are batched in this process, or on
    the first stage's worker with `model.data_device = "auto"`
    (`PipelineModel.data_device`).

    ```python
    import keras
    import keras_pipe

    with keras_pipe.local_workers(num_workers=2) as devices:
        stages = [keras.Sequential([keras.layers.Dense(64, activation="relu")]),
                  keras.Sequential([keras.layers.Dense(1)])]
        model = keras_pipe.PipelineModel(stages, devices=devices,
                                         num_micro_batches=4)
        model.compile("adam", "mse")
        model.fit(x, y, batch_size=64)
    ```

    Args:
        num_workers: how many worker processes, one device each. Defaults
            to `2`.
        cores: the CPU id of each worker, one per worker. Defaults to
            `None`: the first `num_workers` CPUs this process may run on
            (the worker processes are then not pinned when `gpus` is set).
        gpus: the GPU index of each worker, one per worker; each worker
            then sees that GPU only (`CUDA_VISIBLE_DEVICES`) and the device
            is its `GPU:0`. Defaults to `None`: CPU devices.
        intra_op_threads: each worker's intra-op thread pool, all on
            its one core. Defaults to `None`: 1 where TF runs oneDNN's
            kernels, 4 where it runs its own, whose one-thread products
            cost more per row for a micro-batch's smaller products
            (`INTRA_OP_THREADS`).
        inter_op_threads: the inter-op pool of the contexts the workers
            run this process's functions in (see `keras_pipe.connect`);
            2 or more, so that a transfer to the next stage does not wait
            for the worker's other work. Defaults to `2`.
        heap: how each worker keeps freed tensor buffers
            (`keras_pipe.distributed.heap`): `"reuse"` (fast; freed
            blocks stay resident for reuse while a worker works, and go
            back once it idles), `"return"` (blocks of 128 KiB
            or more go back to the OS when freed, and the rest of the free
            heap once a worker idles 0.5 s: lower resident peaks, for
            a model sized to a memory budget, at the cost of slower steps;
            docs/capacity.md) or `"glibc"`. Defaults to `"reuse"`.
        timeout: seconds for the workers to start and then to answer.
            Defaults to `120.0`.
        onednn: whether the workers run oneDNN's kernels, whose small
            products (a micro-batch's) are the fastest TF has on a CPU;
            TF itself leaves oneDNN off on some CPUs. This process keeps
            the kernels TF chose when it was imported: the workers' setting
            is their own. Defaults to `None`: what `TF_ENABLE_ONEDNN_OPTS`
            in this environment says if it is set, else on.
        restart: whether a worker process that ends while the block runs
            is started again, with the same task and address (a thread of
            this process watches them). A `fit` given a
            `keras_pipe.BackupAndRestore` then goes on after the loss
            (`keras_pipe.distributed.recovery`). Defaults to `False`.


    Returns:
        A context manager whose value is the list of the workers' devices,
        e.g. `["/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0"]`.

    Raises:
        TypeError: for a count that is not an int, `cores`/`gpus` that
            are not lists of ints, or an `onednn` or `restart` that is not
            a bool.
        ValueError: for a count < 1, more workers than available CPUs,
            `cores`/`gpus` of the wrong length, with an id twice or naming
            a CPU this process cannot run on, a `heap` not in
            `keras_pipe.distributed.heap.HEAP_MODES`, or an
            `onednn=None` with `TF_ENABLE_ONEDNN_OPTS` set to neither 0
            nor 1.
        RuntimeError: if a worker exits or does not start within `timeout`
            seconds (the message holds the end of its log).
        keras_pipe.distributed.cluster.WorkerUnavailableError: if a started worker does
            not answer.
    """
    cores, gpus = _check_args(num_workers, cores, gpus, intra_op_threads,
                              inter_op_threads, timeout)
    if not isinstance(restart, bool):
        raise TypeError(f"restart must be True or False. Received: "
                        f"restart={restart!r}")
    heap_lib.check_mode(heap)
    onednn = workers_onednn(onednn)
    from keras_pipe.engine import products  # imports TF
    products.set_workers_onednn(onednn)  # their forward products follow
    if intra_op_threads is None:
        intra_op_threads = default_intra_op_threads(onednn)
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]
    logdir = tempfile.TemporaryDirectory(prefix="keras_pipe_workers_")
    procs = []
    supervisor = None
    names = [f"/job:worker/replica:0/task:{task}"
             for task in range(num_workers)]
    try:
        for task in range(num_workers):
            procs.append(_start(task, addresses, cores, gpus,
                                intra_op_threads, inter_op_threads, heap,
                                onednn, pathlib.Path(logdir.name)))
        _wait_serving(procs, pathlib.Path(logdir.name), timeout)
        if restart:
            supervisor = _Supervisor(procs, pathlib.Path(logdir.name), (
                lambda task: _start(task, addresses, cores, gpus,
                                    intra_op_threads, inter_op_threads, heap,
                                    onednn, pathlib.Path(logdir.name))))
        from keras_pipe.distributed.cluster import connect  # imports TF
        listing = connect({"worker": addresses}, timeout=timeout,
                          inter_op_threads=inter_op_threads)
        kind = "CPU" if gpus is None else "GPU"
        devices = []
        for task, name in enumerate(names):
            wanted = f"{name}/device:{kind}:0"
            if wanted not in listing.get(name, []):
                raise RuntimeError(
                    f"Worker task {task} has no {kind}:0; its devices: "
                    f"{listing.get(name)}. Pass gpus=None for CPU workers.")
            devices.append(wanted)
        if cores is not None:
            for task, name in enumerate(names):
                _PINNED[name] = (procs, task, cores[task])
        yield devices
    finally:
        for name in names:
            _PINNED.pop(name, None)
        if supervisor is not None:
            supervisor.stop()
        _stop(procs)
        logdir.cleanup()


# The running pinned workers: task name -> (the block's process list, the
# task's index in it, its core). The list is the supervisor's too: a
# restarted worker is found in it.
_PINNED = {}


def _set_threads_affinity(pid, cpus):
    """Confines every thread of process `pid` to `cpus` (a thread that
    ends meanwhile is skipped)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


@contextlib.contextmanager
def cores_shared(devices):
    """While the block runs, the threads of the pinned `local_workers` that
    hold `devices` may run on any of those workers' cores, then each is
    confined to its own core again. Yields whether it shared any (two or
    more such workers).

    For work that hands small tensors from worker to worker many times a
    second (a decode tick): a worker's threads on its one core wait for
    that core, which the worker's own kernels keep busy, before they pass
    on what the next worker needs; the cores shared, they run on the core
    that is free. Devices of other processes (remote workers, this one's)
    are left as they are; so is everything when no device is a pinned local
    worker's.
    """
    from keras_pipe.distributed.cluster import task_of  # imports TF
    found = [_PINNED[t] for t in {task_of(d) for d in devices}
             if t in _PINNED]
    shared = {core for _, _, core in found}
    if len(shared) < 2:
        yield False
        return
    for procs, task, _ in found:
        _set_threads_affinity(procs[task].pid, shared)
    try:
        yield True
    finally:
        for procs, task, core in found:
            _set_threads_affinity(procs[task].pid, {core})


def _start(task, addresses, cores, gpus, intra, inter, heap, onednn,
           logdir):
    """Starts worker `task`, its output to `logdir/worker{task}.log`."""
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[ONEDNN_VARIABLE] = "1" if onednn else "0"
    command = [sys.executable, "-m", "keras_pipe.distributed.worker", "--task",
               str(task), "--cluster", ",".join(addresses),
               "--intra-op-threads", str(intra), "--inter-op-threads",
               str(inter), "--heap", heap]
    if cores is not None:
        command += ["--cpu-affinity", str(cores[task])]
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[task])
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker takes no GPU
    path = logdir / f"worker{task}.log"
    with open(path, "w") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            # Not in the terminal's process group: Ctrl-C reaches this
            # process only, which then stops the workers itself.
            start_new_session=True)
    # For the error of a worker that dies (out of memory): `exits`.
    exits.started(f"/job:worker/replica:0/task:{task}", proc, path)
    return proc


def _wait_serving(procs, logdir, timeout):
    """Waits until every worker says it serves; raises with its log if not."""
    deadline = time.monotonic() + timeout
    for task, proc in enumerate(procs):
        path = logdir / f"worker{task}.log"
        while "serving" not in path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                what = (f"exited with code {proc.returncode}"
                        if proc.poll() is not None else
                        f"did not start within {timeout:g} s")
                raise RuntimeError(
                    f"keras_pipe worker task {task} {what}. Its log:\n"
                    f"{path.read_text()[-2000:]}")
            time.sleep(0.1)


class _Supervisor:
    """Starts again, at the same task and address, a worker that ended.

    A thread polls the worker processes; one that has ended (killed, out
    of memory, crashed) is started again by `start(task)` and replaces its
    entry in `procs`. Its log is kept as `worker<task>.<n>.log` and its
    exit recorded (`exits.restarted`), so that the error of the call it
    broke can still say why it ended. The thread started the new process,
    so the process ends with that thread (parent-death signal): `stop`
    ends the thread, and the caller then stops the workers.
    """

    POLL = 0.2  # seconds between two looks at the processes
    # Seconds between two starts of one worker: one that cannot start
    # (it exits at once) is tried again at this pace, not in a busy loop.
    RESTART_AFTER = 1.0

    def __init__(self, procs, logdir, start):
        self.procs = procs
        self.logdir = logdir
        self.start = start
        self.restarts = [0] * len(procs)
        self.started = [time.monotonic()] * len(procs)
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="keras_pipe-supervisor")
        for task in range(len(procs)):
            exits.supervise(f"/job:worker/replica:0/task:{task}")
        self.thread.start()

    def _run(self):
        while not self.finished.wait(self.POLL):
            for task, proc in enumerate(self.procs):
                with self.lock:
                    if self.finished.is_set() or proc.poll() is None or (
                            time.monotonic() - self.started[task]
                            < self.RESTART_AFTER):
                        continue
                    self.restarts[task] += 1
                    log = self.logdir / f"worker{task}.log"
                    kept = self.logdir / (f"worker{task}."
                                          f"{self.restarts[task]}.log")
                    if log.exists():
                        os.replace(log, kept)
                    exits.restarted(f"/job:worker/replica:0/task:{task}",
                                    proc, kept)
                    self.procs[task] = self.start(task)
                    self.started[task] = time.monotonic()

    def stop(self):
        """Ends the thread; no worker is started after this returns."""
        with self.lock:
            self.finished.set()
        self.thread.join()


def _stop(procs):
    """Kills every worker, then waits for each: none is left running."""
    for task in range(len(procs)):
        exits.stopped(f"/job:worker/replica:0/task:{task}")
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
