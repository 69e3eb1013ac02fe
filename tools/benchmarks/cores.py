"""Part cores: do two pinned processes run twice as fast as one?

A pipeline on two worker processes, each pinned to its own CPU, is bounded
by what the two CPUs deliver at once. On a virtual machine two vCPUs may
be hyperthreads of one physical core, sharing its vector and matrix units:
two processes then run no faster together than one alone, and no schedule
can give a speed-up. This part runs the same float32 products (a Dense
layer's, on a micro-batch of rows, one intra-op thread) in a process
pinned to one CPU alone, then in two processes pinned to two CPUs at once,
each timing its products from the same moment on, and reports the
throughput of both together over one alone (2.0 for two real cores).

    python -m tools.benchmarks.cores
"""

import argparse
import concurrent.futures
import os
import time

from tools.benchmarks.harness import _tf_env, child, median, run_child


@child("cores_products")
def child_products(p):
    """Products of `p["rows"]` rows by a square kernel, timed from
    `p["start_at"]` (wall clock) for `p["seconds"]`."""
    tf, _ = _tf_env([1, 1])
    x = tf.random.normal([p["rows"], p["width"]])
    w = tf.random.normal([p["width"], p["width"]])

    @tf.function
    def products(x, w):
        for _ in range(10):
            x = tf.nn.relu(x @ w) * 0.01
        return x

    products(x, w).numpy()  # traced and warm
    while time.time() < p["start_at"]:
        time.sleep(0.01)
    times, end = [], time.time() + p["seconds"]
    while time.time() < end:
        start = time.perf_counter()
        products(x, w).numpy()
        times.append(time.perf_counter() - start)
    return {"seconds_per_call": median(times), "calls": len(times)}


def run(cpus, rows=128, width=1024, seconds=8.0, log=print):
    """One process on `cpus[0]` alone, then one on each of `cpus` at once."""
    common = {"rows": rows, "width": width, "seconds": seconds}

    def one(cpu, start_at):
        return run_child("cores_products",
                         dict(common, cpus=[cpu], start_at=start_at), 600,
                         log=log)

    alone = one(cpus[0], time.time() + 20)
    start_at = time.time() + 30  # both import TF and warm up first
    with concurrent.futures.ThreadPoolExecutor(len(cpus)) as pool:
        together = list(pool.map(lambda c: one(c, start_at), cpus))
    rate = 1 / alone["seconds_per_call"]
    combined = sum(1 / r["seconds_per_call"] for r in together)
    return {"cpus": list(cpus), "rows": rows, "width": width,
            "alone_ms": alone["seconds_per_call"] * 1e3,
            "together_ms": [r["seconds_per_call"] * 1e3 for r in together],
            "throughput_ratio": combined / rate}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    result = run(cpus, args.rows, args.width, args.seconds)
    print(f"CPUs {result['cpus']}, {args.rows} x {args.width} products: "
          f"one process alone {result['alone_ms']:.1f} ms per call; two at "
          f"once {', '.join(f'{t:.1f}' for t in result['together_ms'])} "
          f"ms; together they deliver {result['throughput_ratio']:.2f}x one "
          "alone (2.0 for two real cores)")


if __name__ == "__main__":
    main()
