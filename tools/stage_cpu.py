"""CPU per batch of one stage's forward and backward pass, at M = 1, 2, 4, 8.

The first half of a peer benchmark job (`tools/benchmarks/peer_jobs.py`)
as one stage, in this process: its forward and backward pass over the
job's batch cut into M micro-batches, CPU time per batch (robust to other
processes' load), against M=1. Keras with `--threads` intra-op threads
(spinning or, `--no-spin`, not, as a `keras_pipe.local_workers` worker),
or torch with one thread. Pin it to one core:

    taskset -c 1 python tools/stage_cpu.py --job transformer --threads 4
    taskset -c 1 python tools/stage_cpu.py --job transformer --no-spin
    taskset -c 1 python tools/stage_cpu.py --job transformer --torch
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _keras(job, threads, spinning, ms, repeats):
    import numpy as np

    from tools.benchmarks import peer_jobs
    from tools.benchmarks.harness import _tf_env
    tf, keras = _tf_env([threads, 2], spinning=spinning)
    stage = peer_jobs.keras_stages(keras, job, 2)[0]
    stage.build((None, *peer_jobs.input_shape(job)))
    x = tf.constant(peer_jobs.data(np, job, job["batch"])[0])

    @tf.function
    def forward_backward(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(stage(x, training=True))
        return loss, tape.gradient(loss, stage.trainable_variables)

    out = {}
    for m in ms:
        parts = tf.split(x, m)
        for part in parts:
            forward_backward(part)
        start = time.process_time()
        for _ in range(repeats):
            for part in parts:
                forward_backward(part)[0].numpy()
        out[m] = (time.process_time() - start) / repeats
    return out


def _torch(job, ms, repeats):
    import numpy as np
    import torch

    from tools.benchmarks import peer_jobs
    torch.set_num_threads(1)
    stage = peer_jobs.torch_stages(torch, job, 2)[0]
    x = peer_jobs.torch_data(torch, np, job, job["batch"])[0]
    out = {}
    for m in ms:
        parts = list(torch.chunk(x, m))

        def run(parts=parts):
            for part in parts:
                stage.zero_grad()
                stage(part).sum().backward()
        run()
        start = time.process_time()
        for _ in range(repeats):
            run()
        out[m] = (time.process_time() - start) / repeats
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="transformer",
                        choices=["mlp", "transformer", "conv"])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--no-spin", action="store_true")
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tools.benchmarks import peer_jobs
    job = peer_jobs.jobs()[args.job]
    ms = (1, 2, 4, 8)
    if args.torch:
        out, what = _torch(job, ms, args.repeats), "torch, 1 thread"
    else:
        out = _keras(job, args.threads, not args.no_spin, ms, args.repeats)
        what = (f"keras, {args.threads} threads, "
                + ("not spinning" if args.no_spin else "spinning"))
    print(f"{args.job} stage 0 of 2, {what}: CPU ms per batch at M="
          + ", ".join(f"{m}: {out[m] * 1e3:.0f} ({out[m] / out[1]:.2f}x)"
                      for m in ms)
          + f"; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
