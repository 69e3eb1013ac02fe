"""Benchmark of keras_pipe: speedup, overhead, memory, build time, schedule.

```
python tools/benchmark.py [--quick] [--out DIR] [--only a,b,c,d,e]
                          [--schedules gpipe,1f1b,zb_h1,zb_h2,...]
```

measures in one run, and prints as tables of ratios (absolute times are
context only: the machine may be shared and noisy):

  (a) training throughput vs M and schedule on 2 worker processes
      (`python -m keras_pipe.worker`), each pinned to its own core: K=2
      stages for gpipe, 1f1b, zb_h1 and zb_h2, K=4 stages (2 per worker)
      for interleaved_1f1b and zbv, against the same plain Keras model in
      1 process pinned to 1 core (its rounds interleaved with the
      pipeline's, so that host load varying over minutes weighs on both
      sides of each ratio), the ideal 2M/(M+1), and a bare TF graph
      of the same GPipe step on the same workers (one `tf.function`, data
      already on the workers, no `fit`): keras_pipe's overhead per step;
  (b) the overhead of a PipelineModel with K=1, M=1 against the same plain
      Keras model (`fit` step time, warm, interleaved);
  (c) peak memory per remat mode, schedule and M for deep models at K=4
      (`tf.config.experimental.get_memory_info`, process-wide on CPU);
  (d) time to build the training step (first call minus a warm call) vs M
      and K;
  (e) schedule fidelity: stages that sleep a fixed time (one at a time per
      stage, as one device runs one op at a time) against (M+K-1) stage
      times, for a forward pass and training steps (GPipe, GPipe with
      remat, 1F1B);
  (f) 2 replicas x 2 stages against 1 replica of a BatchNormalization +
      Dropout model on 4 worker processes (replicas no longer wait for
      each other's state);

and writes `benchmark.json` (every number), `benchmark.md` (the tables in
Markdown) and `benchmark.png` to `--out`.

Why subprocesses: logical CPU devices and thread pools are fixed when
TensorFlow starts, and a process pinned to one core must be pinned before
TensorFlow is imported, so every part runs in its own child process
(`--child NAME`); the parent only starts processes, collects JSON and
prints. The helpers at the top (ideal speedup, ratios, tables, goals) are
plain Python and imported by `tests/test_benchmark.py`.
"""

import argparse
import json
import os
import pathlib
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Schedules of part (a): K=2 stages on the 2 workers, or K=4 stages with
# these worker indices (two stages per worker, as the schedule needs).
TWO_STAGE_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2")
FOUR_STAGE_SCHEDULES = {"interleaved_1f1b": (0, 1, 0, 1), "zbv": (0, 1, 1, 0)}
SCHEDULES = TWO_STAGE_SCHEDULES + tuple(FOUR_STAGE_SCHEDULES)
# Part (c) runs K=4 stages on 4 devices: the one-stage-per-device schedules.
MEMORY_SCHEDULES = TWO_STAGE_SCHEDULES
# torch 2.13 pipelining's best speedup on the same job (ScheduleZBVZeroBubble,
# M=4), measured in issue 12; the goal is 1.2x that.
TORCH_BEST_SPEEDUP = 1.33
# Part (a)'s one-core process when its rounds interleave with the pipeline's.
BASELINE_LABEL = "1 process, 1 core"

# Goals of issues 6 and 12 (reported, never asserted).
GOALS = {
    "a": ("best speedup over schedules and M on 2 pinned workers over 1 "
          "process on 1 core", ">=", 1.6),
    "a-torch": (f"best speedup / torch pipelining's best ({TORCH_BEST_SPEEDUP}"
                "x, ZBV, issue 12)", ">=", 1.2),
    "a-overhead": ("keras_pipe GPipe step / bare TF graph GPipe step, same "
                   "M, worst M", "<=", 1.05),
    "a-cpu": ("workers' CPU s per step / 1-core process's, M=8, the best "
              "schedule at M=8", "<=", 1.15),
    "b": ("step time of PipelineModel(K=1, M=1) / plain Keras model",
          "<=", 1.05),
    "c": ('peak memory remat="always" / "never", K=4, M=8, activations '
          "dominate", "<=", 0.5),
    "c*": ('the same, weights and their gradients weigh more', "<=", 0.5),
    "d": ("build time of the training step, K=8 M=32 / K=8 M=4", "<=", 2.0),
    "e": ("step time / (M+K-1) stage times, worst configuration "
          "(|ratio - 1|)", "<=", 0.05),
}

# ---------------------------------------------------------------- helpers


def ideal_speedup(num_micro_batches, num_stages=2):
    """GPipe's bound on speedup over one device: `K M / (M + K - 1)`.

    With `M` micro-batches on `K` equal stages, a step takes `M + K - 1`
    stage-times of one micro-batch instead of `M K`.
    """
    for name, value in (("num_micro_batches", num_micro_batches),
                        ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1. Received: "
                             f"{name}={value!r}")
    m, k = num_micro_batches, num_stages
    return k * m / (m + k - 1)


