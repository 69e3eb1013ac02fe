"""Remote workers: connect to a TensorFlow cluster, fail fast when a worker is gone.

Stages run on remote devices through TensorFlow's own distributed runtime
(`tf.distribute.Server` workers, `tf.config.experimental_connect_to_cluster`):
after `connect`, a device such as `/job:worker/replica:0/task:1/device:CPU:0`
is an ordinary stage device, and the whole training step stays one
`tf.function` whose cross-worker edges TF turns into gRPC transfers.

Why a wrapper around `experimental_connect_to_cluster`: TF connects lazily,
so a worker that is down makes the *first* use of the cluster (listing
devices, creating a variable) block with no deadline. `connect` first probes
every task with a gRPC channel-readiness check under a deadline and names
the tasks it cannot reach. `fit`/`evaluate`/`predict` of a model with remote
stages go through `run`, which probes those workers once a second; when one
stops answering, the call ends with a `WorkerUnavailableError` naming the
lost task instead of waiting forever (TF waits with no deadline on a worker
that hangs, and reports a killed one as an anonymous `UnavailableError`).

Security: TF's gRPC runtime has no authentication and no encryption; anyone
who can reach a worker's port, or the client's own port that `connect`
opens, can run arbitrary ops in that process. Use a trusted network.
`python -m keras_pipe.distributed.worker` and `connect` listen on loopback by default
(`keras_pipe.distributed.bind`).
"""

import ctypes
import ipaddress
import json
import os
import re
import socket
import threading
import time
import warnings

import tensorflow as tf

from keras_pipe import _compat, _validation
from keras_pipe.distributed import bind as bind_lib
from keras_pipe.distributed import diagnosis, exits
from keras_pipe.distributed.probes import KeptProbe as _KeptProbe
from keras_pipe.distributed.probes import gone as _gone
from keras_pipe.distributed.probes import probe
from keras_pipe.distributed.probes import unreachable as _unreachable
from keras_pipe.distributed.probes import why_down as _why_down

__all__ = ["WorkerRestartedError", "WorkerUnavailableError", "check_addresses",
           "cluster_spec", "connect", "describe_tasks", "is_remote",
           "local_cpu", "probe", "reconnect", "remote_tasks", "run",
           "raise_if_lost"]


class WorkerUnavailableError(ConnectionError):
    """A task of the cluster cannot be reached (down, or lost during a call).

    Attributes:
        tasks: `{task name: address}` of the unreachable tasks, e.g.
            `{"/job:worker/replica:0/task:1": "127.0.0.1:2223"}`.
    """

    def __init__(self, message, tasks):
        super().__init__(message)
        self.tasks = dict(tasks)


class WorkerRestartedError(WorkerUnavailableError):
    """A task answers, but it is a new process: the state placed there is gone.

    TF reports it as an `AbortedError` ("different device incarnation",
    "Unable to find a context_id") before `connect()` is called again, and
    as an `InvalidArgumentError` ("Unable to find the relevant tensor
    remote_handle") for a model built before the restart.

    Attributes:
        tasks: `{task name: address}` of the restarted tasks.
    """


# What TF says when a worker process was replaced after `connect`: a
# context, session, graph or device incarnation it no longer knows. Most
# of these errors also carry TF's `WorkerPossiblyRestarted` payload, and
# an error with that payload is a restart whatever its text (a step's
# error can name a stage's node and no sign, "Session handle is not found:
# ... Possibly this worker (...) just restarted" among others).
_RESTART_SIGNS = ("device incarnation", "was probably restarted",
                  "Unable to find a context_id", "worker was restarted",
                  "just restarted", "server has restarted",
                  "relevant tensor remote_handle")
_RESTART_PAYLOAD = (b"type.googleapis.com/"
                    b"tensorflow.distributed_runtime.WorkerPossiblyRestarted")
_TASK = re.compile(r"/job:[\w.-]+/replica:\d+/task:\d+")


