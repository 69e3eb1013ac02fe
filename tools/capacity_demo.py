"""Capacity in one number: the widest MLP one process trains, against two workers.

    python tools/capacity_demo.py --depth 24 --low 1536 --high 3072 \
        --pipelined-high 4096 --adam --out /tmp/capacity.json
    python tools/capacity_demo.py --depth 24 --widths 2432 3072  # repeats only

(each trial starts its processes and takes 1-5 minutes on 2 shared cores;
narrow the search with --low/--high/--pipelined-high, or skip it with
--widths)

Every process that holds model memory (the unsplit process; each worker)
runs under one resident-memory limit, `--limit-mib`, enforced by a
watchdog: a thread of this process reads `VmHWM` (the kernel's record of
the process's resident peak) from `/proc/<pid>/status` every 10 ms and
kills the process with SIGKILL once it is over the limit, recording which
process, its `VmHWM` and `VmRSS`. Why a watchdog: a cgroup's `memory.max`
would bind resident memory but the cgroup tree is not writable here;
`RLIMIT_RSS` is not enforced by Linux; `RLIMIT_AS` caps address space,
which TensorFlow and glibc reserve less of when capped (a process 1.14x
over an `RLIMIT_AS` cap uncapped trained under it). Reading `VmHWM`, not
`VmRSS`, makes the limit exact: a spike between two polls is still seen
at the next one (the kill then comes up to one poll late).

The model: `--depth` x Dense(width, relu) + Dense(10) on 1024 inputs,
batch 64, SGD, 3 steps (`train_on_batch`). For a width:
* unsplit: plain Keras in one process, no remat (activations are small
  here: 64 rows), jit_compile "auto" (False on CPU), and the workers' heap
  settings (`keras_pipe.distributed.heap`), so that the comparison is like
  for like (without them the unsplit process holds more: conservative);
* pipelined: two watched workers (`python -m keras_pipe.distributed.worker`)
  and an unwatched client that holds no stage; `keras_pipe.plan(
  memory_budget=..., optimizer_slots=0)` chooses the cut, M and per-stage
  remat; the client builds the model (it holds its initial values until
  they are sent) and trains.

The planner's memory model predicts a stage on a logical device, not a
worker's resident peak (issue 30, item 2, under way elsewhere). So, by
default, one calibration run at the widest unsplit width measures each
worker's peak net of an idle worker against the prediction, and the
planner then gets `(limit - idle worker) / scale` with `scale` the largest
ratio. `--planner-scale 0.01` instead lets the planner choose the cut, M
and remat with no memory verdict of its own: the watchdog alone judges.

A bisection over widths (multiples of 128) finds the widest that trains
unsplit and the widest that trains pipelined; then `--repeats` runs at the
pipelined width check that the unsplit run is killed for memory and the
workers stay under the limit, every time. Losses of the unsplit and the
pipelined run at the unsplit width are compared (SGD: equal to 1e-5);
`--adam` adds one Adam run of each at half that width, reported as runs.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
INPUTS, CLASSES, BATCH, STEPS = 1024, 10, 64, 3
DEPTH = 16  # set from --depth


def status(pid="self"):
    """VmHWM and VmRSS of a process, in bytes (None if it is gone)."""
    result = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    result[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return result or None


class Watchdog:
    """Kills a watched process whose resident peak passes `limit` bytes."""

    def __init__(self, limit, interval=0.01):
        self.limit, self.interval = limit, interval
        self.watched, self.killed, self.peaks = {}, {}, {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def watch(self, pid, role):
        with self.lock:
            self.watched[pid] = role

    def _run(self):
        while not self.stop.wait(self.interval):
            with self.lock:
                watched = dict(self.watched)
            for pid, role in watched.items():
                s = status(pid)
                if s is None:
                    continue
                self.peaks[role] = max(self.peaks.get(role, 0), s["VmHWM"])
                if s["VmHWM"] > self.limit and role not in self.killed:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed[role] = {"pid": pid, **s}

    def close(self):
        self.stop.set()
        self.thread.join()


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for name in ("TF_CONFIG", "LD_PRELOAD", "MALLOC_ARENA_MAX"):
        env.pop(name, None)
    return env


def build_model(keras, width):
    """`DEPTH` x Dense(width, relu) + Dense(10) on `INPUTS` inputs."""
    layers = [keras.Input((INPUTS,))]
    layers += [keras.layers.Dense(width, activation="relu")
               for _ in range(DEPTH)]
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers, name=f"mlp_{width}")


def params(width):
    return (INPUTS * width + width + (DEPTH - 1) * (width * width + width)
            + width * CLASSES + CLASSES)


def _data(np):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, INPUTS)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(BATCH * STEPS,)).astype("int32")


def _optimizer(keras, name):
    return (keras.optimizers.SGD(0.01) if name == "sgd"
            else keras.optimizers.Adam(1e-4))


def _train(keras, np, model, optimizer):
    model.compile(_optimizer(keras, optimizer),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(np)
    return [float(model.train_on_batch(x[s * BATCH:(s + 1) * BATCH],
                                       y[s * BATCH:(s + 1) * BATCH]))
            for s in range(STEPS)]


def child_unsplit(args):
    from keras_pipe.distributed import heap
    heap.configure(args.heap)  # as its workers: like for like
    heap.trim_when_idle()  # and trimmed when idle, as they are
    import keras
    import numpy as np
    keras.utils.set_random_seed(0)
    model = build_model(keras, args.width)
    return {"loss": _train(keras, np, model, args.optimizer)}


def child_idle(args):
    import tensorflow as tf

    import keras_pipe
    cluster = args.cluster.split(",")
    keras_pipe.connect({"worker": cluster}, timeout=60.0)
    for device in _remote(cluster):
        with tf.device(device):
            tf.function(lambda: tf.reduce_sum(tf.ones([64, 64])))().numpy()
    return {}


def _remote(cluster):
    return [f"/job:worker/replica:0/task:{t}/device:CPU:0"
            for t in range(len(cluster))]


def child_client(args):
    import keras
    import numpy as np

    import keras_pipe
    from keras_pipe.planning import partition
    cluster = args.cluster.split(",")
    keras_pipe.connect({"worker": cluster}, timeout=60.0)
    devices = _remote(cluster)
    keras.utils.set_random_seed(0)
    model = build_model(keras, args.width)
    if args.defaults:  # the model and the devices alone
        pipe = keras_pipe.PipelineModel.from_model(model, devices=devices)
        loss = _train(keras, np, pipe, args.optimizer)
        p = pipe.plan
        return {"loss": loss, "sizes": p.sizes, "schedule": p.schedule,
                "num_micro_batches": p.num_micro_batches, "remat": p.remat,
                "predicted_peaks": p.peak_memory}
    try:
        p = keras_pipe.plan(model, devices=devices,
                            memory_budget=int(args.budget / args.scale),
                            batch_size=BATCH,
                            optimizer_slots=0 if args.optimizer == "sgd"
                            else 2)
    except ValueError as exc:
        return {"failed": True, "planner": str(exc).splitlines()[0][:300]}
    pipe = keras_pipe.PipelineModel(
        partition.split_model(model, len(devices), balance=p.sizes),
        devices=devices, num_micro_batches=p.num_micro_batches,
        remat=p.remat)
    loss = _train(keras, np, pipe, args.optimizer)
    return {"loss": loss, "sizes": p.sizes,
            "num_micro_batches": p.num_micro_batches, "remat": p.remat,
            "predicted_peaks": [s.peak_memory_bytes for s in p.stages]}


def _child(name, args, watchdog=None, role=None, timeout=1200):
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", name] + args,
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    if watchdog is not None:
        watchdog.watch(proc.pid, role)
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"failed": True, "returncode": proc.returncode,
            "stderr": err.strip().splitlines()[-1:]}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_unsplit(width, limit, optimizer="sgd", heap="return"):
    watchdog = Watchdog(limit)
    try:
        result = _child("unsplit", ["--width", str(width), "--depth",
                                    str(DEPTH), "--optimizer", optimizer,
                                    "--heap", heap],
                        watchdog, "unsplit")
    finally:
        watchdog.close()
    result["peak"] = watchdog.peaks.get("unsplit")
    if watchdog.killed:
        result.update(failed=True, killed=watchdog.killed)
    return result


def run_on_watched_workers(limit, client, heap="return"):
    """Starts two loopback workers (heap `heap`) watched against
    `limit`, runs `client(cluster_args)` (the `--cluster` arguments of a
    client child; it returns the child's result) and adds each worker's
    peak, and whom the watchdog killed."""
    cluster = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    watchdog = Watchdog(limit)
    workers = []
    try:
        for t in range(2):
            w = subprocess.Popen(
                [sys.executable, "-m", "keras_pipe.distributed.worker",
                 "--task", str(t),
                 "--cluster", ",".join(cluster), "--intra-op-threads", "1",
                 "--heap", heap],
                env=_env(), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            workers.append(w)
            watchdog.watch(w.pid, f"worker {t}")
        result = client(["--cluster", ",".join(cluster)])
        time.sleep(3 * watchdog.interval)
    finally:
        watchdog.close()
        for w in workers:
            w.kill()
            w.wait()
    result["peaks"] = [watchdog.peaks.get(f"worker {t}") for t in range(2)]
    if watchdog.killed:
        result.update(failed=True, killed=watchdog.killed)
    return result


def run_pipelined(width, limit, budget=None, optimizer="sgd", idle=False,
                  scale=1.0, defaults=False):
    """Two watched workers and a client; with `idle`, one tiny op each.

    The planner gets `budget / scale` (see `calibrate`); with `defaults`,
    `from_model(model, devices=...)` alone on workers with their default
    heap."""
    def client(args):
        if idle:
            return _child("idle", args)
        return _child("client", args + [
            "--width", str(width), "--depth", str(DEPTH), "--budget",
            str(budget), "--scale", repr(scale), "--optimizer", optimizer]
            + (["--defaults"] if defaults else []))

    return run_on_watched_workers(limit, client, _heap(defaults))


def _heap(defaults):
    """The workers' heap: their default, or `"return"` for a budget."""
    return "reuse" if defaults else "return"


def calibrate(width, limit, budget, idle_peaks):
    """How the planner's predicted stage peaks compare with the workers'.

    `keras_pipe.planning.memory` predicts a stage's peak on a logical
    device, not a worker's resident peak (issue 30, item 2). One run at
    `width`, planned with the budget, gives per worker its measured peak
    net of an idle worker over the predicted one; the largest ratio then
    scales the predictions of every width (the planner gets
    `budget / scale`). The watchdog still enforces the limit.
    """
    result = run_pipelined(width, limit, budget)
    if "planner" in result:  # a plan to measure, within the limit or not
        result = run_pipelined(width, limit, budget, scale=0.25)
    if result.get("failed") or "predicted_peaks" not in result:
        raise RuntimeError(f"calibration run at width {width} failed: "
                           f"{_why(result)}")
    ratios = [(p - i) / q for p, i, q in zip(
        result["peaks"], idle_peaks, result["predicted_peaks"])]
    return max(ratios), result


def widest(trains, low, high, step=128):
    """The widest width in [low, high) (multiples of `step`) that trains.

    `trains(low)` must hold and `trains(high)` not (not checked). Returns
    the width and every trial `(width, result)`.
    """
    trials = []
    while high - low > step:
        mid = (low + high) // 2 // step * step
        result = trains(mid)
        trials.append((mid, result))
        if result.get("failed"):
            high = mid
        else:
            low = mid
    return low, trials


def _why(result):
    if "killed" in result:
        return "; ".join(f"{role} killed at VmHWM {k['VmHWM'] / MiB:,.0f} "
                         f"MiB" for role, k in result["killed"].items())
    if "planner" in result:
        return f"planner: {result['planner']}"
    if result.get("failed"):
        return f"failed: {result.get('stderr')}"
    peaks = result.get("peaks") or [result.get("peak")]
    return "trained, peak " + ", ".join(f"{p / MiB:,.0f}" for p in peaks
                                        if p) + " MiB"


def main(argv=None):
    global DEPTH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=1280,
                        help="resident-memory limit per process (VmHWM)")
    parser.add_argument("--depth", type=int, default=DEPTH,
                        help="Dense layers of the model")
    parser.add_argument("--low", type=int, default=1024,
                        help="a width that trains unsplit")
    parser.add_argument("--high", type=int, default=8192,
                        help="a width that trains on no setup")
    parser.add_argument("--pipelined-high", type=int, default=None,
                        help="a width that does not train on 2 workers "
                        "(default: --high)")
    parser.add_argument("--widths", type=int, nargs=2, default=None,
                        metavar=("UNSPLIT", "PIPELINED"),
                        help="skip the search: the widest unsplit and "
                        "pipelined widths found before")
    parser.add_argument("--calibrate-width", type=int, default=None,
                        help="width of the calibration run (default: "
                        "the widest unsplit width); --no-calibration "
                        "plans with the bare budget")
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--planner-scale", type=float, default=None,
                        help="no calibration run: the planner gets budget "
                        "/ this (e.g. 0.01: the planner chooses the cut, M "
                        "and remat, the watchdog alone judges memory)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--defaults", action="store_true",
                        help="pipelined: from_model(model, devices=...) "
                        "alone (planned at its first step, no budget) on "
                        "workers with their default heap; the unsplit "
                        "process gets that heap too")
    parser.add_argument("--adam", action="store_true",
                        help="one Adam run of each at half the unsplit width")
    parser.add_argument("--no-losses", action="store_true",
                        help="skip the SGD loss comparison")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=float, default=1.0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="sgd", help=argparse.SUPPRESS)
    parser.add_argument("--heap", default="return", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    DEPTH = args.depth
    if args.child:
        out = {"unsplit": child_unsplit, "client": child_client,
               "idle": child_idle}[args.child](args)
        print(json.dumps(out))
        return
    start = time.time()
    limit = args.limit_mib * MiB
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(f"load average {os.getloadavg()}; model {DEPTH} x Dense(width) + "
        f"Dense(10) on {INPUTS} inputs, batch {BATCH}, SGD, {STEPS} steps")
    idle = run_pipelined(None, limit, idle=True, defaults=args.defaults)
    worker_idle = max(idle["peaks"])
    budget = limit - worker_idle
    report = {"limit": limit, "depth": DEPTH,
              "idle_worker_peaks": idle["peaks"], "budget": budget,
              "argv": sys.argv[1:]}
    say(f"limit per process (resident peak, watchdog): {args.limit_mib:,} "
        f"MiB; idle worker {worker_idle / MiB:,.0f} MiB; budget per worker "
        f"{budget / MiB:,.0f} MiB")

    def unsplit(width):
        result = run_unsplit(width, limit, heap=_heap(args.defaults))
        say(f"  unsplit   width {width}: {params(width):>12,} params: "
            f"{_why(result)}")
        return result

    def pipelined(width):
        result = run_pipelined(width, limit, budget, scale=scale,
                               defaults=args.defaults)
        plan = (f" ({result.get('schedule', 'gpipe')}, cut "
                f"{result['sizes']}, M={result['num_micro_batches']}"
                f", remat {result['remat']})" if "sizes" in result else "")
        say(f"  pipelined width {width}: {params(width):>12,} params: "
            f"{_why(result)}{plan}")
        return result

    def save(data):
        if args.out:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)

    def calibrated(w_unsplit):
        if (args.no_calibration or args.defaults
                or args.planner_scale is not None):
            report["scale"] = args.planner_scale or 1.0
            return report["scale"]
        width = args.calibrate_width or w_unsplit
        scale, result = calibrate(width, limit, budget, idle["peaks"])
        net = [round((p - i) / MiB)
               for p, i in zip(result["peaks"], idle["peaks"])]
        report.update(scale=scale, calibration={
            "width": width, "scale": scale, "run": result})
        say(f"calibration at width {width}: worker peaks net of idle {net}"
            f" MiB, predicted "
            f"{[round(q / MiB) for q in result['predicted_peaks']]}: "
            f"the planner gets budget / {scale:.2f}")
        return scale

    if args.widths:
        w_unsplit, w_pipe = args.widths
    else:
        w_unsplit, trials_u = widest(unsplit, args.low, args.high)
        report["trials_unsplit"] = trials_u
        scale = calibrated(w_unsplit)
        w_pipe, trials_p = widest(pipelined, w_unsplit,
                                  args.pipelined_high or args.high)
        report["trials_pipelined"] = trials_p
    if args.widths:
        scale = calibrated(w_unsplit)
    ratio = params(w_pipe) / params(w_unsplit)
    report.update(unsplit_width=w_unsplit, pipelined_width=w_pipe,
                  unsplit_params=params(w_unsplit),
                  pipelined_params=params(w_pipe), ratio=ratio)
    say(f"widest unsplit: {w_unsplit} ({params(w_unsplit):,} params); "
        f"widest on 2 workers: {w_pipe} ({params(w_pipe):,} params): "
        f"{ratio:.2f}x the parameters")
    repeats = []
    for r in range(args.repeats):
        u = unsplit(w_pipe)
        p = pipelined(w_pipe)
        ok = bool(u.get("killed")) and not p.get("failed")
        repeats.append({"unsplit": u, "pipelined": p, "ok": ok})
        say(f"repeat {r + 1}: {'as expected' if ok else 'NOT as expected'}")
        save(dict(report, repeats=repeats))
    report["repeats"] = repeats
    say(f"{sum(r['ok'] for r in repeats)} of {len(repeats)} runs at width "
        f"{w_pipe}: the unsplit process killed for memory, the workers "
        f"under the limit")
    if not args.no_losses:
        u = unsplit(w_unsplit)
        p = pipelined(w_unsplit)
        report["sgd"] = {"unsplit": u, "pipelined": p}
        save(report)
        if "loss" in u and "loss" in p:
            diff = max(abs(a - b) for a, b in zip(u["loss"], p["loss"]))
            say(f"SGD losses at width {w_unsplit}: unsplit {u['loss']}, "
                f"pipelined {p['loss']}: max difference {diff:.2e} "
                f"({'equal' if diff <= 1e-5 else 'NOT equal'} to 1e-5)")
    if args.adam:
        half = w_unsplit // 2 // 128 * 128
        ua = run_unsplit(half, limit, "adam")
        pa = run_pipelined(half, limit, budget, "adam", scale=scale)
        report["adam"] = {"width": half, "unsplit": ua, "pipelined": pa}
        say(f"Adam runs at width {half} (runs, not an equality test: "
            f"Adam turns float-level differences of tiny gradients into "
            f"lr-sized steps): unsplit {ua.get('loss', _why(ua))}, "
            f"pipelined {pa.get('loss', _why(pa))}")
    report["seconds"] = time.time() - start
    say(f"total {report['seconds'] / 60:.1f} min; load average "
        f"{os.getloadavg()}")
    save(report)


if __name__ == "__main__":
    main()