def ratio(numerator, denominator):
    """`numerator / denominator`, `None` when either is missing or zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median(values):
    """The median of the numbers in `values`, `None` if there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=2, suffix=""):
    """A table cell: a rounded number, `-` for `None`, text as it is."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}{suffix}"
    return str(value)


def format_table(headers, rows):
    """A plain-text table, one column per header, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n and _numeric(c) else
                               c.ljust(w) for c, w in zip(row, widths))
                     .rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers, rows):
    """The same table in Markdown (for the README)."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(text):
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return False


def _percentages(values):
    """`"41%/38%"` from fractions; `-` when there are none."""
    return "/".join(fmt(v * 100 if v is not None else None, 0, "%")
                    for v in values or []) or "-"


def check_goal(key, measured):
    """`{"goal", "bound", "measured", "met"}` for the goal `key` of GOALS."""
    text, op, bound = GOALS[key]
    met = None
    if measured is not None:
        met = measured >= bound if op == ">=" else measured <= bound
    return {"goal": text, "bound": f"{op} {bound:g}", "measured": measured,
            "met": met}


def _num_stages(schedule):
    """K of a schedule's runs in part (a): 2 stages per worker for the
    schedules of FOUR_STAGE_SCHEDULES, else one."""
    return 4 if schedule in FOUR_STAGE_SCHEDULES else 2


def throughput_configs(p):
    """The runs of part (a) in one round, from its settings, as dicts.

    `kind` is `"one_worker"` (K=1 on worker 0), `"pipeline"` (a schedule on
    both workers), `"bare"` (the bare TF graph of the GPipe step),
    `"steps_per_execution"` (a schedule compiled with `steps_per_execution`)
    or `"no_xla_updates"` (a schedule compiled with `jit_compile=False`,
    when the others compile each worker's optimizer update with XLA).
    """
    configs = [{"kind": "one_worker", "schedule": "gpipe", "num_stages": 1,
                "num_micro_batches": m}
               for m in p["one_worker_micro_batches"]]
    for m in p["micro_batches"]:
        for name in p["schedules"]:
            configs.append({"kind": "pipeline", "schedule": name,
                            "num_stages": _num_stages(name),
                            "num_micro_batches": m})
        configs.append({"kind": "bare", "schedule": "gpipe", "num_stages": 2,
                        "num_micro_batches": m})
    for m in p["steps_per_execution_micro_batches"]:
        for name in p.get("steps_per_execution_schedules", ["gpipe"]):
            configs.append({"kind": "steps_per_execution", "schedule": name,
                            "num_stages": _num_stages(name),
                            "num_micro_batches": m,
                            "steps_per_execution": p["steps_per_execution"]})
    if p.get("xla_updates"):
        for m in p.get("no_xla_micro_batches", []):
            for name in p.get("no_xla_schedules", []):
                configs.append({"kind": "no_xla_updates", "schedule": name,
                                "num_stages": 2, "num_micro_batches": m,
                                "xla_updates": False})
    return configs


def config_label(config):
    """`"zbv K=4 M=8"`, `"bare K=2 M=4"`: one run of part (a)."""
    name = "bare" if config["kind"] == "bare" else config["schedule"]
    label = f"{name} K={config['num_stages']} M={config['num_micro_batches']}"
    if config.get("steps_per_execution"):
        label += f" steps_per_execution={config['steps_per_execution']}"
    if config.get("xla_updates") is False:
        label += " jit_compile=False"
    return label


def throughput_rows(result):
    """Rows of table (a) from the JSON of the throughput part.

    One row per (schedule, M), in the order of SCHEDULES then M; then the
    runs compiled with `steps_per_execution`, named so
    (`"zb_h2 steps_per_execution=4"`).
    """
    base = result["baseline_1core"]["step_seconds"]
    base_best = result["baseline_1core"].get("best_step_seconds")
    base_cpu = _base_cpu(result)
    worker1 = result.get("one_worker", {}).get("step_seconds")
    rows = []
    setting = result.get("steps_per_execution_setting", 4)
    runs = [(e, e.get("schedule", "gpipe")) for e in
            sorted(result["pipeline"], key=_schedule_order)] + [
        (e, f"{e.get('schedule', 'gpipe')} steps_per_execution="
            f"{e.get('steps_per_execution') or setting}") for e in
        sorted(result.get("steps_per_execution", []), key=_schedule_order)]
    for entry, name in runs:
        m, step = entry["num_micro_batches"], entry["step_seconds"]
        speedup = ratio(base, step)
        # Two devices whatever the number of stages: GPipe's bound on 2.
        ideal = ideal_speedup(m, 2)
        rows.append({
            "schedule": name, "K": entry.get("num_stages", 2),
            "M": m, "ideal": ideal, "speedup": speedup,
            "speedup_best": ratio(base_best, entry.get("best_step_seconds")),
            "speedup_vs_one_worker": ratio(worker1, step),
            "efficiency": ratio(speedup, ideal),
            "ms_per_step": step * 1e3,
            "worker_cpu": entry.get("worker_cpu_utilisation"),
            "worker_wait": entry.get("worker_cpu_wait"),
            "cpu_ratio": ratio(_sum(entry.get("worker_cpu_seconds_per_step")),
                               base_cpu),
            # The speedup two cores allow at the CPU that the workers and
            # the client (which shares their cores) spent per step.
            "cpu_bound": ratio(2 * base_cpu if base_cpu else None, _sum(
                (entry.get("worker_cpu_seconds_per_step") or [None])
                + [entry.get("client_cpu_seconds_per_step")])),
            # What the schedule allows with the CPU the workers spent:
            # (M+K-1)/M times the busier worker's CPU seconds per step.
            # Over 1: the schedule (dependencies, transfers) costs time;
            # at 1: only the CPU spent limits the speedup.
            "schedule_ratio": ratio(step, _schedule_bound(entry, m))})
    return rows


def _schedule_order(entry):
    name = entry.get("schedule", "gpipe")
    return (SCHEDULES.index(name) if name in SCHEDULES else len(SCHEDULES),
            name, entry["num_micro_batches"])


def overhead_rows(result):
    """Rows of the bare-graph table: per M, keras_pipe GPipe / bare graph."""
    base = result["baseline_1core"]["step_seconds"]
    gpipe = {e["num_micro_batches"]: e for e in result["pipeline"]
             if e.get("schedule", "gpipe") == "gpipe"
             and e.get("num_stages", 2) == 2}
    pipe = {m: e["step_seconds"] for m, e in gpipe.items()}
    spe = {e["num_micro_batches"]: e.get("step_seconds")
           for e in result.get("steps_per_execution", [])
           if e.get("schedule", "gpipe") == "gpipe"}
    rows = []
    for entry in sorted(result.get("bare", []),
                        key=lambda e: e["num_micro_batches"]):
        m, bare = entry["num_micro_batches"], entry["step_seconds"]
        rows.append({
            "M": m, "bare_ms": _ms(bare), "pipeline_ms": _ms(pipe.get(m)),
            "ratio": ratio(pipe.get(m), bare),
            # Fastest step of each: the least disturbed by other load.
            "ratio_best": ratio(gpipe.get(m, {}).get("best_step_seconds"),
                                entry.get("best_step_seconds")),
            "bare_speedup": ratio(base, bare),
            "pipeline_speedup": ratio(base, pipe.get(m)),
            "spe_ms": _ms(spe.get(m)), "spe_ratio": ratio(spe.get(m), bare),
            "bare_cpu_ratio": ratio(
                _sum(entry.get("worker_cpu_seconds_per_step")),
                _base_cpu(result))})
    return rows


def xla_rows(result):
    """Rows of the XLA-updates table: per run compiled with
    `jit_compile=False`, the same schedule and M with each worker's update
    one XLA function (the run's other rows)."""
    base = result["baseline_1core"]
    with_xla = {(e.get("schedule", "gpipe"), e["num_micro_batches"]): e
                for e in result["pipeline"] if e.get("num_stages", 2) == 2}
    rows = []
    for entry in sorted(result.get("no_xla_updates", []),
                        key=_schedule_order):
        key = (entry["schedule"], entry["num_micro_batches"])
        xla = with_xla.get(key, {})
        rows.append({
            "schedule": key[0], "M": key[1],
            "xla_ms": _ms(xla.get("step_seconds")),
            "no_xla_ms": _ms(entry["step_seconds"]),
            "ratio": ratio(entry["step_seconds"], xla.get("step_seconds")),
            "xla_speedup": ratio(base["step_seconds"],
                                 xla.get("step_seconds")),
            "no_xla_speedup": ratio(base["step_seconds"],
                                    entry["step_seconds"]),
            "xla_cpu_ratio": ratio(
                _sum(xla.get("worker_cpu_seconds_per_step")),
                base.get("cpu_seconds_per_step")),
            "no_xla_cpu_ratio": ratio(
                _sum(entry.get("worker_cpu_seconds_per_step")),
                base.get("cpu_seconds_per_step"))})
    return rows


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def throughput_goals(result, rows=None, over_bare=None):
    """Goals a, a-torch, a-overhead and a-cpu from part (a)'s JSON."""
    rows = throughput_rows(result) if rows is None else rows
    over_bare = overhead_rows(result) if over_bare is None else over_bare
    goals = {}
    best = max((r for r in rows if r["speedup"]), key=lambda r: r["speedup"],
               default=None)
    goals["a"] = check_goal("a", best and best["speedup"])
    goals["a-torch"] = check_goal(
        "a-torch", best and ratio(best["speedup"], TORCH_BEST_SPEEDUP))
    if best:
        goals["a"]["note"] = goals["a-torch"]["note"] = (
            f"{best['schedule']}, M={best['M']}")
        if best.get("cpu_bound"):
            goals["a"]["note"] += (
                f"; the CPU its workers and client spent allows "
                f"{best['cpu_bound']:.2f}x on 2 cores")
    ratios = [r for r in over_bare if r["ratio"] is not None]
    worst = max(ratios, key=lambda r: r["ratio"], default=None)
    goals["a-overhead"] = check_goal("a-overhead", worst and worst["ratio"])
    goals["a-overhead"]["note"] = ", ".join(
        f"M={r['M']}: {fmt(r['ratio'], 3)}" for r in ratios)
    # At M=8, else (a quick run) at the largest M measured, said in the note.
    ms = sorted({r["M"] for r in rows if r["cpu_ratio"] is not None})
    m = 8 if 8 in ms else (ms[-1] if ms else None)
    at_m = [r for r in rows if r["M"] == m and r["cpu_ratio"] is not None
            and r["speedup"]]
    fastest = max(at_m, key=lambda r: r["speedup"], default=None)
    goals["a-cpu"] = check_goal("a-cpu", fastest and fastest["cpu_ratio"])
    if fastest:
        goals["a-cpu"]["note"] = f"{fastest['schedule']}, M={m}" + (
            "" if m == 8 else " (no M=8 in this run)")
        parts = cpu_at_m(result, fastest["schedule"], fastest["K"], m)
        if parts["product_ratio"] is not None:
            goals["a-cpu"]["note"] += (
                f"; one layer's F and B products cost "
                f"{parts['product_ratio']:.2f}x at M={m} what they cost on "
                "the whole batch")
        if parts["products"] is not None:
            goals["a-cpu"]["note"] += (
                f", the model's run micro-batch by micro-batch through its "
                f"layers {parts['chain_ratio']:.2f}x, which adds "
                f"{parts['products']:.3f} of the one-core process's CPU")
        if parts["transfers"] is not None:
            goals["a-cpu"]["note"] += (
                f"; its {parts['transfer_count']} transfers of activations "
                "and gradients between the workers add "
                f"{parts['transfers']:.3f}")
    return goals


def _base_cpu(a):
    return (a.get("baseline_1core") or {}).get("cpu_seconds_per_step")


def cpu_at_m(a, schedule, num_stages, m):
    """What micro-batching at M costs on top of the one-core CPU, measured.

    `products`: what the model's forward and input-gradient products cost
    more at M than on the whole batch when run micro-batch by micro-batch
    through its layers (the kernel child's chain), as a share of the
    one-core process's CPU per step; `product_ratio` one layer's ratio
    alone, `chain_ratio` the chain's. `transfers`: the schedule's transfers
    between the workers per step (`transfer_count`), as the same share.
    `None` where a measurement is missing. Pure, for
    `tests/test_benchmark.py`.
    """
    base = _base_cpu(a)
    kernel = a.get("kernel") or {}
    seconds, chain = kernel.get("seconds", {}), kernel.get(
        "chain_seconds", {})
    moved = {r["M"]: r for r in transfer_rows(a)}.get(m)
    count = 2 * m * cross_hops(schedule, num_stages)
    return {"product_ratio": ratio(seconds.get(str(m)), seconds.get("1")),
            "chain_ratio": ratio(chain.get(str(m)), chain.get("1")),
            "products": None if str(m) not in chain or "1" not in chain
            else ratio(chain[str(m)] - chain["1"], base),
            "transfer_count": count,
            "transfers": None if moved is None or moved["cpu_ms"] is None
            else ratio(count * moved["cpu_ms"] / 1e3, base)}


def _schedule_bound(entry, m, k=2):
    cpu = entry.get("worker_cpu_seconds_per_step")
    if not cpu or any(c is None for c in cpu):
        return None
    return (m + k - 1) / m * max(cpu)


def _sum(values):
    """The sum of `values`, `None` if any is missing."""
    if not values or any(v is None for v in values):
        return None
    return sum(values)


def fidelity_rows(result):
    """Rows of table (e): measured time over the schedule's prediction."""
    rows = []
    for entry in result["runs"]:
        expected = entry["stage_times"] * entry["stage_seconds"]
        rows.append({**entry, "expected_seconds": expected,
                     "ratio": ratio(entry["seconds"], expected)})
    return rows


def speedup_table(result, rows=None, over_bare=None):
    """Rows of the summary of (a): speedup per schedule (rows) and M."""
    rows = throughput_rows(result) if rows is None else rows
    over_bare = overhead_rows(result) if over_bare is None else over_bare
    ms = sorted({r["M"] for r in rows} | {r["M"] for r in over_bare})
    table = []
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = {r["M"]: r for r in rows if r["schedule"] == name}
        k = next(iter(mine.values()))["K"]
        best = max((r["speedup"] for r in mine.values() if r["speedup"]),
                   default=None)
        table.append([f"keras_pipe {name}", k] + [
            fmt(mine[m]["speedup"], suffix="x") if m in mine else "-"
            for m in ms] + [fmt(best, suffix="x")])
    if over_bare:
        bare = {r["M"]: r["bare_speedup"] for r in over_bare}
        table.append(["bare TF graph, GPipe", 2] + [
            fmt(bare.get(m), suffix="x") for m in ms] + [
            fmt(max((v for v in bare.values() if v), default=None),
                suffix="x")])
    table.append(["ideal 2M/(M+1)", ""] + [fmt(ideal_speedup(m, 2))
                                           for m in ms] + [""])
    return ["run", "K"] + [f"M={m}" for m in ms] + ["best"], table


def throughput_tables(a):
    """The tables of part (a): per schedule, per run, bare graph, context."""
    rows, over_bare = throughput_rows(a), overhead_rows(a)
    tables = []
    headers, table = speedup_table(a, rows, over_bare)
    tables.append((
        f"(a) Speedup over 1 process on 1 core per schedule, 2 single-core "
        f"worker processes, {a['model']}, remat={a['remat']!r}"
        + (", compile(jit_compile=True): each worker's Adam update one XLA "
           "function" if a.get("xla_updates") else "") + " (medians of "
        "interleaved rounds; K=4: 2 stages per worker, interleaved_1f1b on "
        "workers [0, 1, 0, 1], zbv on [0, 1, 1, 0])", headers, table))
    tables.append((
        "(a) Each run: speedup = 1-core step time / pipeline step time "
        "('fastest steps': ratio of the fastest step of each, the least "
        "disturbed)",
        ["schedule", "K", "M", "ideal 2M/(M+1)", "speedup vs 1 core",
         "same, fastest steps", "vs 1 worker K=1", "speedup/ideal",
         "ms/step", "worker CPU use", "worker CPU wait",
         "worker CPU s / 1-core CPU s",
         "speedup 2 cores allow at the CPU of workers + client",
         "step / ((M+1)/M x busier worker's CPU s)"],
        [[r["schedule"], r["K"], r["M"], fmt(r["ideal"]),
          fmt(r["speedup"], suffix="x"), fmt(r["speedup_best"], suffix="x"),
          fmt(r["speedup_vs_one_worker"], suffix="x"),
          fmt(r["efficiency"]), fmt(r["ms_per_step"], 0),
          _percentages(r["worker_cpu"]), _percentages(r["worker_wait"]),
          fmt(r["cpu_ratio"], suffix="x"), fmt(r["cpu_bound"], suffix="x"),
          fmt(r["schedule_ratio"], suffix="x")]
         for r in rows]))
    if over_bare:
        spe = a.get("steps_per_execution_setting", 4)
        tables.append((
            "(a) Overhead over a bare TF graph of the same GPipe step on the "
            f"same workers ({a.get('bare_optimizer', 'Adam')}; one "
            "tf.function per step, data already on the workers, no fit), "
            f"and keras_pipe GPipe compiled with steps_per_execution={spe}",
            ["M", "bare ms/step", "keras_pipe ms/step", "keras_pipe/bare",
             "same, fastest steps", "bare speedup vs 1 core",
             "bare worker CPU s / 1-core CPU s",
             f"steps_per_execution={spe} ms/step", "same / bare"],
            [[r["M"], fmt(r["bare_ms"], 0), fmt(r["pipeline_ms"], 0),
              fmt(r["ratio"], 3, "x"), fmt(r["ratio_best"], 3, "x"),
              fmt(r["bare_speedup"], suffix="x"),
              fmt(r["bare_cpu_ratio"], suffix="x"), fmt(r["spe_ms"], 0),
              fmt(r["spe_ratio"], 3, "x")] for r in over_bare]))
    xla = xla_rows(a)
    if xla:
        tables.append((
            "(a) Each worker's Adam update as one XLA function "
            "(compile(jit_compile=True), the runs above) against the same "
            "run compiled with jit_compile=False, rounds interleaved",
            ["schedule", "M", "jit_compile=True ms/step",
             "jit_compile=False ms/step", "False / True",
             "speedup vs 1 core, True", "same, False",
             "worker CPU s / 1-core CPU s, True", "same, False"],
            [[r["schedule"], r["M"], fmt(r["xla_ms"], 0),
              fmt(r["no_xla_ms"], 0), fmt(r["ratio"], 3, "x"),
              fmt(r["xla_speedup"], suffix="x"),
              fmt(r["no_xla_speedup"], suffix="x"),
              fmt(r["xla_cpu_ratio"], suffix="x"),
              fmt(r["no_xla_cpu_ratio"], suffix="x")] for r in xla]))
    base = a["baseline_1core"]
    context = [[f"1 process, 1 core (baseline; rounds "
                f"{base.get('source', 'before and after')})", "1.00x",
                fmt(base["step_seconds"] * 1e3, 0), "1.00x"]]
    if base.get("source") == "interleaved":  # how far the host drifted
        for when in ("before", "after"):
            alone = base.get(when) or {}
            if alone.get("step_seconds"):
                context.append([
                    f"the same, {when} the pipeline runs",
                    fmt(ratio(base["step_seconds"], alone["step_seconds"]),
                        suffix="x"), fmt(alone["step_seconds"] * 1e3, 0),
                    fmt(ratio(alone.get("cpu_seconds_per_step"),
                              base.get("cpu_seconds_per_step")),
                        suffix="x")])
    for e in a.get("one_worker_runs", []):
        context.append([
            f"1 worker process, K=1, M={e['num_micro_batches']}"
            + (" (XLA update)" if a.get("xla_updates") else ""),
            fmt(ratio(base["step_seconds"], e["step_seconds"]), suffix="x"),
            fmt(e["step_seconds"] * 1e3, 0),
            fmt(ratio(_sum(e.get("worker_cpu_seconds_per_step")),
                      base.get("cpu_seconds_per_step")), suffix="x")])
    spe = a.get("steps_per_execution_setting", 4)
    for key, label in (  # plain Keras otherwise run, after the pipeline runs
            ("baseline_2cores", "1 process, 2 cores (plain Keras)"),
            ("baseline_1core_spe", "1 process, 1 core, plain Keras with "
             f"steps_per_execution={spe} (after the pipeline runs)"),
            ("baseline_1core_xla", "1 process, 1 core, plain Keras with "
             "jit_compile=True (after the pipeline runs)")):
        if key in a:
            one = a[key]
            context.append([
                label, fmt(ratio(base["step_seconds"], one["step_seconds"]),
                           suffix="x"), fmt(one["step_seconds"] * 1e3, 0),
                fmt(ratio(one.get("cpu_seconds_per_step"),
                          base.get("cpu_seconds_per_step")), suffix="x")])
    if (a.get("kernel") or {}).get("seconds"):
        tables.append((
            "(a) One core, one Dense layer's forward and input-gradient "
            "products over the batch cut into M micro-batches (what a "
            "stage's F and B cost per row at that size), and the same "
            "products of the model's layers run micro-batch by "
            "micro-batch, as stages run them",
            ["M", "rows per micro-batch", "ms per batch", "ratio to M=1",
             "same with XLA, ms", "XLA / without",
             f"{a['kernel'].get('layers')} layers in a chain, ms",
             "ratio to M=1"],
            kernel_rows(a["kernel"])))
    moved = transfer_rows(a)
    if moved:
        t = next(iter(a["transfers"].values()))
        tables.append((
            f"(a) One hop of a micro-batch between the two workers against "
            f"one on a worker ({t['hops']} element-wise ops in a chain, "
            f"median of {t['repeats']} interleaved chains; CPU of both "
            "workers); K=2 moves 2M of them per step, zbv 4M",
            ["M", "rows", "MB", "ms per hop between workers",
             "ms per hop on a worker", "transfer ms",
             "transfer CPU ms", "K=2: CPU ms per step",
             "same / 1-core CPU per step"],
            [[r["M"], r["rows"], fmt(r["megabytes"], 2),
              fmt(r["cross_ms"], 2), fmt(r["local_ms"], 2),
              fmt(r["latency_ms"], 2), fmt(r["cpu_ms"], 2),
              fmt(r["step_cpu_ms"], 1), fmt(r["share"], 3)]
             for r in moved]))
    tables.append(("(a) references (CPU: all workers, per step)",
                   ["run", "speedup vs 1 core", "ms/step",
                    "CPU s / 1-core CPU s"], context))
    if a.get("errors"):
        tables.append(("(a) runs that failed (error text in benchmark.json)",
                       ["run", "error"],
                       [[e["run"], e["error"][:200]] for e in a["errors"]]))
    return tables


def replicas_table(result):
    """Table (f): step time of R=2 replicas x K=2 stages vs R=1, same model.

    Pure, for `tests/test_benchmark.py`.
    """
    one, two = result["R1"], result["R2"]
    return ((
        "(f) Replicas with BatchNormalization + Dropout on 4 worker "
        f"processes (2 per core), {result['model']}, M={result['M']} per "
        "replica, same global batch: step time of 2 replicas x 2 stages "
        "over 1 replica x 2 stages (medians of interleaved rounds)"),
        ["run", "ms/step", "fastest ms/step", "ratio to R=1"],
        [["R=1, K=2", fmt(one["step_seconds"] * 1e3, 0),
          fmt(one["best_step_seconds"] * 1e3, 0), "1.00x"],
         ["R=2, K=2", fmt(two["step_seconds"] * 1e3, 0),
          fmt(two["best_step_seconds"] * 1e3, 0),
          fmt(ratio(two["step_seconds"], one["step_seconds"]),
              suffix="x")]])


def summarize(results):
    """Tables (text) and goal checks from the parts' JSON."""
    tables, goals = [], {}
    a = results.get("a")
    if a and "error" not in a:
        tables += throughput_tables(a)
        goals.update(throughput_goals(a))
    b = results.get("b")
    if b and "error" not in b:
        rows = [[e["model"], fmt(e["ratio"], 3, "x"),
                 fmt(e["plain_seconds"] * 1e3, 1),
                 fmt(e["pipeline_seconds"] * 1e3, 1)] for e in b["models"]]
        tables.append(("(b) Overhead of PipelineModel(K=1, M=1) over plain "
                       "Keras, warm fit steps (step-time ratio)",
                       ["model", "pipeline/plain", "plain ms", "pipeline ms"],
                       rows))
        goals["b"] = check_goal("b", b["models"][0]["ratio"])
        goals["b"]["note"] = b["models"][0]["model"]
    c = results.get("c")
    if c and "error" not in c:
        by_m = {}
        for e in c["runs"]:
            key = (e["model"], e.get("schedule", "gpipe"), e["M"])
            by_m.setdefault(key, {})[e["remat"]] = e
        rows = []
        for (model, schedule, m), runs in sorted(
                by_m.items(), key=lambda kv: (c["models"].index(kv[0][0]),
                                              _schedule_order({
                                                  "schedule": kv[0][1],
                                                  "num_micro_batches": 0}),
                                              kv[0][2])):
            never = runs.get("never", {})
            row = [model, schedule, m]
            for mode in ("always", "except_last", "never"):
                e = runs.get(mode)
                row.append(fmt(e["peak_bytes"] / 2**20, 0) if e else "-")
            for mode in ("always", "except_last"):
                e = runs.get(mode)
                row.append(fmt(ratio(e and e["peak_bytes"],
                                     never.get("peak_bytes")), suffix="x"))
            row.append(fmt(ratio(runs.get("always", {}).get("step_bytes"),
                                 never.get("step_bytes")), suffix="x"))
            gpipe = by_m.get((model, "gpipe", m), {})
            for mode in ("never", "always"):
                row.append(fmt(ratio(
                    runs.get(mode, {}).get("peak_bytes"),
                    gpipe.get(mode, {}).get("peak_bytes")), suffix="x")
                    if schedule != "gpipe" else "")
            rows.append(row)
        tables.append((
            f"(c) Peak memory of a training step at K=4 (MiB, "
            f"{c['measure']}); Adam",
            ["model", "schedule", "M", "always", "except_last", "never",
             "always/never", "except_last/never",
             "step increment always/never", "never: schedule/gpipe",
             "always: schedule/gpipe"], rows))
        for key, model in zip(("c", "c*"), c["models"]):
            m8 = by_m.get((model, "gpipe", 8), {})
            goals[key] = check_goal(key, ratio(
                m8.get("always", {}).get("peak_bytes"),
                m8.get("never", {}).get("peak_bytes")))
            goals[key]["note"] = model
    d = results.get("d")
    if d and "error" not in d:
        ms = sorted({e["M"] for e in d["runs"]})
        ks = sorted({e["K"] for e in d["runs"]})
        cell = {(e["K"], e["M"]): e["build_seconds"] for e in d["runs"]}
        cpu = {(e["K"], e["M"]): e.get("build_cpu_seconds")
               for e in d["runs"]}
        rows = []
        for k in ks:
            first = next((cell[(k, m)] for m in ms if (k, m) in cell), None)
            rows.append([k] + [
                (fmt(cell[(k, m)], 1, " s") + " (" +
                 fmt(ratio(cell[(k, m)], first), 2, "x") + ")")
                if (k, m) in cell else "-" for m in ms])
        tables.append((
            f"(d) Time to build the training step (first train_on_batch "
            f"minus a warm one, wall clock), {d['model']}; (ratio to the "
            "smallest M)", ["K \\ M"] + ms, rows))
        goals["d"] = check_goal("d", ratio(cell.get((8, 32)),
                                           cell.get((8, 4))))
        goals["d"]["note"] = "CPU-time ratio (less sensitive to load): " + \
            fmt(ratio(cpu.get((8, 32)), cpu.get((8, 4))), 3)
    e = results.get("e")
    if e and "error" not in e:
        rows = fidelity_rows(e)
        tables.append((
            "(e) Schedule fidelity: stages sleeping t s each (one op at a "
            "time per stage) vs (M+K-1) stage times",
            ["run", "K", "M", "t", "expected s", "measured s",
             "measured/expected", "bubble measured", "bubble theory"],
            [[r["run"], r["K"], r["M"], fmt(r["stage_seconds"], 3),
              fmt(r["expected_seconds"], 3), fmt(r["seconds"], 3),
              fmt(r["ratio"], 3), fmt(r.get("bubble_measured"), 3),
              fmt(r.get("bubble_theory"), 3)] for r in rows]))
        worst = max((abs(r["ratio"] - 1) for r in rows if r["ratio"]),
                    default=None)
        goals["e"] = check_goal("e", worst)
    f = results.get("f")
    if f and "error" not in f:
        tables.append(replicas_table(f))
    goal_rows = [[key, g["goal"], g["bound"], fmt(g["measured"], 3),
                  fmt(g["met"]) if g["met"] is not None else "not measured",
                  g.get("note", "")]
                 for key, g in sorted(goals.items())]
    tables.append(("Goals", ["part", "goal", "bound", "measured", "met",
                             "note"], goal_rows))
    return tables, goals


# --------------------------------------------------------- child processes
# Each child prints one JSON object as its last line of stdout.


def _tf_env(threads=None):
    """Imports TF/Keras (after pinning) and sets the thread pools."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf
    if threads:
        intra, inter = threads
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    import keras
    return tf, keras


def _mlp(keras, num_layers, width, name, last_linear=True):
    """`num_layers` Dense layers of `width` units, ReLU but the last."""
    layers = [keras.layers.Dense(
        width, activation=None if last_linear and n == num_layers - 1
        else "relu", name=f"{name}_dense{n}") for n in range(num_layers)]
    return keras.Sequential(layers, name=name)


def _split(keras, num_layers, width, num_stages, last_linear=True):
    """The same MLP cut into `num_stages` Sequential stages."""
    per = num_layers // num_stages
    stages = []
    for j in range(num_stages):
        layers = [keras.layers.Dense(
            width, activation=None if last_linear and j * per + n ==
            num_layers - 1 else "relu") for n in range(per)]
        stages.append(keras.Sequential(layers, name=f"stage{j}"))
    return stages


class _StepClock:
    """Per-step wall times of `fit`, each taken after the step finished."""

    def __init__(self, keras):
        import numpy as np
        times = self.times = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                # Reading the loss waits for the step to end.
                np.asarray((logs or {}).get("loss", 0.0))
                times.append(time.perf_counter())

        self.callback = Clock()

    def steps(self):
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _fit_steps(keras, model, x, y, batch_size):
    """Durations of the steps of one `fit` epoch (the first step excluded)."""
    clock = _StepClock(keras)
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False,
              callbacks=[clock.callback])
    return clock.steps()


def _cpu_seconds(pid):
    """User + system CPU seconds of a process, from /proc."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(
            ")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_delay_seconds(pid):
    """Seconds the threads of a process were runnable but not running.

    Summed over its threads from /proc/PID/task/*/schedstat (the second
    field): the time spent waiting for a CPU, taken by other processes or
    by the process's own threads.
    """
    total = 0.0
    try:
        tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def _throughput_data(np, steps, batch, width):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    y = rng.normal(size=(steps * batch, width)).astype("float32")
    return x, y


def _baseline_round(p):
    """The plain Keras model of part (a), warm: returns one round's runner.

    Each call of the runner is one `fit` epoch of `p["steps"]` steps and
    returns `(step seconds, CPU seconds per step)`; with
    `p["steps_per_execution"]`, each execution's seconds over its steps.
    """
    tf, keras = _tf_env(p.get("threads"))
    import numpy as np
    keras.utils.set_random_seed(0)
    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    model = _mlp(keras, p["layers"], p["width"], "plain")
    spe = p.get("steps_per_execution", 1)
    model.compile(keras.optimizers.Adam(1e-4), "mse",
                  jit_compile=p.get("jit_compile", False),
                  steps_per_execution=spe)
    warm = max(3, 2 * spe) * p["batch"]
    _fit_steps(keras, model, x[:warm], y[:warm], p["batch"])

    def run():
        start = time.process_time()
        steps = _fit_steps(keras, model, x, y, p["batch"])
        return ([t / spe for t in steps],
                (time.process_time() - start) / p["steps"])
    return run


def child_baseline(p):
    """Plain Keras model in this process (pinned by the parent): step time."""
    run = _baseline_round(p)
    steps, cpu = [], []
    for _ in range(p["rounds"]):
        times, seconds = run()
        steps += times
        cpu.append(seconds)
    return {"step_seconds": median(steps), "best_step_seconds": min(steps),
            "cpu_seconds_per_step": median(cpu), "steps": steps,
            "affinity": sorted(os.sched_getaffinity(0))}


def child_baseline_server(p):
    """`child_baseline` one round per line read from stdin, until EOF.

    The throughput child drives it (`_PinnedBaseline`) so that the 1-core
    rounds interleave with the pipeline's: host load that comes and goes
    over minutes then weighs on both sides of every ratio alike. Prints
    `READY` once warm, then `ROUND {json}` per round.
    """
    run = _baseline_round(p)
    print("READY", flush=True)
    for _ in sys.stdin:
        times, seconds = run()
        print("ROUND " + json.dumps({"steps": times,
                                     "cpu_seconds_per_step": seconds}),
              flush=True)
    return {}  # every round went out with its ROUND line


class _PinnedBaseline:
    """A `baseline_server` child pinned to `p["cpus"]`: `round()` per call."""

    def __init__(self, p):
        import tempfile
        env = _env()
        for name in ("LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):  # no server
            env.pop(name, None)
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "baseline_server",
             "--params", json.dumps(p)], env=env, cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr)
        self._read("READY")

    def _read(self, prefix):
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait(timeout=60)
        self.stderr.seek(0)
        raise RuntimeError(
            f"baseline_server exited {self.proc.returncode}: "
            f"{self.stderr.read().strip().splitlines()[-1:]}")

    def round(self):
        """One round: `{"steps": [seconds], "cpu_seconds_per_step": s}`."""
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return json.loads(self._read("ROUND "))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


class _BarePipeline:
    """A bare TF graph of the GPipe training step of `_split`'s K=2 model.

    The same 8 x Dense weights as `tf.Variable`s, half on each worker; x
    already on worker 0 and y on worker 1; one `tf.function` per step:
    forward per micro-batch and stage under the stage's device, the mse on
    the last stage, backward per stage under its device with its own
    `tf.GradientTape` (one tape over the step would put every gradient op
    on one device), gradients summed over micro-batches on each variable's
    device, and `keras.optimizers.Adam` colocated by keras_pipe (each
    worker's update one XLA function with `xla_updates`, as keras_pipe's
    runs then do).
    """

    def __init__(self, tf, keras, devices, p, x, y, xla_updates=False):
        import numpy as np

        from keras_pipe import placement
        self.tf, self.devices = tf, devices
        rng = np.random.default_rng(0)
        width, per = p["width"], p["layers"] // 2
        limit = (6 / (2 * width)) ** 0.5  # glorot_uniform, as Dense
        self.stages = [[], []]
        for n in range(p["layers"]):
            with tf.device(devices[n // per]):
                self.stages[n // per].append((
                    tf.Variable(rng.uniform(-limit, limit, (width, width))
                                .astype("float32"), name=f"kernel{n}"),
                    tf.Variable(np.zeros(width, "float32"), name=f"bias{n}")))
        self.variables = [v for stage in self.stages for layer in stage
                          for v in layer]
        self.optimizer = placement.colocate_optimizer(
            keras.optimizers.Adam(1e-4), xla_updates=xla_updates)
        self.optimizer.build(self.variables)
        batch = p["batch"]
        with tf.device(devices[0]):
            self.x = tf.identity(tf.constant(x[:batch]))
        with tf.device(devices[1]):
            self.y = tf.identity(tf.constant(y[:batch]))
        self.step_functions = {}

    def slot_devices(self):
        """Devices of the optimizer's variables (slots, iterations)."""
        return sorted({v.value.device for v in self.optimizer.variables})

    def _step(self, x, y, num_micro_batches):
        tf, devices, m = self.tf, self.devices, num_micro_batches
        with tf.device(devices[0]):
            xs = tf.split(x, m)
        with tf.device(devices[1]):
            ys = tf.split(y, m)
        last = len(self.stages) - 1
        tapes, inputs, outputs, losses = {}, {}, {}, []
        for i in range(m):  # forward, micro-batch by micro-batch
            h = xs[i]
            for j, stage in enumerate(self.stages):
                with tf.device(devices[j]):
                    h = tf.identity(h)  # the transfer, on the receiver
                    with tf.GradientTape() as tape:
                        tape.watch(h)
                        inputs[i, j] = h
                        for n, (kernel, bias) in enumerate(stage):
                            h = tf.matmul(h, kernel) + bias
                            if j < last or n < len(stage) - 1:
                                h = tf.nn.relu(h)
                        if j == last:  # the full batch's mse, in M parts
                            h = tf.reduce_mean(tf.square(h - ys[i])) / m
                            losses.append(h)
                    tapes[i, j], outputs[i, j] = tape, h
        parts = {v.ref(): [] for v in self.variables}
        for i in reversed(range(m)):  # backward, as GPipe: last first
            upstream = None
            for j in reversed(range(len(self.stages))):
                with tf.device(devices[j]):
                    own = [v for layer in self.stages[j] for v in layer]
                    # No input gradient for the first stage: x is data.
                    sources = own + ([inputs[i, j]] if j else [])
                    grads = tapes[i, j].gradient(
                        outputs[i, j], sources, output_gradients=upstream)
                upstream = grads[-1] if j else None
                for v, g in zip(own, grads):
                    parts[v.ref()].append(g)
        sums = []
        for v in self.variables:
            with tf.device(v.device):
                sums.append(tf.add_n(parts[v.ref()]))
        self.optimizer.apply_gradients(zip(sums, self.variables))
        with tf.device(devices[-1]):
            return tf.add_n(losses)

    def steps(self, num_micro_batches, num_steps):
        """Seconds of each of `num_steps` steps (traced once per M)."""
        tf = self.tf
        if num_micro_batches not in self.step_functions:
            self.step_functions[num_micro_batches] = tf.function(
                lambda x, y: self._step(x, y, num_micro_batches))
        step = self.step_functions[num_micro_batches]
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            step(self.x, self.y).numpy()  # waits for the step to end
            times.append(time.perf_counter() - start)
        return times


def _per(before, after, amount):
    """Per process, `(after - before) / amount`; `None` where a reading is
    missing (a process that ended)."""
    return [None if a is None or b is None else (b - a) / amount
            for a, b in zip(before, after)]


def _interleave(runs, rounds, pids, errors):
    """Each run of `runs` once per round, in turn: noise hits them alike.

    Adds to each run its step times and, per process of `pids`, its CPU
    use and wait (fractions of the wall time) and CPU seconds per step. A
    run that raises is reported in `errors` and dropped.
    """
    for _ in range(rounds):
        for label, r in list(runs.items()):
            cpu0 = [_cpu_seconds(pid) for pid in pids]
            wait0 = [_run_delay_seconds(pid) for pid in pids]
            start = time.perf_counter()
            try:
                steps, count = r["run"]()
            except Exception as exc:  # noqa: BLE001 - reported, others go on
                errors.append({"run": label, "error": f"{type(exc).__name__}"
                               f": {exc}"})
                del runs[label]
                continue
            wall = time.perf_counter() - start
            cpu1 = [_cpu_seconds(pid) for pid in pids]
            r["steps"] += steps
            r["cpu"].append(_per(cpu0, cpu1, wall))
            r["cpu_per_step"].append(_per(cpu0, cpu1, count))
            r["wait"].append(_per(
                wait0, [_run_delay_seconds(pid) for pid in pids], wall))


def _transfer_costs(tf, remote, pids, batch, micro_batches, width, hops,
                    repeats):
    """What one hop of a micro-batch between the two workers costs.

    Per M, at `batch / M` rows: a chain of `hops` element-wise ops on
    `rows x width` floats, alternating between the workers (each op reads
    the previous one's output: one transfer per hop) against the same chain
    on one worker. Chains interleaved over `repeats`, so that host noise
    hits both alike. Per hop: the median seconds of each, and the CPU
    seconds the two workers (`pids[:2]`) spent, summed over all repeats of
    each chain.
    """
    costs = {}
    for m in micro_batches:
        rows, chains = batch // m, {}
        for kind, cross in (("cross", True), ("local", False)):
            def chain(rows=rows, cross=cross):
                with tf.device(remote[0]):
                    h = tf.random.normal([rows, width])
                last = 0
                for hop in range(hops):
                    last = (hop + 1) % 2 if cross else 0
                    with tf.device(remote[last]):
                        h = h * 1.0001
                with tf.device(remote[last]):  # only a scalar leaves
                    return tf.reduce_sum(h)
            run = tf.function(chain)
            run().numpy()  # traced and warm
            chains[kind] = (run, [], [])
        for _ in range(repeats):
            for run, times, cpu in chains.values():
                cpu0 = [_cpu_seconds(pid) for pid in pids[:2]]
                start = time.perf_counter()
                run().numpy()
                times.append(time.perf_counter() - start)
                cpu.append(_sum(_per(
                    cpu0, [_cpu_seconds(pid) for pid in pids[:2]], 1)))
        entry = {"M": m, "rows": rows, "width": width, "hops": hops,
                 "repeats": repeats}
        for kind, (_, times, cpu) in chains.items():
            entry[f"{kind}_seconds"] = median(times) / hops
            entry[f"{kind}_cpu_seconds"] = (
                None if None in cpu else sum(cpu) / (repeats * hops))
        costs[str(m)] = entry
    return costs


def child_throughput(p):
    """Client of 2 workers: every schedule for each M, the bare graph, K=1.

    K=1 on one worker with M=1 isolates the cost of remote execution, and
    with M>1 the cost of micro-batching without any transfer between stages.
    Runs that fail (to build or to step) are reported, and the others go on.
    """
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.connect({"worker": p["cluster"]}, timeout=60.0)
    remote = [names[0] for _, names in sorted(devices.items())]
    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    warm = (x[:3 * p["batch"]], y[:3 * p["batch"]])
    runs, errors, bare = {}, [], None
    baseline, baseline_cpu = None, []
    if p.get("baseline"):  # one of the runs of each round
        try:
            baseline = _PinnedBaseline(p["baseline"])
        except (OSError, RuntimeError) as exc:  # the parent's rounds remain
            errors.append({"run": BASELINE_LABEL, "error": str(exc)})
    if baseline is not None:
        def run_baseline():
            r = baseline.round()
            baseline_cpu.append(r["cpu_seconds_per_step"])
            return r["steps"], p["baseline"]["steps"]
        runs[BASELINE_LABEL] = {"run": run_baseline, "steps": [], "cpu": [],
                                "wait": [], "cpu_per_step": []}
    for config in throughput_configs(p):
        label = config_label(config)
        k, m = config["num_stages"], config["num_micro_batches"]
        start = time.perf_counter()
        try:
            if config["kind"] == "bare":
                if bare is None:
                    bare = _BarePipeline(tf, keras, remote, p, x, y,
                                         p.get("xla_updates", False))
                bare.steps(m, 3)  # trace and warm up
                run = (lambda m=m: (bare.steps(m, p["steps"]), p["steps"]))  # noqa: B023,E731
            else:
                keras.utils.set_random_seed(0)
                if k == 1:
                    stages = [_mlp(keras, p["layers"], p["width"], "whole")]
                else:
                    stages = _split(keras, p["layers"], p["width"], k)
                order = FOUR_STAGE_SCHEDULES.get(config["schedule"], (0, 1))
                model = keras_pipe.PipelineModel(
                    stages, devices=[remote[w] for w in order[:k]],
                    num_micro_batches=m, remat=p["remat"],
                    schedule=config["schedule"])
                model.build((None, p["width"]))
                spe = config.get("steps_per_execution", 1)
                model.compile(keras.optimizers.Adam(1e-4), "mse",
                              steps_per_execution=spe,
                              jit_compile=config.get(
                                  "xla_updates", p.get("xla_updates", False)))
                _fit_steps(keras, model, *(
                    warm if spe == 1 else (x[:2 * spe * p["batch"]],
                                           y[:2 * spe * p["batch"]])),
                    p["batch"])
                # With steps_per_execution, the clock ticks once per
                # execution of `spe` steps.
                n = p["steps"] // spe * spe
                rows = n * p["batch"]
                run = (lambda model=model, spe=spe, n=n, rows=rows: ([  # noqa: E731
                    t / spe for t in _fit_steps(keras, model, x[:rows],
                                                y[:rows], p["batch"])], n))
        except Exception as exc:  # noqa: BLE001 - reported, others go on
            errors.append({"run": label, "error": f"{type(exc).__name__}: "
                           f"{exc}"})
            continue
        runs[label] = {"config": config, "run": run, "steps": [],
                       "cpu": [], "wait": [], "cpu_per_step": [],
                       "first_fit_seconds": time.perf_counter() - start}
    pids = p["worker_pids"] + [os.getpid()]  # the workers, then the client
    try:
        _interleave(runs, p["rounds"], pids, errors)
    finally:
        if baseline is not None:
            baseline.close()
    transfers = {}
    try:
        transfers = _transfer_costs(
            tf, remote, pids, p["batch"], sorted({8, *p["micro_batches"]}),
            p["width"], p["transfer_hops"], p["transfer_repeats"])
    except Exception as exc:  # noqa: BLE001 - reported, the runs stand
        errors.append({"run": "transfers", "error": f"{type(exc).__name__}"
                       f": {exc}"})
    xla = p.get("xla_updates", False)
    result = {"pipeline": [], "one_worker_runs": [], "bare": [],
              "steps_per_execution": [], "no_xla_updates": [],
              "errors": errors, "devices": remote, "xla_updates": xla,
              "bare_optimizer": "keras.optimizers.Adam, colocated by "
              "keras_pipe.placement.colocate_optimizer" + (
                  ", each worker's update one XLA function" if xla else ""),
              "steps_per_execution_setting": p["steps_per_execution"],
              "transfers": transfers}
    if bare is not None:
        result["bare_optimizer_devices"] = bare.slot_devices()
    kinds = {"pipeline": "pipeline", "one_worker": "one_worker_runs",
             "bare": "bare", "steps_per_execution": "steps_per_execution",
             "no_xla_updates": "no_xla_updates"}
    baseline_run = runs.pop(BASELINE_LABEL, None)
    if baseline_run and baseline_run["steps"]:
        result["baseline_interleaved"] = {
            "step_seconds": median(baseline_run["steps"]),
            "best_step_seconds": min(baseline_run["steps"]),
            "cpu_seconds_per_step": median(baseline_cpu),
            "steps": baseline_run["steps"]}
    for label, r in runs.items():
        if not r["steps"]:
            continue

        def per_process(key, r=r):
            return [median([row[w] for row in r[key]])
                    for w in range(len(pids))]

        use, delay = per_process("cpu"), per_process("wait")
        per_step = per_process("cpu_per_step")
        config = r["config"]
        entry = {"run": label, "schedule": config["schedule"],
                 "num_stages": config["num_stages"],
                 "steps_per_execution": config.get("steps_per_execution", 1),
                 "num_micro_batches": config["num_micro_batches"],
                 "step_seconds": median(r["steps"]),
                 "best_step_seconds": min(r["steps"]),
                 "steps": r["steps"], "first_fit_seconds":
                 r["first_fit_seconds"],
                 "worker_cpu_utilisation": use[:-1],
                 "worker_cpu_wait": delay[:-1],
                 "worker_cpu_seconds_per_step": per_step[:-1],
                 "client_cpu_seconds_per_step": per_step[-1],
                 "client_cpu_utilisation": use[-1],
                 "client_cpu_wait": delay[-1]}
        result[kinds[config["kind"]]].append(entry)
        if config["kind"] == "one_worker" and entry["num_micro_batches"] == 1:
            result["one_worker"] = entry
    return result


def child_overhead(p):
    """PipelineModel(K=1, M=1) vs the same plain Keras model, interleaved."""
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    out = []
    for spec in p["models"]:
        width, layers, batch = spec["width"], spec["layers"], spec["batch"]
        x, y = _throughput_data(np, p["steps"], batch, width)
        keras.utils.set_random_seed(0)
        plain = _mlp(keras, layers, width, "plain")
        plain.build((None, width))
        twin = _mlp(keras, layers, width, "twin")
        twin.build((None, width))
        twin.set_weights(plain.get_weights())
        pipe = keras_pipe.PipelineModel([twin], devices=["/device:CPU:0"],
                                         num_micro_batches=1)
        plain.compile(keras.optimizers.Adam(1e-4), "mse", jit_compile=False)
        pipe.compile(keras.optimizers.Adam(1e-4), "mse")
        for model in (plain, pipe):
            _fit_steps(keras, model, x[:3 * batch], y[:3 * batch], batch)
        times = {"plain": [], "pipeline": []}
        for _ in range(p["rounds"]):
            for name, model in (("plain", plain), ("pipeline", pipe)):
                times[name] += _fit_steps(keras, model, x, y, batch)
        plain_s, pipe_s = median(times["plain"]), median(times["pipeline"])
        out.append({"model": f"{layers} x Dense({width}), batch {batch}",
                    "plain_seconds": plain_s, "pipeline_seconds": pipe_s,
                    "ratio": ratio(pipe_s, plain_s), "steps": times})
    return {"models": out}


def child_memory(p):
    """Peak memory of one training step for one (remat, M), K=4."""
    import resource
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(p["batch"], p["width"])).astype("float32")
    y = rng.normal(size=(p["batch"], p["width"])).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras_pipe.PipelineModel(
        _split(keras, p["layers"], p["width"], 4), devices=devices,
        num_micro_batches=p["M"], remat=p["remat"],
        schedule=p.get("schedule", "gpipe"))
    model.build((None, p["width"]))
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.train_on_batch(x, y)  # trace and warm up
    info = tf.config.experimental.get_memory_info
    # Process-wide: every logical CPU device reports the same allocator.
    tf.config.experimental.reset_memory_stats("CPU:0")
    resting = info("CPU:0")["current"]
    model.train_on_batch(x, y)
    peak = info("CPU:0")["peak"]
    same = info("CPU:3")["peak"] == peak
    return {"M": p["M"], "remat": p["remat"],
            "schedule": p.get("schedule", "gpipe"), "peak_bytes": peak,
            "resting_bytes": resting, "step_bytes": peak - resting,
            "all_devices_report_same_peak": same,
            "maxrss_bytes": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024}


def child_build(p):
    """Build time of the training step for each (K, M) in one process."""
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(max(k for k, _ in p["grid"]))

    def build_seconds(k, m):
        keras.utils.set_random_seed(0)
        stages = [keras.Sequential([
            keras.layers.Dense(p["width"], activation="relu"),
            keras.layers.Dense(p["width"])]) for _ in range(k)]
        model = keras_pipe.PipelineModel(stages, devices=devices[:k],
                                          num_micro_batches=m,
                                          remat="except_last")
        model.build((None, p["width"]))
        model.compile("adam", "mse")
        x = np.ones((2 * m, p["width"]), "float32")
        calls, cpu = [], []
        for _ in range(3):
            start, start_cpu = time.perf_counter(), time.process_time()
            model.train_on_batch(x, x)
            calls.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return {"K": k, "M": m, "build_seconds": calls[0] - min(calls[1:]),
                "build_cpu_seconds": cpu[0] - min(cpu[1:]), "calls": calls,
                "cpu": cpu}

    build_seconds(2, 2)  # one-time costs of the first traced function
    return {"runs": [build_seconds(k, m) for k, m in p["grid"]]}


def child_fidelity(p):
    """Stages that sleep `t` s per op vs the schedule's (M+K-1) ticks."""
    import threading
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(
        max(k for k, _ in p["grid"]), inter_op_threads=p["inter_op_threads"])
    t = p["stage_seconds"]
    log = []
    locks = {}

    def sleeper(stage, phase):
        lock = locks.setdefault(stage, threading.Lock())

        def wait(value):
            # One op at a time per stage, as on a real device.
            with lock:
                start = time.perf_counter()
                time.sleep(t)
                log.append((stage, phase, start, time.perf_counter()))
            return value
        return wait

    class Sleep(keras.layers.Layer):
        """Identity that takes `t` s forward and `t` s backward."""

        def __init__(self, stage, **kwargs):
            super().__init__(**kwargs)
            self.stage = stage

        def build(self, shape):
            self.scale = self.add_weight(shape=(), initializer="ones")

        def call(self, inputs):
            forward = sleeper(self.stage, "forward")
            backward = sleeper(self.stage, "backward")

            @tf.custom_gradient
            def op(x):
                y = tf.numpy_function(forward, [x], tf.float32,
                                      stateful=False)
                y = tf.ensure_shape(y, x.shape)

                def grad(dy):
                    # Reads the forward output, as a real layer's backward
                    # reads saved activations: under remat the recompute is
                    # needed, and not pruned.
                    dx = tf.numpy_function(backward, [dy + 0.0 * y],
                                           tf.float32, stateful=False)
                    return tf.ensure_shape(dx, dy.shape)
                return y, grad

            # Scaled first: the weight's gradient then needs the op's
            # backward on every stage, the first one included.
            return op(inputs * self.scale)

    def bubble(elapsed, k):
        busy = sum(e - s for _, _, s, e in log)
        return 1 - busy / (k * elapsed)

    runs = []
    for k, m in p["grid"]:
        for run in p["runs"]:
            remat = "always" if run == "train_remat" else "never"
            model = keras_pipe.PipelineModel(
                [Sleep(j) for j in range(k)], devices=devices[:k],
                num_micro_batches=m, remat=remat,
                schedule="1f1b" if run == "train_1f1b" else "gpipe")
            model.build((None, 3))
            x = np.ones((2 * m, 3), "float32")
            if run == "forward":
                # Called in this iteration only.
                step = tf.function(lambda v: model(v))  # noqa: B023
                call = lambda: step(x).numpy()  # noqa: B023,E731
                ticks = m + k - 1
            else:
                model.compile(keras.optimizers.SGD(0.0), "mse")
                call = lambda: model.train_on_batch(x, x)  # noqa: B023,E731
                # Forward, then backward (with its recompute first under
                # remat="always"): each (M+K-1) ticks of t. 1F1B has the
                # same bubble as GPipe, in other places.
                ticks = (3 if run == "train_remat" else 2) * (m + k - 1)
            call()
            best = None
            for _ in range(p["repeats"]):
                log.clear()
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                if best is None or elapsed < best[0]:
                    best = (elapsed, bubble(elapsed, k), len(log))
            runs.append({"run": run, "K": k, "M": m, "stage_seconds": t,
                         "stage_times": ticks, "seconds": best[0],
                         "bubble_measured": best[1],
                         "bubble_theory": (k - 1) / (m + k - 1),
                         "ops_logged": best[2],
                         "ops_expected": ticks // (m + k - 1) * m * k})
    return {"runs": runs}


def child_replicas(p):
    """Client of 4 workers: R=1 vs R=2 replicas of a 2-stage BN+Dropout MLP."""
    tf, keras = _tf_env()
    del tf
    import numpy as np

    import keras_pipe
    devices = keras_pipe.connect({"worker": p["cluster"]}, timeout=60.0)
    remote = [names[0] for _, names in sorted(devices.items())]

    def stages():
        per = p["layers"] // 2
        return [keras.Sequential(
            [layer for _ in range(per) for layer in (
                keras.layers.Dense(p["width"], activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.1))], name=f"stage{j}")
            for j in range(2)]

    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    models = {}
    for r in (1, 2):
        keras.utils.set_random_seed(0)
        model = keras_pipe.PipelineModel(stages(), devices=remote[:2],
                                         num_micro_batches=p["M"])
        model.build((None, p["width"]))
        if r == 2:
            model.replicate(remote[:4])
        model.compile(keras.optimizers.Adam(1e-4), "mse")
        _fit_steps(keras, model, x[:3 * p["batch"]], y[:3 * p["batch"]],
                   p["batch"])
        models[r] = model
    steps = {r: [] for r in models}
    for _ in range(p["rounds"]):
        for r, model in models.items():
            steps[r] += _fit_steps(keras, model, x, y, p["batch"])
    return {f"R{r}": {"step_seconds": median(steps[r]),
                      "best_step_seconds": min(steps[r]), "steps": steps[r]}
            for r in models}


def child_probe(p):
    """One-core matmul time on each core: how busy the host is.

    The machine is shared: when the host is busy, every ratio against the
    one-core process moves. A 512 x 1024 x 1024 float32 matmul, one thread,
    median of `p["repeats"]` per core (about 7.5-7.9 ms here when quiet).
    """
    tf, _ = _tf_env([1, 1])
    w = tf.random.normal([1024, 1024])
    x = tf.random.normal([512, 1024])
    product = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, w)))
    product(x)
    result = {}
    for core in sorted(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {core})
        times = []
        for _ in range(p["repeats"]):
            start = time.perf_counter()
            product(x).numpy()
            times.append(time.perf_counter() - start)
        result[str(core)] = median(times)
    return {"matmul_seconds": result}


