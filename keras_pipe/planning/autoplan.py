"""`schedule="auto"`: the configuration with the least simulated step time.

The choices a user otherwise makes by hand -- the schedule, one or two
stages per device, `num_micro_batches`, the cut and each stage's remat mode
-- are made together: for every registered schedule (built-in or
registered by the user), every stages-per-device count it allows and every
`M`, the cut is the one that minimises the slowest stage's measured work
(`keras_pipe.planning.profiling`) among the cuts whose stages fit `memory_budget`
under the fastest remat mode that fits (`keras_pipe.planning.memory`); then the
whole step is simulated (`keras_pipe.planning.simulator`) with those costs,
transfer times, a stage call's and a step's fixed costs
(`keras_pipe.calibration`) and each stage's optimizer update, and the
configurations are ranked by the simulated step time. Among those within
`NEAR_FASTEST` of the fastest (as fast as the simulator can tell), the pick
is the one whose fullest device holds the least.
"""

import dataclasses
import warnings

import numpy as np

from keras_pipe import _validation
from keras_pipe.engine import placement
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import budget as budget_lib
from keras_pipe.planning import graph as graph_lib
from keras_pipe.planning import memory as memory_lib
from keras_pipe.planning import partition as partition_lib
from keras_pipe.planning import profiling, simulator
from keras_pipe.planning.balance import shapes as shapes_lib

__all__ = ["Candidate", "calibration_points", "fit_scale", "scale_at",
           "search"]

_MODES = ("never", "except_last", "always")  # fastest first


@dataclasses.dataclass
class Candidate:
    """One configuration and its simulated step.

    Attributes:
        schedule: the schedule's registered name.
        num_stages: `K`.
        stage_devices: per stage, its device index.
        num_micro_batches: `M`.
        sizes: layer calls per stage.
        remat: one remat mode per stage.
        step_time: simulated seconds per training step.
        idle: per device, the simulated idle share of the step.
        peak_memory: per device, the predicted peak (bytes; the sum of its
            stages' peaks).
        stage_peak_memory: per stage, its predicted peak (bytes).
    """

    schedule: str
    num_stages: int
    stage_devices: list
    num_micro_batches: int
    sizes: list
    remat: list
    step_time: float
    idle: list
    peak_memory: list
    stage_peak_memory: list

    def __str__(self):
        return (f"schedule={self.schedule!r} num_stages={self.num_stages} "
                f"M={self.num_micro_batches} sizes={self.sizes} "
                f"remat={self.remat}: {self.step_time * 1e3:.2f} ms")


def layouts(num_devices):
    """`(name, stage_devices)` of every registered schedule on `num_devices`
    devices: one stage per device, and two where the schedule places several
    on a device (`placement`), or the count it needs."""
    result = []
    for name in schedule_lib.schedule_names():
        entry = schedule_lib.get_schedule(name)
        if entry.stages_per_device:
            counts = [entry.stages_per_device]
        elif entry.placement:
            counts = [1, 2]
        else:
            counts = [1]
        for v in counts:
            k = v * num_devices
            result.append((name, schedule_lib.stage_placement(
                k, num_devices, entry.placement or "loop")))
    return result


def _budgets(memory_budget, num_devices):
    """One budget per device, or None without a budget."""
    if memory_budget is None:
        return None
    return budget_lib.budgets_per_device(memory_budget, num_devices)


def _prefix(values):
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, float))])


def _block(prefix):
    return prefix[None, :] - prefix[:, None]


