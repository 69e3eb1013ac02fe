"""The benchmark tool's pure helpers: ideal speedup, ratios, tables, goals.

Nothing here is timed: the measurements themselves run in
`python -m tools.benchmarks`, on a machine that may be shared.
"""

import json
import os

import pytest

from tools.benchmarks import (
    cli,
    fidelity,
    goals,
    harness,
    peer_jobs,
    peer_report,
    replicas,
    report,
    throughput,
    throughput_report,
)


def test_ideal_speedup_is_gpipe_bound():
    assert harness.ideal_speedup(1) == 1.0
    assert harness.ideal_speedup(2) == pytest.approx(4 / 3, abs=1e-12)
    assert harness.ideal_speedup(4) == pytest.approx(1.6, abs=1e-12)
    assert harness.ideal_speedup(16) == pytest.approx(32 / 17, abs=1e-12)
    assert harness.ideal_speedup(4, num_stages=4) == pytest.approx(16 / 7,
                                                              abs=1e-12)
    assert harness.ideal_speedup(5, num_stages=1) == 1.0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_ideal_speedup_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match=r"num_micro_batches must be an int "
                       r">= 1\. Received: num_micro_batches="):
        harness.ideal_speedup(bad)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        harness.ideal_speedup(2, num_stages=bad)


def test_ratio_median_and_cells():
    assert harness.ratio(3.0, 2.0) == 1.5
    assert harness.ratio(None, 2.0) is None
    assert harness.ratio(1.0, None) is None
    assert harness.ratio(1.0, 0) is None
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0
    assert harness.median([None]) is None
    assert harness.fmt(None) == "-"
    assert harness.fmt(1.23456, 3, "x") == "1.235x"
    assert harness.fmt(True) == "yes"
    assert harness.fmt("K=2") == "K=2"


def test_format_table_aligns_columns():
    text = harness.format_table(["M", "speedup", "note"],
                           [[1, "0.98x", "a"], [16, "1.50x", "longer"]])
    assert text == (
        "M   speedup  note\n"
        "--  -------  ------\n"
        " 1    0.98x  a\n"
        "16    1.50x  longer")


def test_markdown_table():
    assert harness.markdown_table(["M", "x"], [[1, "2.0x"]]) == (
        "| M | x |\n|---|---|\n| 1 | 2.0x |")


def test_check_goal_both_directions():
    assert goals.check_goal("a", 1.7)["met"] is True
    assert goals.check_goal("a", 1.2)["met"] is False
    assert goals.check_goal("b", 1.05)["met"] is True
    assert goals.check_goal("b", 1.2) == {
        "goal": goals.GOALS["b"][0], "bound": "<= 1.05", "measured": 1.2,
        "met": False}
    assert goals.check_goal("d", None)["met"] is None


def _entry(m, seconds, schedule="gpipe", k=2, cpu=(0.15, 0.15)):
    """A run of part (a) as `child_throughput` reports it."""
    return {"schedule": schedule, "num_stages": k, "num_micro_batches": m,
            "step_seconds": seconds, "worker_cpu_utilisation": [0.5, 0.6],
            "worker_cpu_wait": [0.1, 0.2],
            "worker_cpu_seconds_per_step": list(cpu)}


def _results():
    """Made-up results with the shapes the child processes return."""
    pipeline = [_entry(m, s) for m, s in ((1, 0.2), (4, 0.125), (16, 0.16))]
    pipeline[1]["best_step_seconds"] = 0.1
    # zbv is the fastest at M=4 (2.0x) and at M=8 (1.6x, CPU 1.25x), where
    # zb_h1 is slower (1.25x) but spends less CPU (1.0x).
    pipeline += [_entry(4, 0.1, "zbv", 4), _entry(8, 0.125, "zbv", 4,
                                                   (0.125, 0.125)),
                 _entry(8, 0.16, "zb_h1", cpu=(0.1, 0.1))]
    memory = [{"model": name, "M": 8, "remat": mode, "peak_bytes": peak,
               "step_bytes": peak - 10}
              for name, scale in (("act", 1), ("weights", 2))
              for mode, peak in (("always", 40 * scale),
                                 ("except_last", 50 * scale),
                                 ("never", 100))]
    memory.append({"model": "act", "M": 8, "remat": "never",
                   "schedule": "1f1b", "peak_bytes": 60, "step_bytes": 50})
    memory += [{"model": "act", "M": 8, "remat": mode, "schedule": "zb_h1",
                "peak_bytes": peak, "step_bytes": peak - 10}
               for mode, peak in (("never", 70), ("always", 30))]
    return {
        "a": {"model": "8 x Dense(1024), batch 512", "remat": "never",
              "pipeline": pipeline,
              "bare": [_entry(1, 0.19), dict(_entry(4, 0.1),
                                             best_step_seconds=0.08)],
              "steps_per_execution": [_entry(4, 0.11)],
              "baseline_1core": {"step_seconds": 0.2,
                                 "cpu_seconds_per_step": 0.2},
              "one_worker": {"step_seconds": 0.25}},
        "b": {"models": [{"model": "big", "ratio": 1.02, "plain_seconds": 0.1,
                          "pipeline_seconds": 0.102}]},
        "c": {"runs": memory, "models": ["act", "weights"],
              "measure": "peak"},
        "d": {"model": "mlp", "runs": [
            {"K": 8, "M": 4, "build_seconds": 2.0},
            {"K": 8, "M": 32, "build_seconds": 5.0}]},
        "e": {"runs": [
            {"run": "forward", "K": 4, "M": 4, "stage_seconds": 0.1,
             "stage_times": 7, "seconds": 0.728},
            {"run": "train", "K": 4, "M": 4, "stage_seconds": 0.1,
             "stage_times": 14, "seconds": 1.386}]},
    }