def child_kernel(p):
    """One-core cost of the model's products at each micro-batch size.

    A micro-batch of `batch / M` rows runs each stage's forward (matmul,
    bias, ReLU) and input-gradient (`dY W^T`) products on fewer rows; on
    this CPU oneDNN's sgemm costs more per row below 128 rows. Here, one
    thread, median seconds per M (repetitions interleaved over M, so that
    host noise hits every M alike):

    * `seconds`: the whole batch through both products of one
      `width x width` layer, cut into M parts;
    * `xla_seconds`: the same compiled by XLA (`jit_compile=True`, which a
      stage on one device could use: issue 12 names it as an avenue);
    * `chain_seconds` (with `layers`): the products of the model's
      `layers` layers as a stage runs them, micro-batch by micro-batch:
      each part's forward through every layer, then its input gradients
      back through every layer but the first (whose input is data). Each
      part streams every layer's weights through the caches again, which
      one layer alone does not show.
    """
    tf, _ = _tf_env(p.get("threads"))
    batch, width = p["batch"], p["width"]
    depth = p.get("layers") or 1
    kernels = [tf.random.normal([width, width]) * width ** -0.5
               for _ in range(depth)]
    biases = [tf.random.normal([width]) for _ in range(depth)]
    x = tf.random.normal([batch, width])

    def products(parts):
        total = tf.constant(0.0)
        for part in parts:
            forward = tf.nn.relu(tf.matmul(part, kernels[0]) + biases[0])
            grad = tf.matmul(part, kernels[0], transpose_b=True)
            total += tf.reduce_sum(forward) + tf.reduce_sum(grad)
        return total

    def chain(parts):
        total = tf.constant(0.0)
        for part in parts:
            h, masks = part, []
            for kernel, bias in zip(kernels, biases):
                h = tf.nn.relu(tf.matmul(h, kernel) + bias)
                masks.append(h > 0)
            grad = h
            for n in reversed(range(depth)):
                grad = tf.where(masks[n], grad, 0.0)
                if n:
                    grad = tf.matmul(grad, kernels[n], transpose_b=True)
            total += tf.reduce_sum(grad)
        return total

    kinds = {"seconds": (products, False), "xla_seconds": (products, True)}
    if p.get("layers"):
        kinds["chain_seconds"] = (chain, False)
    runs = {}
    for m in sorted({1, *p["micro_batches"]}):
        if batch % m:
            continue
        parts = tf.split(x, m)
        for key, (function, xla) in kinds.items():
            run = tf.function(function, jit_compile=xla)
            run(parts)  # traced and warm
            runs[m, key] = (run, parts, [])
    for _ in range(p["repeats"]):
        for run, parts, times in runs.values():
            start = time.perf_counter()
            run(parts).numpy()
            times.append(time.perf_counter() - start)
    result = {"batch": batch, "width": width, "layers": p.get("layers")}
    for key in kinds:
        result[key] = {str(m): median(times)
                       for (m, kind), (_, _, times) in runs.items()
                       if kind == key}
    return result


