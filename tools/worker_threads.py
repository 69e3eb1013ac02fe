"""CPU of each local worker per thread name over a warm `fit` (6 steps).

Builds the peer benchmark's Transformer with 2 blocks on 2
`keras_pipe.local_workers` (1F1B, M=8), warms it up, runs a 6-step `fit`
and prints each worker's CPU ticks (1/100 s, /proc) in all and per thread
name (TF's intra-op threads are named after the process, `python`). Run it
against another checkout with `PYTHONPATH=/that/checkout`: the A/B of the
workers' thread spinning in docs/performance.md.

    PYTHONPATH=$PWD python tools/worker_threads.py
"""

import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ticks(pids):
    out = {}
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a thread that ended meanwhile
            out[(pid, task, name)] = int(fields[11]) + int(fields[12])
    return out


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_pipe
    sys.path.append(ROOT)
    from tools.benchmarks import peer_jobs
    from tools.benchmarks.peer import _worker_pids
    job = dict(peer_jobs.jobs()["transformer"], blocks=2)
    x, y = peer_jobs.data(np, job, 6 * job["batch"])
    with keras_pipe.local_workers(num_workers=2) as devices:
        pids = _worker_pids()
        model = keras_pipe.PipelineModel(
            peer_jobs.keras_stages(keras, job, 2), devices=devices,
            num_micro_batches=8, schedule="1f1b", remat="never")
        model.build((None, *peer_jobs.input_shape(job)))
        model.compile(keras.optimizers.SGD(job["lr"]), "mse")
        model.fit(x[:2 * job["batch"]], y[:2 * job["batch"]],
                  batch_size=job["batch"], verbose=0)
        before = _ticks(pids)
        model.fit(x, y, batch_size=job["batch"], verbose=0)
        after = _ticks(pids)
    per = collections.Counter()
    for key, value in after.items():
        per[(key[0], re.sub(r"\d+", "#", key[2]))] += value - before.get(
            key, 0)
    total = collections.Counter()
    for (pid, _), value in per.items():
        total[pid] += value
    print(f"{keras_pipe.__file__}: CPU ticks per worker over 6 steps "
          f"{list(total.values())}; load {os.getloadavg()[0]:.1f}")
    for (pid, name), value in per.most_common(6):
        print(f"  worker {pid} {name}: {value}")


if __name__ == "__main__":
    main()
