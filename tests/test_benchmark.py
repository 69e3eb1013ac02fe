"""The benchmark tool's pure helpers: ideal speedup, ratios, tables, goals.

Nothing here is timed: the measurements themselves run in
`python tools/benchmark.py`, on a machine that may be shared.
"""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "benchmark_tool", ROOT / "tools" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bm = _load()


def test_ideal_speedup_is_gpipe_bound():
    assert bm.ideal_speedup(1) == 1.0
    assert bm.ideal_speedup(2) == pytest.approx(4 / 3, abs=1e-12)
    assert bm.ideal_speedup(4) == pytest.approx(1.6, abs=1e-12)
    assert bm.ideal_speedup(16) == pytest.approx(32 / 17, abs=1e-12)
    assert bm.ideal_speedup(4, num_stages=4) == pytest.approx(16 / 7,
                                                              abs=1e-12)
    assert bm.ideal_speedup(5, num_stages=1) == 1.0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_ideal_speedup_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match=r"num_micro_batches must be an int "
                       r">= 1\. Received: num_micro_batches="):
        bm.ideal_speedup(bad)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        bm.ideal_speedup(2, num_stages=bad)


def test_ratio_median_and_cells():
    assert bm.ratio(3.0, 2.0) == 1.5
    assert bm.ratio(None, 2.0) is None
    assert bm.ratio(1.0, None) is None
    assert bm.ratio(1.0, 0) is None
    assert bm.median([3.0, None, 1.0, 2.0]) == 2.0
    assert bm.median([None]) is None
    assert bm.fmt(None) == "-"
    assert bm.fmt(1.23456, 3, "x") == "1.235x"
    assert bm.fmt(True) == "yes"
    assert bm.fmt("K=2") == "K=2"


def test_format_table_aligns_columns():
    text = bm.format_table(["M", "speedup", "note"],
                           [[1, "0.98x", "a"], [16, "1.50x", "longer"]])
    assert text == (
        "M   speedup  note\n"
        "--  -------  ------\n"
        " 1    0.98x  a\n"
        "16    1.50x  longer")


def test_markdown_table():
    assert bm.markdown_table(["M", "x"], [[1, "2.0x"]]) == (
        "| M | x |\n|---|---|\n| 1 | 2.0x |")


def test_check_goal_both_directions():
    assert bm.check_goal("a", 1.7)["met"] is True
    assert bm.check_goal("a", 1.2)["met"] is False
    assert bm.check_goal("b", 1.05)["met"] is True
    assert bm.check_goal("b", 1.2) == {
        "goal": bm.GOALS["b"][0], "bound": "<= 1.05", "measured": 1.2,
        "met": False}
    assert bm.check_goal("d", None)["met"] is None


def _results():
    """Made-up results with the shapes the child processes return."""
    pipeline = [{"num_micro_batches": m, "step_seconds": s,
                 "worker_cpu_utilisation": [0.5, 0.6],
                 "worker_cpu_wait": [0.1, 0.2],
                 "worker_cpu_seconds_per_step": [0.15, 0.15]}
                for m, s in ((1, 0.2), (4, 0.125), (16, 0.16))]
    memory = [{"model": name, "M": 8, "remat": mode, "peak_bytes": peak,
               "step_bytes": peak - 10}
              for name, scale in (("act", 1), ("weights", 2))
              for mode, peak in (("always", 40 * scale),
                                 ("except_last", 50 * scale),
                                 ("never", 100))]
    memory.append({"model": "act", "M": 8, "remat": "never",
                   "schedule": "1f1b", "peak_bytes": 60, "step_bytes": 50})
    return {
        "a": {"model": "8 x Dense(1024), batch 512", "remat": "never",
              "pipeline": pipeline,
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
    rows = bm.throughput_rows(_results()["a"])
    assert [r["M"] for r in rows] == [1, 4, 16]
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.6, 1.25],
                                                         abs=1e-12)
    assert [r["efficiency"] for r in rows] == pytest.approx(
        [1.0, 1.0, 1.25 * 17 / 32], abs=1e-12)
    assert rows[1]["speedup_vs_one_worker"] == pytest.approx(2.0, abs=1e-12)
    # CPU seconds of both workers per step over the 1-core process's.
    assert rows[0]["cpu_ratio"] == pytest.approx(1.5, abs=1e-12)
    # Step over (M+1)/M x the busier worker's CPU seconds (0.15).
    assert [r["schedule_ratio"] for r in rows] == pytest.approx(
        [0.2 / 0.3, 0.125 / (1.25 * 0.15), 0.16 / (17 / 16 * 0.15)],
        abs=1e-12)


def test_fidelity_rows_compare_with_the_schedule():
    rows = bm.fidelity_rows(_results()["e"])
    assert [r["expected_seconds"] for r in rows] == pytest.approx(
        [0.7, 1.4], abs=1e-12)
    assert [r["ratio"] for r in rows] == pytest.approx([1.04, 0.99],
                                                       abs=1e-12)


def test_summarize_reports_every_goal():
    tables, goals = bm.summarize(_results())
    assert {k: g["met"] for k, g in goals.items()} == {
        "a": True, "b": True, "c": True, "c*": False, "d": False, "e": True}
    assert goals["a"]["measured"] == pytest.approx(1.6, abs=1e-12)
    assert goals["c"]["measured"] == pytest.approx(0.4, abs=1e-12)
    assert goals["c*"]["measured"] == pytest.approx(0.8, abs=1e-12)
    assert goals["d"]["measured"] == pytest.approx(2.5, abs=1e-12)
    assert goals["e"]["measured"] == pytest.approx(0.04, abs=1e-12)
    titles = [t for t, _, _ in tables]
    assert titles[-1] == "Goals" and len(titles) == 7
    c_rows = tables[3][2]
    assert c_rows[0][:3] == ["act", "gpipe", 8]
    assert c_rows[1][:3] == ["act", "1f1b", 8]
    assert c_rows[1][-1] == "0.60x"  # 1f1b never / gpipe never
    a_rows = tables[0][2]
    assert a_rows[1][:5] == [4, "1.60", "1.60x", "-", "2.00x"]
    assert a_rows[1][-4:] == ["50%/60%", "10%/20%", "1.50x", "0.67x"]


def test_summarize_skips_failed_parts():
    tables, goals = bm.summarize({"b": {"error": "overhead exited 1"}})
    assert goals == {}
    assert tables == [("Goals", ["part", "goal", "bound", "measured", "met",
                                 "note"], [])]


def test_plot_writes_a_small_png(tmp_path):
    results = _results()
    _, goals = bm.summarize(results)
    path = tmp_path / "benchmark.png"
    bm.plot(results, goals, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) < 200_000


def test_bad_part_is_refused(capsys):
    with pytest.raises(SystemExit):
        bm.main(["--only", "a,x"])
    assert "--only takes parts among a,b,c,d,e. Received: ['x']" in (
        capsys.readouterr().err)


def test_settings_are_json_and_quick_is_smaller():
    quick, full = bm.settings(True), bm.settings(False)
    json.dumps(full)  # children receive them as JSON
    assert quick["a"]["micro_batches"] == [1, 2, 4, 8, 16]
    assert len(quick["d"]["grid"]) < len(full["d"]["grid"])
    assert (8, 4) in quick["d"]["grid"] and (8, 32) in quick["d"]["grid"]
    assert 8 in quick["c"]["micro_batches"]
