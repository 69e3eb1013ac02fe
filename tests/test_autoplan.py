"""schedule="auto": the search, the plan it reports, the model it builds;
measured costs and their cache."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import schedule
from keras_pipe.planning import autoplan, profiling, simulator
from keras_pipe.planning import graph as graph_lib
from tests.support import schedules as registered


def _mlp(depth=6, width=64):
    x = keras.Input((32,))
    h = x
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(4)(h), name="auto_mlp")


def _search(model, batch_size=64, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the FLOPs fallback's warning
        return autoplan.search(model, num_devices=2, batch_size=batch_size,
                               measure=False, **kwargs)


def _search_small(model, **kwargs):
    """A smaller grid, for the tests of the budget."""
    return _search(model, micro_batch_choices=(1, 4),
                   schedules=("gpipe", "1f1b", "zbv"), **kwargs)


def test_search_covers_every_registered_schedule_and_ranks_by_simulation():
    ranked = _search(_mlp())
    assert {c.schedule for c in ranked} == set(schedule.schedule_names())
    # The pick, then the others fastest first.
    times = [c.step_time for c in ranked]
    assert times[1:] == sorted(times[1:])
    assert times[0] <= min(times) * (1 + autoplan.NEAR_FASTEST)
    # Stages per device: 1 and 2 for interleaved_1f1b, 2 for zbv, else 1.
    layouts = {(c.schedule, c.num_stages) for c in ranked}
    assert ("interleaved_1f1b", 2) in layouts
    assert ("interleaved_1f1b", 4) in layouts
    assert ("zbv", 4) in layouts and ("zbv", 2) not in layouts
    assert {c.num_micro_batches for c in ranked} == {1, 2, 4, 8}
    best = ranked[0]
    assert sum(best.sizes) == len(graph_lib.read_graph(_mlp()).calls)
    assert all(0 <= i < 1 for i in best.idle)


@pytest.mark.parametrize("near", [0.0, 1e9])
def test_the_pick_holds_the_least_among_the_near_fastest(monkeypatch, near):
    """Within `NEAR_FASTEST` of the fastest simulated step, the pick is the
    configuration whose fullest device holds the least: with no window the
    fastest; with a window over everything the least memory of all."""
    monkeypatch.setattr(autoplan, "NEAR_FASTEST", near)
    ranked = _search(_mlp(), batch_size=256)
    least = min(max(c.peak_memory) for c in ranked)
    fastest = min(ranked, key=lambda c: c.step_time)
    assert max(fastest.peak_memory) > least  # the two rules differ here
    if near:
        assert max(ranked[0].peak_memory) == least
    else:
        assert ranked[0] is fastest


def test_of_near_fastest_candidates_the_least_peak_goes_first():
    def candidate(step, peak):
        return autoplan.Candidate("gpipe", 2, [0, 1], 1, [1, 1],
                                  ["never"] * 2, step, [0, 0], [peak, 1], [])

    fast, near, slow = (candidate(1.0, 300), candidate(1.02, 200),
                        candidate(1.5, 100))
    assert autoplan._least_memory_first([fast, near, slow]) == [
        near, fast, slow]
    assert autoplan._least_memory_first([fast, slow]) == [fast, slow]
    assert autoplan._least_memory_first([]) == []


def test_the_step_time_is_the_simulators_for_the_chosen_configuration():
    _check_simulated(_mlp())


def test_a_split_weight_call_costs_its_weight_gradients_only():
    # zb_h1 splits every backward call: "W" replays the stage's mixing ops
    # (keras_pipe.engine.weight_grad), but TF prunes the replayed forward
    # products (no output reads them), so "W" costs the weight gradients
    # alone; a prediction that charged the replay is higher than this.
    _check_simulated(_mlp(), schedules=["zb_h1"], micro_batch_choices=(4,))


def _check_simulated(model, **kwargs):
    best = _search(model, **kwargs)[0]
    graph = graph_lib.read_graph(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = profiling.flops_costs(graph, 64 // best.num_micro_batches)
    ticks = schedule.get_schedule(best.schedule).build(
        best.num_micro_batches, best.num_stages,
        1 + max(best.stage_devices))
    starts = np.cumsum([0] + best.sizes)
    span = list(zip(starts[:-1], starts[1:]))
    costs = simulator.Costs(
        forward=[sum(calls.forward[a:e]) for a, e in span],
        backward=[sum(calls.backward[a:e]) for a, e in span],
        backward_input=[sum(calls.backward_input[a:e]) for a, e in span],
        weight=[sum(calls.weight[a:e]) for a, e in span],
        call=2e-4, latency=1e-3, bytes_per_second=5e9,
        output_bytes=[_boundary(graph, e, 64 // best.num_micro_batches)
                      for _, e in span],
        # Adam (2 slots) from FLOPs: 9 operations per weight at 2e10/s.
        update=[9 / 2e10 * sum(int(np.prod(v.shape)) for c in
                                 graph.calls[a:e]
                                 for v in c.operation.trainable_variables)
                for a, e in span])
    expected = simulator.simulate(ticks, best.stage_devices, costs,
                                  best.remat, best.num_micro_batches)
    assert best.step_time == pytest.approx(expected.step_time, rel=1e-9)


def _boundary(graph, end, rows):
    from keras_pipe.planning import memory  # noqa: PLC0415
    profile = memory.Profile(graph, rows)
    return profile.output_bytes if end == len(graph.calls) else \
        profile.gap[end - 1]


def test_a_memory_budget_is_met_and_the_error_names_the_least_that_fits():
    model = _mlp(depth=8, width=256)
    free = _search_small(model)[0]
    with pytest.raises(ValueError, match=r"smallest budget that fits is "
                       r"\d+ bytes") as info:
        _search_small(model, memory_budget=10_000)
    least = int(str(info.value).split("fits is ")[1].split(" ")[0])
    # Equal when the optimizer step is every configuration's peak (Adam's
    # update holds ~one buffer per variable: `memory.update_temporaries`).
    assert 10_000 < least <= max(free.peak_memory)
    # The least is exact: it fits, one byte less does not.
    ranked = _search_small(model, memory_budget=least)
    assert all(max(c.peak_memory) <= least for c in ranked)
    assert ranked[0].step_time >= free.step_time
    with pytest.raises(ValueError, match="smallest budget"):
        _search_small(model, memory_budget=least - 1)
    budget = (least + max(free.peak_memory)) // 2
    ranked = _search_small(model, memory_budget=budget)
    assert all(max(c.peak_memory) <= budget for c in ranked)


def test_a_tight_budget_trades_time_for_remat_or_micro_batches():
    # Activations dominate (8192 rows, narrow layers): the least budget
    # needs remat or more micro-batches than the fastest configuration.
    model = _mlp(depth=8, width=64)
    free = _search_small(model, batch_size=8192)[0]
    with pytest.raises(ValueError, match="smallest budget") as info:
        _search_small(model, batch_size=8192, memory_budget=10_000)
    least = int(str(info.value).split("fits is ")[1].split(" ")[0])
    tight = _search_small(model, batch_size=8192, memory_budget=least)[0]
    assert max(tight.peak_memory) <= least < max(free.peak_memory)
    assert (tight.remat != ["never"] * tight.num_stages
            or tight.num_micro_batches > free.num_micro_batches)


def test_a_registered_schedule_is_searched():
    # Registered as a user would, by tests/support/schedules.py.
    name = registered.NAME
    ranked = _search(_mlp(), schedules=[name, "gpipe"])
    assert {c.schedule for c in ranked} == {name, "gpipe"}


def test_plan_reports_the_choice_and_from_model_builds_exactly_it(devices):
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = keras_pipe.plan(model, devices=devices[:2], batch_size=64,
                            schedule="auto", measure=False)
    assert p.schedule in schedule.schedule_names()
    assert p.step_time == p.runner_ups[0].step_time or (
        p.step_time < p.runner_ups[0].step_time)
    assert len(p.devices) == p.num_stages == len(p.stage_devices)
    assert len(p.peak_memory) == len(p.idle) == 2
    text = str(p)
    assert f"schedule={p.schedule!r}" in text and "runner-up" in text
    # from_model measures by default; with the same (FLOPs) costs it builds
    # the same plan: check that by building the plan's arguments directly.
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=p.num_stages, devices=p.devices,
        num_micro_batches=p.num_micro_batches, remat=p.remat,
        balance=p.sizes, schedule=p.schedule)
    assert pipe.schedule == p.schedule
    assert [len(s.calls) for s in pipe.stages] == p.sizes


@pytest.mark.slow  # builds and trains a pipeline
def test_from_model_auto_builds_the_plan(devices, monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_PIPE_CACHE", str(tmp_path / "costs.json"))
    model = _mlp(depth=2, width=16)
    # The step's fixed costs as measured on these devices: measuring them
    # (two pipelines trained, 40% of this test) is
    # test_calibration.py::test_step_overhead_is_measured_once_per_devices.
    # The calibration's pipelines are trained here.
    monkeypatch.setattr(profiling, "step_overhead",
                        lambda devices: profiling.Overhead(2e-4, 1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.setattr(
            autoplan.profiling, "call_costs",
            lambda graph, rows, device=None, shapes=None: (
                profiling.flops_costs(graph, rows, 2e10, shapes)))
        pipe = keras_pipe.PipelineModel.from_model(
            model, devices=devices[:2], batch_size=16, schedule="auto")
    p = pipe.plan
    assert pipe.schedule == p.schedule
    assert pipe.num_stages == p.num_stages
    assert pipe.num_micro_batches == p.num_micro_batches
    assert list(pipe.remat) == list(p.remat)
    assert [len(s.calls) for s in pipe.stages] == p.sizes
    assert list(pipe.devices) == list(p.devices)
    pipe.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.ones((16, 32), "float32")
    y = np.ones((16, 4), "float32")
    assert np.isfinite(pipe.train_on_batch(x, y))


def test_auto_needs_batch_size_and_devices():
    with pytest.raises(ValueError, match="needs batch_size"):
        autoplan.search(_mlp(), num_devices=2)
    with pytest.raises(ValueError, match="needs devices"):
        autoplan.search(_mlp(), batch_size=8)
    with pytest.raises(ValueError, match="schedule must be one of"):
        autoplan.search(_mlp(), num_devices=2, batch_size=8,
                        schedules=["nope"])


def test_flops_fallback_warns():
    graph = graph_lib.read_graph(_mlp())
    with pytest.warns(UserWarning, match="from FLOPs, not measured"):
        costs = profiling.flops_costs(graph, 8)
    assert not costs.measured
    assert costs.forward[0] == pytest.approx(2 * 8 * (32 * 64 + 64) / 2e10,
                                             rel=0.05)


@pytest.mark.slow  # times a model's calls
def test_measured_costs_are_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_PIPE_CACHE", str(tmp_path / "costs.json"))
    graph = graph_lib.read_graph(_mlp(depth=1, width=8))
    first = profiling.call_costs(graph, 4, repeats=1, target=1e-4)
    assert first.measured and len(first.forward) == len(graph.calls)
    assert all(v >= 0 for v in first.forward + first.backward_input
               + first.weight)

    def no_measuring(*args):
        raise AssertionError("measured again instead of read from cache")

    monkeypatch.setattr(profiling, "_per_run", no_measuring)
    assert profiling.call_costs(graph, 4, repeats=1, target=1e-4) == first
    with pytest.raises(AssertionError, match="measured again"):
        profiling.call_costs(graph, 8, repeats=1, target=1e-4)  # other rows
    # Costs measured with TF's own kernels do not serve oneDNN's.
    onednn = profiling._compat.onednn_enabled()
    monkeypatch.setattr(profiling._compat, "onednn_enabled",
                        lambda: not onednn)
    with pytest.raises(AssertionError, match="measured again"):
        profiling.call_costs(graph, 4, repeats=1, target=1e-4)


def test_an_embeddings_gradient_is_timed_as_its_rows():
    # An Embedding's weight gradient is IndexedSlices: returned as such from
    # the timed function, fetching it failed on a worker ("Invalid Tensor
    # call on a REMOTE handle"), so GPT-2 and BERT could not be costed
    # there. The timed functions return its rows, a plain tensor.
    import tensorflow as tf  # noqa: PLC0415
    x = keras.Input((8,), dtype="int32")
    model = keras.Model(x, keras.layers.Embedding(50, 8)(x))
    call = graph_lib.read_graph(model).calls[0]
    (_, _, run_all), copies = profiling._functions(call, training=True)
    flat = [tf.zeros((4, 8), "int32")] + copies
    outputs = tf.function(run_all)(flat)
    assert outputs and all(isinstance(t, tf.Tensor) for t in outputs)


def test_hand_built_stages_with_auto_name_from_model():
    # The stages are already cut and placed: "auto" has nothing to choose,
    # and the error says where it does (before: "schedule must be one of").
    with pytest.raises(ValueError, match=r'from_model\(model, devices=\.\.\., '
                       r'batch_size=\.\.\., schedule="auto"\)'):
        keras_pipe.PipelineModel([keras.layers.Dense(4), keras.layers.Dense(4)],
                                 schedule="auto")


def test_a_link_is_timed_per_hop_of_a_chain(devices):
    # The link was timed against a baseline whose input lived on the source
    # too, so both functions moved the tensor and their difference (the
    # transfer) was noise: latency 0 on 2 workers. Each chain's input lives
    # on its first device; the one on the target alone moves nothing, the
    # other moves the tensor at every hop.
    source, target = devices[0], devices[1]

    def moves(chain):
        function, x = profiling._hop_chain(chain, 4096)
        assert x.device.endswith(chain[0].split("device:")[-1])
        graph = function.get_concrete_function(x).graph
        placed = [op.device.split("device:")[-1]
                  for op in graph.get_operations()
                  if op.type in ("AddV2", "Sum")]
        return sum(a != b for a, b in zip(placed, placed[1:])) + (
            placed[0] != chain[0].split("device:")[-1])

    assert moves([target] * 5) == 0
    assert moves([source, target, source, target, source]) == 4


def _measured_without_timing(monkeypatch, loss_per_row):
    """search(measure=True) with every measurement replaced: FLOPs for the
    calls, no fixed costs, and a loss head of `loss_per_row` s per row."""
    def flops(graph, all_rows, device=None, shapes=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the FLOPs fallback's warning
            return [profiling.flops_costs(graph, rows, 2e10, shapes)
                    for rows in all_rows]

    monkeypatch.setattr(profiling, "call_costs_at", flops)
    monkeypatch.setattr(profiling, "step_overhead",
                        lambda devices: profiling.Overhead(0.0, 0.0))
    monkeypatch.setattr(profiling, "link",
                        lambda a, b: profiling.Link(0.0, 1e12))
    monkeypatch.setattr(profiling, "update_rate",
                        lambda device, slots: profiling.UpdateRate(0.0, 0.0))
    # No calibration:
    monkeypatch.setattr(profiling, "has_step_probe", lambda: False)
    seen = []

    def loss_seconds(loss, outputs, rows, device=None, shapes=None):
        seen.append((loss, rows))
        return loss_per_row * rows

    monkeypatch.setattr(profiling, "loss_seconds", loss_seconds)
    return seen


def test_the_loss_head_is_costed_per_micro_batch_or_per_batch(
        devices, monkeypatch):
    seen = _measured_without_timing(monkeypatch, 1e-3)
    model = _mlp(depth=3, width=16)

    def step(loss, name):
        (c,) = [c for c in autoplan.search(
            model, devices=devices[:2], batch_size=32, schedules=[name],
            micro_batch_choices=[4], loss=loss) if c.num_stages == 2]
        return c.step_time

    # GPipe waits for the full batch's loss (32 rows: 32 ms) once; 1F1B
    # seeds each micro-batch from its part (8 rows: 8 ms, M=4 times on the
    # last stage's device).
    assert step("mse", "gpipe") - step(None, "gpipe") == pytest.approx(
        0.032, rel=0.02)
    gained = step("mse", "1f1b") - step(None, "1f1b")
    assert 0.008 <= gained <= 0.032 + 1e-9
    assert ("mse", 8) in seen and ("mse", 32) in seen
    # A compiled model's own loss is the default.
    model.compile("sgd", "mae")
    seen.clear()
    step(None, "gpipe")
    assert seen and {loss for loss, _ in seen} == {"mae"}


def test_loss_seconds_times_a_sparse_cross_entropy_and_warns_on_a_dict(
        monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_PIPE_CACHE", str(tmp_path / "costs.json"))
    x = keras.Input((6, 5))
    model = keras.Model(x, keras.layers.Dense(50)(x))
    graph = graph_lib.read_graph(model)
    # Integer targets of the logits' shape without the class axis.
    sparse = profiling.loss_seconds("sparse_categorical_crossentropy",
                                    graph.outputs, 8, repeats=1, target=1e-3)
    dense = profiling.loss_seconds("mse", graph.outputs, 8, repeats=1,
                                   target=1e-3)
    assert sparse > 0 and dense > 0
    target = profiling.loss_target(
        keras.losses.get("sparse_categorical_crossentropy"),
        tf.zeros([8, 6, 50]))
    assert target.dtype == tf.int32 and target.shape == (8, 6)
    with pytest.warns(UserWarning, match="costs no loss head"):
        assert profiling.loss_seconds({"out": "mse"}, graph.outputs, 8) == 0


def test_loss_outside_auto_is_refused_not_ignored(devices):
    # Without a choice given, the planner chooses and costs the loss head;
    # with a schedule named it would be ignored.
    with pytest.raises(ValueError, match='schedule="auto" only'):
        keras_pipe.plan(_mlp(depth=2), devices=devices[:2], loss="mse",
                        schedule="gpipe")
    with pytest.raises(ValueError, match='schedule="auto" only'):
        keras_pipe.PipelineModel.from_model(
            _mlp(depth=2), devices=devices[:2], loss="mse", schedule="1f1b")


def test_scale_at_is_linear_in_log_rows_between_the_measured_ones():
    assert autoplan.scale_at({}, 8) == 1.0
    scales = {4: 1.0, 16: 1.5}
    assert autoplan.scale_at(scales, 8) == pytest.approx(1.25)
    assert autoplan.scale_at(scales, 2) == 1.0  # the nearest outside
    assert autoplan.scale_at(scales, 64) == 1.5
    assert autoplan.scale_at({8: 1.3}, 2) == 1.3


def test_fit_scale_finds_the_scale_of_a_measured_step():
    assert autoplan.fit_scale(lambda s: 0.002 + 0.010 * s,
                              0.017) == pytest.approx(1.5, rel=1e-6)
    # Fixed costs alone above the measured step: the least scale.
    assert autoplan.fit_scale(lambda s: 0.02 + s, 0.01) == 1 / 16


@pytest.mark.slow
@pytest.mark.parametrize("receive, weight_call", [(0.0, 0.0), (4e-6, 1e-6)])
def test_calibration_makes_the_trained_configurations_predict_their_steps(
        devices, monkeypatch, receive, weight_call):
    """With costs from FLOPs and no fixed costs, the "measured" steps are
    the simulator's with the layers' work 3x at M=1, 1.2x at M=4 and 1.5x
    at M=8 (not linear in log rows: a middle point is needed), `receive`
    seconds per input received from the other device and `weight_call`
    seconds per layer with weights of each weight-gradient call: the
    search trains GPipe at M=1, 4 and 8, interleaved 1F1B (two stages per
    device) and 1F1B at M=8, and from those five steps predicts every
    configuration as that truth does (M=2 scaled linearly in log rows
    between M=1 and 4: 2.1x)."""
    _measured_without_timing(monkeypatch, 0.0)
    model = _mlp(depth=4, width=32)

    def ranked(calibrate=True):
        return {(c.schedule, c.num_stages, c.num_micro_batches): c
                for c in autoplan.search(model, devices=devices[:2],
                                         batch_size=64, calibrate=calibrate)}

    before = ranked(calibrate=False)
    measured_init = autoplan._Measured.__init__

    def true_costs(self, *args, **kwargs):
        measured_init(self, *args, **kwargs)
        self.scales, self.receive = {64: 3.0, 16: 1.2, 8: 1.5}, receive
        self.weight_call = weight_call

    with monkeypatch.context() as patch:
        patch.setattr(autoplan._Measured, "__init__", true_costs)
        truth = ranked(calibrate=False)
    trained = []

    def probe(model_, graph, shapes, devices_, sizes, m, remat, batch_size,
              *args, **kwargs):
        trained.append((args[-1], len(sizes), m))
        return truth[(args[-1], len(sizes), m)].step_time

    monkeypatch.setattr(profiling, "has_step_probe", lambda: True)
    monkeypatch.setattr(profiling, "model_step_seconds", probe)
    after = ranked()
    assert trained == [("gpipe", 2, 1), ("gpipe", 2, 4), ("gpipe", 2, 8),
                       ("interleaved_1f1b", 4, 8), ("1f1b", 2, 8)]
    for key, c in truth.items():
        # (rel 1e-3: a scaled cost matrix may break a tie of cuts another
        # way, within float rounding; the fits alternate three times)
        assert after[key].step_time == pytest.approx(c.step_time,
                                                     rel=2e-3), key
    if receive:  # the fixed costs move the steps the test checks
        assert truth[("interleaved_1f1b", 4, 4)].step_time > 1.1 * (
            1.2 * before[("interleaved_1f1b", 4, 4)].step_time)
        assert truth[("1f1b", 2, 4)].step_time > 1.1 * (
            1.2 * before[("1f1b", 2, 4)].step_time)
    else:
        for m, f in [(1, 3.0), (2, 2.1), (4, 1.2), (8, 1.5)]:
            assert after[("zbv", 4, m)].step_time == pytest.approx(
                f * before[("zbv", 4, m)].step_time, rel=1e-3)
    # With calibrate=False nothing is trained.
    trained.clear()
    assert ranked(calibrate=False)[("gpipe", 2, 1)].step_time == (
        pytest.approx(before[("gpipe", 2, 1)].step_time))
    assert not trained


@pytest.mark.slow  # builds and trains two small pipelines
@pytest.mark.parametrize("loss", ["mse", "sparse_categorical_crossentropy"])
def test_step_seconds_trains_a_clone_and_leaves_the_model_alone(devices,
                                                                loss):
    from keras_pipe import calibration
    from keras_pipe.planning.balance import shapes as shapes_lib
    model = _mlp(depth=3, width=16)
    before = [w.copy() for w in model.get_weights()]
    shapes = shapes_lib.infer_shapes(graph_lib.read_graph(model))
    seconds = calibration.step_seconds(
        model, devices[:2], [2, 2], 2, "never", 16, shapes, loss=loss,
        optimizer_slots=2, steps=3, runs=1)
    assert 0 < seconds < 5
    after = model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.slow  # builds and trains a small pipeline
def test_step_seconds_trains_a_sequential_never_called(devices):
    """A Sequential built from `keras.Input` has no `input` until called:
    the calibration reads its single input and output tensors instead."""
    from keras_pipe import calibration
    from keras_pipe.planning.balance import shapes as shapes_lib
    model = keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(8, activation="relu") for _ in range(3)] + [
        keras.layers.Dense(3)])
    shapes = shapes_lib.infer_shapes(graph_lib.read_graph(model))
    seconds = calibration.step_seconds(
        model, devices[:2], [2, 2], 2, "never", 16, shapes,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer_slots=0, steps=2, runs=1)
    assert 0 < seconds < 5


def _validate_planner():
    from tests.support import tools  # noqa: PLC0415
    return tools.load("validate_planner")


def test_the_validation_tables_leave_out_the_trained_configurations():
    tool = _validate_planner()

    def row(schedule, k, m, error):
        return {"model": "m", "schedule": schedule, "num_stages": k, "M": m,
                "rank": 0 if schedule == "zbv" else 1, "measured": 1.0,
                "error": error}

    rows = [row("gpipe", 2, 1, 0.0), row("gpipe", 2, 8, 0.0),
            row("gpipe", 2, 4, 0.3), row("1f1b", 2, 4, -0.1),
            row("zbv", 4, 1, 0.2), row("interleaved_1f1b", 4, 8, 0.0),
            row("interleaved_1f1b", 2, 8, 0.4), row("1f1b", 2, 8, 0.0)]
    assert [tool.calibration_point(r, rows) for r in rows] == [
        True, True, True, False, False, True, False, True]
    (summary,) = tool.per_model(rows)
    assert summary["median_abs_error"] == pytest.approx(0.05)
    assert summary["median_abs_error_others"] == pytest.approx(0.2)
    assert summary["max_abs_error_others"] == pytest.approx(0.4)
    assert summary["pick"] == "zbv K=4 M=1"


def test_the_regret_re_timed_in_turn_is_the_picks_median_over_the_least():
    tool = _validate_planner()
    rows = [{"model": "m", "schedule": s, "num_stages": 2, "M": 2,
             "rank": rank, "measured": measured, "error": 0.0}
            for rank, (s, measured) in enumerate(
                [("zb_h1", 1.10), ("1f1b", 1.00), ("gpipe", 1.20)])]
    # The grid's single measurements say +10%; timed again in turn, the
    # pick's median 1.02 against 1f1b's 1.00.
    confirmed = {"m": {"zb_h1 K=2 M=2": [1.05, 1.02, 0.99],
                       "1f1b K=2 M=2": [1.00, 1.10, 0.98]}}
    (plain,) = tool.per_model(rows)
    (again,) = tool.per_model(rows, confirmed)
    assert plain["regret"] == pytest.approx(0.10)
    assert "confirmed_regret" not in plain
    assert again["confirmed_best"] == "1f1b K=2 M=2"
    assert again["confirmed_regret"] == pytest.approx(0.02)
    assert "+2.0% (1f1b K=2 M=2)" in tool.summary(rows, confirmed)


def test_a_calibration_that_fails_warns_and_the_search_goes_on(
        devices, monkeypatch):
    _measured_without_timing(monkeypatch, 0.0)
    model = _mlp(depth=3, width=16)

    def probe(*args, **kwargs):
        raise ValueError("cannot clone this model")

    monkeypatch.setattr(profiling, "has_step_probe", lambda: True)
    monkeypatch.setattr(profiling, "model_step_seconds", probe)
    with pytest.warns(UserWarning, match="cannot clone this model.*"
                      "calibrate=False"):
        calibrated = autoplan.search(model, devices=devices[:2],
                                     batch_size=32, micro_batch_choices=[1])
    plain = autoplan.search(model, devices=devices[:2], batch_size=32,
                            micro_batch_choices=[1], calibrate=False)
    assert [c.step_time for c in calibrated] == [c.step_time for c in plain]


def test_a_calibration_fit_issues_each_steps_calls_once(devices, monkeypatch):
    # The fits re-simulate each trained step ~50 times per round with other
    # costs: its calls (`simulator.calls`, as much work as the replay) are
    # the same each time, made once with the step's cut and remat.
    _measured_without_timing(monkeypatch, 0.0)
    model = _mlp(depth=3, width=16)
    made, simulated, configured = [], [], []
    calls, simulate = simulator.calls, simulator.simulate
    configure = autoplan._configure

    def counted_calls(*args, **kwargs):
        made.append(args[0])
        return calls(*args, **kwargs)

    def counted_simulate(*args, **kwargs):
        simulated.append(args[0])
        return simulate(*args, **kwargs)

    def counted_configure(*args, **kwargs):
        step = configure(*args, **kwargs)
        configured.extend([step] if isinstance(step, autoplan._Step) else [])
        return step

    def probe(*args, **kwargs):
        return 0.01

    monkeypatch.setattr(simulator, "calls", counted_calls)
    monkeypatch.setattr(simulator, "simulate", counted_simulate)
    monkeypatch.setattr(autoplan, "_configure", counted_configure)
    monkeypatch.setattr(profiling, "has_step_probe", lambda: True)
    monkeypatch.setattr(profiling, "model_step_seconds", probe)
    plain = autoplan.search(model, devices=devices[:2], batch_size=32,
                            micro_batch_choices=[1, 2], calibrate=False)
    assert len(made) == len(configured) == len(simulated)
    n = len(configured)
    made.clear(), simulated.clear(), configured.clear()
    calibrated = autoplan.search(model, devices=devices[:2], batch_size=32,
                                 micro_batch_choices=[1, 2])
    # Two rankings (one bounds what calibration may train) configure and
    # simulate every configuration once each; the trained points are
    # configured once and simulated by the fits many times.
    assert len(made) == len(configured)
    assert len(configured) - 2 * n < (len(simulated) - 2 * n) / 10
    assert len(calibrated) == len(plain)


@pytest.mark.slow
def test_a_search_lets_go_of_its_timing_loops_and_their_weight_copies(
        devices, tmp_path, monkeypatch):
    """The timing loops hold a copy of each layer's weights on the device
    they time; kept after the search, a worker would hold the model's
    weights twice once the pipeline is placed."""
    monkeypatch.setenv("KERAS_PIPE_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(profiling, "cache_path",
                        lambda: tmp_path / "costs.json")
    autoplan.search(_mlp(depth=2), devices=devices[:2], batch_size=16,
                    micro_batch_choices=(1, 2), calibrate=False)
    assert not profiling._LOOPS


@pytest.mark.slow
def test_a_search_holds_one_layer_calls_timing_loops_at_a_time(
        devices, tmp_path, monkeypatch):
    """Measured one layer call at a time over every row count, the device
    holds one call's weight copies at a time, not the model's."""
    monkeypatch.setattr(profiling, "cache_path",
                        lambda: tmp_path / "costs.json")
    held = []
    per_run = profiling._per_run

    def counting(*args, **kwargs):
        held.append(len(profiling._LOOPS))
        return per_run(*args, **kwargs)

    monkeypatch.setattr(profiling, "_per_run", counting)
    autoplan.search(_mlp(depth=2), devices=devices[:2], batch_size=16,
                    micro_batch_choices=(1, 2), calibrate=False)
    assert held and max(held) == 1, held


def test_timing_loops_free_their_weight_copies_without_a_collection(
        devices, tmp_path, monkeypatch):
    """The copies of a layer's weights the timing loops read on the device
    are freed when the loops are let go, with the cyclic collector off: a
    full collection per layer call (what freed them when the traced
    loops captured them) walks a long-lived process's whole heap."""
    import gc
    import weakref
    monkeypatch.setattr(profiling, "cache_path",
                        lambda: tmp_path / "costs.json")
    made, functions = [], profiling._functions

    def keeping(call, training, device=None):
        loops, copies = functions(call, training, device)
        made.extend(weakref.ref(c) for c in copies)
        return loops, copies

    monkeypatch.setattr(profiling, "_functions", keeping)
    graph = graph_lib.read_graph(_mlp(depth=2, width=16))
    gc.collect()
    gc.disable()
    try:
        profiling.call_costs_at(graph, [2, 4], devices[1], target=1e-4,
                                repeats=1, cache=False)
        alive = sum(r() is not None for r in made)
    finally:
        gc.enable()
    assert len(made) == 6  # 3 Dense layers, a kernel and a bias each
    assert alive == 0, f"{alive} of {len(made)} weight copies still held"


@pytest.mark.parametrize("slack, trains", [(1e-9, False), (1e9, True)])
def test_calibration_trains_no_point_that_would_hold_more_than_the_plan(
        devices, monkeypatch, slack, trains):
    """Without a memory budget, a calibration point is trained only if its
    predicted device peak is within `_CALIBRATION_SLACK` of the pick's."""
    _measured_without_timing(monkeypatch, 0.0)
    trained = []

    def probe(*args, **kwargs):
        trained.append(args[-1])
        return 0.01

    monkeypatch.setattr(profiling, "has_step_probe", lambda: True)
    monkeypatch.setattr(profiling, "model_step_seconds", probe)
    monkeypatch.setattr(autoplan, "_CALIBRATION_SLACK", slack)
    autoplan.search(_mlp(depth=3, width=16), devices=devices[:2],
                    batch_size=32, micro_batch_choices=[1, 2])
    assert bool(trained) == trains, trained
