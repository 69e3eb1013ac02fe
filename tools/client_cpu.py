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

    python tools/client_cpu.py --job transformer --configs gpipe:2,gpipe:8
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_pipe
    from tools.benchmarks import peer_jobs
    from tools.benchmarks.harness import _cpu_seconds, _system_cpu_seconds
    from tools.benchmarks.peer import _worker_pids

    job = peer_jobs.jobs(args.quick)[args.job]
    x, y = peer_jobs.data(np, job, args.steps * job["batch"])
    print(peer_jobs.describe(job), f"load {os.getloadavg()}")

    class Clock(keras.callbacks.Callback):
        def __init__(self, pids):
            super().__init__()
            self.pids, self.rows = pids, []

        def on_train_batch_end(self, batch, logs=None):
            self.rows.append([time.process_time()]
                             + [_cpu_seconds(p) for p in self.pids]
                             + [_system_cpu_seconds(p) for p in self.pids])

    with keras_pipe.local_workers(num_workers=2) as devices:
        workers = _worker_pids()
        for config in args.configs.split(","):
            schedule, m = config.split(":")
            order = peer_jobs.FOUR_STAGE_LAYOUTS.get(schedule, (0, 1))
            keras.utils.set_random_seed(0)
            model = keras_pipe.PipelineModel(
                peer_jobs.keras_stages(keras, job, len(order)),
                devices=[devices[w] for w in order],
                num_micro_batches=int(m), schedule=schedule, remat="never")
            model.build((None, *peer_jobs.input_shape(job)))
            model.compile(keras.optimizers.SGD(job["lr"]),
                          peer_jobs.keras_loss(keras, job))
            model.fit(x[:2 * job["batch"]], y[:2 * job["batch"]],
                      batch_size=job["batch"], verbose=0)
            if args.reseed:
                keras.utils.set_random_seed(0)
            clock = Clock(workers)
            start = time.process_time()
            model.fit(x, y, batch_size=job["batch"], verbose=0,
                      shuffle=False, callbacks=[clock])
            whole = (time.process_time() - start) / args.steps
            first, last = clock.rows[0], clock.rows[-1]
            n = len(clock.rows) - 1
            per = [(b - a) / n * 1000 for a, b in zip(first, last)]
            k = len(workers)
            print(f"{config:12s} client {per[0]:6.0f} ms/step in the epoch, "
                  f"{whole * 1000:6.0f} over the whole fit; workers "
                  + "/".join(f"{w:.0f}" for w in per[1:1 + k])
                  + " ms/step (system "
                  + "/".join(f"{w:.0f}" for w in per[1 + k:])
                  + f"); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
