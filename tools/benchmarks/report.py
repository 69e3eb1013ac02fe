"""Tables, goals and the figure of the parts that ran."""


from tools.benchmarks.fidelity import fidelity_rows
from tools.benchmarks.goals import GOALS, check_goal
from tools.benchmarks.harness import _m_axis, fmt, ratio
from tools.benchmarks.replicas import replicas_table
from tools.benchmarks.throughput_report import (
    _schedule_order,
    overhead_rows,
    throughput_goals,
    throughput_rows,
    throughput_tables,
)


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

