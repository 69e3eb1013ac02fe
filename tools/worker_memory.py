"""Where a worker's resident memory goes: phases of a pipelined fit, per worker.

    python tools/worker_memory.py                 # the issue's MLP, SGD
    python tools/worker_memory.py --optimizer adam --num-micro-batches 4
    python tools/worker_memory.py --schedule zbv --placement 0110 \
        --sizes 2,2,1,3 --num-micro-batches 1   # a plan replayed

Starts two loopback workers (`python -m keras_pipe.distributed.worker`) and a client
process that connects, runs one op on each worker, then builds the model
(7 x Dense(WIDTH), batch 64), cuts it with `from_model(num_stages=2,
balance="params", schedule="gpipe")` (`--defaults`: the model and the
devices alone, with a phase per planning step; `--placement`/`--sizes`:
a given cut under `--schedule`), compiles and trains. After each phase
the client reads each worker's `VmRSS` and `VmHWM` (resident now, resident peak) from
`/proc/<pid>/status`, then resets the peak (`/proc/<pid>/clear_refs`), so
each phase's HWM is the peak of that phase; everything is net of the idle
worker after the first op. The unsplit model is measured the same way in
its own process (net of the process after one op), once with the
workers' heap and once as plain Keras runs (glibc's heap; `--no-plain`
leaves that run out). Every other
process keeps its heap as `--heap` says (`keras_pipe.distributed.heap`; default
`return`: freed buffers go back to the OS, the setting for a memory
budget). Prints one table and, with `--out`, JSON.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
INPUTS, CLASSES, BATCH = 2048, 10, 64


def status(pid="self"):
    """VmHWM and VmRSS of a process, in bytes."""
    result = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                result[key] = int(value.split()[0]) * 1024
    return result


def reset_peak(pid="self"):
    """Resets the process's VmHWM to its VmRSS (Linux `clear_refs` 5), so
    that the next reading is the peak of what ran since."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def build_model(keras, width, depth):
    layers = [keras.Input((INPUTS,))]
    layers += [keras.layers.Dense(width, activation="relu")
               for _ in range(depth)]
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers, name="mlp")


def _data(np, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, INPUTS)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(BATCH * steps,)).astype("int32")


def _optimizer(keras, name):
    return {"sgd": lambda: keras.optimizers.SGD(0.01),
            "adam": lambda: keras.optimizers.Adam(1e-4)}[name]()


def child_unsplit(args):
    from keras_pipe.distributed import heap
    heap.configure(args.heap)
    import keras
    import numpy as np
    import tensorflow as tf
    tf.reduce_sum(tf.ones([8])).numpy()
    phases = []

    def mark(name):
        phases.append((name, status()))
        reset_peak()

    mark("idle")
    keras.utils.set_random_seed(0)
    model = build_model(keras, args.width, args.depth)
    mark("built")
    model.compile(_optimizer(keras, args.optimizer),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(np, args.steps)
    model.train_on_batch(x[:BATCH], y[:BATCH])
    mark("first step")
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                        shuffle=False)
    mark("fit")
    return {"phases": phases, "loss": history.history["loss"],
            "params": model.count_params()}


def _mark_planning(mark):
    """Marks a phase after each training the planner runs to calibrate its
    costs (`profiling.model_step_seconds`) and after the search, so that
    planning's peaks show apart from the first step's."""
    import inspect

    from keras_pipe.planning import autoplan, profiling
    timed, search = profiling.model_step_seconds, autoplan.search
    signature = inspect.signature(timed)

    def model_step_seconds(*a, **k):
        mark("planning: measured")
        try:
            return timed(*a, **k)
        finally:
            call = signature.bind(*a, **k).arguments
            mark(f"planning: {call.get('schedule', 'gpipe')} "
                 f"M={call['num_micro_batches']} sizes={list(call['sizes'])}")

    def planned(*a, **k):
        try:
            return search(*a, **k)
        finally:
            mark("planning: searched")

    profiling.model_step_seconds = model_step_seconds
    autoplan.search = planned


