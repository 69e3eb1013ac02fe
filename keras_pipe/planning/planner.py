"""A dry run of `PipelineModel.from_model`: where it cuts, what it costs.

`plan` reads the model's graph, cuts it as `from_model` would, and estimates
per stage the parameters, forward FLOPs, boundary bytes and peak training
memory, plus the GPipe bubble and the step time. It builds no pipeline and
moves no variable, so it runs on a laptop for a model meant for 8 GPUs;
only `schedule="auto"` with measured costs trains a clone of the model on
the devices to calibrate them (`calibrate=False` does not).
"""

import dataclasses
import math
import warnings

from keras_pipe import _validation
from keras_pipe.engine import building
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import autoplan, choices
from keras_pipe.planning import budget as budget_lib
from keras_pipe.planning import memory as memory_lib
from keras_pipe.planning import partition as partition_lib
from keras_pipe.planning.balance import cost as cost_lib
from keras_pipe.planning.balance import shapes as shapes_lib

__all__ = ["Plan", "StagePlan", "plan"]

# `keras_pipe.planning.profiling.flops_costs`' warning, which a plan left
# to the planner on logical devices does not raise (`choices.measured`).
_FLOPS_WARNING = "keras_pipe is costing the model from FLOPs"


@dataclasses.dataclass
class StagePlan:
    """Estimates for one stage; sizes are per micro-batch.

    Attributes:
        index: the stage number `j`.
        layers: names of the layer calls of the stage, in order.
        params: weights the stage uses (tied weights count in each stage).
        flops: estimated forward FLOPs for one micro-batch.
        input_bytes: bytes of the tensors the stage receives per
            micro-batch (the model inputs for stage 0).
        output_bytes: bytes of the tensors it sends on per micro-batch.
        peak_memory_bytes: estimated training memory: weights, gradients,
            optimizer slots and the activations kept under `remat`.
        time: measured forward seconds per micro-batch (`balance="time"`),
            else `None`.
        cost: the stage's total of the balanced cost, `None` for an
            explicit balance.
    """

    index: int
    layers: list
    params: int
    flops: float
    input_bytes: int
    output_bytes: int
    peak_memory_bytes: int
    time: object
    cost: object

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def first_layer(self):
        return self.layers[0]

    @property
    def last_layer(self):
        return self.layers[-1]


@dataclasses.dataclass
class Plan:
    """How a model would be pipelined; `str(plan)` is a per-stage table.

    Attributes:
        model_name: the model's name.
        num_stages: `K`.
        num_micro_batches: `M`.
        micro_batch_size: rows per micro-batch the sizes are for.
        balance: the `balance` argument.
        remat: the remat mode the memory estimate assumes.
        stages: one `StagePlan` per stage.
        sizes: layer calls per stage; `from_model(..., balance=plan.sizes)`
            reproduces this cut.
        tied: `(layers, stages)` for layers whose weights several stages
            share.
        bubble_fraction: `(K - 1) / (M + K - 1)`, the idle share of a step.
        step_time: estimated seconds per training step, or `None` when
            neither times nor `flops_per_second` are known.
        suggestion: advice on `num_micro_batches`, or `None`.
        budget: the `keras_pipe.planning.budget.Choice` when `memory_budget` was
            given (cut, `M` and remat chosen to fit it), else `None`.
        opaque: `(call name, class name, reason)` of each call that runs
            whole: a layer with its own `call()` around other layers, which
            no cut can fall inside (nested Functional and Sequential models
            are opened instead).
        schedule: the schedule's name.
        devices: the device of each stage (`None` without `devices`).
        stage_devices: per stage, its device index.
        peak_memory: with `schedule="auto"`, the predicted peak of each
            device (bytes), else `None`.
        idle: with `schedule="auto"`, each device's simulated idle share.
        runner_ups: with `schedule="auto"`, the other
            `keras_pipe.planning.autoplan.Candidate`s, fastest first.
    """

    model_name: str
    num_stages: int
    num_micro_batches: int
    micro_batch_size: int
    balance: object
    remat: str
    stages: list
    sizes: list
    tied: list
    bubble_fraction: float
    step_time: object
    suggestion: object
    budget: object = None
    opaque: list = dataclasses.field(default_factory=list)
    schedule: str = "gpipe"
    devices: list = None
    stage_devices: list = None
    peak_memory: list = None
    idle: list = None
    runner_ups: list = dataclasses.field(default_factory=list)

    def __str__(self):
        return _format(self)


