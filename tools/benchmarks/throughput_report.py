"""Part (a), report: speedup rows, overhead over a bare graph, goals."""


from tools.benchmarks.goals import check_goal
from tools.benchmarks.harness import (
    _ms,
    _percentages,
    _sum,
    fmt,
    ideal_speedup,
    ratio,
)
from tools.benchmarks.throughput import FOUR_STAGE_SCHEDULES, SCHEDULES


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


def throughput_goals(result, rows=None, over_bare=None):
    """Goals a, a-overhead and a-cpu from part (a)'s JSON."""
    rows = throughput_rows(result) if rows is None else rows
    over_bare = overhead_rows(result) if over_bare is None else over_bare
    goals = {}
    best = max((r for r in rows if r["speedup"]), key=lambda r: r["speedup"],
               default=None)
    goals["a"] = check_goal("a", best and best["speedup"])
    if best:
        goals["a"]["note"] = (
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