def test_throughput_rows_are_ratios_to_the_baseline():
    rows = throughput_report.throughput_rows(_results()["a"])
    # Schedules in the order of SCHEDULES, then M.
    # Then the runs compiled with steps_per_execution.
    assert [(r["schedule"], r["K"], r["M"]) for r in rows] == [
        ("gpipe", 2, 1), ("gpipe", 2, 4), ("gpipe", 2, 16), ("zb_h1", 2, 8),
        ("zbv", 4, 4), ("zbv", 4, 8), ("gpipe steps_per_execution=4", 2, 4)]
    assert [r["speedup"] for r in rows] == pytest.approx(
        [1.0, 1.6, 1.25, 1.25, 2.0, 1.6, 0.2 / 0.11], abs=1e-12)
    # The ideal is GPipe's on the 2 workers, whatever K.
    assert [r["efficiency"] for r in rows[:3]] == pytest.approx(
        [1.0, 1.0, 1.25 * 17 / 32], abs=1e-12)
    assert rows[4]["ideal"] == pytest.approx(1.6, abs=1e-12)
    assert rows[1]["speedup_vs_one_worker"] == pytest.approx(2.0, abs=1e-12)
    # CPU seconds of both workers per step over the 1-core process's.
    assert rows[0]["cpu_ratio"] == pytest.approx(1.5, abs=1e-12)
    # No client CPU reported: no bound; with it, 2 cores' worth of the
    # 1-core CPU over the workers' and the client's CPU.
    assert rows[4]["cpu_bound"] is None
    a = _results()["a"]
    a["pipeline"][3]["client_cpu_seconds_per_step"] = 0.05  # zbv, M=4
    rows = throughput_report.throughput_rows(a)
    assert rows[4]["cpu_bound"] == pytest.approx(0.4 / 0.35, abs=1e-12)
    assert throughput_report.throughput_goals(a)["a"]["note"] == (
        "zbv, M=4; the CPU its workers and client spent allows 1.14x on 2 "
        "cores")
    # Step over (M+1)/M x the busier worker's CPU seconds (0.15).
    assert [r["schedule_ratio"] for r in rows[:3]] == pytest.approx(
        [0.2 / 0.3, 0.125 / (1.25 * 0.15), 0.16 / (17 / 16 * 0.15)],
        abs=1e-12)


def test_overhead_rows_compare_gpipe_with_the_bare_graph():
    rows = throughput_report.overhead_rows(_results()["a"])
    assert [r["M"] for r in rows] == [1, 4]
    assert [r["ratio"] for r in rows] == pytest.approx([0.2 / 0.19, 1.25],
                                                       abs=1e-12)
    assert rows[0]["ratio_best"] is None  # no fastest step reported
    assert rows[1]["ratio_best"] == pytest.approx(1.25, abs=1e-12)
    assert rows[1]["bare_ms"] == pytest.approx(100.0, abs=1e-9)
    assert rows[1]["pipeline_ms"] == pytest.approx(125.0, abs=1e-9)
    assert rows[1]["bare_speedup"] == pytest.approx(2.0, abs=1e-12)
    assert rows[1]["spe_ratio"] == pytest.approx(1.1, abs=1e-12)
    assert rows[0]["spe_ms"] is None and rows[0]["spe_ratio"] is None
    assert rows[1]["bare_cpu_ratio"] == pytest.approx(1.5, abs=1e-12)