def _remat_factor(remat, num_micro_batches):
    """Step work in forward passes: forward + backward (~2) + recompute.

    For one mode per stage, the largest factor.
    """
    recompute = {"always": 1.0, "never": 0.0,
                 "except_last": (num_micro_batches - 1) / num_micro_batches}
    if isinstance(remat, (list, tuple)):
        return 3.0 + max(recompute[mode] for mode in remat)
    return 3.0 + recompute[remat]


def _stage_weights(calls):
    """The variables of a stage's layers (layer weights), each once."""
    seen, weights = set(), []
    for call in calls:
        for v in getattr(call.operation, "weights", None) or []:
            if id(v) not in seen:
                seen.add(id(v))
                weights.append(v)
    return weights


def plan(model, num_stages=None, num_micro_batches=None, balance=None,
         remat=None, batch_size=None, devices=None,
         optimizer_slots=2, flops_per_second=None, memory_budget=None,
         schedule=None, input_shape=None, sample_inputs=None,
         micro_batch_choices=(1, 2, 4, 8), measure=None, loss=None,
         calibrate=True):
    """Plans the pipeline `PipelineModel.from_model` would build, without it.

    ```python
    model = keras.applications.ResNet50(weights=None)
    p = keras_pipe.plan(model, num_stages=4, num_micro_batches=16,
                        batch_size=256)
    print(p)                # a table, one row per stage
    p.stages[0].params      # the same data, for tools

    # Let the planner choose the cut, M and per-stage remat for 1 GiB each:
    p = keras_pipe.plan(model, devices=devices, memory_budget=2**30,
                        batch_size=256)
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.
        num_stages: `K`, number of stages. Defaults to `None`: one stage per
            device of `devices`.
        num_micro_batches: `M`, micro-batches per mini-batch. Chosen by the
            planner with `memory_budget`. Defaults to `None`: chosen
            (`keras_pipe.planning.choices`).
        balance: as in `PipelineModel.from_model`. Defaults to `None`:
            chosen with the others, else `"params"`.
        remat: the remat mode the memory estimate assumes. Defaults to
            `None`: chosen with the others, else `"except_last"`.
        batch_size: mini-batch size; sizes are for micro-batches of
            `ceil(batch_size / M)` rows. Defaults to `None` (one row).
        devices: stage devices; `balance="time"` measures on the first.
            Defaults to `None` (TF's default device).
        optimizer_slots: optimizer variables per weight for the memory
            estimate (2 for Adam, 0 for SGD). Defaults to `2`.
        flops_per_second: a device's sustained FLOP rate, to turn FLOPs into
            a step time when times are not measured. Defaults to `None`.
        memory_budget: bytes per device, or a list of one per device. When
            given, the planner picks the cut, `num_micro_batches` and one
            remat mode per stage that fit every device's budget in
            predicted peak (`keras_pipe.planning.memory`) and minimise the
            predicted step time (`keras_pipe.planning.budget.search`); `balance`,
            `num_micro_batches` and `remat` are then ignored and
            `batch_size` is required. Defaults to `None`.
        schedule: a registered schedule's name, for the memory budget, or
            `"auto"`: the planner then picks the schedule, one or two
            stages per device (for the schedules that place several),
            `num_micro_batches` among `micro_batch_choices`, the cut and one
            remat mode per stage that fit `memory_budget` (when given) and
            minimise the step time simulated from measured costs
            (`keras_pipe.planning.autoplan`); `num_stages`, `balance`,
            `num_micro_batches` and `remat` are then ignored, `batch_size`
            is required, and the plan reports the schedule, each stage's
            device, the predicted step time, the peak memory per device
            and the runner-ups. Defaults to `None`: `"auto"` when
            `num_micro_batches`, `balance`, `remat` and `memory_budget`
            are not given either (what `from_model` then builds), else
            the fastest exact schedule for one stage per device
            (`"gpipe"` with `memory_budget`).
        input_shape: the input shapes to cost, batch axis first (its size
            is ignored: sizes are per micro-batch): one shape such as
            `(None, 128)`, a list with one per input, or a dict by input
            name. Needed where inputs have unknown dimensions (token ids of
            shape `(None, None)`): an unknown dimension is costed as 1, with
            a warning naming the input. Defaults to `None`.
        sample_inputs: a batch of inputs whose shapes to cost, instead of
            `input_shape`. Defaults to `None`.
        micro_batch_choices: with `schedule="auto"`, the `M` values to
            try. Defaults to `(1, 2, 4, 8)`.
        measure: with `schedule="auto"`, time each layer call, a stage
            call and a transfer on `devices` (cached,
            `keras_pipe.planning.profiling`); `False` costs from FLOPs at
            `flops_per_second` (2e10 if not given), with a warning.
            Defaults to `None`: `True` when `schedule="auto"` is given;
            when every choice is left to the planner, measured on worker
            processes and GPUs, costed from FLOPs (without a warning) on
            logical CPU devices of this process
            (`keras_pipe.planning.choices.measured`).
        loss: with `schedule="auto"`, the loss the pipeline will be
            compiled with: its loss head (on the last stage, per
            micro-batch or once for the batch) is timed and simulated.
            Defaults to `None`: `model`'s compiled loss if any, else not
            costed (a softmax over a large vocabulary is then missed).
        calibrate: with `schedule="auto"` and `measure`, train a clone
            of `model` in the configurations of
            `keras_pipe.planning.autoplan.calibration_points` and fit the
            measured layer costs and the step's fixed costs to those steps
            (`keras_pipe.planning.autoplan.search`). Defaults to `True`.

    Returns:
        A `Plan`.

    Raises:
        TypeError, ValueError: as `keras_pipe.planning.partition.split_model`;
            without `num_stages` and `devices`; with `memory_budget` but no
            `batch_size`; when nothing fits `memory_budget` (the error
            names the smallest budget that would); and for an
            `optimizer_slots` that is not an int >= 0 or a
            `flops_per_second` that is not a number > 0.
    """
    _check_arguments(optimizer_slots, flops_per_second, devices, num_stages)
    masked = choices.outputs_masked(model)
    chosen = choices.resolve(num_micro_batches, schedule, remat, balance,
                             memory_budget, devices, num_stages, batch_size,
                             measure, masked=masked)
    if chosen.schedule != "auto":
        schedule_lib.get_schedule(chosen.schedule)
        if loss is not None:
            raise ValueError(
                'loss= costs the loss head for schedule="auto" only; here it '
                "would be ignored. Drop it, or pass schedule=\"auto\". "
                f"Received: loss={loss!r}, schedule={chosen.schedule!r}")
    batch_size = chosen.batch_size
    flops = {"flops_per_second": flops_per_second} if flops_per_second else {}
    ranked = None
    if chosen.schedule == "auto":
        try:
            ranked = _search(model, devices, num_stages, memory_budget,
                             micro_batch_choices, optimizer_slots, chosen,
                             flops, input_shape, sample_inputs, loss,
                             calibrate, ["gpipe"] if masked else None)
        except ValueError:
            if not chosen.implicit:
                raise
            # Nothing the planner simulates fits this model (too few layer
            # calls to cut for its layouts, say): the fixed defaults, whose
            # cut says what is wrong if it cannot be made.
            chosen = choices.resolve(None, choices.default_schedule(
                building.device_indices(devices), masked), None,
                None, None, devices, num_stages, batch_size, masked=masked)
            num_stages = len(devices) if num_stages is None else num_stages
    if ranked is not None:
        best, memory_budget = ranked[0], None
        chosen = dataclasses.replace(
            chosen, schedule=best.schedule, balance=list(best.sizes),
            num_micro_batches=best.num_micro_batches, remat=list(best.remat))
        num_stages = best.num_stages
        if devices is not None:
            devices = autoplan.expand_devices(devices, best.stage_devices)
    num_stages = len(devices) if num_stages is None else num_stages
    budget = None
    if memory_budget is not None:
        budget = budget_lib.search(
            model, num_stages, memory_budget, batch_size,
            schedule=chosen.schedule, optimizer_slots=optimizer_slots,
            **flops)
        chosen = dataclasses.replace(
            chosen, balance=budget.sizes,
            num_micro_batches=budget.num_micro_batches, remat=budget.remat)
    part = partition_lib.cut(model, num_stages, chosen.balance, devices,
                             chosen.num_micro_batches, chosen.remat,
                             batch_size, input_shape, sample_inputs)
    micro = partition_lib.micro_batch_size(batch_size,
                                           chosen.num_micro_batches)
    stages = _stage_plans(part, chosen, micro, optimizer_slots, budget,
                          input_shape, sample_inputs, batch_size, devices)
    m, k = chosen.num_micro_batches, num_stages
    bubble = schedule_lib.bubble_fraction(m, k)
    result = Plan(model.name, k, m, micro, chosen.balance, chosen.remat,
                  stages, list(part.sizes), list(part.tied), bubble,
                  _step_time(stages, chosen, k, budget, flops_per_second),
                  _suggestion(m, k), budget, part.graph.opaque,
                  schedule=chosen.schedule if isinstance(chosen.schedule, str)
                  else getattr(chosen.schedule, "__name__",
                               str(chosen.schedule)),
                  devices=list(devices) if devices is not None else None,
                  stage_devices=None)
    if ranked is not None:
        _add_search(result, ranked)
    return result


