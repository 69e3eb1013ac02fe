"""Simulated step time of any schedule: device chains and transfers.

Why a simulator and not a formula: GPipe's bubble `(M + K - 1) / M` is
wrong for every other schedule (1F1B's equal bubble with less memory, the
zero-bubble schedules' deferred weight gradients, two stages per device),
and wrong for GPipe too once a transfer or a per-call cost is not small.
The executor (`keras_pipe.engine.executor`) issues a schedule's actions in tick
order and chains each device's calls in that order; a call starts when the
previous call on its device ended and what it reads has arrived. This
module replays exactly that, with a cost per call, so a schedule a user
registers is simulated like the built-in ones.

What the executor adds to the schedule's actions is replayed too:

* runs of backward calls without remat fed back to back (GPipe's backward
  phase) compute input gradients only, and one weight-gradient call after
  the run computes the weights'; every other backward call without remat
  (1F1B's) is followed by its own weight-gradient call, and so is each
  stage's last backward call if whole (`engine.weight_calls`);
* consecutive `"W"` actions of one stage on a device are one call;
* the last stage's backward calls are seeded from the full-batch loss when
  every forward call comes before the first backward call (GPipe), else
  from each micro-batch's own part of the loss;
* each stage applies its optimizer update after its last call.

A transfer between two devices delays the receiver by `transfer(bytes)`; it
does not occupy either device (TF sends asynchronously). What the receiving
device spends on an input from another device (a worker's gRPC receive
copies the tensor in on its own core) is `receive` per received input,
added to the call that reads it: a stage's forward call reading the
previous stage's outputs, its backward call reading the next stage's input
gradients, when that stage is on another device.

GPipe with 2 micro-batches on 2 stages, forward 1, backward 2, no transfer
cost (``simulate(gpipe(2, 2), [0, 1], costs)``)::

    time      0   1   2   3   4   5   6   7   8
    device 0  F0  F1  .   .   .   B1  B1  B0  B0
    device 1  .   F0  F1  B1  B1  B0  B0  .   .

step time 9, device 0 idle 3/9, device 1 idle 3/9.
"""

import dataclasses

from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.engine import weight_calls

__all__ = ["Call", "Costs", "Simulation", "calls", "receives", "simulate"]


@dataclasses.dataclass
class Costs:
    """Seconds per call of each stage, for one micro-batch.

    Attributes:
        forward: per stage, a forward call.
        backward: per stage, a fused backward call (input and weight
            gradients).
        backward_input: per stage, the input gradients only (`"B"` of a
            split backward pass). Defaults to `backward` (nothing split).
        weight: per stage, the weight gradients of one micro-batch (`"W"`).
            Defaults to zeros.
        recompute: per stage, the forward pass a remat backward call redoes.
            Defaults to `forward`.
        call: a fixed cost of every call (launch, control edges). Defaults
            to `0`.
        output_bytes: per stage, bytes of its outputs per micro-batch (its
            input gradients going back are the previous stage's outputs).
            Defaults to zeros.
        latency: seconds of any transfer between two devices. Defaults to
            `0`.
        bytes_per_second: transfer bandwidth; `None` for infinite.
            Defaults to `None`.
        loss: the loss head's time on the last stage's device for one
            micro-batch (a schedule whose backward calls start before its
            last forward call seeds each micro-batch from its own part).
            Defaults to `0`.
        full_loss: the loss head's time for the full batch (every other
            schedule seeds from it once). Defaults to `None`: `loss`.
        update: per stage, its optimizer update at the end of the step.
            Defaults to zeros.
        step: a fixed cost of the step (splitting the batch, reading the
            weights), before any call. Defaults to `0`.
        receive: seconds a call spends on its own device per input it
            reads from a stage on another device. Defaults to `0`.
        weight_call: per stage, seconds of each of its weight-gradient
            calls (`"W"`) beyond its layers' work: a separate call replays
            the stage's parameter ops and adds its gradients into the
            step's running sums, once however many micro-batches it
            groups. Defaults to zeros.
    """

    forward: list
    backward: list
    backward_input: list = None
    weight: list = None
    recompute: list = None
    call: float = 0.0
    output_bytes: list = None
    latency: float = 0.0
    bytes_per_second: float = None
    loss: float = 0.0
    update: list = None
    step: float = 0.0
    full_loss: float = None
    receive: float = 0.0
    weight_call: list = None

    def __post_init__(self):
        k = len(self.forward)
        if len(self.backward) != k:
            raise ValueError(
                f"Costs needs one backward time per stage: got "
                f"{len(self.backward)} for {k} forward times.")
        self.backward_input = list(self.backward_input or self.backward)
        self.weight = list(self.weight or [0.0] * k)
        self.recompute = list(self.recompute or self.forward)
        self.output_bytes = list(self.output_bytes or [0] * k)
        if self.full_loss is None:
            self.full_loss = self.loss
        self.update = list(self.update or [0.0] * k)
        self.weight_call = list(self.weight_call or [0.0] * k)
        for name in ("backward_input", "weight", "recompute",
                     "output_bytes", "update", "weight_call"):
            if len(getattr(self, name)) != k:
                raise ValueError(
                    f"Costs.{name} needs one value per stage ({k}). "
                    f"Received: {name}={getattr(self, name)}")

    @property
    def num_stages(self):
        return len(self.forward)

    def transfer(self, num_bytes):
        """Seconds to move `num_bytes` between two devices."""
        if not self.bytes_per_second:
            return self.latency
        return self.latency + num_bytes / self.bytes_per_second


