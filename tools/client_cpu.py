"""CPU per step of the client and of each worker, inside a warm `fit` epoch.

The client is the process that runs `fit` and drives the workers of
`keras_pipe.local_workers`; it shares their cores. For each `schedule:M`
this builds the peer benchmark's job (`tools/benchmarks/peer_jobs.py`) on 2
local workers, warms it up with one `fit`, then runs a measured `fit` and
reports, per step between two steps' ends (the first step left out), the
CPU of the client (`time.process_time`) and of each worker (/proc, with
its system part), and the
client's CPU per step over the whole `fit` call (setup and end included).
`--reseed` calls `keras.utils.set_random_seed(0)` between the warm-up and
the measured `fit`: TF then instantiates the step function again at its
first step (the seed clears TF's kernel cache), which the whole-`fit`
figure shows. CPU time, not wall time: robust to other processes' load.

`--threads` adds the client's CPU per step by thread (ns from
/proc/self/task/*/schedstat; Python threads by their Python name, the
others by the name TF or gRPC gave them). `--record perf|py-spy` records
the client from the first step's end to the measured `fit`'s end (`perf
record -g`, or `py-spy record --native`, into `--out`).
`--steps-per-execution N` compiles with it.

    python tools/client_cpu.py --job transformer --configs gpipe:2,gpipe:8
    python tools/client_cpu.py --job mlp --configs 1f1b:2,1f1b:8 --threads
"""

import argparse
import collections
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _thread_ns():
    """`{tid: (name, CPU ns)}` of this process's threads (schedstat)."""
    python = {t.native_id: f"py:{t.name}" for t in threading.enumerate()}
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
        out[int(task)] = (python.get(int(task), comm), ns)
    return out


def _by_name(before, after, steps):
    """CPU ms per step by thread name (digits folded), largest first."""
    per = collections.Counter()
    for tid, (name, ns) in after.items():
        start = before.get(tid, (name, 0))[1]
        per[re.sub(r"\d+", "N", name)] += (ns - start) / 1e6 / steps
    return per.most_common()


def _start_recorder(kind, out, label):
    """Starts `perf record` or `py-spy record` on this process."""
    out.mkdir(parents=True, exist_ok=True)
    pid = str(os.getpid())
    if kind == "perf":
        command = ["perf", "record", "-g", "-F", "999", "-p", pid, "-o",
                   str(out / f"{label}.perf.data")]
    else:
        command = ["py-spy", "record", "--native", "--threads",
                   "-r", "200", "-f", "raw", "-p", pid, "-o",
                   str(out / f"{label}.pyspy.txt")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the measured steps
    return proc


def _stop_recorder(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="transformer",
                        choices=["mlp", "transformer", "conv"])
    parser.add_argument("--quick", action="store_true",
                        help="the peer benchmark's quick sizes")
    parser.add_argument("--configs", default="gpipe:2,gpipe:4,gpipe:8",
                        help="schedule:M, comma-separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reseed", action="store_true")
    parser.add_argument("--threads", action="store_true",
                        help="the client's CPU per step by thread")
    parser.add_argument("--record", choices=["perf", "py-spy"])
    parser.add_argument("--out", default="/tmp/client_cpu")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--data", choices=["client", "auto"],
                        default="auto", help="the model's data_device: "
                        "this process, or the first stage's worker")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_pipe
    from tools.benchmarks import peer_jobs
    from tools.benchmarks.harness import _cpu_seconds, _system_cpu_seconds
    from tools.benchmarks.peer import _worker_pids

    job = peer_jobs.jobs(args.quick)[args.job]
    spe = args.steps_per_execution
    x, y = peer_jobs.data(np, job, args.steps * job["batch"])
    print(peer_jobs.describe(job), f"steps_per_execution {spe}",
          f"load {os.getloadavg()}")

    class Clock(keras.callbacks.Callback):
        def __init__(self, pids):
            super().__init__()
            self.pids, self.rows, self.threads = pids, [], []

        def on_train_batch_end(self, batch, logs=None):
            if args.record and not self.rows:  # the first step left out
                self.recorder = _start_recorder(
                    args.record, pathlib.Path(args.out), self.label)
            self.rows.append([time.process_time()]
                             + [_cpu_seconds(p) for p in self.pids]
                             + [_system_cpu_seconds(p) for p in self.pids])
            last = batch == args.steps - 1  # Keras passes the end step
            if args.threads and (len(self.rows) == 1 or last):
                self.threads.append(_thread_ns())  # /proc reads cost CPU

    with keras_pipe.local_workers(num_workers=2) as devices:
        workers = _worker_pids()
        for config in args.configs.split(","):
            model = peer_jobs.keras_pipeline(keras, keras_pipe, job, config,
                                               devices)
            model.data_device = None if args.data == "client" else "auto"
            model.compile(keras.optimizers.SGD(job["lr"]),
                          peer_jobs.keras_loss(keras, job),
                          steps_per_execution=spe)
            traces = []
            traced = model._executor.loss_and_gradients
            model._executor.loss_and_gradients = (
                lambda *a, _f=traced, _t=traces, **k: (_t.append(1),
                                                       _f(*a, **k))[1])
            model.fit(x[:2 * spe * job["batch"]], y[:2 * spe * job["batch"]],
                      batch_size=job["batch"], verbose=0)
            if args.reseed:
                keras.utils.set_random_seed(0)
            warm_traces = len(traces)
            clock = Clock(workers)
            clock.label = config.replace(":", "_")
            start = time.process_time()
            model.fit(x, y, batch_size=job["batch"], verbose=0,
                      shuffle=False, callbacks=[clock])
            whole = (time.process_time() - start) / args.steps
            if args.record:
                _stop_recorder(clock.recorder)
            first, last = clock.rows[0], clock.rows[-1]
            n = (len(clock.rows) - 1) * spe  # steps between the rows
            per = [(b - a) / n * 1000 for a, b in zip(first, last)]
            k = len(workers)
            print(f"{config:12s} client {per[0]:6.1f} ms/step in the epoch, "
                  f"{whole * 1000:6.0f} over the whole fit; workers "
                  + "/".join(f"{w:.0f}" for w in per[1:1 + k])
                  + " ms/step (system "
                  + "/".join(f"{w:.0f}" for w in per[1 + k:])
                  + f"); load {os.getloadavg()[0]:.1f}; step traced "
                  f"{warm_traces}x in the warm-up, "
                  f"{len(traces) - warm_traces}x in the measured fit",
                  flush=True)
            if args.threads:
                table = _by_name(clock.threads[0], clock.threads[-1], n)
                print("    client threads, ms/step: " + ", ".join(
                    f"{name} {ms:.1f}" for name, ms in table if ms >= 0.05),
                    flush=True)


if __name__ == "__main__":
    main()
