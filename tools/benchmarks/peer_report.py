"""Part peer, report: one table per job with both systems, goals, a figure.

Pure functions of the part's JSON, for `tests/test_benchmark.py`.
"""

from tools.benchmarks.harness import _m_axis, fmt, median, ratio

# Reported, never asserted.
PEER_GOALS = {
    "best": ("keras_pipe's best speedup / torch's best speedup, same job, "
             "same run", ">=", 1.1),
    "mlp": ("keras_pipe's best speedup over its 1-core process, MLP",
            ">=", 1.6),
    "1f1b": ("keras_pipe 1F1B speedup / torch 1F1B speedup, worst M",
             ">=", 1.0),
}


def _pooled(*entries):
    """Median step of the steps of several runs (missing ones skipped)."""
    steps = [s for e in entries if e and "error" not in e
             for s in e.get("steps", [])]
    return median(steps)


def speedups(entry):
    """`{(system, schedule, K): {M: speedup}}` of one job, each system
    against its own one-core process (its runs before and after pooled)."""
    out = {}
    keras_base = _pooled(entry.get("keras_baseline_before"),
                         entry.get("keras_baseline_after"))
    for run in (entry.get("keras_pipeline") or {}).get("runs", []):
        key = ("keras_pipe", run["schedule"], run["num_stages"])
        out.setdefault(key, {})[run["num_micro_batches"]] = ratio(
            keras_base, run["step_seconds"])
    torch_base = _pooled(entry.get("torch_baseline_before"),
                         entry.get("torch_baseline_after"))
    torch_runs = {}
    for when in ("before", "after"):
        for run in (entry.get(f"torch_pipeline_{when}") or {}).get(
                "runs", []):
            key = (run["schedule"], run["num_stages"],
                   run["num_micro_batches"])
            torch_runs.setdefault(key, []).append(run)
    for (schedule, k, m), runs in torch_runs.items():
        out.setdefault(("torch", schedule, k), {})[m] = ratio(
            torch_base, _pooled(*runs))
    return out


def _best(table, system):
    cells = [(v, name, m) for (s, name, _), by_m in table.items()
             if s == system for m, v in by_m.items() if v is not None]
    return max(cells, default=None)


def job_table(name, entry):
    """`(title, headers, rows)`: speedup per schedule and M, both systems."""
    table = speedups(entry)
    ms = sorted({m for by_m in table.values() for m in by_m})
    rows = []
    for (system, schedule, k), by_m in sorted(
            table.items(), key=lambda kv: (kv[0][0] != "keras_pipe",
                                           kv[0][2], kv[0][1])):
        best = max((v for v in by_m.values() if v is not None), default=None)
        rows.append([system, schedule, k] + [
            fmt(by_m.get(m), suffix="x") for m in ms] + [
            fmt(best, suffix="x")])
    bases = []
    for system, prefix in (("keras_pipe", "keras"), ("torch", "torch")):
        step = _pooled(entry.get(f"{prefix}_baseline_before"),
                       entry.get(f"{prefix}_baseline_after"))
        bases.append(f"{system} 1 core {fmt(step and step * 1e3, 0)} ms")
    title = (f"{name}: {entry['description']}; speedup over each system's "
             f"own 1-core process ({', '.join(bases)} per step)")
    return title, ["system", "schedule", "K"] + [f"M={m}" for m in ms] + [
        "best"], rows


def check_table(entry):
    """Rows: parameters and FLOPs per step, as each side counts them."""
    keras_base = entry.get("keras_baseline_before") or {}
    torch_base = entry.get("torch_baseline_before") or {}
    return [
        ["parameters", fmt(keras_base.get("parameters"), 0),
         fmt(torch_base.get("parameters"), 0),
         fmt(entry.get("parameters_formula"), 0)],
        ["GFLOPs per step", fmt(_g(keras_base.get("flops_per_step")), 2),
         fmt(_g(torch_base.get("flops_per_step")), 2),
         fmt(_g(entry.get("flops_per_step_formula")), 2)]]


