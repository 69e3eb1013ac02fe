"""The GPipe schedule: exact clock ticks, and the executor follows it."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import schedule


def _forwards(ticks):
    """The forward actions of each tick, as (i, j) pairs."""
    return [[(a.i, a.j) for a in tick if a.kind == "F"] for tick in ticks]


def test_gpipe_clock_ticks_exactly():
    ticks = schedule.gpipe(3, 3)
    assert _forwards(ticks)[:5] == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]
    # The backward passes mirror the forward ones, last micro-batch first.
    assert [[(a.i, a.j) for a in tick] for tick in ticks[5:]] == [
        [(2, 2)], [(2, 1), (1, 2)], [(2, 0), (1, 1), (0, 2)],
        [(1, 0), (0, 1)], [(0, 0)]]
    assert all(a.kind == "B" for tick in ticks[5:] for a in tick)
    assert _forwards(schedule.gpipe(1, 1)) == [[(0, 0)], []]
    assert _forwards(schedule.gpipe(2, 1))[:2] == [[(0, 0)], [(1, 0)]]
    assert _forwards(schedule.gpipe(1, 3))[:3] == [[(0, 0)], [(0, 1)],
                                                   [(0, 2)]]


def test_actions_print_as_torch_does():
    assert str(schedule.Action("F", 0, 1)) == "1F0"
    assert [[str(a) for a in tick] for tick in schedule.gpipe(2, 2)] == [
        ["0F0"], ["0F1", "1F0"], ["1F1"], ["1B1"], ["0B1", "1B0"], ["0B0"]]


@pytest.mark.parametrize("m,k", [(1, 4), (4, 1), (5, 3), (16, 4)])
def test_gpipe_dependencies_hold(m, k):
    ticks = schedule.gpipe(m, k)
    assert len(ticks) == 2 * (m + k - 1)
    when = {(a.i, a.j): t for t, tick in enumerate(ticks) for a in tick
            if a.kind == "F"}
    assert sorted(when) == [(i, j) for i in range(m) for j in range(k)]
    for (i, j), t in when.items():
        if j:
            assert when[(i, j - 1)] < t  # left the previous stage
        if i:
            assert when[(i - 1, j)] < t  # stage j finished micro-batch i - 1


def _flat(ticks):
    return [a for tick in ticks for a in tick]


def test_runs_of_backward_passes_defer_their_weight_gradients():
    # GPipe on 2 devices: each device's backward phase is one run.
    actions = schedule.defer_weight_runs(
        _flat(schedule.gpipe(3, 2)), lambda a: a.j, lambda a: True)
    assert [str(a) for a in actions if a.j == 0] == [
        "0F0", "0F1", "0F2", "0B2", "0B1", "0B0", "0W2", "0W1", "0W0"]
    assert [str(a) for a in actions if a.j == 1][-4:] == [
        "1B0", "1W2", "1W1", "1W0"]
    # The W actions come right after the run's last B, before what follows.
    assert actions.index(schedule.Action("W", 2, 1)) == actions.index(
        schedule.Action("B", 0, 1)) + 1
    # 1F1B: only the drain is a run; a lone B keeps its weight gradients.
    actions = schedule.defer_weight_runs(
        _flat(schedule.one_f_one_b(4, 2)), lambda a: a.j, lambda a: True)
    assert [str(a) for a in actions if a.j == 0] == [
        "0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3", "0W2", "0W3"]
    assert not any(a.kind == "W" for a in actions if a.j == 1)
    # Not eligible (remat, or a W of its own): no run through it.
    actions = schedule.defer_weight_runs(
        _flat(schedule.gpipe(3, 1)), lambda a: 0, lambda a: a.i != 1)
    assert not any(a.kind == "W" for a in actions)
    # Two stages on one device: a run is one stage's.
    orders = [[schedule.Action("F", 0, 0), schedule.Action("F", 0, 1),
               schedule.Action("B", 0, 1), schedule.Action("B", 0, 0)]]
    flat = [a for a in orders[0]]
    assert schedule.defer_weight_runs(flat, lambda a: 0,
                                      lambda a: True) == flat


def test_format_schedule_draws_the_bubble():
    assert schedule.format_schedule(schedule.gpipe(3, 2)) == (
        "tick     0  1  2  3  4  5  6  7\n"
        "stage 0 F0 F1 F2  .  . B2 B1 B0\n"
        "stage 1  . F0 F1 F2 B2 B1 B0  .")


def test_registry_names_and_errors():
    assert {"gpipe", "1f1b"} <= set(schedule.schedule_names())
    assert schedule.get_schedule("gpipe").build is schedule.gpipe
    with pytest.raises(ValueError, match="schedule must be one of .*gpipe.*"
                       "Received: schedule='nope'"):
        schedule.get_schedule("nope")
    with pytest.raises(ValueError, match="already registered"):
        schedule.register_schedule("gpipe", schedule.gpipe)
    with pytest.raises(TypeError, match="build must be callable"):
        schedule.register_schedule("x", 3)


def test_deadlocked_orders_are_refused():
    # Stage 0 waits for its own backward before the forward that feeds it.
    orders = [[schedule.Action("B", 0, 0), schedule.Action("F", 0, 0)],
              [schedule.Action("F", 0, 1), schedule.Action("B", 0, 1)]]
    with pytest.raises(ValueError, match=r"deadlocks: \['0B0', '1F0'\]"):
        schedule.ticks_from_orders(orders, 2)


def test_bubble_fraction():
    assert schedule.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert schedule.bubble_fraction(1, 1) == 0.0


@pytest.mark.parametrize("bad", [0, -1])
def test_schedule_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match=f"num_micro_batches must be >= 1. "
                       f"Received: num_micro_batches={bad}"):
        schedule.gpipe(bad, 2)
    with pytest.raises(TypeError, match="num_stages must be an int"):
        schedule.gpipe(2, 2.0)


class Wait(keras.layers.Layer):
    """Identity that takes `seconds` (sleeps in a non-stateful op) and logs."""

    def __init__(self, stage, seconds, record, **kwargs):
        super().__init__(**kwargs)
        # A callable, not the list: Keras would track (copy) a list attribute.
        self.stage, self.seconds, self.record = stage, seconds, record

    def call(self, inputs):
        def wait(x):
            start = time.perf_counter()
            time.sleep(self.seconds)
            # Row ids travel in column 0: the first one names the micro-batch.
            self.record((self.stage, int(x[0, 0]), start,
                             time.perf_counter()))
            return x

        out = tf.numpy_function(wait, [inputs], tf.float32, stateful=False)
        return tf.ensure_shape(out, inputs.shape)


def timed_forward(devices, num_stages, num_micro_batches, seconds):
    log = []
    model = keras_pipe.PipelineModel(
        [Wait(j, seconds, log.append) for j in range(num_stages)],
        devices=devices[:num_stages], num_micro_batches=num_micro_batches)
    batch = 2 * num_micro_batches
    x = np.repeat(np.arange(batch, dtype="float32")[:, None], 3, axis=1)
    forward = tf.function(lambda x: model(x))
    forward(x)  # trace
    elapsed = []
    for _ in range(3):
        log.clear()
        start = time.perf_counter()
        forward(x).numpy()
        elapsed.append(time.perf_counter() - start)
    return min(elapsed), log, batch // num_micro_batches


@pytest.mark.slow
def test_stages_overlap_as_the_schedule_says(devices):
    # K stages, M micro-batches, each stage-time t: the pipeline takes
    # about (M + K - 1) t, a sequential run M K t. Sleeping does not use
    # the CPU, so this holds on 2 shared cores with enough inter-op threads.
    k, m, t = 4, 6, 0.05
    elapsed, log, rows = timed_forward(devices, k, m, t)
    assert len(log) == m * k
    ideal, sequential = (m + k - 1) * t, m * k * t
    assert ideal * 0.95 <= elapsed <= ideal * 1.3 + 0.05, (elapsed, ideal)
    assert elapsed < 0.6 * sequential
    # Execution order follows the schedule: micro-batch i on stage j starts
    # after i left stage j - 1 and after stage j finished i - 1.
    done = {(j, first_row // rows): (s, e) for j, first_row, s, e in log}
    for (j, i), (start, _) in done.items():
        if j:
            assert start >= done[(j - 1, i)][1]
        if i:
            assert start >= done[(j, i - 1)][1]


def test_one_f_one_b_clock_ticks_exactly():
    assert [[(a.kind, a.i, a.j) for a in tick]
            for tick in schedule.one_f_one_b(2, 2)] == [
        [("F", 0, 0)],
        [("F", 1, 0), ("F", 0, 1)],
        [("B", 0, 1)],
        [("B", 0, 0), ("F", 1, 1)],
        [("B", 1, 1)],
        [("B", 1, 0)],
    ]
    assert schedule.format_schedule(schedule.one_f_one_b(3, 2)) == (
        "tick     0  1  2  3  4  5  6  7\n"
        "stage 0 F0 F1  . B0 F2 B1  . B2\n"
        "stage 1  . F0 B0 F1 B1 F2 B2  .")


@pytest.mark.parametrize("m,k", [(1, 1), (1, 4), (3, 2), (8, 4), (16, 3)])
def test_one_f_one_b_dependencies_and_memory_bound(m, k):
    ticks = schedule.one_f_one_b(m, k)
    assert len(ticks) == 2 * (m + k - 1)  # same makespan as GPipe's F + B
    when = {(a.kind, a.i, a.j): t for t, tick in enumerate(ticks)
            for a in tick}
    assert sorted(when) == sorted(
        (kind, i, j) for kind in "FB" for i in range(m) for j in range(k))
    for (kind, i, j), t in when.items():
        if kind == "F" and j:
            assert when[("F", i, j - 1)] < t
        if kind == "B":
            assert when[("F", i, j)] < t
            if j < k - 1:
                assert when[("B", i, j + 1)] < t
    # At most K - j micro-batches in flight (forward done, backward not)
    # on stage j: activations of K micro-batches, not M as in GPipe.
    for j in range(k):
        in_flight = 0
        for tick in ticks:
            for kind, _, jj in ((a.kind, a.i, a.j) for a in tick):
                if jj == j:
                    in_flight += 1 if kind == "F" else -1
                    assert in_flight <= k - j


@pytest.mark.parametrize("name", schedule.schedule_names())
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [2, 4])
def test_every_registered_schedule_is_complete_and_ordered(name, m, k):
    d = k // 2 if name in ("interleaved_1f1b", "zbv") else k
    ticks = schedule.get_schedule(name).build(m, k, d)
    when = {a: t for t, tick in enumerate(ticks) for a in tick}
    kinds = {a.kind for a in when}
    assert len(when) == sum(len(tick) for tick in ticks)  # no action twice
    for i in range(m):
        for j in range(k):
            f, b = schedule.Action("F", i, j), schedule.Action("B", i, j)
            assert f in when and b in when
            assert when[f] < when[b]
            if j:
                assert when[schedule.Action("F", i, j - 1)] < when[f]
            if j < k - 1:
                assert when[schedule.Action("B", i, j + 1)] < when[b]
            if "W" in kinds:
                assert when[b] < when[schedule.Action("W", i, j)]


# ------------------------------------------------- checked before they run

A = schedule.Action
GPIPE_2_2 = [[A("F", 0, 0)], [A("F", 1, 0), A("F", 0, 1)],
             [A("F", 1, 1)], [A("B", 1, 1)], [A("B", 1, 0), A("B", 0, 1)],
             [A("B", 0, 0)]]
WHERE = "Schedule 's' with M=2 micro-batches and K=2 stages"


def _without(ticks, action):
    return [[a for a in tick if a != action] for tick in ticks]


def test_check_ticks_accepts_every_registered_schedule():
    for name in schedule.schedule_names():
        entry = schedule.get_schedule(name)
        for d in (1, 2, 3):
            k = d * (entry.stages_per_device or 2)
            for m in (1, 2, 5, 8):
                try:
                    ticks = entry.build(m, k, d)
                except ValueError:  # counts this schedule refuses
                    continue
                assert schedule.check_ticks(ticks, m, k, name) == [
                    list(t) for t in ticks]
    assert schedule.check_ticks(GPIPE_2_2, 2, 2) == GPIPE_2_2


@pytest.mark.parametrize("ticks, error", [
    # Broke: a dropped B trained silently (weights off by 0.064).
    (_without(GPIPE_2_2, A("B", 1, 0)),
     "action 0B1 \\(B of micro-batch 1 on stage 0\\) is missing: every "
     "\\(micro-batch, stage\\) needs one F and one B"),
    # Broke: AttributeError: 'NoneType' object has no attribute 'shape'.
    (_without(GPIPE_2_2, A("F", 1, 1)),
     "action 1B1 \\(B of micro-batch 1 on stage 1\\) at tick 3 runs before "
     "1F1 has run in an earlier tick: B comes after its own F and after B "
     "of the next stage"),
    ([[A("B", 0, 0)], [A("F", 0, 0)]],
     "action 0B0 .* at tick 0 runs before 0F0 has run"),
    ([[A("F", 0, 1)]], "action 1F0 .* at tick 0 runs before 0F0 has run in "
     "an earlier tick: F of a stage comes after F of the previous stage"),
    ([[A("F", 0, 0), A("F", 0, 1)]], "action 1F0 .* at tick 0 runs before "
     "0F0 has run in an earlier tick"),
    (GPIPE_2_2[:3] + [[A("B", 1, 1)], [A("B", 1, 0), A("B", 0, 0)],
                      [A("B", 0, 1)]],
     "action 0B0 .* at tick 4 runs before 1B0 has run in an earlier tick: B "
     "comes after its own F and after B of the next stage"),
    (GPIPE_2_2[:3] + [[A("W", 1, 1)]] + GPIPE_2_2[3:],
     "action 1W1 .* at tick 3 runs before 1B1 has run in an earlier tick: W "
     "comes after its B"),
    (GPIPE_2_2 + [[A("W", 0, 0)], [A("W", 0, 0)]],
     "action 0W0 .* at tick 7 appears twice: each action runs once"),
    (GPIPE_2_2 + [[A("F", 0, 0)]], "action 0F0 .* at tick 6 appears twice"),
    ([[A("F", 2, 0)]], "action 0F2 .* at tick 0 has micro-batch index 2 out "
     "of range: 0 <= index < 2"),
    ([[A("F", 0, -1)]], "action -1F0 .* has stage index -1 out of range"),
    ([[A("X", 0, 0)]], "action 0X0 .* has kind 'X': kinds are 'F', 'B' and "
     "'W'"),
])
def test_check_ticks_names_the_first_offending_action_and_rule(ticks, error):
    with pytest.raises(ValueError, match=f"^{WHERE}: {error}"):
        schedule.check_ticks(ticks, 2, 2, "s")


@pytest.mark.parametrize("ticks, error", [
    (None, "must build a list of ticks .* Received: None of type NoneType"),
    ([A("F", 0, 0)], "tick 0 must be a list of keras_pipe.engine.schedule.Action"),
    ([[("F", 0, 0)]], "tick 0 must be a list of keras_pipe.engine.schedule.Action"),
])
def test_check_ticks_wants_lists_of_actions(ticks, error):
    with pytest.raises(TypeError, match=error):
        schedule.check_ticks(ticks, 2, 2, "s")


def _register(name, build, **kwargs):
    try:
        schedule.register_schedule(name, build, **kwargs)
    finally:
        schedule._REGISTRY.pop(name, None)


def test_register_checks_the_schedule():
    # Broke: each registered and failed (or trained wrongly) only in fit.
    with pytest.raises(ValueError, match="action 0B1 .* is missing"):
        _register("t_drop_b", lambda m, k, d=None: _without(
            schedule.gpipe(m, k), A("B", 1, 0)))
    with pytest.raises(TypeError, match="must build a list of ticks"):
        _register("t_none", lambda m, k, d=None: None)
    with pytest.raises(ValueError, match=r"build\(1, 1, 1\) raised "
                       "IndexError: boom. build must take"):
        _register("t_raises", lambda m, k, d=None: [][0] if False else
                  (_ for _ in ()).throw(IndexError("boom")))
    # Ticks for the wrong K: stage indices out of range.
    with pytest.raises(ValueError, match="stage index 1 out of range: "
                       "0 <= index < 1"):
        _register("t_wrong_k", lambda m, k, d=None: schedule.gpipe(m, k + 1))
    # Broke: registered, then "Pass 0 stages" at model build.
    with pytest.raises(ValueError, match="stages_per_device must be >= 1. "
                       "Received: stages_per_device=0"):
        _register("t_zero", schedule.gpipe, stages_per_device=0)
    assert not any(n.startswith("t_") for n in schedule.schedule_names())


def test_a_model_checks_its_schedule_for_its_counts(devices):
    # Correct for the counts tried at registration, wrong for M=3.
    def build(m, k, d=None):
        ticks = schedule.gpipe(m, k)
        return _without(ticks, A("B", 2, 0)) if m == 3 else ticks

    schedule.register_schedule("t_wrong_at_3", build)
    try:
        stages = [keras.layers.Dense(2), keras.layers.Dense(2)]
        with pytest.raises(ValueError, match="Schedule 't_wrong_at_3' with "
                           "M=3 micro-batches and K=2 stages: action 0B2"):
            keras_pipe.PipelineModel(stages, devices=devices[:2],
                                     num_micro_batches=3,
                                     schedule="t_wrong_at_3")
    finally:
        schedule._REGISTRY.pop("t_wrong_at_3", None)


def test_weight_gradients_wait_for_no_later_backward_pass():
    # With `num_stages` (as the executor runs a step), a run is deferred
    # only where its input gradients arrive back to back (GPipe); 1F1B's
    # drain waits for the next stage micro-batch by micro-batch, so each W
    # follows its own B: a W held to the run's end waits for every later
    # B and so for the other device, and runs in the step's tail.
    def issued(ticks, k, stage_device):
        return schedule.defer_weight_runs(
            _flat(ticks), lambda a: stage_device(a.j), lambda a: True, k)

    gpipe = issued(schedule.gpipe(3, 2), 2, lambda j: j)
    assert gpipe == schedule.defer_weight_runs(
        _flat(schedule.gpipe(3, 2)), lambda a: a.j, lambda a: True)
    for ticks, k, stage_device in [
            (schedule.one_f_one_b(4, 2), 2, lambda j: j),
            (schedule.one_f_one_b(8, 4), 4, lambda j: j),
            (schedule.interleaved_1f1b(4, 4, 2), 4, lambda j: j % 2)]:
        actions = issued(ticks, k, stage_device)
        for n, a in enumerate(actions):
            if a.kind == "B" and a.j > 0:
                assert actions[n + 1] == schedule.Action("W", a.i, a.j), (
                    [str(b) for b in actions])
        # The first stage sends no input gradient back: whole B calls.
        assert not any(a.kind == "W" and a.j == 0 for a in actions)
    # Two stages on one device: no split either (a second call, no gain).
    actions = issued(schedule.one_f_one_b(4, 2), 2, lambda j: 0)
    assert not any(a.kind == "W" for a in actions)
    # A run fed by a run that is not deferred is not deferred either.
    orders = [[schedule.Action("F", i, 0) for i in range(2)] +
              [schedule.Action("B", i, 0) for i in range(2)],
              [schedule.Action("F", 0, 1), schedule.Action("B", 0, 1),
               schedule.Action("F", 1, 1), schedule.Action("B", 1, 1)]]
    actions = issued(schedule.ticks_from_orders(orders, 2), 2, lambda j: j)
    assert [str(a) for a in actions if a.j == 0][-2:] == ["0B0", "0B1"]