def test_xla_rows_pair_each_run_without_xla_with_the_same_run_with():
    a = _results()["a"]
    a["no_xla_updates"] = [_entry(4, 0.15, cpu=(0.15, 0.15)),
                           _entry(2, 0.3, "zb_h2")]  # no zb_h2 M=2 with XLA
    rows = throughput_report.xla_rows(a)
    assert [(r["schedule"], r["M"]) for r in rows] == [("gpipe", 4),
                                                        ("zb_h2", 2)]
    assert rows[0]["xla_ms"] == pytest.approx(125.0, abs=1e-9)
    assert rows[0]["no_xla_ms"] == pytest.approx(150.0, abs=1e-9)
    assert rows[0]["ratio"] == pytest.approx(1.2, abs=1e-12)
    assert rows[0]["xla_speedup"] == pytest.approx(1.6, abs=1e-12)
    assert rows[0]["no_xla_speedup"] == pytest.approx(0.2 / 0.15, abs=1e-12)
    assert rows[0]["no_xla_cpu_ratio"] == pytest.approx(1.5, abs=1e-12)
    assert rows[1]["xla_ms"] is None and rows[1]["ratio"] is None
    tables = {t: body for t, _, body in throughput_report.throughput_tables(
        dict(a, xla_updates=True, baseline_1core_xla={
            "step_seconds": 0.25, "cpu_seconds_per_step": 0.25},
            baseline_1core_spe={"step_seconds": 0.2,
                                "cpu_seconds_per_step": 0.19}))}
    titles = list(tables)
    assert "compile(jit_compile=True): each worker's Adam update" in titles[0]
    xla = next(t for t in titles if "against the same run compiled with "
               "jit_compile=False" in t)
    assert tables[xla][0][:5] == ["gpipe", 4, "125", "150", "1.200x"]
    references = tables["(a) references (CPU: all workers, per step)"]
    assert references[-2:] == [
        ["1 process, 1 core, plain Keras with steps_per_execution=4 (after "
         "the pipeline runs)", "1.00x", "200", "0.95x"],
        ["1 process, 1 core, plain Keras with jit_compile=True (after the "
         "pipeline runs)", "0.80x", "250", "1.25x"]]


def test_throughput_goals_take_the_best_schedule():
    goals = throughput_report.throughput_goals(_results()["a"])
    assert {k: g["met"] for k, g in goals.items()} == {
        "a": True, "a-overhead": False, "a-cpu": False}
    assert goals["a"]["measured"] == pytest.approx(2.0, abs=1e-12)
    assert goals["a"]["note"] == "zbv, M=4"
    # The worst M: 1.25 at M=4.
    assert goals["a-overhead"]["measured"] == pytest.approx(1.25, abs=1e-12)
    assert goals["a-overhead"]["note"] == "M=1: 1.053, M=4: 1.250"
    # At M=8 the fastest schedule (zbv), not the most frugal (zb_h1).
    assert goals["a-cpu"]["measured"] == pytest.approx(1.25, abs=1e-12)
    assert goals["a-cpu"]["note"] == "zbv, M=8"
    # With the kernel child's timings, the note says what M=8 costs per row.
    a = {**_results()["a"], "kernel": {"seconds": {"1": 0.02, "8": 0.026},
                                       "batch": 512, "width": 1024}}
    assert throughput_report.throughput_goals(a)["a-cpu"]["note"] == (
        "zbv, M=8; one layer's F and B products cost 1.30x at M=8 what they "
        "cost on the whole batch")


def _transfers():
    """`child_throughput`'s transfer costs at M=4 and 8 (512 rows)."""
    return {str(m): {"M": m, "rows": 512 // m, "width": 1024, "hops": 20,
                     "repeats": 30, "cross_seconds": cross,
                     "local_seconds": local, "cross_cpu_seconds": cpu,
                     "local_cpu_seconds": 0.0002}
            for m, cross, local, cpu in ((4, 0.0008, 0.0003, 0.0010),
                                         (8, 0.0006, 0.0002, 0.0007))}


def test_transfer_rows_take_the_hop_on_one_worker_away():
    a = {"transfers": _transfers(),
         "baseline_1core": {"cpu_seconds_per_step": 0.2}}
    rows = throughput_report.transfer_rows(a)
    assert [(r["M"], r["rows"]) for r in rows] == [(4, 128), (8, 64)]
    four, eight = rows
    assert four["megabytes"] == pytest.approx(0.5, abs=1e-12)
    assert four["latency_ms"] == pytest.approx(0.5, abs=1e-9)
    assert four["cpu_ms"] == pytest.approx(0.8, abs=1e-9)
    # K=2 moves 2M micro-batches per step: 16 hops of 0.5 ms CPU at M=8.
    assert eight["step_cpu_ms"] == pytest.approx(8.0, abs=1e-9)
    assert eight["share"] == pytest.approx(0.04, abs=1e-12)
    # Without the one-core CPU, no share; without a CPU reading, no CPU.
    a["transfers"]["8"]["cross_cpu_seconds"] = None
    del a["baseline_1core"]
    assert throughput_report.transfer_rows(a)[1]["cpu_ms"] is None
    assert throughput_report.transfer_rows(a)[0]["share"] is None
    assert throughput_report.transfer_rows({}) == []


