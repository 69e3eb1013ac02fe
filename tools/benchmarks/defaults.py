"""Part defaults: `from_model(model, devices=d)` alone against the best grid
configuration and against plain Keras on one core, same run.

Per job: plain Keras in one process pinned to one core, with TF's own
kernels (`TF_ENABLE_ONEDNN_OPTS=0`) and with oneDNN's (`=1`): the baseline
is the faster of the two. Then, on 2 `keras_pipe.local_workers` in the
default environment (no `TF_ENABLE_ONEDNN_OPTS`): the pipeline built from
the model and the devices alone (planned by the first `fit`, whose time is
reported), and a grid of schedules and `M` (`remat="never"`, 2 stages, or
4 in the interleaved and V layouts), all rounds interleaved. Step times
are medians of warm steps inside a `fit` epoch.

    python -m tools.benchmarks.defaults [--quick] [--jobs mlp,transformer]
"""

import argparse
import json
import os
import pathlib
import time

from tools.benchmarks import peer_jobs
from tools.benchmarks.harness import (
    _fit_steps,
    _interleave,
    _tf_env,
    build_then_warm,
    child,
    median,
    run_child,
)

# Two models the peer jobs do not hold: blocks of Dense + LayerNormalization
# trained with Adam, and a stack of wide-then-narrow Dense pairs (an FFN
# without attention) trained with Adam.
EXTRA_JOBS = {
    "ln_mlp": {"kind": "mlp", "variant": "layernorm", "layers": 6,
               "width": 1024, "batch": 256, "lr": 1e-3, "optimizer": "adam"},
    "ffn": {"kind": "mlp", "variant": "ffn", "layers": 4, "width": 512,
            "inner": 2048, "batch": 256, "lr": 1e-3, "optimizer": "adam"},
}
GRID_SCHEDULES = ("gpipe", "1f1b", "zb_h2", "interleaved_1f1b", "zbv")


def jobs(quick=False):
    """Every job by name: the peer comparison's and `EXTRA_JOBS`."""
    found = dict(peer_jobs.jobs(quick))
    for name, job in EXTRA_JOBS.items():
        found[name] = dict(job, batch=64, width=128, inner=256) if quick \
            else dict(job)
    return found


def _layers(keras, job):
    """The job's layers in order."""
    variant = job.get("variant")
    if variant == "layernorm":
        return [layer for _ in range(job["layers"]) for layer in (
            keras.layers.Dense(job["width"], activation="relu"),
            keras.layers.LayerNormalization())]
    if variant == "ffn":
        return [layer for _ in range(job["layers"]) for layer in (
            keras.layers.Dense(job["inner"], activation="relu"),
            keras.layers.Dense(job["width"]))]
    return [layer for unit in peer_jobs.keras_units(keras, job)
            for layer in unit]


