"""Capacity demo: a model too big for one capped process trains on two.

    python tools/capacity_demo.py --out docs/capacity_demo.json

Every process that holds model memory runs under an OS memory cap:
`RLIMIT_AS` (address space, set with `resource.setrlimit` in the child
before it starts; the kernel refuses any mapping past it, and tracks the
peak as `VmPeak` in `/proc/<pid>/status`). A cgroup's `memory.max` would cap
resident memory instead, but needs a writable cgroup tree; `RLIMIT_RSS` is
not enforced by Linux. TensorFlow reserves address space it never touches:
each of a worker's ~100 threads reserves a stack of `RLIMIT_STACK` bytes
(8 MiB by default; 2 MiB here, for every process) and glibc an arena per
thread (`MALLOC_ARENA_MAX=2` keeps them few). So the planner's budget per
device is the cap minus an idle worker's measured `VmPeak`.

1. Two idle workers after one tiny op: their `VmPeak` is TensorFlow's own
   share; a plain process's likewise.
2. The unsplit model (plain Keras `fit`) in one process without a cap:
   its `VmPeak` is over the cap; and under the cap: it fails.
3. `keras_pipe.plan(..., memory_budget=cap - idle worker)` picks the cut,
   `num_micro_batches` and per-stage remat; two capped worker processes
   (`python -m keras_pipe.worker`) train it from an uncapped client that
   holds no stage; the loss goes down; each worker's `VmPeak` stays under
   the cap.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
WIDTH, DEPTH, INPUTS, CLASSES = 4096, 6, 2048, 10
BATCH, ROWS, EPOCHS = 64, 256, 3


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", MALLOC_ARENA_MAX="2",
               KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


STACK = 2 * MiB


def _capped(cap):
    def limit():
        resource.setrlimit(resource.RLIMIT_STACK, (STACK, STACK))
        if cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return limit


def status(pid="self"):
    """VmPeak, VmSize, VmHWM, VmRSS of a process, in bytes."""
    result = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmPeak", "VmSize", "VmHWM", "VmRSS"):
                result[key] = int(value.split()[0]) * 1024
    return result


def build_model(keras):
    """The unsplit model: an MLP of ~92M parameters (Adam: ~1.5 GB)."""
    layers = [keras.Input((INPUTS,))]
    layers += [keras.layers.Dense(WIDTH, activation="relu")
               for _ in range(DEPTH)]
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers, name="wide_mlp")


def data(np):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, INPUTS)).astype("float32")
    w = rng.normal(size=(INPUTS, CLASSES)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def child_unsplit():
    """Plain Keras fit of the whole model in this process."""
    import keras
    import numpy as np
    keras.utils.set_random_seed(0)
    model = build_model(keras)
    model.compile(keras.optimizers.Adam(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(np)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                        shuffle=False)
    return {"loss": history.history["loss"], **status()}


def child_idle():
    """An idle TF worker's own share: import, serve, one tiny op."""
    import tensorflow as tf
    tf.reduce_sum(tf.ones([8])).numpy()
    return status()


def child_probe(cluster):
    """Runs one tiny op on each worker (their thread pools start)."""
    import tensorflow as tf

    import keras_pipe
    keras_pipe.connect({"worker": cluster}, timeout=60.0)
    for device in _remote(cluster):
        with tf.device(device):
            tf.function(lambda: tf.reduce_sum(tf.ones([64, 64])))().numpy()
    return {}


def _remote(cluster):
    return [f"/job:worker/replica:0/task:{t}/device:CPU:0"
            for t in range(len(cluster))]


def child_client(cluster, budget):
    """Plans for `budget` bytes per worker, trains on the workers."""
    import keras
    import numpy as np

    import keras_pipe
    from keras_pipe import partition
    keras_pipe.connect({"worker": cluster}, timeout=60.0)
    devices = _remote(cluster)
    keras.utils.set_random_seed(0)
    model = build_model(keras)
    p = keras_pipe.plan(model, devices=devices, memory_budget=budget,
                        batch_size=BATCH)
    pipe = keras_pipe.PipelineModel(
        partition.split_model(model, len(devices), balance=p.sizes),
        devices=devices, num_micro_batches=p.num_micro_batches,
        remat=p.remat)
    pipe.compile(keras.optimizers.Adam(1e-4),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(np)
    start = time.time()
    history = pipe.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                       shuffle=False)
    return {"loss": history.history["loss"], "plan": str(p),
            "sizes": p.sizes, "num_micro_batches": p.num_micro_batches,
            "remat": p.remat, "seconds": time.time() - start,
            "predicted_peaks": [s.peak_memory_bytes for s in p.stages]}