def kernel_rows(kernel):
    """Rows of the kernel table: M, rows per micro-batch, ms, ratio to M=1,
    the XLA-compiled ms and its ratio to the same without XLA, then the
    model's chain of layers (ms, ratio to M=1; `-` without it).

    Pure, for `tests/test_benchmark.py`.
    """
    seconds = {int(m): s for m, s in kernel["seconds"].items()}
    xla = kernel.get("xla_seconds", {})
    chain = kernel.get("chain_seconds", {})
    whole = seconds.get(1)
    return [[m, kernel["batch"] // m, fmt(s * 1e3, 1),
             fmt(ratio(s, whole), 2, "x"),
             fmt(xla[str(m)] * 1e3 if str(m) in xla else None, 1),
             fmt(ratio(xla.get(str(m)), s), 2, "x"),
             fmt(chain[str(m)] * 1e3 if str(m) in chain else None, 1),
             fmt(ratio(chain.get(str(m)), chain.get("1")), 2, "x")]
            for m, s in sorted(seconds.items())]


def cross_hops(schedule, num_stages):
    """Stage boundaries between the two workers one micro-batch crosses in
    one direction: 1 for K=2, 2 for zbv's V, 3 for interleaved_1f1b."""
    order = FOUR_STAGE_SCHEDULES.get(schedule, (0, 1))[:num_stages]
    return sum(a != b for a, b in zip(order, order[1:]))