def test_cross_hops_count_the_boundaries_between_the_workers():
    assert [throughput_report.cross_hops(name, k) for name, k in (
        ("gpipe", 1), ("zb_h2", 2), ("zbv", 4),
        ("interleaved_1f1b", 4))] == [0, 1, 2, 3]


def test_cpu_goal_note_says_what_products_and_transfers_add():
    a = {**_results()["a"], "transfers": _transfers(),
         "kernel": {"seconds": {"1": 0.02, "8": 0.026},
                    "chain_seconds": {"1": 0.14, "8": 0.21}, "batch": 512,
                    "width": 1024, "layers": 8}}
    # zbv (the fastest at M=8) crosses the workers twice each way: 4M hops.
    parts = throughput_report.cpu_at_m(a, "zbv", 4, 8)
    assert parts["transfer_count"] == 32
    assert parts["transfers"] == pytest.approx(32 * 0.0005 / 0.2, abs=1e-12)
    # The chain's 70 ms more at M=8 over the one-core CPU of 200 ms.
    assert parts["products"] == pytest.approx(0.07 / 0.2, abs=1e-12)
    assert parts["product_ratio"] == pytest.approx(1.3, abs=1e-12)
    assert parts["chain_ratio"] == pytest.approx(1.5, abs=1e-12)
    assert throughput_report.throughput_goals(a)["a-cpu"]["note"] == (
        "zbv, M=8; one layer's F and B products cost 1.30x at M=8 what they "
        "cost on the whole batch, the model's run micro-batch by "
        "micro-batch through its layers 1.50x, which adds 0.350 of the "
        "one-core process's CPU; its 32 transfers of activations and "
        "gradients between the workers add 0.080")
    # Without the chain or the transfers, those parts stay unsaid.
    del a["kernel"]["chain_seconds"]
    assert throughput_report.cpu_at_m({**a, "transfers": {}}, "zb_h2", 2, 8) == {
        "product_ratio": pytest.approx(1.3), "chain_ratio": None,
        "products": None, "transfer_count": 16, "transfers": None}


def test_transfer_costs_time_both_chains_on_two_devices(devices):
    # Two logical CPUs of this process stand for the workers (not timed:
    # any positive time passes; the CPU is this process's, read twice).
    import tensorflow as tf
    costs = throughput._transfer_costs(tf, devices[:2], [os.getpid()] * 2, 64,
                               [2, 8], 16, hops=4, repeats=3)
    assert sorted(costs, key=int) == ["2", "8"]
    assert (costs["8"]["M"], costs["8"]["rows"]) == (8, 8)
    for entry in costs.values():
        for key in ("cross_seconds", "local_seconds"):
            assert 0 < entry[key] < 1
        assert entry["cross_cpu_seconds"] >= 0


def test_throughput_goals_without_m8_or_bare_say_so():
    a = _results()["a"]
    a["pipeline"] = [e for e in a["pipeline"] if e["num_micro_batches"] != 8]
    a["bare"] = []
    goals = throughput_report.throughput_goals(a)
    assert goals["a-cpu"]["note"] == "gpipe, M=16 (no M=8 in this run)"
    assert goals["a-overhead"]["measured"] is None
    assert goals["a-overhead"]["met"] is None
    assert throughput_report.throughput_goals({
        **a, "pipeline": [], "steps_per_execution": []
                               })["a"]["met"] is None


def test_throughput_configs_cover_every_schedule():
    p = cli.settings(True)["a"]
    configs = throughput.throughput_configs(p)
    labels = [throughput.config_label(c) for c in configs]
    assert labels == [
        "gpipe K=1 M=1",
        "gpipe K=2 M=2", "1f1b K=2 M=2", "zb_h1 K=2 M=2", "zb_h2 K=2 M=2",
        "interleaved_1f1b K=4 M=2", "zbv K=4 M=2", "bare K=2 M=2",
        "gpipe K=2 M=4", "1f1b K=2 M=4", "zb_h1 K=2 M=4", "zb_h2 K=2 M=4",
        "interleaved_1f1b K=4 M=4", "zbv K=4 M=4", "bare K=2 M=4",
        "gpipe K=2 M=4 steps_per_execution=4",
        "zb_h2 K=2 M=4 steps_per_execution=4",
        "gpipe K=2 M=4 jit_compile=False", "zb_h2 K=2 M=4 jit_compile=False"]
    only = throughput.throughput_configs(dict(p, schedules=["zbv"],
                                      steps_per_execution_schedules=["gpipe"],
                                      xla_updates=False))
    assert [c["kind"] for c in only] == [
        "one_worker", "pipeline", "bare", "pipeline", "bare",
        "steps_per_execution"]
    # The 4-stage schedules' worker order (checked by PipelineModel).
    assert throughput.FOUR_STAGE_SCHEDULES == {
        "interleaved_1f1b": (0, 1, 0, 1), "zbv": (0, 1, 1, 0)}


