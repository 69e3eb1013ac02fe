"""Part inference: pipelined `predict` and `evaluate` against one core.

For each job of `peer_jobs` (the MLP and the Transformer): plain Keras
`predict` and `evaluate` of the whole model in a process pinned to one core
(default thread pools, default environment), then keras_pipe's on 2
`keras_pipe.local_workers` (K = 2 stages, GPipe's cut), for each
`(inference_micro_batches, inference_steps_per_execution)` (`M:S`;
`M:S:d` with `data_device="auto"`: arrays batched on the first worker),
then the one core again. A time is one warm call's wall time over its
batches, the median of the rounds (5: now and then a pipelined call
takes about 0.5 s longer, and a median of 3 can land on it); the
pipeline's configs are all built and warmed first, then timed in turn
in each round. With it, the CPU
seconds per batch of each process (the one-core process; worker 0, worker
1 and the client), which a loaded host moves less than the wall times.
The pipeline's process also runs the unsplit model and reports the
largest difference of the outputs.

    python -m tools.benchmarks.inference [--jobs mlp,transformer]
        [--batches 16] [--rounds 5] [--configs auto,1:1,4:1,2:4,4:4]
"""

import argparse
import json
import os
import time

from tools.benchmarks import peer_jobs
from tools.benchmarks.harness import (
    _cpu_seconds,
    child,
    fmt,
    format_table,
    median,
    run_child,
)
from tools.benchmarks.peer import _worker_pids


def _unsplit(keras, job):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([layer for unit in peer_jobs.keras_units(
        keras, job) for layer in unit])
    model.build((None, *peer_jobs.input_shape(job)))
    model.compile("sgd", peer_jobs.keras_loss(keras, job))
    return model


def _timed(call, rounds, batches, pids, warm=True):
    """Seconds per batch of `rounds` warm calls (after one warming call,
    unless `warm` is False), and the CPU seconds per batch of each process
    of `pids` (medians)."""
    if warm:
        call()
    times, cpu = [], []
    for _ in range(rounds):
        before = [_cpu_seconds(pid) for pid in pids]
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) / batches)
        cpu.append([(_cpu_seconds(pid) - b) / batches
                    for pid, b in zip(pids, before)])
    return times, [median(list(c)) for c in zip(*cpu)]


def _measure(model, x, y, job, rounds, batches, pids, warm=True):
    """`{kind: seconds per batch, kind_cpu: CPU seconds per batch of each
    process of pids}` for predict and evaluate."""
    b = job["batch"]
    out = {}
    for kind, call in (
            ("predict", lambda: model.predict(x, batch_size=b, verbose=0)),
            ("evaluate", lambda: model.evaluate(x, y, batch_size=b,
                                                verbose=0))):
        out[kind], out[f"{kind}_cpu"] = _timed(call, rounds, batches, pids,
                                               warm)
    return out


