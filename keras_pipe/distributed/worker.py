"""A TensorFlow worker process that serves pipeline stages to a client.

```
python -m keras_pipe.distributed.worker --task 1 \
    --cluster 127.0.0.1:2222,127.0.0.1:2223 --intra-op-threads 2
```

starts `tf.distribute.Server` for `/job:worker/replica:0/task:1` and serves
until killed; a client then calls `keras_pipe.connect(...)` and places
stages on `/job:worker/replica:0/task:1/device:CPU:0`.

**Security: TensorFlow's gRPC runtime has no authentication and no
encryption.** Anyone who can reach a worker's port can run arbitrary
TensorFlow ops in it (read files, run code). Run workers on a trusted
network only, and by default on loopback.

Why this module exists beyond `tf.distribute.Server(...).join()`: the TF
gRPC server listens on `0.0.0.0:<port>` (every interface) whatever host the
cluster spec names (hard-coded in TF's `grpc_server_lib.cc`). Here a worker
listens on `--bind` (default `127.0.0.1`) and nowhere else: `serve` first
rewrites TF's bind() calls in this process (`keras_pipe.distributed.bind.pin`, a small C
library built when keras_pipe is installed), then checks in `/proc/net` that
no socket of the port listens on a wildcard address. Listening on every
interface takes an explicit `--bind 0.0.0.0`. Every flag is checked before
the server starts; a bad one ends the process with a message naming it.
"""

import argparse
import ipaddress
import json
import os
import socket
import sys

from keras_pipe import _validation
from keras_pipe.distributed import bind as bind_lib
from keras_pipe.distributed import heap as heap_lib
from keras_pipe.distributed import runtime
from keras_pipe.distributed.bind import listening_hosts  # noqa: F401  (public here too)

__all__ = ["ONEDNN_VARIABLE", "serve", "bind_shim_path", "listening_hosts",
           "main"]


# TF reads this variable once, when its runtime loads: "1" runs oneDNN's
# kernels, "0" TF's own (Eigen). Unset, TF decides by the CPU and leaves
# oneDNN off on some (AMD CPUs without AVX-512), where a micro-batch's small
# matrix products then cost several times more. A worker turns oneDNN on
# unless its environment names a setting: the fast-kernels default.
ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"


def bind_shim_path():
    """The path of the checked bind shim (see `keras_pipe.distributed.bind.shim_path`).

    Workers and `keras_pipe.connect` load it themselves. Preloading it
    (`LD_PRELOAD=<path> KERAS_PIPE_BIND_HOST=127.0.0.1`) applies the same
    rule to every library of a process.
    """
    return bind_lib.shim_path()


def _parse_cluster(text, job):
    """`--cluster`: JSON (a dict or TF_CONFIG) or comma-separated addresses."""
    if text is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError(
                "--cluster is required when TF_CONFIG is unset. Pass the "
                "job's addresses, e.g. "
                "--cluster 127.0.0.1:2222,127.0.0.1:2223")
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--cluster is not valid JSON ({exc.msg} at character "
                f"{exc.pos}). Pass comma-separated addresses (host:port,...) "
                f"or a JSON object {{job: [addresses]}}. Received: "
                f"--cluster {text!r}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "--cluster JSON must be an object {job: [addresses]} or a "
                f"TF_CONFIG. Received: --cluster {text!r}")
        return value.get("cluster", value)
    return {job: [a.strip() for a in text.split(",") if a.strip()]}


def _split_address(address, where):
    """`(host, port)` of `host:port` or `[v6]:port`, with a valid port."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{where} must be host:port with a port in 1..65535. Received: "
            f"{address!r}")
    return host.strip("[]"), int(port)


def _host_addresses(host):
    """The IP addresses a cluster entry's host resolves to."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(
            f"The cluster names host {host!r}, which does not resolve "
            f"({exc}). Use an IP address in --cluster.") from None
    return {info[4][0] for info in infos}