class _Measured:
    """Costs per micro-batch size, measured (or from FLOPs) once each; the
    step's fixed costs, transfers and optimizer updates."""

    def __init__(self, graph, shapes, devices, measure, flops_per_second,
                 optimizer_slots, loss=None):
        self.graph, self.shapes = graph, shapes
        self.loss = loss
        self._losses = {}
        self.device = devices[0] if devices else None
        self.measure = measure
        self.flops_per_second = flops_per_second
        self._calls = {}
        if measure:
            self.overhead = profiling.step_overhead(devices)
            distinct = list(dict.fromkeys(devices or []))
            self.link = (profiling.link(distinct[0], distinct[1])
                         if len(distinct) > 1 else profiling.Link(0.0, 1e12))
            rate = profiling.update_rate(self.device, optimizer_slots)
        else:
            self.overhead = profiling.Overhead(0.0, 2e-4, False)
            self.link = profiling.Link(1e-3, 5e9)
            rate = profiling.flops_update_rate(optimizer_slots,
                                               flops_per_second)
        self.update = _prefix(profiling.update_seconds(graph, rate))
        self.weighted = np.array([bool(getattr(c.operation,
                                               "trainable_variables", None))
                                  for c in graph.calls])
        self.scales = {}  # rows -> the step's scale of the layers' work
        self.receive = 0.0  # seconds per input received from another device
        self.weight_call = 0.0  # seconds per layer with weights of a W call

    def prepare(self, all_rows):
        """Measures every row count at once and `smooth`s them together."""
        all_rows = sorted(set(all_rows))
        self._measure([r for r in all_rows if r not in self._calls])
        for rows, costs in zip(all_rows, profiling.smooth(
                [self._calls[r] for r in all_rows])):
            self._calls[rows] = costs

    def scale(self, rows):
        """The factor the layers' work of `rows`-row micro-batches takes in
        a step (`calibrate`): 1 without calibration."""
        return scale_at(self.scales, rows)

    def loss_seconds(self, rows):
        """The loss head's seconds for `rows` rows (0 without a loss or
        without measuring), scaled as the layers' work."""
        if self.loss is None or not self.measure:
            return 0.0
        if rows not in self._losses:
            self._losses[rows] = profiling.loss_seconds(
                self.loss, self.graph.outputs, rows, self.device,
                self.shapes)
        return self._losses[rows] * self.scale(rows)

    def _measure(self, all_rows):
        if not all_rows:
            return
        if self.measure:
            # One layer call at a time over every row count: the device
            # holds one call's weights at a time (`call_costs_at`).
            costs = profiling.call_costs_at(self.graph, all_rows,
                                            self.device, self.shapes)
        else:
            costs = [profiling.flops_costs(self.graph, rows,
                                           self.flops_per_second, self.shapes)
                     for rows in all_rows]
        self._calls.update(zip(all_rows, costs))

    def _measured(self, rows):
        if rows not in self._calls:
            self._measure([rows])
        return self._calls[rows]

    def calls(self, rows):
        """Per layer call, its costs for `rows` rows, scaled."""
        costs, s = self._measured(rows), self.scale(rows)
        if s == 1.0:
            return costs
        return profiling.CallCosts(
            rows, [t * s for t in costs.forward],
            [t * s for t in costs.backward_input],
            [t * s for t in costs.weight], costs.measured)


def scale_at(scales, rows):
    """The scale at `rows` from scales measured at some row counts
    (`{rows: scale}`): linear in log(rows) between the two nearest, the
    nearest's outside them, 1.0 with none.

    ```python
    scale_at({4: 1.0, 16: 1.5}, 8)  # 1.25
    ```
    """
    if not scales:
        return 1.0
    known = sorted(scales)
    return float(np.interp(np.log(rows), np.log(known),
                           [scales[r] for r in known]))


def fit_scale(simulated, measured, low=1 / 16, high=16.0):
    """The value `s` in [`low`, `high`] whose `simulated(s)` (a step time
    that grows with `s`) is `measured`: bisection in log(s); `low` or
    `high` where even those miss.

    ```python
    fit_scale(lambda s: 0.002 + 0.010 * s, 0.017)  # 1.5
    ```
    """
    if simulated(low) >= measured:
        return low
    if simulated(high) <= measured:
        return high
    a, b = np.log(low), np.log(high)
    for _ in range(50):
        mid = (a + b) / 2
        if simulated(float(np.exp(mid))) < measured:
            a = mid
        else:
            b = mid
    return float(np.exp((a + b) / 2))