def cluster_spec(cluster=None):
    """Reads a cluster given as a ClusterSpec, a dict or a TF_CONFIG.

    Args:
        cluster: a `tf.train.ClusterSpec`; a dict `{job: [address, ...]}`
            (or `{job: {index: address}}`); a TF_CONFIG dict or JSON string
            (`{"cluster": {...}, "task": {...}}`). Defaults to `None`: the
            `TF_CONFIG` environment variable.

    Returns:
        A `tf.train.ClusterSpec`.

    Raises:
        TypeError: for another kind of object.
        ValueError: for an empty cluster or a malformed TF_CONFIG.
    """
    if cluster is None:
        cluster = os.environ.get("TF_CONFIG")
        if not cluster:
            raise ValueError(
                "cluster=None reads the TF_CONFIG environment variable, which "
                "is unset. Pass a ClusterSpec or a dict such as "
                "{'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}.")
    if isinstance(cluster, str):
        try:
            cluster = json.loads(cluster)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"A cluster string must be a TF_CONFIG JSON document. "
                f"Received: {cluster!r}") from exc
    if isinstance(cluster, tf.train.ClusterSpec):
        spec = cluster
    elif isinstance(cluster, dict):
        spec = tf.train.ClusterSpec(cluster.get("cluster", cluster))
    else:
        raise TypeError(
            "cluster must be a tf.train.ClusterSpec, a dict {job: [address, "
            "...]} or a TF_CONFIG. Received: "
            f"{cluster!r} of type {type(cluster).__name__}")
    if not any(spec.task_indices(job) for job in spec.jobs):
        raise ValueError(f"The cluster has no task. Received: {cluster!r}")
    return spec


def check_addresses(spec):
    """Checks every task address of `spec`: `host:port`, each used once.

    Raises:
        ValueError: naming each malformed or repeated address and its task
            (TF would wait for the whole timeout on the first, and fail
            with "Context id already exists" on the second).
    """
    problems, seen = [], {}
    for name, address in _tasks(spec).items():
        host, colon, port = str(address).rpartition(":")
        if not colon or not host or not port.isdigit() or not (
                0 < int(port) < 65536):
            problems.append(
                f"{name}: {address!r} is not host:port with a port in "
                "1..65535 (e.g. '127.0.0.1:2222')")
        elif address in seen:
            problems.append(f"{name}: {address!r} is also the address of "
                            f"{seen[address]} (each task needs its own)")
        seen.setdefault(address, name)
    if problems:
        raise ValueError("Bad cluster addresses: " + "; ".join(problems)
                         + ". Fix the cluster spec.")


def _tasks(spec):
    """`{"/job:j/replica:0/task:t": address}` for every task of `spec`."""
    return {f"/job:{job}/replica:0/task:{t}": spec.task_address(job, t)
            for job in spec.jobs for t in spec.task_indices(job)}


def describe_tasks(tasks):
    return ", ".join(f"{name} at {address}" for name, address in tasks.items())