@dataclasses.dataclass(frozen=True)
class Call:
    """One call the executor issues: `kind` on micro-batches `i` of `j`."""

    kind: str        # "F", "B" (fused or input only), "W"
    i: tuple         # micro-batches (several for a grouped "W")
    j: int
    split: bool = False  # a "B" whose weight gradients a "W" computes

    def __str__(self):
        return f"{self.j}{self.kind}{','.join(map(str, self.i))}"


@dataclasses.dataclass
class Simulation:
    """A simulated step.

    Attributes:
        step_time: seconds from the step's start to the last update.
        idle: per device, the share of `step_time` it computes nothing.
        busy: per device, the seconds it computes.
        spans: per device, `(call, start, end)` in order.
        seeded_by_parts: whether the loss seeds each micro-batch.
    """

    step_time: float
    idle: list
    busy: list
    spans: list
    seeded_by_parts: bool

    def format(self, unit=1.0):
        """Per device, its calls with their start and end times."""
        lines = [f"step time {self.step_time / unit:g}"]
        for d, spans in enumerate(self.spans):
            cells = " ".join(f"{c}[{s / unit:g},{e / unit:g}]"
                             for c, s, e in spans)
            lines.append(f"device {d} (idle {self.idle[d]:.1%}): {cells}")
        return "\n".join(lines)


def calls(ticks, stage_devices, remat, num_micro_batches=None):
    """The calls the executor issues for `ticks`, per device, in order.

    Args:
        ticks: a schedule's clock ticks.
        stage_devices: per stage, its device index.
        remat: one remat mode per stage (`"always"`, `"except_last"`,
            `"never"`).
        num_micro_batches: `M`. Defaults to `None` (read from `ticks`).

    Returns:
        `(per_device, seeded_by_parts)`: per device the list of `Call`s in
        issue order, and whether the loss seeds each micro-batch.
    """
    actions = [a for tick in ticks for a in tick]
    m = num_micro_batches or 1 + max(a.i for a in actions)
    actions = weight_calls.place_weight_calls(
        actions, lambda a: stage_devices[a.j], lambda a: a.j,
        lambda a: schedule_lib.is_remat(remat[a.j], a.i, m),
        len(stage_devices))
    split = {(a.i, a.j) for a in actions if a.kind == "W"}
    last_forward = max(n for n, a in enumerate(actions) if a.kind == "F")
    by_parts = any(a.kind == "B" for a in actions[:last_forward])
    per_device = [[] for _ in range(1 + max(stage_devices))]
    pending = {}
    for a in actions:
        d = stage_devices[a.j]
        group = pending.get(d)
        if group and (a.kind != "W" or a.j != group[0].j):
            per_device[d].append(Call("W", tuple(g.i for g in group),
                                      group[0].j))
            del pending[d]
        if a.kind == "W":
            pending.setdefault(d, []).append(a)
        else:
            per_device[d].append(Call(a.kind, (a.i,), a.j,
                                      a.kind == "B" and (a.i, a.j) in split))
    for d, group in pending.items():
        per_device[d].append(Call("W", tuple(g.i for g in group),
                                  group[0].j))
    return per_device, by_parts


def receives(call, stage_devices):
    """How many of `call`'s inputs come from a stage on another device: a
    forward call reads the previous stage's outputs, a backward call the
    next stage's input gradients, a weight-gradient call nothing sent."""
    j, k = call.j, len(stage_devices)
    if call.kind == "F":
        other = j - 1
    elif call.kind == "B":
        other = j + 1
    else:
        return 0
    return int(0 <= other < k
               and stage_devices[other] != stage_devices[j])