def transfer_rows(a):
    """Rows of the transfer table, one per M: a hop between the workers
    against a hop on one worker (ms), what the transfer adds (ms, and CPU
    ms of both workers), and the CPU of K=2's 2M hops per step, also as a
    share of the one-core process's CPU per step.

    Pure, for `tests/test_benchmark.py`.
    """
    def less(x, y):
        return None if x is None or y is None else x - y

    base_cpu = _base_cpu(a)
    rows = []
    for t in sorted((a.get("transfers") or {}).values(),
                    key=lambda t: t["M"]):
        cpu = less(t["cross_cpu_seconds"], t["local_cpu_seconds"])
        step_cpu = None if cpu is None else 2 * t["M"] * cpu
        rows.append({
            "M": t["M"], "rows": t["rows"],
            "megabytes": t["rows"] * t["width"] * 4 / 2**20,
            "cross_ms": t["cross_seconds"] * 1e3,
            "local_ms": t["local_seconds"] * 1e3,
            "latency_ms": less(t["cross_seconds"], t["local_seconds"]) * 1e3,
            "cpu_ms": None if cpu is None else cpu * 1e3,
            "step_cpu_ms": None if step_cpu is None else step_cpu * 1e3,
            "share": ratio(step_cpu, base_cpu)})
    return rows