def connect(cluster=None, timeout=30.0, job_name="localhost",
            bind="127.0.0.1", inter_op_threads=None, thread_spinning=False):
    """Connects this process to a cluster of TF workers and lists their devices.

    Every task must answer within `timeout` seconds, else nothing is
    connected and the error names the tasks that did not. Afterwards stage
    devices may name remote devices.

    Connecting starts a TF gRPC server in this process too (workers send
    results back through it). TF's gRPC runtime has no authentication, so
    that server listens on `bind` only, loopback by default: workers on
    other hosts need `bind` set to this host's address on their network.
    Listening on every interface takes `bind="0.0.0.0"`.

    ```python
    devices = keras_pipe.connect(
        {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]})
    # {'/job:worker/replica:0/task:0': ['/job:worker/replica:0/task:0/device:CPU:0'],
    #  '/job:worker/replica:0/task:1': ['/job:worker/replica:0/task:1/device:CPU:0']}
    model = keras_pipe.PipelineModel(
        stages, devices=[devices[t][0] for t in devices])
    ```

    Args:
        cluster: a `tf.train.ClusterSpec`, a dict `{job: [address, ...]}` or
            a TF_CONFIG (dict or JSON string). Defaults to `None`: the
            `TF_CONFIG` environment variable.
        timeout: seconds to wait for every task to answer, and then for
            the device listing. Defaults to `30.0`.
        job_name: the job name of this (client) process; TF adds it to the
            cluster on a free local port unless the cluster names it.
            Defaults to `"localhost"`.
        bind: the only IP address of this machine the client's TF server
            listens on; workers reach the client there. `"0.0.0.0"` (or
            `"::"`) opts in to every interface (trusted networks only).
            Defaults to `"127.0.0.1"`.
        inter_op_threads: the inter-op thread pool of the contexts the
            workers run this client's functions in (and of this client):
            TF sizes those from the client's setting, not from the worker's
            `--inter-op-threads`. A worker needs 2 or more, or a transfer
            to the next stage waits until its device ran out of work (TF's
            executor queues the `_Send` behind the next call on the only
            thread). Defaults to `None`: the client's setting if one was
            made, else `max(4, os.cpu_count())`. Set it before TF runs any
            op in this process.
        thread_spinning: whether idle threads of TF's pools in this
            client and in the contexts the workers run its functions in
            spin before they sleep (TF's default). Without spinning the
            client spends less CPU per step and the workers no more
            (docs/performance.md). Set before TF runs any op in this
            process. Defaults to `False`.

    Returns:
        `{task name: [device names]}` for every task of the cluster, task
        names like `"/job:worker/replica:0/task:1"`.

    Raises:
        TypeError, ValueError: for a malformed `cluster` or `timeout`.
        WorkerUnavailableError: if a task does not answer within `timeout`
            seconds; the message names each such task and its address.
        RuntimeError: if the client's server cannot be kept on `bind`
            (the message says how to opt in to every interface), or if
            `inter_op_threads` differs from the setting of a TF runtime
            already started in this process.
    """
    if inter_op_threads is not None:
        _validation.check_positive_int("inter_op_threads", inter_op_threads)
    if not isinstance(job_name, str) or not re.fullmatch(r"[A-Za-z0-9_]+",
                                                         job_name):
        raise TypeError(
            f"job_name must be a string of letters, digits or '_', e.g. "
            f"'localhost'. Received: job_name={job_name!r}")
    _validation.check_positive_number("timeout", timeout)
    spec = cluster_spec(cluster)
    check_addresses(spec)
    bind = bind_lib.check_address(bind)
    _check_client_address(spec, job_name, bind)
    tasks = {n: a for n, a in _tasks(spec).items()
             if not n.startswith(f"/job:{job_name}/")}
    down = _unreachable(tasks, timeout)
    if down:
        raise WorkerUnavailableError(
            f"Cannot reach {describe_tasks(down)} within {timeout:g} s "
            f"({_why_down(down)}). "
            "Start the worker (python -m keras_pipe.distributed.worker --task N "
            "--cluster ...), check its address, or raise `timeout`.", down)
    full_spec = _with_local_job(spec, job_name, bind)
    _set_inter_op_threads(inter_op_threads)
    if not thread_spinning:
        _compat.disable_thread_spinning()
    _pin_client(bind)
    tf.config.experimental_connect_to_cluster(full_spec, job_name=job_name)
    _CONNECTED.update(bind=bind, inter_op_threads=inter_op_threads,
                      thread_spinning=thread_spinning)
    _check_client_listener(full_spec, job_name, bind)
    listing = {}
    thread = threading.Thread(
        target=lambda: listing.update(
            names=[d.name for d in tf.config.list_logical_devices()]),
        daemon=True)
    thread.start()
    thread.join(timeout)
    if "names" not in listing:
        down = _unreachable(tasks, 1.0) or tasks
        raise WorkerUnavailableError(
            f"Connected, but listing the devices of {describe_tasks(down)} "
            f"did not finish within {timeout:g} s.", down)
    return {name: [d for d in listing["names"]
                   if d.startswith(name + "/")] for name in tasks}


# The settings of the last `connect`, for `reconnect`.
_CONNECTED = {}


def reconnect(timeout=30.0):
    """Connects again to the cluster of the last `connect`, with its settings.

    The client keeps its address (`_with_local_job`), so workers started
    again at their addresses reach it. Every worker gets a new context:
    what the client placed there before is no longer reachable.

    Returns:
        What `connect` returns.
    """
    server_def = _compat.get_server_def()
    spec = {job.name: dict(job.tasks) for job in server_def.cluster.job}
    return connect(spec, timeout=timeout, job_name=server_def.job_name,
                   **_CONNECTED)