def test_fidelity_rows_compare_with_the_schedule():
    rows = fidelity.fidelity_rows(_results()["e"])
    assert [r["expected_seconds"] for r in rows] == pytest.approx(
        [0.7, 1.4], abs=1e-12)
    assert [r["ratio"] for r in rows] == pytest.approx([1.04, 0.99],
                                                       abs=1e-12)


def test_summarize_reports_every_goal():
    tables, goals = report.summarize(_results())
    assert {k: g["met"] for k, g in goals.items()} == {
        "a": True, "a-overhead": False, "a-cpu": False,
        "b": True, "c": True, "c*": False, "d": False, "e": True}
    assert goals["a"]["measured"] == pytest.approx(2.0, abs=1e-12)
    assert goals["c"]["measured"] == pytest.approx(0.4, abs=1e-12)
    assert goals["c*"]["measured"] == pytest.approx(0.8, abs=1e-12)
    assert goals["d"]["measured"] == pytest.approx(2.5, abs=1e-12)
    assert goals["e"]["measured"] == pytest.approx(0.04, abs=1e-12)
    titles = [t for t, _, _ in tables]
    assert titles[-1] == "Goals" and len(titles) == 9
    assert [t.split(" ")[1] for t in titles[:4]] == [
        "Speedup", "Each", "Overhead", "references"]
    c_rows = tables[5][2]
    assert [r[:3] for r in c_rows[:3]] == [
        ["act", "gpipe", 8], ["act", "1f1b", 8], ["act", "zb_h1", 8]]
    assert c_rows[1][-2:] == ["0.60x", "-"]  # 1f1b never / gpipe never
    assert c_rows[2][4] == "-"  # except_last: not measured for zb_h1
    assert c_rows[2][-2:] == ["0.70x", "0.75x"]  # zb_h1 / gpipe
    headers, speedups = tables[0][1], tables[0][2]
    assert headers == ["run", "K", "M=1", "M=4", "M=8", "M=16", "best"]
    assert speedups == [
        ["keras_pipe gpipe", 2, "1.00x", "1.60x", "-", "1.25x", "1.60x"],
        ["keras_pipe zb_h1", 2, "-", "-", "1.25x", "-", "1.25x"],
        ["keras_pipe zbv", 4, "-", "2.00x", "1.60x", "-", "2.00x"],
        ["keras_pipe gpipe steps_per_execution=4", 2, "-", "1.82x", "-",
         "-", "1.82x"],
        ["bare TF graph, GPipe", 2, "1.05x", "2.00x", "-", "-", "2.00x"],
        ["ideal 2M/(M+1)", "", "1.00", "1.60", "1.78", "1.88", ""]]
    a_rows = tables[1][2]
    assert a_rows[1][:6] == ["gpipe", 2, 4, "1.60", "1.60x", "-"]
    assert a_rows[1][-5:] == ["50%/60%", "10%/20%", "1.50x", "-", "0.67x"]
    bare_rows = tables[2][2]
    assert bare_rows[1] == [4, "100", "125", "1.250x", "1.250x", "2.00x",
                            "1.50x", "110", "1.100x"]


def test_summarize_skips_failed_parts():
    tables, goals = report.summarize({"b": {"error": "overhead exited 1"}})
    assert goals == {}
    assert tables == [("Goals", ["part", "goal", "bound", "measured", "met",
                                 "note"], [])]


def test_plot_writes_a_small_png(tmp_path):
    results = _results()
    _, goals = report.summarize(results)
    path = tmp_path / "benchmark.png"
    assert report.plot(results, goals, path) == ["a", "c", "d", "e"]
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) < 200_000
    # A run of part (a) alone draws that panel only.
    only_a = {"a": results["a"], "c": {"error": "not run"}}
    assert report.plot(only_a, goals, path) == ["a"]


def test_bad_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--only", "a,x"])
    assert ("--only takes parts among peer,a,b,c,d,e,f. Received: ['x']"
            in capsys.readouterr().err)


def test_bad_schedule_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--only", "a", "--schedules", "gpipe,zb_h3"])
    assert "--schedules takes names among gpipe,1f1b,zb_h1,zb_h2," \
        "interleaved_1f1b,zbv. Received: ['zb_h3']" in capsys.readouterr().err