def _run_child(name, args, cap=None, limited=True, timeout=1800):
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", name] + args,
        env=_env(), preexec_fn=_capped(cap) if limited else None,
        capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    errors = [line.strip()[:300] for line in done.stderr.splitlines()
              if any(word in line for word in (
                  "ResourceExhausted", "OOM", "bad_alloc", "MemoryError",
                  "llocat", "Cannot allocate", "terminate", "Aborted",
                  "Check failed"))]
    return {"failed": True, "returncode": done.returncode,
            "signal": -done.returncode if done.returncode < 0 else None,
            "errors": errors[:5]}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipelined(cap, budget, num_workers=2, probe=False):
    """Capped workers, an uncapped client; the workers' peaks.

    With `probe`, the client only runs a tiny op on each worker.
    """
    cluster = [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]
    workers = [subprocess.Popen(
        [sys.executable, "-m", "keras_pipe.worker", "--task", str(t),
         "--cluster", ",".join(cluster), "--intra-op-threads", "1",
         "--cpu-affinity", str(t % os.cpu_count())],
        env=_env(), preexec_fn=_capped(cap), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for t in range(num_workers)]
    try:
        if probe:
            result = _run_child("probe", ["--cluster", ",".join(cluster)],
                                limited=False)
        else:
            result = _run_child("client", ["--cluster", ",".join(cluster),
                                           "--budget", str(budget)],
                                limited=False)
        result["workers"] = []
        for t, w in enumerate(workers):
            alive = w.poll() is None
            entry = {"task": t, "alive": alive}
            if alive:
                entry.update(status(w.pid))
                entry["rlimit_as"] = resource.prlimit(
                    w.pid, resource.RLIMIT_AS)[0]
            result["workers"].append(entry)
        return result
    finally:
        for w in workers:
            w.kill()
            w.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=None,
                        help="RLIMIT_AS per process (default: from the "
                        "idle worker's and the unsplit model's peaks)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child == "client":
            out = child_client(args.cluster.split(","), args.budget)
        elif args.child == "probe":
            out = child_probe(args.cluster.split(","))
        else:
            out = {"unsplit": child_unsplit, "idle": child_idle}[args.child]()
        print(json.dumps(out))
        return
    report = {"idle": _run_child("idle", [])}
    report["idle_workers"] = run_pipelined(None, None, probe=True)["workers"]
    report["unsplit"] = _run_child("unsplit", [])
    idle, unsplit = report["idle"]["VmPeak"], report["unsplit"]["VmPeak"]
    worker = max(w["VmPeak"] for w in report["idle_workers"])
    # Halfway between the unsplit model and an even split on two workers.
    cap = (args.cap_mib * MiB if args.cap_mib else
           (unsplit + worker + (unsplit - idle) // 2) // 2)
    budget = cap - worker
    report["cap"], report["budget"] = cap, budget
    report["unsplit_capped"] = _run_child("unsplit", [], cap=cap)
    report["pipelined"] = run_pipelined(cap, budget)
    mib = lambda b: f"{b / MiB:,.0f} MiB"  # noqa: E731
    print(f"cap per process (RLIMIT_AS): {mib(cap)}; idle TF worker "
          f"VmPeak {mib(worker)} (plain TF process {mib(idle)}); planner "
          f"budget per worker {mib(budget)}")
    print(f"unsplit, no cap: VmPeak {mib(unsplit)} "
          f"({unsplit / cap:.2f}x the cap), VmHWM "
          f"{mib(report['unsplit']['VmHWM'])}, loss "
          f"{report['unsplit']['loss']}")
    capped = report["unsplit_capped"]
    print("unsplit, capped: " + ("trained?!" if not capped.get("failed")
                                 else f"failed: {capped}"))
    pipe = report["pipelined"]
    if pipe.get("failed"):
        print(f"pipelined: FAILED {pipe}")
    else:
        print(pipe["plan"])
        print(f"pipelined loss per epoch: {pipe['loss']}")
        for w in pipe["workers"]:
            print(f"worker {w['task']}: VmPeak {mib(w.get('VmPeak', 0))} "
                  f"({w.get('VmPeak', 0) / cap:.2f}x the cap), VmHWM "
                  f"{mib(w.get('VmHWM', 0))}, alive {w['alive']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