@child("inference_baseline")
def child_inference_baseline(p):
    """The unsplit model in this process (pinned by the parent), Keras'
    default thread pools."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    job = p["job"]
    x, y = peer_jobs.data(np, job, p["batches"] * job["batch"])
    model = _unsplit(keras, job)
    return dict(_measure(model, x, y, job, p["rounds"], p["batches"],
                         [os.getpid()]),
                affinity=sorted(os.sched_getaffinity(0)))


@child("inference_pipeline")
def child_inference_pipeline(p):
    """keras_pipe on 2 local workers: every config built and warmed, then
    timed in turn, round after round (a process's first timed calls run
    slower than its later ones: config after config, the first config
    would carry that)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_pipe
    job = p["job"]
    b = job["batch"]
    x, y = peer_jobs.data(np, job, p["batches"] * b)
    models, out = {}, {}
    with keras_pipe.local_workers(num_workers=2) as devices:
        pids = _worker_pids() + [os.getpid()]
        plain = _unsplit(keras, job)
        expected = plain.predict(x[:2 * b], verbose=0, batch_size=b)
        for config in p["configs"]:
            parts = config.split(":")
            placed = parts[-1] == "d"  # data_device="auto"
            parts = parts[:-1] if placed else parts
            m, s = ("auto", "auto") if parts == ["auto"] else (
                int(v) for v in parts)
            model = peer_jobs.keras_pipeline(keras, keras_pipe, job,
                                             "gpipe:1", devices)
            model.compile("sgd", peer_jobs.keras_loss(keras, job))
            model.inference_micro_batches = m
            model.inference_steps_per_execution = s
            if placed:
                model.data_device = "auto"
            got = model.predict(x[:2 * b], verbose=0, batch_size=b)
            models[config] = model
            out[config] = dict(
                counts=list(model._inference_counts()),
                max_difference=float(np.max(np.abs(got - expected))),
                predict=[], evaluate=[], predict_cpu=[], evaluate_cpu=[])
        for model in models.values():  # warm: each call traced and run
            _measure(model, x, y, job, 0, p["batches"], pids)
        for _ in range(p["rounds"]):
            for config, model in models.items():
                timed = _measure(model, x, y, job, 1, p["batches"], pids,
                                 warm=False)
                for kind in ("predict", "evaluate"):
                    out[config][kind] += timed[kind]
                    out[config][f"{kind}_cpu"].append(timed[f"{kind}_cpu"])
        for entry in out.values():
            for kind in ("predict", "evaluate"):
                entry[f"{kind}_cpu"] = [median(list(c)) for c in zip(
                    *entry[f"{kind}_cpu"])]
    return out


def run(jobs, batches, rounds, configs, log=print):
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = {}
    for name in jobs:
        job = peer_jobs.jobs()[name]
        log(f"{name}: {peer_jobs.describe(job)}")
        common = {"job": job, "batches": batches, "rounds": rounds}
        entry = result[name] = {}
        entry["baseline_before"] = run_child(
            "inference_baseline", dict(common, cpus=cores[:1]), 1800, log=log)
        entry["pipeline"] = run_child(
            "inference_pipeline", dict(common, configs=configs), 3600,
            log=log)
        entry["baseline_after"] = run_child(
            "inference_baseline", dict(common, cpus=cores[:1]), 1800, log=log)
    return result


def table(result):
    """Rows: job, config, ms per batch and ratio to one core, per call."""
    rows = []
    for name, entry in result.items():
        base = {kind: median(entry["baseline_before"].get(kind, []) +
                             entry["baseline_after"].get(kind, []))
                for kind in ("predict", "evaluate")}
        cpu = {kind: median([(entry[w].get(f"{kind}_cpu") or [None])[0]
                             for w in ("baseline_before", "baseline_after")])
               for kind in ("predict", "evaluate")}
        rows.append([name, "1 core", fmt(base["predict"] * 1e3, 1), "1.00",
                     fmt(base["evaluate"] * 1e3, 1), "1.00",
                     _cpu_text(cpu["predict"]), _cpu_text(cpu["evaluate"]),
                     ""])
        for config, r in entry["pipeline"].items():
            if not isinstance(r, dict):
                continue
            p, e = median(r["predict"]), median(r["evaluate"])
            rows.append([name, f"{config} (M, S = {r['counts']})",
                         fmt(p * 1e3, 1), fmt(base["predict"] / p),
                         fmt(e * 1e3, 1), fmt(base["evaluate"] / e),
                         _cpu_text(*r["predict_cpu"]),
                         _cpu_text(*r["evaluate_cpu"]),
                         f"{r['max_difference']:.1e}"])
    return format_table(["job", "inference M:S", "predict ms/batch",
                         "x 1 core", "evaluate ms/batch", "x 1 core",
                         "predict CPU ms/batch", "evaluate CPU ms/batch",
                         "max |diff|"], rows)


def _cpu_text(*seconds):
    """CPU ms per batch: one process, or worker 0 / worker 1 / client."""
    return " / ".join(fmt(None if s is None else s * 1e3, 0)
                      for s in seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="mlp,transformer")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default="auto,1:1,4:1,2:4,4:4")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    result = run(args.jobs.split(","), args.batches, args.rounds,
                 args.configs.split(","))
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
