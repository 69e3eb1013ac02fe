"""A TensorFlow worker process that serves pipeline stages to a client.

```
python -m keras_pipe.worker --task 1 \
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
listens on `--bind` (default `127.0.0.1`) and nowhere else: on Linux, the
process re-executes itself with a tiny `LD_PRELOAD` shim (`_bind.c`, built
once with the system C compiler) that turns TF's wildcard `bind()` into a
bind to that address, and then checks in `/proc/net` that no socket of the
port listens on a wildcard address. Listening on every interface takes an
explicit `--bind 0.0.0.0`.
"""

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

__all__ = ["serve", "bind_shim_path", "listening_hosts", "main"]

_WILDCARDS = ("0.0.0.0", "::")
_SHIM_ENV = "KERAS_PIPE_BIND_HOST"
_SHIM_SOURCE = pathlib.Path(__file__).with_name("_bind.c")


def bind_shim_path():
    """Builds (once) the bind shim and returns the path of its shared library.

    The library is cached under `$XDG_CACHE_HOME/keras_pipe` (or
    `~/.cache/keras_pipe`), keyed by a hash of its source. To keep a
    *client's* own TF gRPC port on loopback as well (`keras_pipe.connect`
    opens one), start the client with
    `LD_PRELOAD=<this path> KERAS_PIPE_BIND_HOST=127.0.0.1`.

    Raises:
        RuntimeError: if the platform is not Linux or no C compiler (`$CC`,
            `cc` or `gcc`) can build it.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            "Pinning the TF gRPC server to one address needs LD_PRELOAD, "
            f"which this platform ({sys.platform}) does not have. Pass "
            "--bind 0.0.0.0 to accept TF's default of listening on every "
            "interface (trusted network only).")
    source = _SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME")
                         or pathlib.Path.home() / ".cache") / "keras_pipe"
    target = cache / f"bind-{digest}.so"
    if target.exists():
        return str(target)
    compilers = [c for c in (os.environ.get("CC"), "cc", "gcc") if c]
    compiler = next((shutil.which(c) for c in compilers if shutil.which(c)),
                    None)
    if compiler is None:
        raise RuntimeError(
            "No C compiler (tried $CC, cc, gcc) to build the shim that keeps "
            "the TF gRPC server on the --bind address. Install one, or pass "
            "--bind 0.0.0.0 to listen on every interface (trusted network "
            "only).")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(built),
             str(_SHIM_SOURCE), "-ldl"], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(
                f"Building the bind shim with {compiler} failed:\n"
                f"{result.stderr}Pass --bind 0.0.0.0 to listen on every "
                "interface instead (trusted network only).")
        os.replace(built, target)  # Atomic: concurrent workers are safe.
    return str(target)


def _decode_address(hex_address):
    """Decodes an address of /proc/net/tcp{,6} into text."""
    import ipaddress
    import struct
    # The kernel prints the address as 32-bit words in host byte order.
    packed = b"".join(struct.pack("=I", int(hex_address[k:k + 8], 16))
                      for k in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(packed)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def listening_hosts(port):
    """The local addresses with a TCP socket listening on `port` (Linux).

    Returns:
        A sorted list such as `["127.0.0.1"]`; `"0.0.0.0"` or `"::"` for a
        wildcard listener. Empty where `/proc/net` is unavailable.
    """
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:  # LISTEN
                hosts.add(_decode_address(address))
    return sorted(hosts)


def _parse_cluster(text, job):
    """`--cluster`: JSON (a dict or TF_CONFIG) or comma-separated addresses."""
    if text is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError("--cluster is required when TF_CONFIG is unset.")
    text = text.strip()
    if text.startswith("{"):
        value = json.loads(text)
        return value.get("cluster", value)
    return {job: [a.strip() for a in text.split(",") if a.strip()]}


def serve(cluster, task, job="worker", bind="127.0.0.1",
          inter_op_threads=None, intra_op_threads=None, cpu_affinity=None):
    """Starts the TF server of one task in this process and returns it.

    Call before anything else initializes TensorFlow. Listening on `bind`
    only needs the shim loaded (see `main`); `serve` checks it and raises
    if the port also listens on another address.

    ```python
    server = serve({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, task=0)
    server.join()
    ```

    Args:
        cluster: a `tf.train.ClusterSpec`, a dict `{job: [address, ...]}`
            or a TF_CONFIG dict/JSON string.
        task: this task's index in `job`.
        job: this task's job name. Defaults to `"worker"`.
        bind: the only address the server may listen on; `"0.0.0.0"`
            listens on every interface. Defaults to `"127.0.0.1"`.
        inter_op_threads: size of TF's inter-op pool. Defaults to `None`
            (TF's choice).
        intra_op_threads: size of TF's intra-op pool. Defaults to `None`.
        cpu_affinity: CPU ids this process may run on (Linux). Defaults to
            `None` (unchanged).

    Returns:
        The started `tf.distribute.Server`.

    Raises:
        ValueError: if `task` is not in `job`, or the server listens on an
            address other than `bind`.
    """
    if cpu_affinity is not None:
        os.sched_setaffinity(0, set(cpu_affinity))
    import tensorflow as tf

    from keras_pipe.cluster import cluster_spec

    spec = cluster_spec(cluster)
    if job not in spec.jobs or task not in spec.task_indices(job):
        raise ValueError(
            f"Task {task} of job {job!r} is not in the cluster "
            f"{spec.as_dict()}. Pass --task/--job naming one of its tasks.")
    address = spec.task_address(job, task)
    config = tf.compat.v1.ConfigProto()
    if inter_op_threads is not None:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
        config.inter_op_parallelism_threads = inter_op_threads
    if intra_op_threads is not None:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
        config.intra_op_parallelism_threads = intra_op_threads
    server = tf.distribute.Server(spec, job_name=job, task_index=task,
                                  config=config, start=True)
    port = int(address.rsplit(":", 1)[1])
    hosts = listening_hosts(port)
    if bind not in _WILDCARDS and any(h in _WILDCARDS for h in hosts):
        raise ValueError(
            f"The TF server of /job:{job}/task:{task} listens on {hosts} "
            f"port {port}, not only on {bind!r}: TF binds every interface "
            "unless this process runs with the keras_pipe bind shim. Start "
            "it with `python -m keras_pipe.worker`.")
    return server


def _cpu_list(text):
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_pipe.worker",
        description="Serve one TensorFlow task for keras_pipe stages. TF's "
        "gRPC runtime has NO authentication: anyone reaching the port can "
        "run code in this process. Trusted networks only.")
    parser.add_argument("--task", type=int, required=True,
                        help="index of this task in its job")
    parser.add_argument("--job", default="worker",
                        help="job name (default: worker)")
    parser.add_argument("--cluster", default=None,
                        help="comma-separated addresses of the job's tasks, "
                        "or JSON: {job: [addresses]} or a TF_CONFIG. "
                        "Default: $TF_CONFIG")
    parser.add_argument("--bind", default="127.0.0.1",
                        help="the only address to listen on (default: "
                        "127.0.0.1; 0.0.0.0 = every interface)")
    parser.add_argument("--inter-op-threads", type=int, default=None)
    parser.add_argument("--intra-op-threads", type=int, default=None)
    parser.add_argument("--cpu-affinity", type=_cpu_list, default=None,
                        help="CPU ids, e.g. 0,1 or 0-3")
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.bind not in _WILDCARDS and os.environ.get(_SHIM_ENV) != args.bind:
        try:
            shim = bind_shim_path()
        except RuntimeError as exc:
            sys.exit(f"keras_pipe.worker: {exc}")
        env = dict(os.environ)
        env[_SHIM_ENV] = args.bind
        env["LD_PRELOAD"] = " ".join(
            p for p in (shim, env.get("LD_PRELOAD")) if p)
        os.execve(sys.executable,
                  [sys.executable, "-m", "keras_pipe.worker", *argv], env)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cluster = _parse_cluster(args.cluster, args.job)
    try:
        server = serve(cluster, args.task, job=args.job, bind=args.bind,
                       inter_op_threads=args.inter_op_threads,
                       intra_op_threads=args.intra_op_threads,
                       cpu_affinity=args.cpu_affinity)
    except ValueError as exc:
        sys.exit(f"keras_pipe.worker: {exc}")
    print(f"keras_pipe.worker: serving /job:{args.job}/replica:0/task:"
          f"{args.task} on {args.bind} ({server.target}); no "
          "authentication: trusted network only", flush=True)
    server.join()


if __name__ == "__main__":
    main()