def _tasks(cluster):
    """`{job: {task index: address}}` of a cluster, without TensorFlow.

    `cluster`: a dict `{job: [address, ...]}` or `{job: {index: address}}`,
    a TF_CONFIG dict or JSON string, or a `tf.train.ClusterSpec`.
    """
    if isinstance(cluster, str):
        try:
            cluster = json.loads(cluster)
        except json.JSONDecodeError as exc:
            raise ValueError(f"A cluster string must be a TF_CONFIG JSON "
                             f"document. Received: {cluster!r}") from exc
    if hasattr(cluster, "as_dict") and not isinstance(cluster, dict):
        cluster = cluster.as_dict()  # a tf.train.ClusterSpec
    if not isinstance(cluster, dict):
        raise TypeError(
            "cluster must be a tf.train.ClusterSpec, a dict {job: [address, "
            f"...]}} or a TF_CONFIG. Received: {cluster!r} of type "
            f"{type(cluster).__name__}")
    cluster = cluster.get("cluster", cluster)
    tasks = {}
    for job, addresses in cluster.items():
        if isinstance(addresses, (list, tuple)):
            addresses = dict(enumerate(addresses))
        elif isinstance(addresses, dict):
            try:
                addresses = {int(i): a for i, a in addresses.items()}
            except (TypeError, ValueError):
                raise ValueError(
                    f"The task indices of job {job!r} must be ints. "
                    f"Received: {addresses!r}") from None
        else:
            raise TypeError(
                f"The tasks of job {job!r} must be a list of addresses or a "
                f"dict {{index: address}}. Received: {addresses!r}")
        if not all(isinstance(a, str) for a in addresses.values()):
            raise TypeError(f"The addresses of job {job!r} must be strings "
                            f"host:port. Received: {addresses!r}")
        tasks[str(job)] = addresses
    if not any(tasks.values()):
        raise ValueError(f"The cluster has no task. Received: {cluster!r}")
    return tasks


def _check_serve_args(tasks, job, task, bind, inter_op_threads,
                      intra_op_threads, cpu_affinity):
    """Checks `serve`'s arguments; returns (address, port, bind)."""
    if isinstance(task, bool) or not isinstance(task, int) or task < 0:
        raise ValueError(f"task must be an int >= 0, this task's index in "
                         f"its job. Received: task={task!r}")
    if task not in tasks.get(job, {}):
        cluster = {j: [a for _, a in sorted(t.items())]
                   for j, t in tasks.items()}
        raise ValueError(
            f"Task {task} of job {job!r} is not in the cluster "
            f"{cluster}. Pass --task/--job naming one of its tasks.")
    for name, value in (("inter_op_threads", inter_op_threads),
                        ("intra_op_threads", intra_op_threads)):
        if value is not None:
            _validation.check_positive_int(name, value)
    if cpu_affinity is not None:
        available = sorted(os.sched_getaffinity(0))
        bad = sorted(set(cpu_affinity) - set(available))
        if not cpu_affinity or bad:
            raise ValueError(
                f"cpu_affinity names CPUs {bad or '[]'} this process cannot "
                f"run on; available: {available}. Received: "
                f"cpu_affinity={list(cpu_affinity)}")
    address = tasks[job][task]
    host, port = _split_address(address, f"The address of task {task}")
    bind = bind_lib.check_address(bind)
    if bind not in bind_lib.WILDCARDS and bind not in _host_addresses(host):
        raise ValueError(
            f"bind={bind!r} differs from this task's cluster address "
            f"{address!r}: clients would dial {host!r} while the server "
            f"listens on {bind!r} only. Pass --bind with the address of "
            f"{host!r}, or fix --cluster.")
    probe_host = "::" if ":" in bind else (
        "0.0.0.0" if bind in bind_lib.WILDCARDS else bind)
    family = socket.AF_INET6 if ":" in probe_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((probe_host, port))
        except OSError as exc:
            raise ValueError(
                f"Port {port} on {bind} is not free ({exc.strerror}): another "
                "process (an older worker?) listens there. Stop it, or give "
                "this task another port in --cluster.") from None
    return address, port, bind


