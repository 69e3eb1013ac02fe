"""CPU per row of TF's matrix products at a micro-batch's sizes.

    python tools/small_products.py                 # this process's setting
    TF_ENABLE_ONEDNN_OPTS=1 python tools/small_products.py --threads 1
    TF_ENABLE_ONEDNN_OPTS=0 python tools/small_products.py --threads 4

Pinned to one core (`--core`, default the last this process may run on),
with `--threads` intra-op threads, as a `keras_pipe.local_workers` worker.
Prints, per product, the least CPU ms per 512 rows over 5 rounds at 512,
256, 128 and 64 rows: the forward `x @ w`, the same with the kernel stored
transposed, `x @ transpose(wt)` (what a pipeline stage runs with oneDNN on
small micro-batches, `keras_pipe.engine.products`), and the input gradient
`dy @ w^T` of a Dense(1024) layer. Then a stage of 4 x Dense(1024), forward and backward
(input and weight gradients) of 512 rows cut into M micro-batches: CPU ms
per step at M = 1, 2, 4, 8. CPU time, not wall time: on a shared machine
it is what a pinned worker pays, whatever else runs.
"""

import argparse
import os
import time


def _cpu_ms(function, calls, rounds=5):
    function().numpy()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            out = function()
        out.numpy()
        best = min(best, (time.process_time() - start) / calls * 1e3)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--core", type=int,
                        default=sorted(os.sched_getaffinity(0))[-1])
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})  # before TF starts its threads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorflow.python.util import _pywrap_util_port

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    print(f"oneDNN {bool(_pywrap_util_port.IsMklEnabled())}, "
          f"{args.threads} intra-op threads, core {args.core}, load "
          f"{os.getloadavg()[0]:.1f}")
    w = tf.Variable(tf.random.normal([1024, 1024]))
    wt = tf.Variable(tf.transpose(w))
    for rows in (512, 256, 128, 64):
        x = tf.random.normal([rows, 1024])
        n = 512 // rows
        forward = tf.function(lambda x=x: x @ w)
        transposed = tf.function(
            lambda x=x: tf.matmul(x, wt, transpose_b=True))
        backward = tf.function(
            lambda x=x: tf.matmul(x, w, transpose_b=True))
        print(f"  {rows:3d} rows: x @ w {_cpu_ms(forward, 20 * n) * n:5.1f}"
              f" ms, x @ transpose(wt) "
              f"{_cpu_ms(transposed, 20 * n) * n:5.1f} ms, dy @ w^T "
              f"{_cpu_ms(backward, 20 * n) * n:5.1f} ms per 512 rows")
    ws = [tf.Variable(tf.random.normal([1024, 1024]) * 0.03)
          for _ in range(4)]
    x = tf.random.normal([512, 1024])

    @tf.function
    def step(x, m):
        grads = [tf.zeros_like(v) for v in ws]
        for part in tf.split(x, m):
            with tf.GradientTape() as tape:
                h = part
                for v in ws:
                    h = tf.nn.relu(h @ v)
                loss = tf.reduce_sum(h * h)
            grads = [g + d for g, d in zip(grads, tape.gradient(loss, ws))]
        return grads[0]

    per_m = {m: _cpu_ms(lambda m=m: step(x, m), 5, rounds=3)
             for m in (1, 2, 4, 8)}
    print("  4 x Dense(1024), forward and backward of 512 rows, CPU ms per "
          "step: " + ", ".join(f"M={m} {v:.0f}" for m, v in per_m.items()))


if __name__ == "__main__":
    main()