def account_rows(entry):
    """Rows: where each run's time goes, per (system, schedule, K, M).

    The CPU seconds per step of each pipeline process (keras_pipe: both
    workers and the client; torch: rank 0, the one that reports) against
    its system's one-core process: over 1, the pipeline does more work
    than the whole model on one core (smaller products per micro-batch,
    transfers, the per-step call); the rest of a step that the CPU does
    not fill is waiting (fill and drain, transfers in flight).
    """
    rows = []
    for system, prefix, runs in (
            ("keras_pipe", "keras", (entry.get("keras_pipeline") or {}).get(
                "runs", [])),
            ("torch", "torch", [dict(r, when=when) for when in (
                "before", "after") for r in (entry.get(
                    f"torch_pipeline_{when}") or {}).get("runs", [])])):
        base = [entry.get(f"{prefix}_baseline_{w}") or {}
                for w in ("before", "after")]
        base_cpu = median([b.get("cpu_seconds_per_step") for b in base])
        base_step = _pooled(*base)
        for run in sorted(runs, key=lambda r: (
                r.get("when", ""), r["num_stages"], r["schedule"],
                r["num_micro_batches"])):
            workers = run.get("worker_cpu_seconds_per_step") or [
                run.get("cpu_seconds_per_step")]
            step = run["step_seconds"]
            rows.append([
                system + (f" ({run['when']} keras_pipe)" if "when" in run
                          else ""), run["schedule"], run["num_stages"],
                run["num_micro_batches"], fmt(step * 1e3, 0),
                fmt(base_step and base_step * 1e3, 0),
                "/".join(fmt(c and c * 1e3, 0) for c in workers),
                "/".join(fmt(c and c * 1e3, 0) for c in run.get(
                    "worker_system_cpu_seconds_per_step") or [
                        run.get("system_cpu_seconds_per_step")]),
                fmt((run.get("client_cpu_seconds_per_step") or 0) * 1e3
                    if system == "keras_pipe" else None, 0),
                fmt(base_cpu and base_cpu * 1e3, 0),
                fmt(ratio(max((c for c in workers if c), default=None),
                          step), 2)])
    return rows


def _g(flops):
    return None if flops is None else flops / 1e9


def goals(results):
    """The peer goals per job: `{f"{job} {key}": {...}}`."""
    out = {}
    for name, entry in results.get("jobs", {}).items():
        table = speedups(entry)
        keras_best, torch_best = _best(table, "keras_pipe"), _best(
            table, "torch")
        checks = {"best": (ratio(keras_best and keras_best[0],
                                 torch_best and torch_best[0]),
                           f"keras_pipe {keras_best and keras_best[1]} M="
                           f"{keras_best and keras_best[2]}, torch "
                           f"{torch_best and torch_best[1]} M="
                           f"{torch_best and torch_best[2]}")}
        if name == "mlp":
            checks["mlp"] = (keras_best and keras_best[0], "")
        ours = table.get(("keras_pipe", "1f1b", 2), {})
        theirs = table.get(("torch", "1f1b", 2), {})
        per_m = {m: ratio(ours.get(m), theirs.get(m)) for m in ours}
        worst = min((v for v in per_m.values() if v is not None),
                    default=None)
        checks["1f1b"] = (worst, ", ".join(
            f"M={m}: {fmt(v, 2)}" for m, v in sorted(per_m.items())))
        for key, (measured, note) in checks.items():
            text, op, bound = PEER_GOALS[key]
            met = None if measured is None else (
                measured >= bound if op == ">=" else measured <= bound)
            out[f"{name} {key}"] = {"goal": text, "bound": f"{op} {bound:g}",
                                    "measured": measured, "met": met,
                                    "note": note}
    return out


def peer_tables(results):
    """Every table of the peer part: per job, its speedups and checks."""
    tables = []
    for name, entry in results.get("jobs", {}).items():
        tables.append(job_table(name, entry))
        tables.append((f"{name}: the same job in both systems (keras_pipe: "
                       "model.count_params() and TF's profiler over the "
                       "step's graph, every float op; torch: "
                       "FlopCounterMode, matmuls and convolutions only)",
                       ["", "keras_pipe", "torch", "from the shapes"],
                       check_table(entry)))
        tables.append((
            f"{name}: where the time goes (ms per step; CPU ms of each "
            "pipeline process per step against the 1-core process's; busy: "
            "the busier pipeline process's CPU / the step)",
            ["system", "schedule", "K", "M", "step", "1-core step",
             "CPU per process", "of which system", "client CPU",
             "1-core CPU", "busy"],
            account_rows(entry)))
        errors = [e for key in ("keras_pipeline", "torch_pipeline_before",
                                "torch_pipeline_after")
                  for e in (entry.get(key) or {}).get("errors", [])]
        for key in ("keras_pipeline", "torch_pipeline_before",
                    "torch_pipeline_after", "keras_baseline_before",
                    "torch_baseline_before"):
            if "error" in (entry.get(key) or {}):
                errors.append({"run": key, "error": entry[key]["error"]})
        if errors:
            tables.append((f"{name}: runs that failed", ["run", "error"],
                           [[e["run"], e["error"][:200]] for e in errors]))
    return tables


def plot_peer(results, path):
    """One panel per job: speedup against M, both systems."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results.get("jobs", {}))
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(
        4.5 * max(1, len(names)), 3.6), dpi=80, squeeze=False)
    for ax, name in zip(axes.flat, names):
        table = speedups(results["jobs"][name])
        ms = sorted({m for by_m in table.values() for m in by_m}) or [1]
        for (system, schedule, _k), by_m in sorted(table.items()):
            pts = sorted((m, v) for m, v in by_m.items() if v)
            if pts:
                ax.plot(*zip(*pts), "o-" if system == "keras_pipe" else
                        "s--", label=f"{system} {schedule}")
        ax.axhline(1.0, color="grey", lw=0.8)
        _m_axis(ax, ms)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("micro-batches M")
        ax.legend(fontsize=6)
    axes.flat[0].set_ylabel("speedup over own 1-core process")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