def _least_peak(actions, m, j, k, grid, weights, trainable,
                optimizer_slots, batch_size):
    """Per block, the stage's least peak over the remat modes."""
    fixed = weights + optimizer_slots * trainable
    return np.min([fixed + (grid @ memory_lib.moments(
        actions, mode, m, j == 0, j == k - 1, optimizer_slots,
        memory_lib.transposes(mode, batch_size, m)).sum(
            axis=1).T).max(axis=-1)
        for mode in _MODES], axis=0)


@dataclasses.dataclass
class _Step:
    """One configuration's cut and remat, ready to simulate."""

    ticks: list
    stage_devices: list
    num_micro_batches: int
    rows: int
    spans: list          # per stage, (first call, end call)
    remat: list
    output_bytes: list   # per stage, bytes of its outputs per micro-batch
    weighted: object     # per layer call, whether it has weights
    stage_peaks: list
    issued: tuple        # `simulator.calls` of the step: made once, as a
    #                      fit re-simulates the step with other costs


def _step_costs(step, measured, batch_size):
    """The simulator's costs of `step` with `measured`'s costs now (its
    calibration's scales and receive cost)."""
    costs = measured.calls(step.rows)

    def per_stage(values):
        prefix = _prefix(values)
        return [float(prefix[e] - prefix[a]) for a, e in step.spans]

    # A split weight-gradient call ("W") replays the stage's mixing ops on
    # their stashed inputs (`keras_pipe.engine.weight_grad`) under a tape,
    # but a weight gradient of a product reads its inputs and output
    # gradient only: the replayed forward feeds no output of the traced
    # call and TF prunes it. So "W" costs the weight gradients alone.
    backward_input = per_stage(costs.backward_input)
    weight = per_stage(costs.weight)
    return simulator.Costs(
        forward=per_stage(costs.forward),
        backward=[b + w for b, w in zip(backward_input, weight)],
        backward_input=backward_input,
        weight=weight,
        call=measured.overhead.call, output_bytes=step.output_bytes,
        latency=measured.link.latency,
        bytes_per_second=measured.link.bytes_per_second,
        update=[float(measured.update[e] - measured.update[a])
                for a, e in step.spans],
        step=measured.overhead.step, loss=measured.loss_seconds(step.rows),
        full_loss=measured.loss_seconds(batch_size),
        receive=measured.receive,
        weight_call=[measured.weight_call * float(
            np.sum(step.weighted[a:e])) for a, e in step.spans])


def _step_time(step, measured, batch_size):
    """`step`'s simulated step time (seconds) with `measured`'s costs."""
    return simulator.simulate(step.ticks, step.stage_devices,
                              _step_costs(step, measured, batch_size),
                              step.remat, step.num_micro_batches,
                              step.issued).step_time