def test_failed_runs_are_listed():
    a = dict(_results()["a"], errors=[
        {"run": "gpipe K=2 M=4 steps_per_execution=4",
         "error": "ValueError: no"}])
    tables, _ = report.summarize({"a": a})
    title, headers, rows = tables[-2]
    assert title.startswith("(a) runs that failed")
    assert rows == [["gpipe K=2 M=4 steps_per_execution=4",
                     "ValueError: no"]]


def test_settings_are_json_and_quick_is_smaller():
    quick, full = cli.settings(True), cli.settings(False)
    json.dumps(full)  # children receive them as JSON
    assert quick["a"]["micro_batches"] == [2, 4]
    assert full["a"]["micro_batches"] == [1, 2, 4, 8, 16]
    assert quick["a"]["schedules"] == list(throughput.SCHEDULES)
    for a in (quick["a"], full["a"]):
        assert a["steps"] % a["steps_per_execution"] == 0
    # Part (c): every 1-stage-per-device schedule asked for, GPipe always.
    assert quick["c"]["schedules"] == ["gpipe", "1f1b", "zb_h1", "zb_h2"]
    assert cli.settings(True, ["zbv", "zb_h1"])["c"]["schedules"] == [
        "gpipe", "zb_h1"]
    assert len(quick["d"]["grid"]) < len(full["d"]["grid"])
    assert (8, 4) in quick["d"]["grid"] and (8, 32) in quick["d"]["grid"]
    assert 8 in quick["c"]["micro_batches"]


def test_replicas_table_gives_the_ratio_to_one_replica():
    result = {"R1": {"step_seconds": 0.2, "best_step_seconds": 0.18},
              "R2": {"step_seconds": 0.25, "best_step_seconds": 0.2},
              "M": 2, "model": "m"}
    title, headers, rows = replicas.replicas_table(result)
    assert "M=2 per replica" in title
    assert headers[-1] == "ratio to R=1"
    assert rows[1] == ["R=2, K=2", "250", "200", "1.25x"]


def test_probe_line_reports_the_host_speed():
    env = {"probe_start": {"matmul_seconds": {"0": 0.0078, "1": 0.0079}},
           "probe_end": {"error": "probe exited 1"}}
    assert harness.probe_line(env) == (
        "Host speed, one-core 512 x 1024 x 1024 matmul (about 7.5-7.9 ms "
        "when the host is quiet): start: core 0 7.8 ms, core 1 7.9 ms")
    assert harness.probe_line({}) is None


@pytest.mark.slow  # a TF child: the full suite runs it
def test_probe_child_times_each_core():
    # Runs the child (not timed: any positive time passes).
    result = harness.run_child("probe", {"repeats": 3}, 300)
    seconds = result["matmul_seconds"]
    assert sorted(seconds) == sorted(str(c) for c in os.sched_getaffinity(0))
    assert all(0 < v < 1 for v in seconds.values())


def test_kernel_rows_relate_each_micro_batch_size_to_the_whole_batch():
    kernel = {"seconds": {"1": 0.020, "4": 0.021, "8": 0.028},
              "xla_seconds": {"1": 0.030, "4": 0.0315},
              "batch": 512, "width": 1024}
    assert throughput_report.kernel_rows(kernel) == [[1, 512, "20.0", "1.00x", "30.0",
                                       "1.50x", "-", "-"],
                                      [4, 128, "21.0", "1.05x", "31.5",
                                       "1.50x", "-", "-"],
                                      [8, 64, "28.0", "1.40x", "-", "-",
                                       "-", "-"]]
    # The model's chain of layers, relative to its own whole batch.
    kernel["chain_seconds"] = {"1": 0.14, "8": 0.21}
    assert [row[6:] for row in throughput_report.kernel_rows(kernel)] == [
        ["140.0", "1.00x"], ["-", "-"], ["210.0", "1.50x"]]


@pytest.mark.slow  # a TF child: the full suite runs it
def test_kernel_child_times_each_micro_batch_size():
    # Runs the child on a small layer (not timed: any positive time passes).
    result = harness.run_child("kernel", {"batch": 64, "width": 32,
                                     "micro_batches": [2, 8, 3],
                                     "layers": 3, "repeats": 2,
                                     "threads": [1, 2]}, 300)
    assert result["layers"] == 3
    for key in ("seconds", "xla_seconds", "chain_seconds"):
        assert sorted(result[key], key=int) == ["1", "2", "8"]  # 3 ∤ 64
        assert all(0 < v < 1 for v in result[key].values())


