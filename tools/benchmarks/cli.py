"""The command line: settings per part, running them, writing the results."""

import argparse
import json
import os
import pathlib
import signal
import sys
import time

from tools.benchmarks import harness, peer, peer_jobs, peer_report
from tools.benchmarks.harness import (
    Workers,
    environment,
    fmt,
    format_table,
    markdown_table,
    probe_line,
    run_child,
)
from tools.benchmarks.report import plot, summarize
from tools.benchmarks.throughput import (
    MEMORY_SCHEDULES,
    SCHEDULES,
    run_throughput,
)


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


def run_parts(parts, quick, outdir, log=print, schedules=SCHEDULES,
              micro_batches=None, jobs=None, reduced=False):
    """Runs the chosen parts, each in child processes; returns their JSON.

    `micro_batches`, if given, replaces part (a)'s values of M; `jobs`, if
    given, the peer part's jobs; `reduced`: the peer part's smaller grid.
    """
    s = settings(quick, schedules)
    if micro_batches:
        s["a"]["micro_batches"] = list(micro_batches)
    results = {}
    loads = {}
    if "peer" in parts:
        log("(peer) keras_pipe and torch.distributed.pipelining, 3 jobs")
        loads["peer"] = os.getloadavg()
        results["peer"] = peer.run_peer(
            dict(peer.settings(quick, jobs or peer_jobs.jobs()),
                 **(peer.REDUCED if reduced else {})), log,
            save=lambda r: write_part(outdir, "peer", r, {
                "command": "(a partial result: the run goes on)"}, None))
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
        from keras_pipe.distributed.worker import (
            bind_shim_path,  # imports TF, here only
        )
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


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks",
        description="Measure keras_pipe: against torch pipelining on three "
        "jobs (peer), speedup on 2 pinned workers (a), overhead (b), peak "
        "memory per remat mode (c), build time (d), schedule fidelity (e), "
        "replicas (f). Prints tables of ratios; writes per part a JSON, a "
        "Markdown table and a PNG.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer configurations and steps (minutes)")
    parser.add_argument("--out", default="benchmark_out",
                        help="folder for each part's PART.json, PART.md, "
                        "PART.png and worker logs (default: benchmark_out)")
    parser.add_argument("--only", default="peer,a,b,c,d,e,f",
                        help="comma-separated parts to run (default: all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated schedules of part (a) (and "
                        "(c), among " + ",".join(MEMORY_SCHEDULES) + "); "
                        "default: all of " + ",".join(SCHEDULES))
    parser.add_argument("--micro-batches", default="",
                        help="comma-separated values of M for part (a) "
                        "(default: 1,2,4,8,16; with --quick 2,4)")
    parser.add_argument("--jobs", default="mlp,transformer,conv",
                        help="comma-separated jobs of the peer part "
                        "(default: mlp,transformer,conv)")
    parser.add_argument("--reduced", action="store_true",
                        help="the peer part on M=2,4 and 4 schedules per "
                        "system, 1 round, torch before keras_pipe only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.child_main(args.child, json.loads(args.params))
        return
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(FILES))
    if unknown:
        parser.error(f"--only takes parts among {','.join(FILES)}. "
                     f"Received: {unknown}")
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
    jobs = [n.strip() for n in args.jobs.split(",") if n.strip()]
    unknown = [n for n in jobs if n not in peer_jobs.jobs()]
    if unknown or not jobs:
        parser.error(f"--jobs takes names among "
                     f"{','.join(peer_jobs.jobs())}. Received: "
                     f"{unknown or args.jobs!r}")
    # SIGTERM unwinds like Ctrl-C, so that the worker processes are killed.
    signal.signal(signal.SIGTERM, _terminate)
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["probe_start"] = run_child("probe", {"repeats": 30}, 300)
    start = time.perf_counter()
    results = run_parts(parts, args.quick, outdir, schedules=schedules,
                        micro_batches=micro_batches, jobs=jobs,
                        reduced=args.reduced)
    env["load_average_end"] = os.getloadavg()
    env["probe_end"] = run_child("probe", {"repeats": 30}, 300)
    host = probe_line(env)
    command = " ".join(["python", "-m", "tools.benchmarks",
                        *(argv if argv is not None else sys.argv[1:])])
    seconds = time.perf_counter() - start
    for part, result in results.items():
        write_part(outdir, part, result, {
            "command": command, "quick": args.quick, "environment": env,
            "seconds": seconds}, host)
    print(f"\nWrote {', '.join(FILES[p] + '.*' for p in results)} to "
          f"{outdir} ({seconds:.0f} s).")


# Each part's files: PART.json, PART.md and PART.png.
FILES = {"peer": "peer", "a": "throughput", "b": "overhead", "c": "memory",
         "d": "build", "e": "fidelity", "f": "replicas"}


def part_tables(part, result):
    """`(tables, goals)` of one part's result."""
    if part == "peer":
        if "error" in result:
            return [], {}
        goals = peer_report.goals(result)
        rows = [[key, g["goal"], g["bound"], fmt(g["measured"], 3),
                 fmt(g["met"]) if g["met"] is not None else "not measured",
                 g.get("note", "")] for key, g in goals.items()]
        return peer_report.peer_tables(result) + [(
            "Goals", ["job, goal", "goal", "bound", "measured", "met",
                      "note"], rows)], goals
    return summarize({part: result})


def write_part(outdir, part, result, document, host):
    """Prints one part's tables; writes its JSON, Markdown and figure."""
    tables, goals = part_tables(part, result)
    for title, headers, rows in tables:
        print(f"\n{title}\n{format_table(headers, rows)}")
    name = FILES[part]
    document = dict(document, part=part, result=result, goals=goals,
                    tables=[{"title": t, "headers": h, "rows": r}
                            for t, h, r in tables])
    (outdir / f"{name}.json").write_text(json.dumps(document, indent=1))
    (outdir / f"{name}.md").write_text(
        f"Command: `{document['command']}`\n\n"
        + "\n\n".join([f"{t}\n\n{markdown_table(h, r)}"
                       for t, h, r in tables] + ([host] if host else []))
        + "\n")
    if part == "peer":
        if "error" not in result:
            peer_report.plot_peer(result, outdir / f"{name}.png")
    elif part in "acde":
        plot({part: result}, goals, outdir / f"{name}.png")