def _set_inter_op_threads(threads):
    """Sets the inter-op pool size the workers' contexts inherit."""
    current = tf.config.threading.get_inter_op_parallelism_threads()
    default = max(4, os.cpu_count() or 1)
    if threads is None:
        if current:
            return  # the user's own setting
        threads = default
    if threads == current:
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as exc:
        if current == 0 and threads == default:
            warnings.warn(
                "keras_pipe.connect() came after TF started in this process, "
                "so the workers' contexts keep TF's default inter-op pool "
                "(each worker's core count; one thread on a single-core "
                "worker, where transfers between stages wait for the "
                "worker's other work). Call connect() before running any TF "
                "op, or tf.config.threading.set_inter_op_parallelism_threads"
                "(4) first.", RuntimeWarning, stacklevel=3)
            return
        raise RuntimeError(
            f"inter_op_threads={threads} cannot be set: TF already started "
            f"in this process with {current or 'its default'} inter-op "
            "threads. Call keras_pipe.connect() before running any TF op.") \
            from exc


def _check_client_address(spec, job_name, bind):
    """Raises if the cluster names this client at an IP other than `bind`."""
    if job_name not in spec.jobs or bind in bind_lib.WILDCARDS:
        return
    address = spec.task_address(job_name, spec.task_indices(job_name)[0])
    host = address.rpartition(":")[0].strip("[]")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        return  # A host name: the workers resolve it.
    if host != bind:
        raise ValueError(
            f"The cluster names this client ({job_name!r}) at {address!r}, "
            f"but bind={bind!r}: workers would call back to {host!r}, where "
            f"nothing listens. Pass bind={host!r}.")


def _pin_client(bind):
    """Keeps the client's TF server on `bind`, or raises saying how to opt out."""
    try:
        bind_lib.pin(bind)
    except RuntimeError as exc:
        raise RuntimeError(
            f"keras_pipe.connect() would leave this process's TF gRPC server "
            f"(no authentication) listening on every interface, because it "
            f"cannot be kept on {bind!r}: {exc} To listen on every "
            "interface anyway (trusted network only), pass "
            "keras_pipe.connect(..., bind='0.0.0.0').") from exc


def _check_client_listener(spec, job_name, bind):
    """Raises if the client's port listens on a wildcard address."""
    if bind in bind_lib.WILDCARDS or job_name not in spec.jobs:
        return
    port = int(spec.task_address(job_name, 0).rsplit(":", 1)[1])
    hosts = bind_lib.listening_hosts(port)
    if any(h in bind_lib.WILDCARDS for h in hosts):
        raise RuntimeError(
            f"This process's TF gRPC server listens on {hosts} port {port}, "
            f"not only on {bind!r}; TF cannot stop it: end this process. "
            "To listen on every interface on purpose, pass "
            "keras_pipe.connect(..., bind='0.0.0.0').")


def _with_local_job(spec, job_name, bind="127.0.0.1"):
    """Adds this process's job to `spec`, at the same address as before.

    Left to TF, every connect puts the local job on a new port, while the
    local server keeps its first one: after a reconnect (a worker was
    restarted) the workers would call back to a port nobody listens on.
    """
    if job_name in spec.jobs:
        return spec
    address = None
    server_def = _compat.get_server_def()
    if server_def is not None and server_def.job_name == job_name:
        for job in server_def.cluster.job:
            if job.name == job_name:
                address = job.tasks.get(server_def.task_index)
    if address is None:
        host = "127.0.0.1" if bind in bind_lib.WILDCARDS else bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host, 0))
            address = bind_lib.format_address(host, s.getsockname()[1])
    return tf.train.ClusterSpec({**spec.as_dict(), job_name: [address]})


def is_remote(device):
    """Whether `device` lives in a cluster task other than this process."""
    return bool(remote_tasks([device]))


def _local_task(server_def):
    if server_def is None:
        return "/job:localhost/replica:0/task:0"
    return (f"/job:{server_def.job_name}/replica:0/"
            f"task:{server_def.task_index}")


def local_cpu():
    """The full name of this process's CPU device, whether or not it is
    connected to a cluster."""
    return _local_task(_compat.get_server_def()) + "/device:CPU:0"