def _check_arguments(optimizer_slots, flops_per_second, devices,
                     num_stages):
    """`plan`'s checks of the arguments the choices do not cover."""
    if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots,
                                                           int):
        raise TypeError(
            "optimizer_slots must be an int (2 for Adam, 0 for SGD). "
            f"Received: optimizer_slots={optimizer_slots!r}")
    _validation.check_non_negative_number("optimizer_slots", optimizer_slots)
    if flops_per_second is not None:
        _validation.check_positive_number("flops_per_second", flops_per_second)
    if devices is not None and (isinstance(devices, str) or not isinstance(
            devices, (list, tuple))):
        raise TypeError(
            "devices must be a list of device strings, one per stage, e.g. "
            f"['/GPU:0', '/GPU:1']. Received: devices={devices!r}")
    if num_stages is None and devices is None:
        raise ValueError(
            "plan needs num_stages or devices (one stage per device). "
            "Received: num_stages=None, devices=None")


def _search(model, devices, num_stages, memory_budget, micro_batch_choices,
            optimizer_slots, chosen, flops, input_shape, sample_inputs, loss,
            calibrate, schedules):
    """`schedule="auto"`: every configuration, the pick first
    (`autoplan.search`)."""
    with warnings.catch_warnings():
        if chosen.implicit and not chosen.measure:  # documented: logical
            warnings.filterwarnings("ignore", _FLOPS_WARNING)
        return autoplan.search(
            model, devices=devices,
            num_devices=None if devices else num_stages,
            batch_size=chosen.batch_size, memory_budget=memory_budget,
            micro_batch_choices=micro_batch_choices,
            optimizer_slots=optimizer_slots, measure=chosen.measure,
            input_shape=input_shape, sample_inputs=sample_inputs,
            loss=loss, calibrate=calibrate, schedules=schedules, **flops)