def _model(keras, job):
    """The job as one Functional model (seeded)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(peer_jobs.input_shape(job))
    h = inputs
    for layer in _layers(keras, job):
        h = layer(h)
    return keras.Model(inputs, h)


def _compile(keras, model, job):
    optimizer = (keras.optimizers.Adam(job["lr"]) if job.get("optimizer")
                 == "adam" else keras.optimizers.SGD(job["lr"]))
    model.compile(optimizer, peer_jobs.keras_loss(keras, job))


@child("defaults_baseline")
def child_baseline(p):
    """The job as one Keras model in this pinned process, warm."""
    _, keras = _tf_env()
    import numpy as np
    job = p["job"]
    model = _model(keras, job)
    _compile(keras, model, job)
    x, y = peer_jobs.data(np, job, p["steps"] * job["batch"])
    warm = p["warm"] * job["batch"]
    _fit_steps(keras, model, x[:warm], y[:warm], job["batch"])
    steps = []
    for _ in range(p["rounds"]):
        steps += _fit_steps(keras, model, x, y, job["batch"])
    return {"step_seconds": median(steps), "steps": steps}


@child("defaults_pipeline")
def child_pipeline(p):
    """The default pipeline and the grid on 2 local workers."""
    _, keras = _tf_env()
    import numpy as np

    import keras_pipe
    job = p["job"]
    x, y = peer_jobs.data(np, job, p["steps"] * job["batch"])
    warm = p["warm"] * job["batch"]
    runs, errors, chosen = {}, [], {}
    with keras_pipe.local_workers(num_workers=2) as devices:
        from tools.benchmarks.peer import _worker_pids
        pids = _worker_pids() + [os.getpid()]

        def default():
            pipe = keras_pipe.PipelineModel.from_model(_model(keras, job),
                                                       devices=devices)
            _compile(keras, pipe, job)
            return pipe

        def build(schedule, m):
            order = peer_jobs.FOUR_STAGE_LAYOUTS.get(schedule, (0, 1))
            layers = _layers(keras, job)
            keras.utils.set_random_seed(0)
            cut = [round(len(layers) * j / len(order))
                   for j in range(len(order) + 1)]
            stages = [keras.Sequential(layers[a:b], name=f"stage{j}")
                      for j, (a, b) in enumerate(zip(cut, cut[1:]))]
            pipe = keras_pipe.PipelineModel(
                stages, devices=[devices[w] for w in order],
                num_micro_batches=m, schedule=schedule, remat="never")
            pipe.build((None, *peer_jobs.input_shape(job)))
            _compile(keras, pipe, job)
            return pipe

        def warm_up(pipe):
            start = time.perf_counter()
            _fit_steps(keras, pipe, x[:warm], y[:warm], job["batch"])
            if pipe.__dict__.get("plan") is not None:
                chosen.update(
                    first_fit_seconds=time.perf_counter() - start,
                    schedule=pipe.schedule, num_stages=pipe.num_stages,
                    num_micro_batches=pipe.num_micro_batches,
                    remat=list(pipe.remat), sizes=pipe.plan.sizes,
                    predicted_step_seconds=pipe.plan.step_time)
            return lambda: (_fit_steps(keras, pipe, x, y, job["batch"]),
                            p["steps"])

        builders = {"default": (default, warm_up)}
        for schedule, m in p["grid"]:
            builders[f"{schedule} M={m}"] = (
                lambda s=schedule, m=m: build(s, m), warm_up)
        for label, run in build_then_warm(builders, errors).items():
            runs[label] = {"steps": [], "cpu": [], "wait": [],
                           "cpu_per_step": [], "run": run}
        _interleave(runs, p["rounds"], pids, errors)
    # Per process (the workers, then this client): CPU seconds per step
    # and the share of the wall time spent waiting for a core.
    return {"runs": {label: {"step_seconds": median(r["steps"]),
                             "steps": r["steps"],
                             "cpu_per_step": r["cpu_per_step"],
                             "wait": r["wait"]}
                     for label, r in runs.items() if r["steps"]},
            "chosen": chosen, "errors": errors}


def run(names, quick, log=print, grid=None, steps=None):
    """Every job of `names`: both baselines, then the pipelines (the
    default and `grid`, `(schedule, M)` pairs; default: every schedule of
    `GRID_SCHEDULES` at M = 2, 4, 8)."""
    s = {"steps": steps or (4 if quick else 8), "warm": 2 if quick else 3,
         "rounds": 1 if quick else 2,
         "grid": grid or [(n, m) for n in (
             ["gpipe", "zb_h2", "zbv"] if quick else GRID_SCHEDULES)
             for m in ([2, 4] if quick else [2, 4, 8])]}
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = {"settings": s, "jobs": {}}
    for name in names:
        job = jobs(quick)[name]
        log(f"{name}: {job}")
        entry = result["jobs"][name] = {"job": job}
        common = {"job": job, "steps": s["steps"], "warm": s["warm"],
                  "rounds": s["rounds"]}
        for onednn in ("0", "1"):
            entry[f"baseline_onednn_{onednn}"] = run_child(
                "defaults_baseline", dict(common, cpus=cores[:1]), 3600,
                log=log, env={"TF_ENABLE_ONEDNN_OPTS": onednn})
        entry["pipeline"] = run_child(
            "defaults_pipeline", dict(common, grid=s["grid"]), 3600, log=log,
            env={"TF_ENABLE_ONEDNN_OPTS": None})
        log("  " + summary_line(name, entry))
    return result


def summary_line(name, entry):
    """The job's speed-ups over the faster one-core baseline."""
    base = [entry.get(f"baseline_onednn_{o}", {}).get("step_seconds")
            for o in ("0", "1")]
    runs = entry.get("pipeline", {}).get("runs", {})
    if None in base or "default" not in runs:
        return f"{name}: incomplete {entry.get('pipeline', {}).get('errors')}"
    one_core = min(base)
    best = min((r["step_seconds"], label) for label, r in runs.items()
               if label != "default")
    default = runs["default"]["step_seconds"]
    return (f"| {name} | {base[0] * 1e3:.0f} | {base[1] * 1e3:.0f} | "
            f"{one_core / default:.2f}x | {one_core / best[0]:.2f}x "
            f"({best[1]}) | {best[0] / default:.2f} | "
            f"{entry['pipeline']['chosen']} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", default="mlp,transformer,conv,ln_mlp,ffn")
    parser.add_argument("--grid", default="",
                        help="schedule:M pairs, e.g. zb_h2:4,zbv:2 "
                        "(default: every schedule at M = 2, 4, 8)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default="benchmark_out/defaults.json")
    args = parser.parse_args()
    grid = [(pair.split(":")[0], int(pair.split(":")[1]))
            for pair in args.grid.split(",") if pair.strip()]
    result = run([j.strip() for j in args.jobs.split(",") if j.strip()],
                 args.quick, grid=grid or None, steps=args.steps)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("| job | 1 core, TF kernels (ms) | 1 core, oneDNN (ms) | defaults "
          "| best of grid | defaults / best (speed-ups) | chosen |")
    print("|---|---|---|---|---|---|---|")
    for name, entry in result["jobs"].items():
        print(summary_line(name, entry))


if __name__ == "__main__":
    main()