def serve(cluster, task, job="worker", bind="127.0.0.1",
          inter_op_threads=None, intra_op_threads=None, cpu_affinity=None,
          heap="reuse"):
    """Starts the TF server of one task in this process and returns it.

    Call before anything else initializes TensorFlow's runtime. The server
    listens on `bind` only (see `keras_pipe.distributed.bind.pin`); every argument is
    checked before it starts. It runs on TF's C++ runtime alone
    (`keras_pipe.distributed.runtime`): this function imports no
    TensorFlow Python module, whose resident memory a worker would hold
    for nothing.

    ```python
    server = serve({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, task=0)
    server.join()
    ```

    Args:
        cluster: a `tf.train.ClusterSpec`, a dict `{job: [address, ...]}`
            or a TF_CONFIG dict/JSON string.
        task: this task's index in `job`.
        job: this task's job name. Defaults to `"worker"`.
        bind: the only address the server may listen on, an IP address of
            this machine matching the task's cluster address; `"0.0.0.0"`
            listens on every interface. Defaults to `"127.0.0.1"`.
        inter_op_threads: size of the server's own inter-op pool, >= 1.
            A client's functions run in a context whose pool the client
            sizes (`keras_pipe.connect(inter_op_threads=...)`). Defaults to
            `None` (TF's choice).
        intra_op_threads: size of TF's intra-op pool, >= 1. Defaults to
            `None`. More threads than CPUs this process may run on: the
            idle ones sleep at once instead of spinning
            (`thread_spinning`).
        cpu_affinity: CPU ids this process may run on (Linux). Defaults to
            `None` (unchanged).
        heap: how glibc keeps freed tensor buffers
            (`keras_pipe.distributed.heap`): `"reuse"` (2 arenas, freed
            blocks reused while working, the free pages trimmed when the
            worker is idle: fast), `"return"` (big freed blocks unmapped,
            the arenas' free pages trimmed when the worker is idle: lower
            resident peaks, for a memory budget, at the cost of slower
            steps) or `"glibc"` (untouched; a worker's many threads then
            keep freed buffers in their own arenas). Defaults to
            `"reuse"`.

    Returns:
        The started server, a `keras_pipe.distributed.runtime.Server`
        (`join()`, `target`): the one `tf.distribute.Server` starts.

    Raises:
        TypeError: for a thread count that is not an int, or a `bind`
            that is not a string.
        ValueError: if `heap` is not a mode of
            `keras_pipe.distributed.heap.HEAP_MODES`, `task` is not in
            `job`, a thread count is < 1, a CPU
            is not available, the task's port is outside 1..65535 or in
            use, or `bind` is a host name, not an address of this machine,
            or not the task's cluster address.
        RuntimeError: if the server cannot be kept on `bind` (no shim).
    """
    heap_lib.check_mode(heap)
    tasks = _tasks(cluster)
    address, port, bind = _check_serve_args(
        tasks, job, task, bind, inter_op_threads, intra_op_threads,
        cpu_affinity)
    if cpu_affinity is not None:
        os.sched_setaffinity(0, set(cpu_affinity))
    heap_lib.configure(heap)
    if heap != "glibc":
        heap_lib.trim_when_idle()
    runtime.load()
    bind_lib.pin(bind)
    server = runtime.Server(runtime.server_def(
        tasks, job, task, intra_op_threads=intra_op_threads,
        inter_op_threads=inter_op_threads,
        thread_spinning=thread_spinning(intra_op_threads,
                                        len(os.sched_getaffinity(0)))))
    server.start()
    hosts = listening_hosts(port)
    if bind not in bind_lib.WILDCARDS and any(
            h in bind_lib.WILDCARDS for h in hosts):
        raise RuntimeError(
            f"The TF server of /job:{job}/task:{task} listens on {hosts} "
            f"port {port}, not only on {bind!r}. Stop this process.")
    return server