def _stage_plans(part, chosen, micro, optimizer_slots, budget, input_shape,
                 sample_inputs, batch_size, devices):
    """One `StagePlan` per stage of the cut `part`; peaks from the memory
    model (`keras_pipe.planning.memory.predict`)."""
    graph, shapes = part.graph, part.shapes
    if shapes is None:
        shapes = shapes_lib.infer_shapes(graph, input_shape, sample_inputs,
                                         what="keras_pipe.plan")
    call_flops = cost_lib.flops(graph, micro, shapes)
    times = part.costs if chosen.balance == "time" else None
    m = chosen.num_micro_batches
    num_devices = len(set(devices)) if devices else part.num_stages
    name = chosen.schedule

    def ticks(m, k):  # the schedule on the plan's devices
        return schedule_lib.build_ticks(name, m, k, num_devices)

    peaks = budget.peaks if budget is not None else memory_lib.predict(
        part, batch_size or m, m, chosen.remat, ticks, optimizer_slots,
        input_shape)
    stages, start = [], 0
    for j, size in enumerate(part.sizes):
        calls = part.stage_calls(j)
        span = range(start, start + size)
        start += size
        in_bytes = sum(cost_lib.tensor_bytes(x, micro, shapes)
                       for x in part.stage_inputs(j))
        out_bytes = sum(cost_lib.tensor_bytes(x, micro, shapes)
                        for x in part.stage_outputs(j))
        weights = _stage_weights(calls)
        stages.append(StagePlan(
            index=j, layers=[c.name for c in calls],
            params=sum(math.prod(v.shape) for v in weights),
            flops=float(sum(call_flops[i] for i in span)),
            input_bytes=in_bytes, output_bytes=out_bytes,
            peak_memory_bytes=peaks[j].total,
            time=None if times is None else sum(times[i] for i in span),
            cost=None if part.costs is None else float(
                sum(part.costs[i] for i in span))))
    return stages


