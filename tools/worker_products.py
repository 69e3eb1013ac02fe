"""Where each worker's step goes: its products, from oneDNN's own log.

Runs a peer benchmark job (`tools/benchmarks/peer_jobs.py`) on 2
`keras_pipe.local_workers` with `ONEDNN_VERBOSE=1` and
`ONEDNN_VERBOSE_TIMESTAMP=1` (the workers inherit them: every product and
reorder a worker runs is logged with its start, in ms since the epoch, and
its duration), and the client's clock at each step's end. Per worker and
step, in ms: the products' busy time (the union of their intervals) and
their summed durations (more than the union where two ran at once: a W
call's independent products on the worker's two inter-op threads), the
transposed kernels' reorders (`keras_pipe.engine.products`), the time
from the previous step's end to the worker's first reorder or product
(`head`: the step's call reaching the worker) and to its first product
(`first_product`: also the batch or the previous stage's output
arriving), the time after its last (`tail`: the other worker's drain,
the outputs returning) and between them (`gaps`: waiting for a transfer,
and every op that is not a oneDNN product: element-wise ops, sums, the
optimizer, the executor). oneDNN is needed
(`TF_ENABLE_ONEDNN_OPTS=1` where TF does not turn it on by itself).
Wall time: on a loaded host the products stretch.

    TF_ENABLE_ONEDNN_OPTS=1 python tools/worker_products.py --configs zbv:2,zb_h1:4
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(lines):
    """`[(start_ms, end_ms, primitive, shape)]` of the `exec` lines of a
    oneDNN verbose log with timestamps, in order of start."""
    events = []
    for line in lines:
        fields = line.strip().split(",")
        if (len(fields) > 8 and fields[0] == "onednn_verbose"
                and fields[4] == "exec"):
            start, duration = float(fields[2]), float(fields[-1])
            events.append((start, start + duration, fields[6], fields[-2]))
    return sorted(events)


def _union(intervals):
    total, last = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, last)
        if end > start:
            total += end - start
            last = end
    return total


def account(events, begin, end):
    """One worker's step from `begin` to `end` (ms, the client's clock at
    the previous step's end and at this one's): a dict of ms."""
    inside = [e for e in events if begin <= e[0] < end]
    products = [e for e in inside if e[2] != "reorder"]
    busy = _union([(s, e) for s, e, _, _ in inside])
    first = inside[0][0] if inside else end
    last = max((e for _, e, _, _ in inside), default=end)
    return {
        "step": end - begin,
        "busy": busy,
        "products": sum(e - s for s, e, _, _ in products),
        "reorders": sum(e - s for s, e, kind, _ in inside
                        if kind == "reorder"),
        "count": len(products),
        "head": first - begin,
        "first_product": (products[0][0] if products else end) - begin,
        "tail": max(0.0, end - last),
        "gaps": max(0.0, min(last, end) - first - busy),
    }


def median_account(events, step_ends):
    """Per key, the median over the steps between `step_ends`."""
    rows = [account(events, a, b) for a, b in zip(step_ends, step_ends[1:])]
    return {key: sorted(r[key] for r in rows)[len(rows) // 2]
            for key in rows[0]}


def _run(configs, steps, workdir):
    """`({config: step ends}, [worker log path])`: every config on the same
    2 workers (one `local_workers` per process)."""
    import keras
    import numpy as np

    import keras_pipe
    from tools.benchmarks import peer_jobs
    from tools.benchmarks.peer import _worker_pids

    job = peer_jobs.jobs()["mlp"]
    x, y = peer_jobs.data(np, job, steps * job["batch"])
    ends = {}

    class Clock(keras.callbacks.Callback):
        def __init__(self, times):
            super().__init__()
            self.times = times

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.time() * 1000)

    with keras_pipe.local_workers(num_workers=2) as devices:
        pids = _worker_pids()
        for config in configs:
            model = peer_jobs.keras_pipeline(keras, keras_pipe, job, config,
                                               devices)
            model.compile(keras.optimizers.SGD(job["lr"]),
                          peer_jobs.keras_loss(keras, job))
            model.fit(x[:2 * job["batch"]], y[:2 * job["batch"]],
                      batch_size=job["batch"], verbose=0)
            ends[config] = []
            model.fit(x, y, batch_size=job["batch"], verbose=0,
                      shuffle=False, callbacks=[Clock(ends[config])])
            print(f"  {config} ran, load {os.getloadavg()[0]:.1f}",
                  flush=True)
        time.sleep(0.5)  # the logs flushed
        logs = []
        for task, pid in enumerate(pids):
            path = os.path.join(workdir, f"worker{task}.log")
            shutil.copy(os.readlink(f"/proc/{pid}/fd/1"), path)
            logs.append(path)
    return ends, logs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="zbv:2,zb_h1:4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None,
                        help="a JSON file for every number")
    parser.add_argument("--logs", default=None,
                        help="a directory to keep the workers' logs in")
    args = parser.parse_args(argv)
    os.environ["ONEDNN_VERBOSE"] = "1"
    os.environ["ONEDNN_VERBOSE_TIMESTAMP"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    print(f"MLP job, load {os.getloadavg()[0]:.1f}; median per step, ms")
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory() as workdir:
        ends, logs = _run(configs, args.steps, workdir)
        events = []
        for path in logs:
            with open(path) as f:
                events.append(parse(f))
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                shutil.copy(path, args.logs)
    results = {}
    for config in configs:
        for task, worker_events in enumerate(events):
            row = median_account(worker_events, ends[config])
            results[f"{config}/worker{task}"] = row
            print(f"{config:10s} worker {task}: " + ", ".join(
                f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results,
                       "step_ends": ends}, f, indent=1)


if __name__ == "__main__":
    main()