def remote_tasks(devices):
    """`{task: address}` of the cluster tasks that `devices` live on."""
    server_def = _compat.get_server_def()
    if server_def is None:
        return {}
    local = _local_task(server_def)
    addresses = {}
    for job in server_def.cluster.job:
        for index, address in job.tasks.items():
            addresses[f"/job:{job.name}/replica:0/task:{index}"] = address
    found = {}
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.job is None:
            continue
        name = f"/job:{spec.job}/replica:0/task:{spec.task or 0}"
        if name != local and name in addresses:
            found[name] = addresses[name]
    return found


class _Watch:
    """Probes tasks in a thread; on a loss, cancels the calls it guards."""

    active = False  # One watchdog at a time: nested calls share it.

    def __init__(self, tasks, interval, misses, silence):
        self.tasks = tasks
        self.interval = interval
        self.misses = misses
        # Seconds, or a function that returns them (read at each probe).
        self.silence = silence if callable(silence) else lambda: silence
        self.lost = {}
        self.lost_at = None
        self.manager = _compat.cancellation.CancellationManager()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="keras_pipe-watch")

    def _run(self):
        refused = dict.fromkeys(self.tasks, 0)
        answered = dict.fromkeys(self.tasks, time.monotonic())
        alive = _KeptProbe()
        try:
            while not self.stop.wait(self.interval):
                for name, address in self.tasks.items():
                    state = alive(address, self.interval)
                    now = time.monotonic()
                    if state == "ok":
                        answered[name], refused[name] = now, 0
                    elif state == "down":
                        refused[name] += 1
                    if (refused[name] >= self.misses
                            or now - answered[name] >= self.silence()):
                        self.lost[name] = address
                if self.lost:
                    self.lost_at = time.monotonic()
                    self.manager.start_cancel()
                    return
        finally:
            alive.close()


# Seconds a task may give no answer (a deadline passes, the connection
# stays open) before it counts as hung: a busy worker on a loaded host
# can miss several probes (`_KeptProbe`); one whose process is gone is
# refused at once and counts after `misses` probes.
HUNG_AFTER = 30.0