def test_baseline_1core_prefers_the_rounds_interleaved_with_the_runs():
    before = {"steps": [0.20, 0.22], "cpu_seconds_per_step": 0.2}
    after = {"steps": [0.30], "cpu_seconds_per_step": 0.3}
    inter = {"step_seconds": 0.25, "cpu_seconds_per_step": 0.24,
             "best_step_seconds": 0.2, "steps": [0.2, 0.25, 0.3]}
    base = harness.baseline_1core(inter, before, after)
    assert base["step_seconds"] == 0.25 and base["source"] == "interleaved"
    assert base["before"] is before and base["after"] is after
    pooled = harness.baseline_1core(None, before, after)
    assert pooled["step_seconds"] == 0.22 and pooled["best_step_seconds"] \
        == 0.20
    assert pooled["cpu_seconds_per_step"] == 0.25
    assert pooled["source"] == "before and after"
    # The references table shows the drift of the rounds run alone.
    a = dict(_results()["a"], baseline_1core=dict(
        base, before={"step_seconds": 0.2, "cpu_seconds_per_step": 0.2}))
    context = dict((t[0], t[2]) for t in throughput_report.throughput_tables(a))[
        "(a) references (CPU: all workers, per step)"]
    assert context[0][0] == "1 process, 1 core (baseline; rounds interleaved)"
    assert context[1] == ["the same, before the pipeline runs", "1.25x",
                          "200", "0.83x"]
    assert not any("after" in row[0] for row in context)


@pytest.mark.slow  # a TF child: the full suite runs it
def test_baseline_server_runs_one_round_per_request():
    # The child the throughput part interleaves (not timed).
    server = harness._PinnedBaseline({"layers": 2, "width": 32, "batch": 16,
                                 "steps": 4, "threads": [1, 2],
                                 "cpus": sorted(os.sched_getaffinity(0))[:1]})
    try:
        rounds = [server.round(), server.round()]
    finally:
        server.close()
    assert server.proc.returncode == 0
    for r in rounds:
        assert len(r["steps"]) == 3  # the first step of each fit excluded
        assert all(0 < s < 5 for s in r["steps"])
        assert r["cpu_seconds_per_step"] > 0


@pytest.mark.slow  # a TF child: the full suite runs it
def test_baseline_server_that_fails_says_why():
    # No "steps": the child fails before READY; its last stderr line is kept.
    with pytest.raises(RuntimeError, match=r"baseline_server exited 1: "
                                           r"\[\"KeyError: 'steps'\"\]"):
        harness._PinnedBaseline({"layers": 2, "width": 8})


# ------------------------------------------------------------- peer part


def _peer_entry():
    """A job of the peer part as `peer.run_peer` reports it (made up)."""
    def runs(schedule, k, seconds):
        return [{"schedule": schedule, "num_stages": k,
                 "num_micro_batches": m, "step_seconds": s, "steps": [s],
                 "worker_cpu_seconds_per_step": [0.1, 0.09],
                 "worker_system_cpu_seconds_per_step": [0.01, 0.002],
                 "client_cpu_seconds_per_step": 0.05,
                 "cpu_seconds_per_step": 0.12}
                for m, s in zip((2, 4), seconds)]
    return {
        "description": "MLP", "parameters_formula": 10,
        "flops_per_step_formula": 3e9,
        "keras_baseline_before": {"steps": [0.2, 0.2], "parameters": 10,
                                  "flops_per_step": 3.1e9,
                                  "cpu_seconds_per_step": 0.15},
        "keras_baseline_after": {"steps": [0.2]},
        "torch_baseline_before": {"steps": [0.3], "parameters": 10,
                                  "flops_per_step": 2.9e9},
        "torch_baseline_after": {"steps": [0.3]},
        "keras_pipeline": {"runs": runs("1f1b", 2, (0.16, 0.125))
                           + runs("zbv", 4, (0.1, 0.2)), "errors": []},
        # torch's runs before and after keras_pipe: their steps pooled.
        "torch_pipeline_before": {"runs": runs("1f1b", 2, (0.2, 0.25)),
                                  "errors": [{"run": "zbv M=2",
                                              "error": "RuntimeError: no"}]},
        "torch_pipeline_after": {"runs": runs("1f1b", 2, (0.2, 0.3))}}


def test_peer_speedups_are_against_each_systems_own_core():
    table = peer_report.speedups(_peer_entry())
    assert table[("keras_pipe", "1f1b", 2)] == {
        2: pytest.approx(1.25), 4: pytest.approx(1.6)}
    assert table[("keras_pipe", "zbv", 4)] == {2: pytest.approx(2.0),
                                               4: pytest.approx(1.0)}
    assert table[("torch", "1f1b", 2)] == {2: pytest.approx(1.5),
                                           4: pytest.approx(0.3 / 0.275)}
    title, headers, rows = peer_report.job_table("mlp", _peer_entry())
    assert headers == ["system", "schedule", "K", "M=2", "M=4", "best"]
    assert rows == [["keras_pipe", "1f1b", 2, "1.25x", "1.60x", "1.60x"],
                    ["keras_pipe", "zbv", 4, "2.00x", "1.00x", "2.00x"],
                    ["torch", "1f1b", 2, "1.50x", "1.09x", "1.50x"]]
    assert "keras_pipe 1 core 200 ms, torch 1 core 300 ms" in title