def _step_time(stages, chosen, num_stages, budget, flops_per_second):
    """GPipe's step estimate from the slowest stage, or None."""
    if budget is not None:
        return budget.step_time
    m = chosen.num_micro_batches
    factor = _remat_factor(chosen.remat, m)
    if chosen.balance == "time":
        return (m + num_stages - 1) * max(s.time for s in stages) * factor
    if flops_per_second:
        return ((m + num_stages - 1) * max(s.flops for s in stages) * factor
                / flops_per_second)
    return None


def _suggestion(m, k):
    """GPipe's advice on `M` for `k` stages, or None."""
    if k > 1 and m < 4 * k:
        return (f"num_micro_batches={m} < 4 x num_stages = {4 * k}: the "
                f"pipeline idles {schedule_lib.bubble_fraction(m, k):.0%} of "
                f"a step. GPipe suggests num_micro_batches >= {4 * k}, which "
                f"idles {schedule_lib.bubble_fraction(4 * k, k):.0%}.")
    return None


def _add_search(result, ranked):
    """What `schedule="auto"` predicted for its pick, and the runner-ups."""
    best = ranked[0]
    for stage, peak in zip(result.stages, best.stage_peak_memory):
        stage.peak_memory_bytes = peak
    result.step_time = best.step_time
    result.stage_devices = list(best.stage_devices)
    result.peak_memory = list(best.peak_memory)
    result.idle = list(best.idle)
    result.runner_ups = ranked[1:]
    result.suggestion = None


def stages_from_model(model, num_stages, devices, num_micro_batches, remat,
                      balance, memory_budget, batch_size, input_shape,
                      sample_inputs, schedule, loss=None,
                      optimizer_slots=choices.DEFAULT_OPTIMIZER_SLOTS):
    """The stages and `PipelineModel` arguments of `from_model`.

    Every choice left `None` is made as `plan` makes it
    (`keras_pipe.planning.choices`), except `num_micro_batches` without a
    `batch_size`, left `None` for the pipeline to choose from the first
    batch it sees. `loss` and `optimizer_slots` are what a plan costs.

    Returns:
        `(stages, arguments, chosen)`: the cut stages, the keyword
        arguments of `PipelineModel` (`devices`, `num_micro_batches`,
        `remat`, `schedule`) and, when the planner chose the schedule, the
        `Plan` chosen (else None).
    """
    if num_stages is None:
        if not devices:
            raise ValueError(
                "from_model needs num_stages, or devices (one per "
                "stage). Received: num_stages=None, devices=None")
        num_stages = len(devices)
    resolved = choices.resolve(num_micro_batches, schedule, remat, balance,
                               memory_budget, devices, num_stages,
                               batch_size, batch_size_known=False,
                               masked=choices.outputs_masked(model))
    if loss is not None and resolved.schedule != "auto":
        raise ValueError(
            'from_model(loss=...) costs the loss head for schedule="auto" '
            "only; here it would be ignored. Drop it (compile with the loss), "
            f'or pass schedule="auto". Received: loss={loss!r}, '
            f"schedule={schedule!r}")
    chosen = None
    if resolved.schedule == "auto":
        chosen = plan(model, num_stages=num_stages, devices=devices,
                      batch_size=batch_size, memory_budget=memory_budget,
                      schedule=schedule, input_shape=input_shape,
                      sample_inputs=sample_inputs, loss=loss,
                      optimizer_slots=optimizer_slots)
        num_stages, devices = chosen.num_stages, chosen.devices
        num_micro_batches, remat = chosen.num_micro_batches, chosen.remat
        balance, schedule = chosen.sizes, chosen.schedule
    elif memory_budget is not None:
        balance, num_micro_batches, remat = budget_lib.pipeline_arguments(
            model, num_stages, memory_budget, batch_size,
            schedule=resolved.schedule)
        schedule = resolved.schedule
    else:
        balance, num_micro_batches, remat, schedule = (
            resolved.balance, resolved.num_micro_batches, resolved.remat,
            resolved.schedule)
    stages = partition_lib.split_model(
        model, num_stages, balance=balance, devices=devices,
        num_micro_batches=num_micro_batches or 1, remat=remat,
        batch_size=batch_size, input_shape=input_shape,
        sample_inputs=sample_inputs)
    arguments = dict(devices=devices, num_micro_batches=num_micro_batches,
                     remat=remat, schedule=schedule)
    return stages, arguments, chosen