def thread_spinning(intra_op_threads, num_cpus):
    """Whether the worker's idle pool threads may spin before sleeping.

    TF's thread pools spin a while for new work before they sleep: that
    pays where each thread has a CPU of its own. With more intra-op
    threads than CPUs (`keras_pipe.local_workers` runs 4 on one core
    with TF's own kernels) a spinning thread takes the core from the
    thread with work, while threads that sleep at once keep the gain of
    several threads on small products (docs/performance.md). So: no
    spinning when the threads outnumber the CPUs.
    """
    return intra_op_threads is None or intra_op_threads <= num_cpus


def _cpu_list(text):
    cpus = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU list; pass ids such as 0,1 or 0-3") \
            from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU list; pass ids >= 0 such as 0,1 or 0-3")
    return sorted(cpus)


def _int_at_least(minimum, what):
    """An argparse type: an int >= `minimum`, else an error naming `what`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {what}; pass an int >= {minimum}")
        return value
    return parse


_count = _int_at_least(1, "thread count")
_index = _int_at_least(0, "task index")


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_pipe.distributed.worker",
        description="Serve one TensorFlow task for keras_pipe stages. TF's "
        "gRPC runtime has NO authentication: anyone reaching the port can "
        "run code in this process. Trusted networks only.")
    parser.add_argument("--task", type=_index, required=True,
                        help="index of this task in its job")
    parser.add_argument("--job", default="worker",
                        help="job name (default: worker)")
    parser.add_argument("--cluster", default=None,
                        help="comma-separated addresses of the job's tasks, "
                        "or JSON: {job: [addresses]} or a TF_CONFIG. "
                        "Default: $TF_CONFIG")
    parser.add_argument("--bind", default="127.0.0.1",
                        help="the only IP address to listen on, the one of "
                        "this task's --cluster entry (default: 127.0.0.1; "
                        "0.0.0.0 = every interface)")
    parser.add_argument("--inter-op-threads", type=_count, default=None,
                        help="this process's own inter-op pool; a client's "
                        "functions run in a context sized by the client's "
                        "setting (keras_pipe.connect(inter_op_threads=))")
    parser.add_argument("--intra-op-threads", type=_count, default=None)
    parser.add_argument("--cpu-affinity", type=_cpu_list, default=None,
                        help="CPU ids, e.g. 0,1 or 0-3")
    parser.add_argument("--heap", choices=heap_lib.HEAP_MODES,
                        default="reuse",
                        help="how freed tensor buffers are kept: reuse (2 "
                        "malloc arenas, freed blocks reused while working, "
                        "the heap trimmed when idle: fast; the "
                        "default), return (blocks of 128 KiB or more unmapped "
                        "when freed, the heap trimmed when idle: lower "
                        "resident peaks, slower steps), "
                        "glibc (glibc's settings)")
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Before TF's runtime loads: TF reads it once.
    os.environ.setdefault(ONEDNN_VARIABLE, "1")
    try:
        cluster = _parse_cluster(args.cluster, args.job)
        server = serve(cluster, args.task, job=args.job, bind=args.bind,
                       inter_op_threads=args.inter_op_threads,
                       intra_op_threads=args.intra_op_threads,
                       cpu_affinity=args.cpu_affinity,
                       heap=args.heap)
    except (TypeError, ValueError, RuntimeError) as exc:
        sys.exit(f"keras_pipe.distributed.worker: {exc}")
    _, port = _split_address(server.target.split("://")[-1], "target")
    listen = bind_lib.format_address(bind_lib.check_address(args.bind), port)
    print(f"keras_pipe.distributed.worker: serving /job:{args.job}/replica:0/task:"
          f"{args.task} on {listen}; no authentication: trusted network "
          "only", flush=True)
    server.join()


if __name__ == "__main__":
    main()