def test_peer_goals_compare_best_with_best_and_1f1b_per_m():
    goals = peer_report.goals({"jobs": {"mlp": _peer_entry()}})
    assert goals["mlp best"]["measured"] == pytest.approx(2.0 / 1.5)
    assert goals["mlp best"]["met"] is True
    assert goals["mlp best"]["note"] == "keras_pipe zbv M=2, torch 1f1b M=2"
    assert goals["mlp mlp"]["measured"] == pytest.approx(2.0)
    assert goals["mlp 1f1b"]["measured"] == pytest.approx(1.25 / 1.5)
    assert goals["mlp 1f1b"]["met"] is False
    assert goals["mlp 1f1b"]["note"] == "M=2: 0.83, M=4: 1.47"
    tables = peer_report.peer_tables({"jobs": {"mlp": _peer_entry()}})
    assert tables[1][2] == [["parameters", "10", "10", "10"],
                            ["GFLOPs per step", "3.10", "2.90", "3.00"]]
    account = tables[2]
    assert account[0].startswith("mlp: where the time goes")
    # keras_pipe: each worker's CPU per step and its system part, and the
    # client's CPU; torch: rank 0's, once per run (before and after
    # keras_pipe).
    assert account[2][0] == ["keras_pipe", "1f1b", 2, 2, "160", "200",
                             "100/90", "10/2", "50", "150", "0.62"]
    assert [r[:4] for r in account[2] if r[0] != "keras_pipe"] == [
        ["torch (after keras_pipe)", "1f1b", 2, 2],
        ["torch (after keras_pipe)", "1f1b", 2, 4],
        ["torch (before keras_pipe)", "1f1b", 2, 2],
        ["torch (before keras_pipe)", "1f1b", 2, 4]]
    assert tables[3][2] == [["zbv M=2", "RuntimeError: no"]]


def test_peer_part_writes_its_json_markdown_and_png(tmp_path):
    result = {"jobs": {"mlp": _peer_entry(), "conv": _peer_entry()}}
    cli.write_part(tmp_path, "peer", result, {"command": "python -m x"},
                   None)
    document = json.loads((tmp_path / "peer.json").read_text())
    assert document["goals"]["conv best"]["met"] is True
    text = (tmp_path / "peer.md").read_text()
    assert text.startswith("Command: `python -m x`")
    assert "| keras_pipe | zbv | 4 | 2.00x | 1.00x | 2.00x |" in text
    png = (tmp_path / "peer.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000


def test_peer_jobs_cut_into_equal_stages_and_count_alike():
    import keras
    jobs = peer_jobs.jobs(quick=True)
    assert peer_jobs.stage_units(jobs["mlp"], 4) == [(0, 2), (2, 4), (4, 6),
                                                     (6, 8)]
    with pytest.raises(ValueError, match="do not cut into num_stages=3"):
        peer_jobs.stage_units(jobs["mlp"], 3)
    for name, job in jobs.items():
        stages = peer_jobs.keras_stages(keras, job, 2)
        model = keras.Sequential([s for s in stages])
        model.build((None, *peer_jobs.input_shape(job)))
        # The torch side is counted in the benchmark run (torch is not a
        # test dependency): here the shapes' count against Keras's.
        assert model.count_params() == peer_jobs.parameter_count(job), name
    assert peer_jobs.flops_per_step(peer_jobs.jobs()["mlp"]) == (
        3 * 2 * 512 * 1024 * 1024 * 8)


def test_the_benchmarks_import_no_torch():
    code = ("import sys; import tools.benchmarks.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=dict(os.environ,
                                              TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_build_then_warm_builds_every_run_before_warming_any():
    # keras.utils.set_random_seed (each build) clears TF's kernel cache: a
    # run warmed before another run's build would instantiate its step
    # function again at its first measured fit (docs/performance.md).
    calls, errors = [], []

    def build(label):
        def run():
            calls.append(("build", label))
            if label == "bad build":
                raise ValueError("no")
            return label
        return run

    def warm(built):
        calls.append(("warm", built))
        if built == "bad warm":
            raise RuntimeError("stuck")
        return f"run {built}"

    runs = {label: (build(label), warm)
            for label in ("a", "bad build", "bad warm", "b")}
    warmed = harness.build_then_warm(runs, errors)
    assert warmed == {"a": "run a", "b": "run b"}
    assert [kind for kind, _ in calls] == ["build"] * 4 + ["warm"] * 3
    assert errors == [{"run": "bad build", "error": "ValueError: no"},
                      {"run": "bad warm", "error": "RuntimeError: stuck"}]
