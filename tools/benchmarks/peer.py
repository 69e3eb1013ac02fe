"""Part peer: keras_pipe against torch.distributed.pipelining, same run.

For each job (`peer_jobs`): each system's one-core process, then each
system's pipeline on two processes pinned to one core each (keras_pipe:
`keras_pipe.local_workers`; torch: two gloo ranks), K=2 stages for
gpipe/1f1b (and keras_pipe's zero-bubble schedules), K=4 stages in the
interleaved and V layouts, for each M. The order: torch, keras_pipe, torch
again, each with its one-core reference around its pipeline runs, so that
load drifting over minutes weighs on both systems. Step times are medians
of warm steps: keras_pipe's between two steps' ends inside a `fit` epoch
(the loss read, as the step clock of every part), torch's between two
barriers of both ranks.
"""

import os
import time

from tools.benchmarks import peer_jobs
from tools.benchmarks.harness import (
    INTRA_OP_THREADS,
    _fit_steps,
    _free_port,
    _interleave,
    _tf_env,
    build_then_warm,
    child,
    median,
    run_child,
)
from tools.benchmarks.peer_torch import TORCH_SCHEDULES

KERAS_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b",
                   "zbv")


def _keras_compile(keras, model, job):
    model.compile(keras.optimizers.SGD(job["lr"]),
                  peer_jobs.keras_loss(keras, job))


def _count_keras_flops(tf, keras, model, job):
    """FLOPs of one training step's graph, counted by TF's profiler."""
    import numpy as np
    x, y = peer_jobs.data(np, job, job["batch"])
    loss_fn = keras.losses.get(peer_jobs.keras_loss(keras, job))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(x, y).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return tf.compat.v1.profiler.profile(graph, options=options).total_float_ops


@child("keras_baseline")
def child_keras_baseline(p):
    """The whole job as one Keras model in this process (pinned), warm;
    its 4 intra-op threads do not spin, as the pipeline's workers'."""
    tf, keras = _tf_env([INTRA_OP_THREADS, 2], spinning=False)
    import numpy as np
    job = p["job"]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [layer for unit in peer_jobs.keras_units(keras, job)
         for layer in unit])
    model.build((None, *peer_jobs.input_shape(job)))
    _keras_compile(keras, model, job)
    x, y = peer_jobs.data(np, job, p["steps"] * job["batch"])
    warm = p["warm"] * job["batch"]
    _fit_steps(keras, model, x[:warm], y[:warm], job["batch"])
    start, system = time.process_time(), os.times().system
    steps = _fit_steps(keras, model, x, y, job["batch"])
    cpu = (time.process_time() - start) / p["steps"]
    system = (os.times().system - system) / p["steps"]
    flops = None
    if p.get("count_flops"):
        try:
            flops = _count_keras_flops(tf, keras, model, job)
        except Exception:  # noqa: BLE001 - reported as not counted
            pass
    return {"step_seconds": median(steps), "best_step_seconds": min(steps),
            "steps": steps, "cpu_seconds_per_step": cpu,
            "system_cpu_seconds_per_step": system,
            "parameters": model.count_params(), "flops_per_step": flops}


@child("keras_pipeline")
def child_keras_pipeline(p):
    """keras_pipe on 2 local workers: every (schedule, M), rounds in turn."""
    _, keras = _tf_env()
    import numpy as np

    import keras_pipe
    job = p["job"]
    x, y = peer_jobs.data(np, job, p["steps"] * job["batch"])
    warm = p["warm"] * job["batch"]
    runs, errors = {}, []
    with keras_pipe.local_workers(num_workers=2, cores=p["cores"]) as devices:
        pids = _worker_pids() + [os.getpid()]

        def build(schedule, m):
            order = peer_jobs.FOUR_STAGE_LAYOUTS.get(schedule, (0, 1))
            keras.utils.set_random_seed(0)
            model = keras_pipe.PipelineModel(
                peer_jobs.keras_stages(keras, job, len(order)),
                devices=[devices[w] for w in order],
                num_micro_batches=m, schedule=schedule, remat="never")
            model.build((None, *peer_jobs.input_shape(job)))
            _keras_compile(keras, model, job)
            return model

        def warm_up(model):
            _fit_steps(keras, model, x[:warm], y[:warm], job["batch"])
            return lambda: (_fit_steps(keras, model, x, y, job["batch"]),
                            p["steps"])

        configs = {f"{s} M={m}": (s, m) for s, m in p["configs"]}
        warmed = build_then_warm(
            {label: (lambda c=c: build(*c), warm_up)
             for label, c in configs.items()}, errors)
        for label, run in warmed.items():
            schedule, m = configs[label]
            k = len(peer_jobs.FOUR_STAGE_LAYOUTS.get(schedule, (0, 1)))
            runs[label] = {"config": (schedule, k, m), "steps": [],
                           "cpu": [], "wait": [], "cpu_per_step": [],
                           "run": run}
        _interleave(runs, p["rounds"], pids, errors)
    out = []
    for _label, r in runs.items():
        if not r["steps"]:
            continue
        schedule, k, m = r["config"]
        per_step = [median([row[w] for row in r["cpu_per_step"]])
                    for w in range(len(pids))]
        system = [median([row[w] for row in r["system_per_step"]])
                  for w in range(len(pids))]
        out.append({"schedule": schedule, "num_stages": k,
                    "num_micro_batches": m,
                    "step_seconds": median(r["steps"]),
                    "best_step_seconds": min(r["steps"]),
                    "steps": r["steps"],
                    "worker_cpu_seconds_per_step": per_step[:-1],
                    "client_cpu_seconds_per_step": per_step[-1],
                    "worker_system_cpu_seconds_per_step": system[:-1],
                    "client_system_cpu_seconds_per_step": system[-1]})
    return {"runs": out, "errors": errors}