def run(devices, action, function, *args, interval=1.0, misses=2,
        silence=None, grace=5.0, **kwargs):
    """Calls `function(*args, **kwargs)`, ended early if a worker is lost.

    Without remote devices (or inside another `run`) this is a plain call.
    Otherwise the call runs in a helper thread while a watchdog probes every
    task holding one of `devices` each `interval` seconds. After `misses`
    refused probes in a row (no server at its address), or `silence`
    seconds without an answer (a hung worker, or one too busy to answer
    for that long), the task is lost: the watchdog cancels the TF
    calls (a `CancellationManager`), and if the call still has not returned
    `grace` seconds later (TF does not cancel a remote call waiting on a
    hung worker) it is left blocked in its thread and this function raises.
    A TF error raised by the call while a task is unreachable (TF raises one
    by itself when a killed worker's connection closes) is translated the
    same way, and one saying that a task was restarted since `connect`
    becomes a `WorkerRestartedError`. So a dead worker ends the call within
    about `interval * (misses + 1) + grace` seconds, a hung one within
    `silence + interval + grace`. Keras' thread-local state
    (dtype policy, seed generator) is copied into the helper thread.

    Args:
        devices: device names, e.g. a model's stage devices.
        action: what runs, for the error message (`"fit"`).
        function: the call, e.g. `keras.Model.fit` bound to a model.
        *args, **kwargs: its arguments.
        interval: seconds between probes (and probe deadline). Defaults to
            `1.0`.
        misses: refused probes in a row that mark a task lost. Defaults
            to `2`.
        silence: seconds without an answer that mark a task lost, or a
            function that returns them (read at each probe). Defaults to
            `None`: `HUNG_AFTER` (30 s).
        grace: seconds a cancelled call gets to return. Defaults to `5.0`.

    Returns:
        What `function` returns.

    A TF error of the call that only reports a cancellation is replaced by
    the error a stage raised, of its original type, naming the stage and
    its device (`keras_pipe.distributed.diagnosis`).

    Raises:
        WorkerUnavailableError: naming each lost task and its address.
        WorkerRestartedError: naming each restarted task and its address.
    """
    tasks = remote_tasks(devices)
    if _Watch.active:
        return function(*args, **kwargs)
    if not tasks:
        try:
            return function(*args, **kwargs)
        except tf.errors.OpError as error:
            _raise_stage_error(function, action, args, kwargs, error)
            raise
    watchdog = _Watch(tasks, interval, misses,
                      HUNG_AFTER if silence is None else silence)
    keras_state = _compat.keras_global_state()
    outcome = {}
    # Set when `call` ends. Not `Thread.is_alive`: a KeyboardInterrupt in
    # `Thread.join` marks a running thread as stopped (CPython 3.11).
    done = threading.Event()

    def call():
        try:
            for name, value in keras_state.items():
                _compat.set_keras_global_attribute(name, value)
            with _compat.cancellation.CancellationManagerContext(watchdog.manager):
                outcome["value"] = function(*args, **kwargs)
        except BaseException as exc:  # Re-raised in the calling thread.
            outcome["error"] = exc
        finally:
            done.set()

    caller = threading.Thread(target=call, daemon=True,
                              name=f"keras_pipe-{action}")
    _Watch.active = True
    try:
        watchdog.thread.start()
        caller.start()
        try:
            _wait(done, watchdog, grace)
        except BaseException as interrupt:  # Ctrl-C reaches this thread only.
            _stop_caller(caller, done, watchdog, grace, interrupt)
            raise
    finally:
        watchdog.stop.set()
        _Watch.active = False
    error = outcome.get("error")
    if not done.is_set() or isinstance(error, tf.errors.OpError):
        # After an error, a task is lost if the watchdog saw it so or it
        # takes no connection; not for missing a probe (busy, loaded).
        lost = dict(watchdog.lost) or (
            _gone_within(tasks, error, interval * misses) if done.is_set()
            else _unreachable(tasks, interval * misses))
        if lost:
            detail = (_first_line(error) if error is not None else
                      f"no answer {grace:g} s after cancelling; the call is "
                      "left blocked in a daemon thread")
            raise WorkerUnavailableError(
                f"Lost {_describe_lost(lost, devices)} during {action}. "
                f"Restart the worker, call keras_pipe.connect() again and "
                f"{_REBUILD} ({detail})", lost) from error
        restarted = _restarted(error, tasks)
        if restarted:
            raise WorkerRestartedError(
                f"{describe_tasks(restarted)} was restarted after "
                f"keras_pipe.connect(), and the model's variables there are "
                f"gone ({action} cannot run). Call keras_pipe.connect() "
                f"again if not done yet, then {_REBUILD} "
                f"({_first_line(error)})", restarted) from error
    if isinstance(error, tf.errors.OpError):
        _raise_stage_error(function, action, args, kwargs, error)
    if error is not None:
        raise error
    return outcome["value"]


def _gone_within(tasks, error, seconds):
    """The tasks whose process this client saw end (`exits`) or that take
    no connection (`_gone`), looked at for up to `seconds` after a lost
    connection (`UnavailableError`): TF can report the reset before the
    dying process has closed its port."""
    deadline = time.monotonic() + (
        seconds if isinstance(error, tf.errors.UnavailableError) else 0.0)
    while True:
        gone = {name: address for name, address in tasks.items()
                if exits.why_ended(name, wait=0.0) is not None}
        gone = gone or _gone(tasks)
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.2)