def _duration(call, costs, remat, m, stage_devices):
    j = call.j
    if call.kind == "F":
        work = costs.forward[j]
    elif call.kind == "W":
        work = costs.weight[j] * len(call.i) + costs.weight_call[j]
    else:
        work = (costs.backward_input[j] if call.split else costs.backward[j])
        if schedule_lib.is_remat(remat[j], call.i[0], m):
            work += costs.recompute[j]
    return costs.call + work + costs.receive * receives(call,
                                                        stage_devices)


def simulate(ticks, stage_devices, costs, remat="never",
             num_micro_batches=None, issued=None):
    """Predicts the step time of a schedule by replaying its device chains.

    ```python
    ticks = keras_pipe.engine.schedule.gpipe(2, 2)
    costs = keras_pipe.planning.simulator.Costs(forward=[1, 1], backward=[2, 2])
    keras_pipe.planning.simulator.simulate(ticks, [0, 1], costs).step_time  # 9.0
    ```

    Args:
        ticks: a schedule's clock ticks (`get_schedule(name).build(...)`).
        stage_devices: per stage, its device index (0, 1, ...).
        costs: a `Costs`.
        remat: a remat mode or one per stage. Defaults to `"never"`.
        num_micro_batches: `M`. Defaults to `None` (read from `ticks`).
        issued: `calls(ticks, stage_devices, remat, num_micro_batches)`,
            when the caller made them already (a fit re-simulates one
            configuration with other costs many times). Defaults to `None`
            (made here).

    Returns:
        A `Simulation`.

    Raises:
        ValueError: if the stages of `ticks`, `stage_devices` and `costs`
            disagree, or the calls wait for each other (a deadlock).
    """
    k = costs.num_stages
    if len(stage_devices) != k:
        raise ValueError(
            f"simulate needs one device per stage: got {len(stage_devices)}"
            f" devices for {k} stages. Received: "
            f"stage_devices={list(stage_devices)}")
    stages = {a.j for tick in ticks for a in tick}
    if stages != set(range(k)):
        raise ValueError(f"The ticks' stages {sorted(stages)} are not the "
                         f"{k} stages of the costs.")
    remat = [remat] * k if isinstance(remat, str) else list(remat)
    m = num_micro_batches or 1 + max(a.i for t in ticks for a in t)
    per_device, by_parts = issued or calls(ticks, stage_devices, remat, m)
    done = {}  # (kind, i, j) -> end time on its device
    position = [0] * len(per_device)
    clock = [costs.step] * len(per_device)
    spans = [[] for _ in per_device]
    loss_done = None

    def arrival(kind, i, j, to_device):
        end = done.get((kind, i, j))
        if end is None:
            return None
        if stage_devices[j] == to_device:
            return end
        num_bytes = costs.output_bytes[j if kind == "F" else j - 1]
        return end + costs.transfer(num_bytes)

    def ready(call, d):
        nonlocal loss_done
        i, j = call.i[0], call.j
        if call.kind == "F":
            return costs.step if j == 0 else arrival("F", i, j - 1, d)
        if call.kind == "W":
            ends = [done.get(("B", ii, j)) for ii in call.i]
            return None if None in ends else max(ends)
        own = done.get(("F", i, j))
        if own is None:
            return None
        if j < k - 1:
            upstream = arrival("B", i, j + 1, d)
            return None if upstream is None else max(own, upstream)
        if by_parts:
            return own + costs.loss
        if loss_done is None:
            ends = [done.get(("F", ii, j)) for ii in range(m)]
            if None in ends:
                return None
            loss_done = max(ends) + costs.full_loss
        return max(own, loss_done)

    remaining = sum(len(c) for c in per_device)
    while remaining:
        progressed = False
        for d, chain in enumerate(per_device):
            while position[d] < len(chain):
                call = chain[position[d]]
                start = ready(call, d)
                if start is None:
                    break
                start = max(start, clock[d])
                end = start + _duration(call, costs, remat, m,
                                        stage_devices)
                for ii in call.i:
                    done[(call.kind, ii, call.j)] = end
                spans[d].append((call, start, end))
                clock[d] = end
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [str(c[p]) for p, c in zip(position, per_device)
                       if p < len(c)]
            raise ValueError(f"The schedule's calls deadlock: {waiting} "
                             "wait for calls that never run first.")
    for j in range(k):
        d = stage_devices[j]
        clock[d] += costs.update[j]
    step_time = max(clock)
    busy = [sum(e - s for _, s, e in spans[d]) + sum(
        costs.update[j] for j in range(k) if stage_devices[j] == d)
        for d in range(len(per_device))]
    idle = [1.0 - b / step_time if step_time else 0.0 for b in busy]
    return Simulation(step_time, idle, busy, spans, by_parts)