def _si(value, unit=""):
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def _bytes(value):
    for scale, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"),
                          (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.2f} {prefix}"
    return f"{value} B"


def _format(p):
    rows = [["stage", "layers", "calls", "params", "fwd FLOPs", "in bytes",
             "out bytes", "peak memory"]]
    timed = any(s.time is not None for s in p.stages)
    if timed:
        rows[0].append("fwd time")
    for s in p.stages:
        row = [str(s.index), f"{s.first_layer}..{s.last_layer}",
               str(s.num_layers), f"{s.params:,}", _si(s.flops),
               _bytes(s.input_bytes), _bytes(s.output_bytes),
               _bytes(s.peak_memory_bytes)]
        if timed:
            row.append(f"{s.time * 1e3:.3f} ms")
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    numeric = {2, 3, 4, 5, 6, 7, 8}
    table = "\n".join(
        "  ".join(cell.rjust(w) if c in numeric else cell.ljust(w)
                  for c, (cell, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows)
    m, k = p.num_micro_batches, p.num_stages
    lines = [
        f"Pipeline plan for {p.model_name!r}: {k} stages, {m} micro-batches "
        f"of {p.micro_batch_size} row(s), balance={p.balance!r}, "
        f"remat={p.remat!r}",
        table,
        f"bubble fraction (K-1)/(M+K-1) = {k - 1}/{m + k - 1} = "
        f"{p.bubble_fraction:.1%}",
    ]
    if p.idle is not None:
        where = p.devices or [f"device {d}" for d in p.stage_devices]
        lines[0] = (f"Pipeline plan for {p.model_name!r} (schedule='auto'): "
                    f"schedule={p.schedule!r}, {k} stages, {m} "
                    f"micro-batches of {p.micro_batch_size} row(s), "
                    f"remat={p.remat}")
        lines.append("stage devices: " + ", ".join(
            f"{j}: {d}" for j, d in enumerate(where)))
        lines.append(
            f"predicted step time: {p.step_time * 1e3:.2f} ms (simulated "
            "from measured costs); peak memory per device: " + ", ".join(
                _bytes(b) for b in p.peak_memory) + "; idle per device: "
            + ", ".join(f"{i:.0%}" for i in p.idle))
        for c in p.runner_ups[:5]:
            lines.append(f"runner-up: {c}")
    elif p.step_time is not None:
        lines.append(f"estimated step time: {p.step_time * 1e3:.2f} ms "
                     "((M+K-1) x slowest stage x forward+backward+remat)")
    else:
        lines.append("estimated step time: unknown (use balance='time' or "
                     "pass flops_per_second=...)")
    for layers, stages in p.tied:
        lines.append(f"tied weights: {layers} shared by stages {stages} "
                     "(one variable, gradients summed)")
    if p.budget is not None:
        lines.append(p.budget.table())
    for name, cls, why in p.opaque:
        lines.append(f"opaque: {name!r} ({cls}) runs whole, no cut inside: "
                     f"{why}")
    if p.suggestion:
        lines.append("suggestion: " + p.suggestion)
    lines.append(f"balance={p.sizes} reproduces this cut.")
    return "\n".join(lines)