def task_of(device):
    """`/job:J/replica:0/task:T` of a device string, or None without a
    job (a device of this process)."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job is None:
        return None
    return f"/job:{spec.job}/replica:0/task:{spec.task or 0}"


def _describe_lost(lost, devices):
    """Each lost task, its address, its stages and why its process ended."""
    parts = []
    for name, address in lost.items():
        stages = [j for j, d in enumerate(devices) if task_of(d) == name]
        held = (f", which held stage{'s' if len(stages) > 1 else ''} "
                f"{', '.join(map(str, stages))}" if stages else "")
        why = exits.why_ended(name)
        if why is None:
            why = ("if it ran out of memory, its log or `dmesg` says so "
                   "(a worker started by keras_pipe.local_workers is named "
                   "with its exit)")
        parts.append(f"{name} at {address}{held} ({why})")
    return "; ".join(parts)


def raise_if_lost(devices, action, error):
    """Raises WorkerUnavailableError if a task of `devices` is gone.

    For a TF error outside `run` (a build: creating a stage's variables on
    a worker that dies, e.g. out of memory, is `UnavailableError: Socket
    closed` naming no task). Returns if every task still answers.
    """
    tasks = remote_tasks(devices)
    if not tasks or not isinstance(error, tf.errors.OpError):
        return
    lost = {n: a for n, a in tasks.items()
            if exits.why_ended(n, wait=0.5) is not None}
    lost = lost or _unreachable(tasks, 2.0)
    if lost:
        raise WorkerUnavailableError(
            f"Lost {_describe_lost(lost, devices)} during {action}. Restart "
            f"the worker, call keras_pipe.connect() again and {_REBUILD} "
            f"({_first_line(error)})", lost) from error


def _wait(done, watchdog, grace):
    """Waits for `done`; returns early `grace` s after a task was lost.

    In 1 s slices until a loss (a Ctrl-C still ends the wait at once), then
    0.1 s: short slices throughout would cost the client CPU at every step
    (docs/performance.md).
    """
    while not done.wait(1.0 if watchdog.lost_at is None else 0.1):
        if (watchdog.lost_at is not None
                and time.monotonic() - watchdog.lost_at > grace):
            return


def _raise_in_thread(ident, kind):
    """Raises exception class `kind` in thread `ident` (CPython's async exc)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                               ctypes.py_object(kind))


def _stop_caller(caller, done, watchdog, grace, interrupt):
    """Ends the call running in `caller` at its next step; then returns.

    Python delivers a signal (Ctrl-C) to the main thread only: without this
    the step loop in `caller` ran on after `fit` had raised (the
    "main-thread interrupt" trap). The
    interrupt is re-raised in `caller` as soon as it runs Python code again,
    so the step in progress (one TF call) finishes and no further step
    starts: the model keeps the weights of its last completed step, as a
    Ctrl-C of a local `fit` does. Waits for `caller` to end (bounded by the
    watchdog as above); a second interrupt stops waiting.
    """
    if done.is_set():
        return
    _raise_in_thread(caller.ident, type(interrupt))
    try:
        _wait(done, watchdog, grace)
    except BaseException as again:  # A second Ctrl-C: stop waiting.
        interrupt.add_note(
            f"keras_pipe: stopped waiting for {caller.name} to end after a "
            f"second interrupt ({type(again).__name__}); the step it was "
            "running may still finish in the background.")


_REBUILD = (
    "rebuild the model: create it again with the same code (its variables "
    "lived on the lost worker) and restore its weights: with "
    "keras_pipe.BackupAndRestore in fit's callbacks, the same fit() call "
    "resumes at the exact batch of the last backup; or load_weights() from "
    "a checkpoint. With a BackupAndRestore(save_freq=<batches>) and "
    "workers started again at their addresses (local_workers(..., "
    "restart=True), or a supervisor on their hosts), fit goes on by itself "
    "(keras_pipe.distributed.recovery).")


def _first_line(error):
    """`Type: first line of the message` of a TF error."""
    text = getattr(error, "message", None) or str(error)
    lines = [l for l in text.strip().splitlines()
             if l.strip() and not l.startswith(("Graph execution error",
                                                "Detected at node",
                                                "<stack traces"))]
    return f"{type(error).__name__}: {lines[0].strip() if lines else ''}"


def _restarted(error, tasks):
    """The tasks of `tasks` that `error` says were restarted, else {}."""
    if not isinstance(error, tf.errors.OpError):
        return {}
    text = str(error)
    payloads = getattr(error, "experimental_payloads", None) or {}
    if _RESTART_PAYLOAD not in payloads and not any(
            sign in text for sign in _RESTART_SIGNS):
        return {}
    named = {name: tasks[name] for name in _TASK.findall(text)
             if name in tasks}
    return named or dict(tasks)


def _raise_stage_error(function, action, args, kwargs, error):
    """Raises the stage's own error for a TF error of a model's call.

    `function` is a bound method of the model (`super().fit`); see
    `keras_pipe.distributed.diagnosis`. Returns if there is nothing better to raise.
    """
    model = getattr(function, "__self__", None)
    explained = diagnosis.explain(model, action, args, kwargs, error)
    if explained is not error:
        raise explained from error