def child_client(args):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_pipe
    cluster = args.cluster.split(",")
    pids = [int(p) for p in args.pids.split(",")]
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0"
               for t in range(len(cluster))]
    keras_pipe.connect({"worker": cluster}, timeout=60.0)
    for device in devices:
        with tf.device(device):
            tf.function(lambda: tf.reduce_sum(tf.ones([64, 64])))().numpy()
    phases = []

    def mark(name):
        phases.append((name, [status(p) for p in pids], status()))
        for p in pids:
            reset_peak(p)

    mark("idle")
    keras.utils.set_random_seed(0)
    model = build_model(keras, args.width, args.depth)
    mark("model built (client)")
    if args.defaults:  # the model and the devices alone: planned by fit
        _mark_planning(mark)
        pipe = keras_pipe.PipelineModel.from_model(model, devices=devices)
    elif args.placement:  # a plan replayed: stage j on worker placement[j]
        place = [int(t) for t in args.placement]
        pipe = keras_pipe.PipelineModel.from_model(
            model, num_stages=len(place),
            devices=[devices[t] for t in place],
            num_micro_batches=args.num_micro_batches,
            balance=[int(n) for n in args.sizes.split(",")],
            remat=args.remat, schedule=args.schedule)
    else:
        pipe = keras_pipe.PipelineModel.from_model(
            model, num_stages=2, devices=devices,
            num_micro_batches=args.num_micro_batches, balance="params",
            remat=args.remat, schedule=args.schedule)
    mark("pipeline built")
    pipe.compile(_optimizer(keras, args.optimizer),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(np, args.steps)
    pipe.train_on_batch(x[:BATCH], y[:BATCH])
    mark("first step")
    history = pipe.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                       shuffle=False)
    mark("fit")
    stages = [[v.shape.num_elements() * 4 for v in s.trainable_variables]
              for s in pipe.stages]
    chosen = pipe.plan
    return {"phases": phases, "loss": history.history["loss"],
            "params": model.count_params(),
            "stage_weight_bytes": [sum(s) for s in stages],
            "chosen": None if chosen is None else {
                "schedule": chosen.schedule, "num_stages": chosen.num_stages,
                "num_micro_batches": chosen.num_micro_batches,
                "remat": list(chosen.remat), "sizes": chosen.sizes}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv):
    done = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv,
                          env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args):
    common = ["--width", str(args.width), "--depth", str(args.depth),
              "--optimizer", args.optimizer, "--steps", str(args.steps),
              "--num-micro-batches", str(args.num_micro_batches),
              "--remat", args.remat, "--schedule", args.schedule] + (
                  ["--defaults"] if args.defaults else []) + (
                  ["--placement", args.placement, "--sizes", args.sizes]
                  if args.placement else [])
    heap = ["--heap", args.heap]
    unsplit = _run(["--child", "unsplit"] + common + heap)
    # And as plain Keras runs it: glibc's heap, TF's own allocators.
    plain = None if not args.plain else unsplit if args.heap == "glibc" \
        else _run(["--child", "unsplit"] + common + ["--heap", "glibc"])
    cluster = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    workers = [subprocess.Popen(
        [sys.executable, "-m", "keras_pipe.distributed.worker", "--task", str(t),
         "--cluster", ",".join(cluster), "--intra-op-threads", "1",
         "--heap", args.heap],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for t in range(2)]
    try:
        client = _run(["--child", "client", "--cluster", ",".join(cluster),
                       "--pids", ",".join(str(w.pid) for w in workers)]
                      + common + heap)
    finally:
        for w in workers:
            w.kill()
            w.wait()
    return {"unsplit": unsplit, "plain": plain, "pipelined": client,
            "args": vars(args)}


def net_peaks(report):
    """Resident peaks over all phases, net of idle: unsplit (with the
    workers' heap, and as plain Keras: `plain`, None when not measured)
    and per worker."""
    def peak(phases):
        return max(s["VmHWM"] for _, s in phases[1:]) - phases[0][1]["VmHWM"]

    p = report["pipelined"]["phases"]
    workers = [max(ws[t]["VmHWM"] for _, ws, _ in p[1:]) - p[0][1][t]["VmHWM"]
               for t in range(len(p[0][1]))]
    plain = report.get("plain")
    return {"unsplit": peak(report["unsplit"]["phases"]),
            "plain": plain and peak(plain["phases"]), "workers": workers}


def table(report):
    mib = lambda b: f"{b / MiB:8.1f}"  # noqa: E731
    lines = []
    u = report["unsplit"]
    idle = u["phases"][0][1]["VmHWM"]
    lines.append(f"unsplit ({u['params']:,} params, weights "
                 f"{u['params'] * 4 / MiB:.1f} MiB), net of idle "
                 f"{idle / MiB:.0f} MiB (MiB):")
    lines.append(f"  {'phase':24} {'RSS':>8} {'HWM':>8}")
    for name, s in u["phases"]:
        lines.append(f"  {name:24} {mib(s['VmRSS'] - idle)} "
                     f"{mib(s['VmHWM'] - idle)}")
    p = report["pipelined"]
    idle = [w["VmHWM"] for w in p["phases"][0][1]]
    lines.append(f"pipelined, stage weights "
                 f"{[round(b / MiB, 1) for b in p['stage_weight_bytes']]} "
                 f"MiB; workers net of idle "
                 f"{[round(b / MiB) for b in idle]} MiB (MiB):")
    lines.append(f"  {'phase':24} {'w0 RSS':>8} {'w0 HWM':>8} {'w1 RSS':>8} "
                 f"{'w1 HWM':>8} {'client RSS':>10}")
    for name, ws, c in p["phases"]:
        cells = " ".join(f"{mib(w['VmRSS'] - i)} {mib(w['VmHWM'] - i)}"
                         for w, i in zip(ws, idle))
        lines.append(f"  {name:24} {cells} {mib(c['VmRSS'])}")
    peaks = net_peaks(report)
    weights = p["stage_weight_bytes"]
    lines.append(f"peaks (max over phases, MiB): unsplit "
                 f"{peaks['unsplit'] / MiB:.1f}; workers "
                 f"{[round(w / MiB, 1) for w in peaks['workers']]} = "
                 f"{[round(w / b, 2) for w, b in zip(peaks['workers'], weights)]}"
                 f" x stage weights, "
                 f"{[round(w / peaks['unsplit'], 2) for w in peaks['workers']]}"
                 f" x unsplit")
    if peaks["plain"]:
        lines.append(
            f"plain Keras (glibc's heap) {peaks['plain'] / MiB:.1f}: "
            f"{[round(w / peaks['plain'], 2) for w in peaks['workers']]}"
            " x plain")
    lines.append(f"losses: unsplit {u['loss']} pipelined {p['loss']}")
    if p.get("chosen"):
        lines.append(f"chosen: {p['chosen']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-micro-batches", type=int, default=2)
    parser.add_argument("--remat", default="never")
    parser.add_argument("--heap", default="return",
                        choices=("reuse", "return", "glibc"),
                        help="every process's heap setting "
                        "(keras_pipe.distributed.heap; default: return)")
    parser.add_argument("--defaults", action="store_true",
                        help="the pipeline from the model and the devices "
                        "alone (from_model(model, devices=...)), planned "
                        "by its first step; pass --heap reuse for the "
                        "workers' default heap")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--placement", default=None,
                        help="a cut to replay: the worker of each stage, "
                        "e.g. 0110 (zbv's V on 2 workers); with --sizes")
    parser.add_argument("--sizes", default=None,
                        help="layer calls per stage, e.g. 2,2,1,3")
    parser.add_argument("--plain", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="also measure the unsplit model as plain Keras "
                        "runs it (glibc's heap; default: yes)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pids", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if bool(args.placement) != bool(args.sizes) or (
            args.placement and len(args.placement) != len(
                args.sizes.split(","))):
        parser.error("--placement and --sizes go together, one entry per "
                     f"stage; got --placement={args.placement!r}, "
                     f"--sizes={args.sizes!r}")
    if args.child:
        out = {"unsplit": child_unsplit, "client": child_client}[
            args.child](args)
        print(json.dumps(out))
        return
    report = measure(args)
    print(table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