def probe_line(env):
    """The host-speed probes of `environment`'s record, as one line."""
    parts = []
    for key, label in (("probe_start", "start"), ("probe_end", "end")):
        seconds = (env.get(key) or {}).get("matmul_seconds")
        if seconds:
            parts.append(f"{label}: " + ", ".join(
                f"core {c} {v * 1e3:.1f} ms" for c, v in sorted(
                    seconds.items())))
    if not parts:
        return None
    return ("Host speed, one-core 512 x 1024 x 1024 matmul (about 7.5-7.9 "
            "ms when the host is quiet): " + "; ".join(parts))


CHILDREN = {"baseline": child_baseline, "throughput": child_throughput,
            "baseline_server": child_baseline_server,
            "replicas": child_replicas,
            "overhead": child_overhead, "memory": child_memory,
            "build": child_build, "fidelity": child_fidelity,
            "probe": child_probe, "kernel": child_kernel}


def _child_main(name, params):
    cpus = params.pop("cpus", None)
    if cpus is not None:  # Before TensorFlow is imported.
        os.sched_setaffinity(0, set(cpus))
    result = CHILDREN[name](params)
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------ orchestration


def _env(shim=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(
                   p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("TF_CONFIG", None)
    if shim:  # Keeps a client's own TF gRPC port on loopback too.
        env["LD_PRELOAD"] = shim
        env["KERAS_PIPE_BIND_HOST"] = "127.0.0.1"
    return env


def run_child(name, params, timeout, shim=None, log=print):
    """Runs `--child name` in a fresh process; returns its JSON or an error."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", name, "--params",
             json.dumps(params)], env=_env(shim), capture_output=True,
            text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"{name}: no answer within {timeout} s"}
    seconds = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        log(f"  {name} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-2000:]}")
        return {"error": f"{name} exited {proc.returncode}: "
                         f"{proc.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(lines[-1])
    result["child_seconds"] = seconds
    return result


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """`python -m keras_pipe.worker` processes, one pinned core each."""

    def __init__(self, num_tasks, logdir, inter_op_threads=2):
        self.addresses = [f"127.0.0.1:{_free_port()}"
                          for _ in range(num_tasks)]
        self.logdir = pathlib.Path(logdir)
        self.inter_op_threads = inter_op_threads
        self.procs = []

    def __enter__(self):
        try:
            self._start()
        except BaseException:  # a worker that did start must not outlive us
            self.__exit__()
            raise
        return self

    def _start(self):
        cores = sorted(os.sched_getaffinity(0))
        for task in range(len(self.addresses)):
            log = open(self.logdir / f"worker{task}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "keras_pipe.worker", "--task",
                 str(task), "--cluster", ",".join(self.addresses),
                 "--intra-op-threads", "1", "--inter-op-threads",
                 str(self.inter_op_threads), "--cpu-affinity",
                 str(cores[task % len(cores)])],
                env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            log.close()
        deadline = time.monotonic() + 180
        for task, proc in enumerate(self.procs):
            path = self.logdir / f"worker{task}.log"
            while "serving" not in path.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {task} did not start:\n"
                                       f"{path.read_text()[-2000:]}")
                time.sleep(0.2)

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def __exit__(self, *exc):
        for proc in self.procs:  # all killed first, then waited for
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"worker pid {proc.pid} did not exit after SIGKILL",
                      file=sys.stderr)


def settings(quick, schedules=SCHEDULES):
    """The parameters of every part; `quick` is a smaller, faster run.

    `schedules` are those of part (a); part (c) measures those among
    MEMORY_SCHEDULES, and GPipe always.
    """
    model = {"layers": 8, "width": 1024, "batch": 512}
    return {
        # Steps a multiple of steps_per_execution.
        "a": {**model, "micro_batches": [2, 4] if quick else [1, 2, 4, 8, 16],
              "schedules": list(schedules), "remat": "never",
              "one_worker_micro_batches": [1] if quick else [1, 4, 16],
              "steps_per_execution": 4,
              "steps_per_execution_micro_batches": [4] if quick else [2, 4],
              "steps_per_execution_schedules": ["gpipe", "zb_h2"] if quick
              else ["gpipe", "zb_h2", "zbv"],
              # Each worker's Adam update one XLA function (compile's
              # jit_compile=True); the same without, at these M, in the run.
              "xla_updates": True, "no_xla_micro_batches": [4],
              "no_xla_schedules": ["gpipe", "zb_h2"],
              "steps": 8 if quick else 12, "rounds": 2 if quick else 4,
              "kernel_repeats": 10 if quick else 20,
              # One hop of a micro-batch between the workers (its M=8 CPU
              # is part of the CPU goal's explanation).
              "transfer_hops": 20, "transfer_repeats": 10 if quick else 30},
        "f": {"layers": 4, "width": 512, "batch": 512, "M": 2,
              "steps": 6 if quick else 10, "rounds": 2 if quick else 4},
        "b": {"models": [model, {"layers": 4, "width": 128, "batch": 64}],
              "steps": 8 if quick else 20, "rounds": 3 if quick else 6},
        # Activations dominate in the first model; in the second, weights,
        # Adam slots and per-micro-batch weight gradients weigh more.
        "c": {"models": [{"layers": 32, "width": 128, "batch": 8192},
                         {"layers": 32, "width": 256, "batch": 2048}],
              "micro_batches": [8] if quick else [1, 4, 8, 16],
              "modes": ["always", "except_last", "never"],
              # On the first model: every mode for these, the others at
              # "never" and "always" only.
              "schedules": ["gpipe"] + [n for n in MEMORY_SCHEDULES
                                        if n in schedules and n != "gpipe"],
              "all_modes_schedules": ["gpipe", "1f1b"]},
        "d": {"width": 32, "grid": [(8, 4), (8, 32), (4, 4), (4, 16)]
              if quick else [(k, m) for k in (2, 4, 8)
                             for m in (1, 4, 8, 16, 32)]},
        "e": {"stage_seconds": 0.03 if quick else 0.05,
              "grid": [(4, 4), (4, 8)] if quick else
              [(4, 1), (4, 4), (4, 8), (4, 16), (2, 8), (8, 8)],
              "runs": ["forward", "train", "train_1f1b"] if quick else
              ["forward", "train", "train_remat", "train_1f1b"],
              "repeats": 2 if quick else 3, "inter_op_threads": 64},
    }


def baseline_1core(interleaved, before, after):
    """Part (a)'s reference: the 1-core rounds interleaved with the runs.

    Without them (a failed server), the rounds run before and after the
    pipeline runs, pooled. Those stay in the result either way: how far
    they are from the interleaved rounds is how much the host drifted.
    """
    if interleaved:
        return dict(interleaved, source="interleaved", before=before,
                    after=after)
    steps = before.get("steps", []) + after.get("steps", [])
    return {"step_seconds": median(steps),
            "cpu_seconds_per_step": median([r.get("cpu_seconds_per_step")
                                            for r in (before, after)]),
            "best_step_seconds": min(steps, default=None),
            "source": "before and after", "before": before, "after": after}


def run_throughput(p, outdir, log):
    """Part (a): 1-core baseline, 2 pinned workers + client, baseline again."""
    from keras_pipe.worker import bind_shim_path  # imports TF, here only
    shim = bind_shim_path()
    core = sorted(os.sched_getaffinity(0))[0]
    base = {k: p[k] for k in ("layers", "width", "batch", "steps", "rounds")}
    one_core = dict(base, cpus=[core], threads=[1, 2])
    log("  1 process pinned to 1 core ...")
    before = run_child("baseline", dict(one_core), 900, log=log)
    log("  2 worker processes, 1 core each; client drives fit; its rounds "
        "interleave with the 1-core process's ...")
    with Workers(2, outdir) as workers:
        result = run_child(
            "throughput", dict(p, cluster=workers.addresses,
                               worker_pids=workers.pids, baseline=one_core),
            3600, shim=shim, log=log)
    if "error" in result:
        return result
    log("  1 process pinned to 1 core, again; 1 process on 2 cores ...")
    after = run_child("baseline", dict(one_core), 900, log=log)
    two = run_child("baseline", dict(base), 900, log=log)
    log("  1 process pinned to 1 core, plain Keras with jit_compile=True, "
        f"then with steps_per_execution={p['steps_per_execution']} ...")
    xla = run_child("baseline", dict(one_core, jit_compile=True), 900,
                    log=log)
    spe = run_child("baseline", dict(
        one_core, steps_per_execution=p["steps_per_execution"]), 900, log=log)
    log("  the model's products per micro-batch size, 1 core ...")
    kernel = run_child("kernel", dict(  # M=8 always: the CPU goal's M
        base, micro_batches=sorted({8, *p["micro_batches"]}),
        repeats=p["kernel_repeats"],
        cpus=[core], threads=[1, 2]), 900, log=log)
    result["kernel"] = kernel  # or its error, logged by run_child
    result["baseline_1core"] = baseline_1core(
        result.get("baseline_interleaved"), before, after)
    for key, other in (("baseline_2cores", two), ("baseline_1core_xla", xla),
                       ("baseline_1core_spe", spe)):
        if "error" not in other:  # else logged by run_child
            result[key] = other
    result["model"] = (f"{p['layers']} x Dense({p['width']}), batch "
                       f"{p['batch']}")
    result["remat"] = p["remat"]
    return result


def run_parts(parts, quick, outdir, log=print, schedules=SCHEDULES,
              micro_batches=None):
    """Runs the chosen parts, each in child processes; returns their JSON.

    `micro_batches`, if given, replaces part (a)'s values of M.
    """
    s = settings(quick, schedules)
    if micro_batches:
        s["a"]["micro_batches"] = list(micro_batches)
    results = {}
    loads = {}
    if "a" in parts:
        log("(a) throughput vs schedule and M on 2 pinned workers")
        loads["a"] = os.getloadavg()
        results["a"] = run_throughput(s["a"], outdir, log)
    if "b" in parts:
        log("(b) overhead of K=1, M=1")
        loads["b"] = os.getloadavg()
        results["b"] = run_child("overhead", s["b"], 1800, log=log)
    if "c" in parts:
        log("(c) peak memory per remat mode, schedule and M")
        loads["c"] = os.getloadavg()
        c = s["c"]
        runs, names = [], []
        for n, spec in enumerate(c["models"]):
            name = (f"{spec['layers']} x Dense({spec['width']}), batch "
                    f"{spec['batch']}")
            names.append(name)
            # Other schedules only where activations dominate: that is
            # where they act.
            for schedule in c["schedules"] if n == 0 else ["gpipe"]:
                modes = [mode for mode in c["modes"] if mode in (
                    "never", "always") or schedule in c["all_modes_schedules"]]
                for m in c["micro_batches"]:
                    for mode in modes:
                        r = run_child("memory", dict(
                            spec, M=m, remat=mode, schedule=schedule), 900,
                            log=log)
                        if "error" not in r:
                            runs.append(dict(r, model=name))
        results["c"] = {"runs": runs, "models": names,
                        "measure": "tf.config.experimental.get_memory_info("
                        "'CPU:0')['peak'] over one warm step"}
        if not runs:
            results["c"]["error"] = "every configuration failed"
    if "d" in parts:
        log("(d) build time of the training step vs M and K")
        loads["d"] = os.getloadavg()
        results["d"] = run_child("build", s["d"], 3600, log=log)
        results["d"]["model"] = (
            f"2 x Dense({s['d']['width']}) per stage, batch 2M, "
            "remat='except_last'")
    if "e" in parts:
        log("(e) schedule fidelity with fixed-duration stages")
        loads["e"] = os.getloadavg()
        results["e"] = run_child("fidelity", s["e"], 3600, log=log)
    if "f" in parts:
        log("(f) 2 replicas x 2 stages vs 1 replica, BatchNorm + Dropout")
        loads["f"] = os.getloadavg()
        from keras_pipe.worker import bind_shim_path  # imports TF, here only
        with Workers(4, outdir) as workers:
            results["f"] = run_child(
                "replicas", dict(s["f"], cluster=workers.addresses), 1800,
                shim=bind_shim_path(), log=log)
        results["f"].update(M=s["f"]["M"], model=(
            f"2 stages of {s['f']['layers'] // 2} x (Dense({s['f']['width']})"
            " + BatchNormalization + Dropout), batch "
            f"{s['f']['batch']}"))
    for part, load in loads.items():  # 1, 5, 15-minute load averages
        results[part]["load_average_at_start"] = load
    return results


def _m_axis(ax, ms):
    """A log2 axis of micro-batch counts labelled with the counts."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()


def plot(results, goals, path):
    """Writes a figure of the parts that ran: speedup (a), memory (c), build
    time (d), fidelity (e), one panel each; returns those parts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    drawn = [part for part in "acde" if results.get(part)
             and "error" not in results[part]]
    shape = {0: (1, 1), 1: (1, 1), 2: (1, 2)}.get(len(drawn), (2, 2))
    alone = len(drawn) == 1  # room for the legend beside the panel
    fig, axes = plt.subplots(*shape, figsize=(
        8 if alone else 5 * shape[1], 4.5 if alone else 3.5 * shape[0]),
        dpi=80, squeeze=False)
    panels = dict(zip(drawn, axes.flat))
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    a = results.get("a")
    if "a" in drawn:
        ax = panels["a"]
        rows = throughput_rows(a)
        bare = overhead_rows(a)
        ms = sorted({r["M"] for r in rows + bare})
        fine = [m / 4 for m in range(4, 4 * max(ms) + 1)]
        ax.plot(fine, [2 * m / (m + 1) for m in fine], "k--",
                label="ideal 2M/(M+1)")
        for name in dict.fromkeys(r["schedule"] for r in rows):
            pts = [(r["M"], r["speedup"]) for r in rows
                   if r["schedule"] == name and r["speedup"]]
            if pts:
                ax.plot(*zip(*pts), "o-", label=name)
        pts = [(r["M"], r["bare_speedup"]) for r in bare if r["bare_speedup"]]
        if pts:
            ax.plot(*zip(*pts), "s:", color="grey", label="bare TF graph")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(GOALS["a"][2], color="tab:green", lw=0.8, ls=":",
                   label="goal")
        _m_axis(ax, ms)
        ax.legend(fontsize=8, **({"loc": "upper left", "bbox_to_anchor": (
            1.02, 1.0)} if alone else {}))
        ax.set_title("(a) speedup on 2 single-core workers", fontsize=10)
        ax.set_xlabel("micro-batches M")
    c = results.get("c")
    if "c" in drawn:
        ax = panels["c"]
        def peaks(model, mode, schedule):
            return sorted((e["M"], e["peak_bytes"] / 2**20)
                          for e in c["runs"]
                          if e["remat"] == mode and e["model"] == model
                          and e.get("schedule", "gpipe") == schedule)

        for model, style in zip(c["models"], ("-", "--")):
            for mode, color in (("always", "tab:blue"),
                                ("except_last", "tab:orange"),
                                ("never", "tab:red")):
                pts = peaks(model, mode, "gpipe")
                if pts:
                    ax.plot(*zip(*pts), "o" + style, color=color,
                            label=f"{mode}: {model}")
        others = [n for n in dict.fromkeys(e.get("schedule", "gpipe")
                                           for e in c["runs"]) if n != "gpipe"]
        for name, marker in zip(others, "sv^D"):
            for mode, color in (("always", "tab:blue"), ("never", "tab:red")):
                pts = peaks(c["models"][0], mode, name)
                if pts:
                    ax.plot(*zip(*pts), marker + ":", color=color,
                            mfc="white", label=f"{name}, {mode}: "
                            f"{c['models'][0]}")
        _m_axis(ax, sorted({e["M"] for e in c["runs"]}))
        ax.set_ylabel("peak MiB")
        ax.legend(fontsize=6)
        ax.set_title("(c) peak memory of a training step, K=4", fontsize=10)
        ax.set_xlabel("micro-batches M")
    d = results.get("d")
    if "d" in drawn:
        ax = panels["d"]
        for k in sorted({e["K"] for e in d["runs"]}):
            pts = sorted((e["M"], e["build_seconds"]) for e in d["runs"]
                         if e["K"] == k)
            ax.plot(*zip(*pts), "o-", label=f"K={k}")
        _m_axis(ax, sorted({e["M"] for e in d["runs"]}))
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
        ax.set_title("(d) time to build the training step", fontsize=10)
        ax.set_xlabel("micro-batches M")
    e = results.get("e")
    if "e" in drawn:
        ax = panels["e"]
        rows = fidelity_rows(e)
        labels = [f"{r['run']}\nK={r['K']} M={r['M']}" for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows])
        ax.axhspan(0.95, 1.05, color="tab:green", alpha=0.2,
                   label="goal: within 5%")
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
        ax.set_ylim(0.8, 1.2)
        ax.set_ylabel("measured / (M+K-1) stage times")
        ax.legend(fontsize=8)
        ax.set_title("(e) schedule fidelity", fontsize=10)
    b = results.get("b")
    note = ""
    if b and "error" not in b:
        note = "   (b) overhead K=1,M=1: " + ", ".join(
            f"{fmt(m['ratio'], 3)}x ({m['model']})" for m in b["models"])
    fig.suptitle("keras_pipe benchmark" + note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


def environment():
    """What the numbers were measured on."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, text=True,
                                  capture_output=True).stdout
        except OSError:
            return
    versions = {}
    for name in ("tensorflow", "keras"):
        try:
            from importlib.metadata import version
            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - reported as unknown
            versions[name] = None
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(), **versions,
            "commit": git("rev-parse", "HEAD").strip(),
            "uncommitted_files": git("status", "--porcelain",
                                     "-uno").splitlines(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python tools/benchmark.py",
        description="Measure keras_pipe: speedup on 2 pinned workers, "
        "overhead, peak memory per remat mode, build time, schedule "
        "fidelity. Prints tables of ratios, writes JSON and a PNG.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer configurations and steps (minutes)")
    parser.add_argument("--out", default="benchmark_out",
                        help="folder for benchmark.json, benchmark.png and "
                        "worker logs (default: benchmark_out)")
    parser.add_argument("--only", default="a,b,c,d,e,f",
                        help="comma-separated parts to run (default: all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated schedules of part (a) (and "
                        "(c), among " + ",".join(MEMORY_SCHEDULES) + "); "
                        "default: all of " + ",".join(SCHEDULES))
    parser.add_argument("--micro-batches", default="",
                        help="comma-separated values of M for part (a) "
                        "(default: 1,2,4,8,16; with --quick 2,4)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child_main(args.child, json.loads(args.params))
        return
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set("abcdef"))
    if unknown:
        parser.error(f"--only takes parts among a,b,c,d,e,f. Received: "
                     f"{unknown}")
    schedules = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = [n for n in schedules if n not in SCHEDULES]
    if unknown or not schedules:
        parser.error(f"--schedules takes names among {','.join(SCHEDULES)}. "
                     f"Received: {unknown or args.schedules!r}")
    try:
        micro_batches = [int(n) for n in args.micro_batches.split(",")
                         if n.strip()]
    except ValueError:
        micro_batches = None
    if micro_batches is None or any(n < 1 for n in micro_batches):
        parser.error("--micro-batches takes positive ints, e.g. 4,8. "
                     f"Received: {args.micro_batches!r}")
    # SIGTERM unwinds like Ctrl-C, so that the worker processes are killed.
    signal.signal(signal.SIGTERM, _terminate)
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["probe_start"] = run_child("probe", {"repeats": 30}, 300)
    start = time.perf_counter()
    results = run_parts(parts, args.quick, outdir, schedules=schedules,
                        micro_batches=micro_batches)
    env["load_average_end"] = os.getloadavg()
    env["probe_end"] = run_child("probe", {"repeats": 30}, 300)
    tables, goals = summarize(results)
    for title, headers, rows in tables:
        print(f"\n{title}\n{format_table(headers, rows)}")
    host = probe_line(env)
    if host:
        print(f"\n{host}")
    document = {"command": " ".join(["python", "tools/benchmark.py",
                                     *(argv if argv is not None
                                       else sys.argv[1:])]),
                "quick": args.quick, "environment": env,
                "seconds": time.perf_counter() - start, "results": results,
                "goals": goals,
                "tables": [{"title": t, "headers": h, "rows": r}
                           for t, h, r in tables]}
    (outdir / "benchmark.json").write_text(json.dumps(document, indent=1))
    (outdir / "benchmark.md").write_text(
        "\n\n".join([f"{t}\n\n{markdown_table(h, r)}" for t, h, r in tables]
                    + ([host] if host else [])) + "\n")
    plot(results, goals, outdir / "benchmark.png")
    print(f"\nWrote benchmark.json, benchmark.md and benchmark.png to "
          f"{outdir} ({document['seconds']:.0f} s).")


if __name__ == "__main__":
    main()