def _worker_pids():
    """The pids of this process's `keras_pipe.distributed.worker` children."""
    children = []
    for task in os.listdir("/proc/self/task"):
        try:  # a thread may end between the listing and the read
            with open(f"/proc/self/task/{task}/children") as f:
                children += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    pids = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"keras_pipe.distributed.worker" in f.read():
                    pids.append(pid)
        except OSError:
            continue
    return pids


def _torch_pipeline(p, cores, log):
    """Both torch ranks at once; returns rank 0's JSON (or an error)."""
    import concurrent.futures
    address = f"127.0.0.1:{_free_port()}"
    params = [dict(p, rank=r, address=address, cpus=[cores[r]])
              for r in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_child, "torch_rank", params[r],
                               p["timeout"], log=log) for r in (0, 1)]
        results = [f.result() for f in futures]
    return results[0] if "error" not in results[0] else dict(
        results[0], other=results[1])


def run_peer(s, log=print, save=None):
    """The peer part: per job, torch, keras_pipe, torch again.

    `save`, if given, is called with the result so far after each job.
    """
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        return {"error": f"the peer part needs 2 CPUs; this process may run "
                f"on {cores}"}
    result = {"jobs": {}, "cores": cores}
    for name in s["jobs"]:
        job = peer_jobs.jobs(s["quick"])[name]
        log(f"  {name}: {peer_jobs.describe(job)}")
        entry = result["jobs"][name] = {
            "job": job, "description": peer_jobs.describe(job),
            "flops_per_step_formula": peer_jobs.flops_per_step(job),
            "parameters_formula": peer_jobs.parameter_count(job),
            "load_average_at_start": os.getloadavg()}
        start = time.perf_counter()
        common = {"job": job, "steps": s["steps"], "warm": s["warm"]}
        log(f"    {s['steps']} steps, M={s['micro_batches']}")
        torch_configs = [(n, m) for n in s["torch_schedules"]
                         for m in s["micro_batches"]]
        keras_configs = [(n, m) for n in s["keras_schedules"]
                         for m in s["micro_batches"]]
        timeout = s["timeout"]
        for when in ("before", "after"):
            log(f"    torch {when}: 1 core, then 2 ranks ...")
            entry[f"torch_baseline_{when}"] = run_child(
                "torch_baseline", dict(common, cpus=cores[:1]), timeout,
                log=log)
            entry[f"torch_pipeline_{when}"] = _torch_pipeline(
                dict(common, configs=torch_configs, timeout=timeout), cores,
                log)
            if when == "after":
                break
            log("    keras_pipe: 1 core, 2 local workers, 1 core again ...")
            entry["keras_baseline_before"] = run_child(
                "keras_baseline", dict(common, cpus=cores[:1],
                                       count_flops=True), timeout, log=log)
            entry["keras_pipeline"] = run_child(
                "keras_pipeline", dict(common, configs=keras_configs,
                                       rounds=s["rounds"], cores=cores),
                timeout, log=log)
            entry["keras_baseline_after"] = run_child(
                "keras_baseline", dict(common, cpus=cores[:1]), timeout,
                log=log)
            if not s["torch_after"]:
                break
        entry["seconds"] = time.perf_counter() - start
        log(f"    {entry['seconds']:.0f} s")
        if save is not None:
            save(result)
    return result


def settings(quick, jobs=("mlp", "transformer", "conv")):
    """The peer part's parameters; `quick`: small jobs, few steps."""
    return {"quick": quick, "jobs": list(jobs),
            "micro_batches": [2, 4] if quick else [2, 4, 8],
            "keras_schedules": (["gpipe", "1f1b", "zbv"] if quick
                                else list(KERAS_SCHEDULES)),
            "torch_schedules": (["gpipe", "1f1b", "zbv"] if quick
                                else list(TORCH_SCHEDULES)),
            "steps": 4 if quick else 6, "warm": 2 if quick else 3,
            "rounds": 1 if quick else 2, "torch_after": not quick,
            "timeout": 1800}


# What fitted a shared 2-core host in the time left (`--reduced`).
REDUCED = {"micro_batches": [2, 4],
           "keras_schedules": ["gpipe", "1f1b", "interleaved_1f1b", "zbv"],
           "torch_schedules": ["gpipe", "1f1b", "interleaved_1f1b", "zbv"],
           "steps": 5, "warm": 2, "rounds": 1, "torch_after": False}