def _configure(name, stage_devices, m, batch_size, graph, measured,
               budgets, optimizer_slots, allowed):
    """The best cut and remat of one (schedule, layout, M) as a `_Step`;
    or, when nothing fits, the least device budget that would (bytes); None
    if the schedule cannot run this layout."""
    k, n = len(stage_devices), len(graph.calls)
    num_devices = 1 + max(stage_devices)
    build = schedule_lib.get_schedule(name).build
    try:
        ticks = build(m, k, num_devices)
    except ValueError:
        return None
    rows = -(-batch_size // m)
    costs = measured.calls(rows)
    f = _block(_prefix(costs.forward))
    bi = _block(_prefix(costs.backward_input))
    w = _block(_prefix(costs.weight))
    profile = memory_lib.Profile(graph, rows)
    grid, weights, trainable = budget_lib.block_grid(profile, n)
    actions = memory_lib.stage_actions(lambda mm, kk: ticks, m, k)
    per_device = [stage_devices.count(d) for d in range(num_devices)]
    modes = _MODES if budgets else ("never",)
    times, chosen, peaks = [], [], []
    for j in range(k):
        time_j = np.full((n + 1, n + 1), np.inf)
        mode_j = np.full((n + 1, n + 1), -1)
        peak_j = np.full((n + 1, n + 1), np.inf)
        fixed = weights + optimizer_slots * trainable
        for index, mode in enumerate(modes):
            forms = memory_lib.moments(
                actions[j], mode, m, j == 0, j == k - 1, optimizer_slots,
                memory_lib.transposes(mode, batch_size, m)).sum(axis=1)
            peak = fixed + (grid @ forms.T).max(axis=-1)
            recomputed = {"never": 0, "except_last": m - 1,
                          "always": m}[mode]
            work = m * (f + bi + w) + recomputed * f
            fits = ~np.isfinite(time_j)
            if budgets:
                share = budgets[stage_devices[j]] / per_device[
                    stage_devices[j]]
                fits &= peak <= share
            time_j = np.where(fits, work, time_j)
            mode_j = np.where(fits, index, mode_j)
            peak_j = np.where(fits, peak, peak_j)
        times.append(time_j)
        chosen.append(mode_j)
        peaks.append(peak_j)
    # Stages sharing a device add up there; balancing each stage's own work
    # is what a schedule placing several per device expects.
    _, sizes = budget_lib.min_max_cut(times, allowed, k)
    if sizes is None:
        # What the least-memory cut needs on its fullest stage's device.
        need, _ = budget_lib.min_max_cut(
            [_least_peak(actions[j], m, j, k, grid, weights, trainable,
                         optimizer_slots, batch_size)
             * per_device[stage_devices[j]]
             for j in range(k)], allowed, k)
        return need
    remat, stage_peaks, spans, start = [], [], [], 0
    for j, size in enumerate(sizes):
        remat.append(modes[int(chosen[j][start, start + size])])
        stage_peaks.append(float(peaks[j][start, start + size]))
        spans.append((start, start + size))
        start += size
    out_bytes = [profile.output_bytes if e == n else profile.gap[e - 1]
                 for _, e in spans]
    return _Step(ticks, list(stage_devices), m, rows, spans, remat,
                 out_bytes, measured.weighted, stage_peaks,
                 simulator.calls(ticks, stage_devices, remat, m))


def _device_peaks(step):
    """Per device, the sum of its stages' predicted peaks (bytes)."""
    peaks = [0.0] * (1 + max(step.stage_devices))
    for j, d in enumerate(step.stage_devices):
        peaks[d] += step.stage_peaks[j]
    return peaks


def _candidate(name, stage_devices, m, batch_size, graph, measured,
               budgets, optimizer_slots, allowed):
    """The best cut and remat of one (schedule, layout, M), simulated; or,
    when nothing fits, the least device budget that would (bytes); None if
    the schedule cannot run this layout."""
    step = _configure(name, stage_devices, m, batch_size, graph, measured,
                      budgets, optimizer_slots, allowed)
    if not isinstance(step, _Step):
        return step
    result = simulator.simulate(step.ticks, step.stage_devices,
                                _step_costs(step, measured, batch_size),
                                step.remat, m, step.issued)
    device_peaks = _device_peaks(step)
    return Candidate(name, len(stage_devices), list(stage_devices), m,
                     [e - a for a, e in step.spans], step.remat,
                     result.step_time, result.idle,
                     [int(p) for p in device_peaks],
                     [int(p) for p in step.stage_peaks])


def calibration_points(num_devices, ms):
    """What `search(calibrate=True)` trains, `(schedule, stage_devices, M,
    fitted)`: GPipe with one stage per device at the least, the middle and
    the largest `M` fits the scale of the layers' work at those micro-batch
    sizes (`"scale"`; the middle: the `M` nearest the geometric mean of the
    two others, the larger of two as near); when registered, interleaved
    1F1B with two stages per device at the largest `M` fits the cost of
    receiving an input (`"receive"`: it receives twice as often) and 1F1B
    at the largest `M` the cost of a weight-gradient call
    (`"weight_call"`: one per micro-batch where GPipe has one in all).

    ```python
    [(name, m) for name, _, m, _ in calibration_points(2, [1, 2, 4, 8])]
    # [('gpipe', 1), ('gpipe', 4), ('gpipe', 8), ('interleaved_1f1b', 8),
    #  ('1f1b', 8)]
    ```
    """
    middle = np.log2(ms[0] * ms[-1]) / 2
    mid = min(reversed(ms), key=lambda m: round(abs(np.log2(m) - middle), 9))
    points = [("gpipe", list(range(num_devices)), m, "scale")
              for m in dict.fromkeys((ms[0], mid, ms[-1]))]
    names = schedule_lib.schedule_names()
    if num_devices > 1 and "interleaved_1f1b" in names:
        entry = schedule_lib.get_schedule("interleaved_1f1b")
        points.append(("interleaved_1f1b", schedule_lib.stage_placement(
            2 * num_devices, num_devices, entry.placement or "loop"),
            ms[-1], "receive"))
    if ms[-1] > 1 and "1f1b" in names:
        points.append(("1f1b", list(range(num_devices)), ms[-1],
                       "weight_call"))
    return points


_MAX_FIXED = 0.05  # seconds per received input or call the fits may reach
# Without a memory budget, a calibration point is trained only if its
# predicted peak on every device is at most this many times the largest
# device peak of the pick without calibration: planning holds about what
# the plan will.
_CALIBRATION_SLACK = 1.25
_ROUNDS = 100  # at most, alternations of the fits


def _calibrate(model, measured, devices, ms, batch_size, budgets,
               optimizer_slots, allowed, input_shape, sample_inputs,
               bound=None):
    """Trains the `calibration_points` and fits what each one fits so that
    its simulated step is its measured step: `measured.scales` at its rows,
    `measured.receive` or `measured.weight_call`. Each step depends on all
    of them, so the fits alternate until none moves (1e-6). A point whose
    predicted peak on a device is over `bound` bytes is not trained (what
    it fits keeps its default)."""
    trained = []
    for name, stage_devices, m, fitted in calibration_points(len(devices),
                                                             ms):
        step = _configure(name, stage_devices, m, batch_size, measured.graph,
                          measured, budgets, optimizer_slots, allowed)
        if not isinstance(step, _Step):
            continue  # cannot run, or does not fit the budget: not trained
        if bound is not None and max(_device_peaks(step)) > bound:
            continue  # would hold more than the plan: not trained
        try:
            seconds = profiling.model_step_seconds(
                model, measured.graph, measured.shapes,
                expand_devices(devices, stage_devices),
                [e - a for a, e in step.spans], m, step.remat, batch_size,
                input_shape, sample_inputs, measured.loss, optimizer_slots,
                name)
        except Exception as exc:  # noqa: BLE001 - the search goes on
            warnings.warn(
                f"keras_pipe could not train {name} with M={m} to calibrate "
                f"the planner's costs ({type(exc).__name__}: "
                f"{str(exc)[:200]}); the planner goes on without what it "
                f"fits ({fitted!r}), so its step times may miss what a step "
                "adds to the layer costs (tens of percent on some "
                "models). Pass calibrate=False to skip the calibration.",
                stacklevel=3)
            continue
        trained.append((step, seconds, fitted))

    def state():
        return [*sorted(measured.scales.items()), measured.receive,
                measured.weight_call]

    rounds = _ROUNDS if any(f != "scale" for _, _, f in trained) else 1
    for _ in range(rounds):
        before = state()
        for step, seconds, fitted in trained:

            def simulated(value, step=step, fitted=fitted):
                if fitted == "scale":
                    measured.scales[step.rows] = value
                else:
                    setattr(measured, fitted, value)
                return _step_time(step, measured, batch_size)

            if fitted == "scale":
                value = fit_scale(simulated, seconds)
            elif simulated(0.0) >= seconds:
                value = 0.0
            else:
                value = fit_scale(simulated, seconds, low=1e-9,
                                  high=_MAX_FIXED)
            simulated(value)
        after = state()
        if len(before) == len(after) and all(
                np.allclose(x, y, rtol=1e-6, atol=1e-12)
                for x, y in zip(before, after)):
            break


def search(model, devices=None, num_devices=None, batch_size=None,
           memory_budget=None, micro_batch_choices=(1, 2, 4, 8),
           schedules=None, optimizer_slots=2, measure=True,
           flops_per_second=2e10, input_shape=None, sample_inputs=None,
           loss=None, calibrate=True):
    """Every configuration that fits: the pick, then fastest first.

    The pick is the configuration that holds the least (its largest device
    peak) among those whose simulated step is within `NEAR_FASTEST` of
    the fastest.

    ```python
    ranked = keras_pipe.planning.autoplan.search(model, devices=devices,
                                        batch_size=256)
    ranked[0]          # the pick; ranked[1:] the runner-ups
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.
        devices: the devices (one per device, not per stage); costs are
            measured on the first, transfers between the first two.
            Defaults to `None`.
        num_devices: `D` when `devices` is not given. Defaults to `None`.
        batch_size: rows per mini-batch (required).
        memory_budget: bytes per device, or a list of one per device.
            Defaults to `None` (no limit: every stage `remat="never"`).
        micro_batch_choices: the `M` values to try. Defaults to
            `(1, 2, 4, 8)`.
        schedules: the schedule names to try. Defaults to `None` (every
            registered schedule).
        optimizer_slots: optimizer variables per weight (Adam 2, SGD 0).
            Defaults to `2`.
        measure: time the calls on `devices[0]`; `False` costs them from
            FLOPs at `flops_per_second` (with a warning). Defaults to
            `True`.
        flops_per_second: the FLOP rate of the FLOPs fallback. Defaults
            to `2e10`.
        input_shape, sample_inputs: as in `keras_pipe.plan`. Default to
            `None`.
        loss: the loss the pipeline will be compiled with, to time the loss
            head (`profiling.loss_seconds`). Defaults to `None`: the
            model's compiled loss if it has one, else the loss head is not
            costed.
        calibrate: with `measure` and at least two devices, train GPipe
            (one stage per device, on a clone of `model`) at the least,
            a middle and the largest `M` and scale the layers' measured
            work to the steps it measured, linearly in log(rows) between
            them;
            interleaved 1F1B with two stages per device and 1F1B at the
            largest `M`, to fit the cost of receiving an input from
            another device and of a weight-gradient call
            (`calibration_points`, `keras_pipe.calibration.step_seconds`;
            cached like the costs). A step runs its calls longer than the
            profile's loop on some models. A point is trained only if its
            predicted peak fits `memory_budget`, or without one, at most
            `_CALIBRATION_SLACK` times the device peak of the pick without
            calibration (planning holds about what the plan will). `False`
            skips it (the clone and its pipeline hold a second copy of the
            weights while they train). Defaults to `True`.

    Returns:
        A list of `Candidate`s: the pick, then the others fastest first.

    Raises:
        ValueError: without `batch_size`, without `devices` and
            `num_devices`, for an unknown schedule name, and when no
            configuration fits `memory_budget` (naming the smallest peak
            any reached).
    """
    if batch_size is None:
        raise ValueError(
            'schedule="auto" needs batch_size: the costs and the memory '
            "depend on the rows per micro-batch. Received: batch_size=None")
    _validation.check_positive_int("batch_size", batch_size)
    if devices is not None:
        devices = placement.resolve_devices(list(devices))
        num_devices = len(dict.fromkeys(devices))
    if num_devices is None:
        raise ValueError(
            'schedule="auto" needs devices=[...] (or num_devices). '
            "Received: devices=None, num_devices=None")
    _validation.check_positive_int("num_devices", num_devices)
    for name in schedules or ():
        schedule_lib.get_schedule(name)
    budgets = _budgets(memory_budget, num_devices)
    graph = graph_lib.read_graph(model)
    shapes = shapes_lib.infer_shapes(graph, input_shape, sample_inputs,
                                     what='schedule="auto"')
    allowed = np.array(partition_lib.allowed_cuts(graph), bool)
    if loss is None:
        loss = getattr(model, "loss", None)
    measured = _Measured(graph, shapes, list(dict.fromkeys(devices or [])),
                         measure, flops_per_second, optimizer_slots, loss)
    ms = sorted({min(_validation.check_positive_int("micro_batch_choices",
                                                   m), batch_size)
                 for m in micro_batch_choices})

    def rank():
        return _rank(graph, num_devices, schedules, allowed, ms, batch_size,
                     measured, budgets, optimizer_slots)

    try:
        measured.prepare(-(-batch_size // m) for m in ms)
        distinct = list(dict.fromkeys(devices or []))
        if calibrate and measure and len(distinct) > 1 and (
                profiling.has_step_probe()):
            bound = None
            if not budgets:  # training holds no more than the plan will
                first, _ = rank()
                if first:  # else nothing to plan: the error comes below
                    bound = _CALIBRATION_SLACK * max(first[0].peak_memory)
            _calibrate(model, measured, distinct, ms, batch_size, budgets,
                       optimizer_slots, allowed, input_shape, sample_inputs,
                       bound)
    finally:
        # The timing loops hold copies of the layers' weights on the
        # device they timed: gone before the pipeline's own weights come.
        profiling.release_loops()
    ranked, needs = rank()
    if not ranked:
        least = f" {int(np.ceil(min(needs)))} bytes" if needs else ""
        raise ValueError(
            f"No schedule, stages per device, num_micro_batches in {ms}, "
            f"cut and remat of {model.name!r} fits memory_budget="
            f"{memory_budget} on {num_devices} devices with batch_size="
            f"{batch_size}: the smallest budget that fits is{least} per "
            "device. Raise memory_budget to at least that, lower "
            "batch_size, or use more devices.")
    return ranked


def _rank(graph, num_devices, schedules, allowed, ms, batch_size, measured,
          budgets, optimizer_slots):
    """`(candidates: the pick, then fastest first; the least budgets of
    those that did not fit)` over every layout, schedule and `M`, with
    `measured`'s costs."""
    ranked, needs = [], []
    for name, stage_devices in layouts(num_devices):
        if schedules is not None and name not in schedules:
            continue
        if len(stage_devices) > len(graph.calls) or (
                int(allowed.sum()) < len(stage_devices) - 1):
            continue
        for m in ms:
            found = _candidate(name, stage_devices, m, batch_size, graph,
                               measured, budgets, optimizer_slots, allowed)
            if isinstance(found, Candidate):
                ranked.append(found)
            elif found is not None:
                needs.append(found)
    ranked.sort(key=lambda c: (c.step_time, c.num_stages,
                               c.num_micro_batches))
    return _least_memory_first(ranked), needs


# Configurations whose simulated step is within this share of the fastest
# are as fast as the simulator can tell: the pick among them is the one
# that holds the least.
NEAR_FASTEST = 0.03


def _least_memory_first(ranked):
    """`ranked` (fastest first) with the pick moved to the front: the least
    largest device peak among the configurations within `NEAR_FASTEST` of
    the fastest step (the faster of equal peaks)."""
    if not ranked:
        return ranked
    near = [c for c in ranked
            if c.step_time <= ranked[0].step_time * (1 + NEAR_FASTEST)]
    pick = min(near, key=lambda c: max(c.peak_memory))
    return [pick] + [c for c in ranked if c is not pick]


def expand_devices(devices, stage_devices):
    """The device string of each stage: `devices[stage_devices[j]]`."""
    distinct = list(dict.fromkeys(devices))
    return [distinct[d] for d in stage_devices]

