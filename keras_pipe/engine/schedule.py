"""Schedules as data: clock ticks of actions (pure Python, no TF).

An `Action` is one stage call: its kind (`"F"` forward, `"B"` backward,
`"W"` weight gradients), micro-batch `i` and stage `j`; it prints as
`"F3"` (stage in the row) or, with `str`, as torch's `"1F3"` (stage 1,
forward, micro-batch 3). A schedule is a list of clock ticks, each a list of
actions that may run at the same time, at most one per device. Every
schedule is a pure function of `(num_micro_batches, num_stages, num_devices)`
registered by name; `PipelineModel(schedule=name)` reads the registry and
`keras_pipe.engine.executor` runs any schedule's actions in tick order, chaining
the calls of each device in that order.

Where a schedule has no `"W"` action for `(i, j)`, `"B"` computes the input
and the weight gradients together. With `"W"` actions, `"B"` computes only
the input gradient (what the previous stage waits for) and `"W"` the weight
gradients, which the schedule may defer to fill the bubbles (zero-bubble
pipelining, Qi et al., "Zero Bubble Pipeline Parallelism").

GPipe with 3 micro-batches on 2 stages (``format_schedule(gpipe(3, 2))``)::

    tick     0  1  2  3  4  5  6  7
    stage 0 F0 F1 F2  .  . B2 B1 B0
    stage 1  . F0 F1 F2 B2 B1 B0  .

Ticks assume that every action takes one unit of time.
"""

import dataclasses

from keras_pipe import _validation

__all__ = ["Action", "bubble_fraction", "build_ticks", "check_placement",
           "check_ticks", "defer_weight_runs", "format_schedule",
           "get_schedule", "gpipe", "idle_fraction", "interleaved_1f1b",
           "is_remat", "list_schedule", "one_f_one_b", "register_schedule",
           "schedule_names", "stage_placement", "ticks_from_orders", "zb_h1",
           "zb_h2", "zbv"]

KINDS = ("F", "B", "W")


def is_remat(mode, i, num_micro_batches):
    """Whether remat `mode` recomputes micro-batch `i`'s forward pass in its
    backward pass: every one under `"always"`, all but the last under
    `"except_last"`, none under `"never"`.

    The one rule the executor runs and the memory model and simulator
    predict with.

    ```python
    >>> [is_remat("except_last", i, 3) for i in range(3)]
    [True, True, False]
    ```
    """
    return mode == "always" or (
        mode == "except_last" and i < num_micro_batches - 1)


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One stage call of a schedule: `kind` of micro-batch `i` on stage `j`."""

    kind: str
    i: int
    j: int

    def __str__(self):
        return f"{self.j}{self.kind}{self.i}"


def _check_counts(num_micro_batches, num_stages, num_devices=None):
    _validation.check_positive_int("num_micro_batches", num_micro_batches)
    _validation.check_positive_int("num_stages", num_stages)
    if num_devices is not None:
        _validation.check_positive_int("num_devices", num_devices)


def _depends_on(action, num_stages, has_w):
    """The actions `action` needs finished before it can start."""
    kind, i, j = action.kind, action.i, action.j
    if kind == "F":
        return [Action("F", i, j - 1)] if j else []
    if kind == "B":
        needs = [Action("F", i, j)]
        if j < num_stages - 1:
            needs.append(Action("B", i, j + 1))
        return needs
    return [Action("B", i, j)] if has_w else []


def ticks_from_orders(orders, num_stages):
    """Clock ticks from each device's order of actions.

    Each device runs its next action as soon as what it depends on ran in
    an earlier tick (forward of `i` on `j - 1`; backward of `i` on `j + 1`
    and its own forward; `"W"` after `"B"`).

    Args:
        orders: one list of `Action`s per device.
        num_stages: `K`.

    Returns:
        The list of ticks.

    Raises:
        ValueError: if the orders deadlock or an action appears twice.
    """
    flat = [a for order in orders for a in order]
    if len(set(flat)) != len(flat):
        raise ValueError("A schedule lists an action twice.")
    has_w = {(a.i, a.j) for a in flat if a.kind == "W"}
    done, position, ticks = set(), [0] * len(orders), []
    while any(p < len(o) for p, o in zip(position, orders)):
        tick = []
        for d, order in enumerate(orders):
            if position[d] == len(order):
                continue
            action = order[position[d]]
            needs = _depends_on(action, num_stages, (action.i, action.j)
                                in has_w)
            if all(n in done for n in needs):
                tick.append(action)
        if not tick:
            waiting = [str(o[p]) for p, o in zip(position, orders)
                       if p < len(o)]
            raise ValueError(f"The schedule deadlocks: {waiting} wait for "
                             "actions that never run first.")
        done.update(tick)
        for action in tick:
            for d, order in enumerate(orders):
                if position[d] < len(order) and order[position[d]] == action:
                    position[d] += 1
                    break
        ticks.append(tick)
    return ticks


def check_ticks(ticks, num_micro_batches, num_stages, name="schedule"):
    """Checks a schedule's ticks before they run; returns them as lists.

    The rules, checked action by action in tick order (the error names the
    first action that breaks one, and the rule):

    - `ticks` is a list of ticks, each a list of `Action`s;
    - kinds are `"F"`, `"B"`, `"W"`; `0 <= i < M` and `0 <= j < K`;
    - no action appears twice;
    - `F` of `(i, j)` comes after `F` of `(i, j - 1)`; `B` of `(i, j)` after
      its own `F` and after `B` of `(i, j + 1)`; `W` after its `B` (each
      in an earlier tick: actions of one tick may run at the same time);
    - every `(i, j)` has its `F` and its `B` (and at most one `W`).

    ```python
    >>> check_ticks([[Action("F", 0, 0)], [Action("B", 0, 0)]], 1, 1)
    [[Action(kind='F', i=0, j=0)], [Action(kind='B', i=0, j=0)]]
    ```

    Args:
        ticks: what a schedule's `build(M, K, D)` returned.
        num_micro_batches: `M`.
        num_stages: `K`.
        name: the schedule's name, for the message. Defaults to
            `"schedule"`.

    Returns:
        The ticks, as a list of lists of `Action`s.

    Raises:
        TypeError: if `ticks` is not a list of lists of `Action`s.
        ValueError: naming the first offending action and the rule.
    """
    m, k = num_micro_batches, num_stages
    where = f"Schedule {name!r} with M={m} micro-batches and K={k} stages"
    if not isinstance(ticks, (list, tuple)):
        raise TypeError(
            f"{where} must build a list of ticks (each a list of "
            f"keras_pipe.engine.schedule.Action). Received: {ticks!r} of type "
            f"{type(ticks).__name__}")
    done, seen, checked = set(), set(), []
    for t, tick in enumerate(ticks):
        if not isinstance(tick, (list, tuple)) or not all(
                isinstance(a, Action) for a in tick):
            raise TypeError(
                f"{where}: tick {t} must be a list of "
                f"keras_pipe.engine.schedule.Action. Received: {tick!r}")
        for a in tick:
            problem = _action_problem(a, m, k, done, seen)
            if problem:
                raise ValueError(f"{where}: action {a} ({a.kind} of "
                                 f"micro-batch {a.i} on stage {a.j}) at "
                                 f"tick {t} {problem}.")
            seen.add(a)
        done.update(tick)
        checked.append(list(tick))
    for i in range(m):
        for j in range(k):
            for kind in ("F", "B"):
                if Action(kind, i, j) not in seen:
                    raise ValueError(
                        f"{where}: action {Action(kind, i, j)} ({kind} of "
                        f"micro-batch {i} on stage {j}) is missing: every "
                        "(micro-batch, stage) needs one F and one B.")
    return checked


def _action_problem(a, m, k, done, seen):
    """What rule `a` breaks, given the actions of earlier ticks, else ''."""
    if a.kind not in KINDS:
        return f"has kind {a.kind!r}: kinds are 'F', 'B' and 'W'"
    for index, count, what in ((a.i, m, "micro-batch"), (a.j, k, "stage")):
        if isinstance(index, bool) or not isinstance(index, int) or not (
                0 <= index < count):
            return (f"has {what} index {index!r} out of range: "
                    f"0 <= index < {count}")
    if a in seen:
        return "appears twice: each action runs once"
    needs = _depends_on(a, k, has_w=True)
    for need in needs:
        if need not in done:
            rule = {"F": "F of a stage comes after F of the previous stage",
                    "B": ("B comes after its own F and after B of the next "
                          "stage"),
                    "W": "W comes after its B"}[a.kind]
            return (f"runs before {need} has run in an earlier tick: {rule}")
    return ""


def defer_weight_runs(actions, device_of, eligible, num_stages=None):
    """Defers the weight gradients of each run of backward passes to its end.

    A run is two or more `"B"` actions of one stage that a device issues
    one after another, each `eligible` (its `"B"` computes the weight
    gradients too): GPipe's backward phase, 1F1B's drain. Their `"W"`
    actions follow the run's last `"B"`, so that the run's weight
    gradients become one product over the concatenated micro-batches.
    No forward pass comes between, so no more micro-batches are in flight.

    With `num_stages`, as the executor runs a step: a run is deferred only
    where its input gradients arrive back to back (on the last stage, or
    where the same micro-batches' `"B"` on the next stage are one deferred
    run themselves: GPipe's backward phase). Elsewhere (1F1B's drain, where
    each `"B"` waits for the next stage's `"B"` of a micro-batch, with a
    forward pass between them there) a deferred `"W"` would wait behind
    every later `"B"` of the run and so behind the other device, and run in
    the tail of the step instead of in the gaps: there, and for every other
    eligible `"B"` whose input gradient goes to another device, the `"W"`
    comes right after its `"B"`, so that the input gradient leaves before
    the weight gradients are computed. A `"B"` of the first stage, or one
    whose previous stage shares its device, stays whole (a split would only
    add a call).

    ```python
    >>> ticks = gpipe(3, 1)
    >>> [str(a) for a in defer_weight_runs(
    ...     [a for t in ticks for a in t], lambda a: 0, lambda a: True)]
    ['0F0', '0F1', '0F2', '0B2', '0B1', '0B0', '0W2', '0W1', '0W0']
    >>> actions = defer_weight_runs([a for t in one_f_one_b(2, 2) for a in t],
    ...                             lambda a: a.j, lambda a: True, 2)
    >>> [str(a) for a in actions if a.j == 1]
    ['1F0', '1B0', '1W0', '1F1', '1B1', '1W1']
    ```

    Args:
        actions: the actions in issue order.
        device_of: `device_of(action)`, a key of the device that runs it.
        eligible: `eligible(action)`, whether that `"B"` may leave its
            weight gradients for later. The actions of a run also share
            their stage `j` (the caller's `eligible` may require more).
        num_stages: `K`, to defer only runs fed back to back and split
            every other eligible `"B"` (see above), or `None`: every run
            deferred, lone `"B"`s left whole. Defaults to `None`.

    Returns:
        The actions with `"W"` actions inserted.
    """
    runs, current = [], {}  # device -> positions of its current run
    for n, a in enumerate(actions):
        device = device_of(a)
        run = current.get(device)
        if a.kind == "B" and eligible(a):
            if run and actions[run[-1]].j == a.j:
                run.append(n)
                continue
            current[device] = [n]
            if run:
                runs.append(run)
        elif run:
            runs.append(current.pop(device))
    runs += list(current.values())
    deferred = _deferred_runs(actions, runs, num_stages)
    after = {}
    for run in runs:
        weights = [Action("W", actions[n].i, actions[n].j) for n in run]
        if id(run) in deferred:
            after[run[-1]] = weights
        elif num_stages is not None:
            after.update((n, [w]) for n, w in zip(run, weights)
                         if _sends_back(actions[n], device_of))
    return [b for n, a in enumerate(actions) for b in [a] + after.get(n, [])]


def _sends_back(action, device_of):
    """Whether the input gradient of `"B"` `action` goes to another device
    (its stage has a previous stage, held elsewhere): only then does a
    split let it leave sooner. The first stage's, or one that stays on its
    device, would only pay a second call."""
    if action.j == 0:
        return False
    return device_of(Action("B", action.i, action.j - 1)) != device_of(action)


def _deferred_runs(actions, runs, num_stages):
    """The ids of the runs whose `"W"`s go to their end (see
    `defer_weight_runs`): all of two or more without `num_stages`; with it,
    those fed back to back, decided from the last stage down."""
    long = [run for run in runs if len(run) >= 2]
    if num_stages is None:
        return {id(run) for run in long}
    run_of = {}  # (i, j) -> id of the deferred run holding its "B"
    for run in sorted(long, key=lambda r: -actions[r[0]].j):
        j = actions[run[0]].j
        feeders = {run_of.get((actions[n].i, j + 1)) for n in run}
        if j == num_stages - 1 or (len(feeders) == 1 and None not in feeders):
            run_of.update(((actions[n].i, j), id(run)) for n in run)
    return set(run_of.values())


def stage_placement(num_stages, num_devices, shape="loop"):
    """The device index of each stage: `"loop"` (`j % D`) or `"v"`.

    `"v"` (two stages per device) runs stages `0..D-1` down the devices and
    `D..2D-1` back up: stage `j` and stage `2D - 1 - j` share device `j`.
    """
    if shape == "v":
        return [j if j < num_devices else 2 * num_devices - 1 - j
                for j in range(num_stages)]
    return [j % num_devices for j in range(num_stages)]


def gpipe(num_micro_batches, num_stages, num_devices=None):
    """GPipe: every forward pass, then every backward pass in reverse order.

    Micro-batch `i` runs forward on stage `j` at tick `i + j`; the backward
    passes mirror the forward ones. `M + K - 1` ticks each way.

    ```python
    >>> [[str(a) for a in tick] for tick in gpipe(2, 2)]
    [['0F0'], ['0F1', '1F0'], ['1F1'], ['1B1'], ['0B1', '1B0'], ['0B0']]
    ```

    Args:
        num_micro_batches: `M`, >= 1.
        num_stages: `K`, >= 1.
        num_devices: unused: any placement. Defaults to `None`.

    Returns:
        A list of `2 (M + K - 1)` ticks of `Action`s.

    Raises:
        TypeError: if a count is not an int.
        ValueError: if a count is < 1.
    """
    _check_counts(num_micro_batches, num_stages, num_devices)
    m, k = num_micro_batches, num_stages
    orders = [[Action("F", i, j) for i in range(m)] +
              [Action("B", i, j) for i in reversed(range(m))]
              for j in range(k)]
    return ticks_from_orders(orders, k)


def one_f_one_b(num_micro_batches, num_stages, num_devices=None):
    """1F1B (PipeDream-flush): after filling, alternate forward and backward.

    Stage `j` runs `min(K - j - 1, M)` forward passes to fill the pipeline,
    then alternates one forward and one backward pass, then drains the
    remaining backward passes. A stage holds the activations of at most
    `K - j` micro-batches at a time (GPipe: all `M`), for the same bubble.

    ```python
    >>> [[str(a) for a in tick] for tick in one_f_one_b(2, 2)]
    [['0F0'], ['0F1', '1F0'], ['1B0'], ['0B0', '1F1'], ['1B1'], ['0B1']]
    ```

    Args and raises: as `gpipe`.

    Returns:
        A list of `2 (M + K - 1)` ticks of `Action`s.
    """
    _check_counts(num_micro_batches, num_stages, num_devices)
    m, k = num_micro_batches, num_stages
    orders = []
    for j in range(k):
        warmup = min(k - j - 1, m)
        order = [Action("F", i, j) for i in range(warmup)]
        for step in range(m - warmup):
            order += [Action("F", warmup + step, j), Action("B", step, j)]
        order += [Action("B", i, j) for i in range(m - warmup, m)]
        orders.append(order)
    return ticks_from_orders(orders, k)


def list_schedule(num_micro_batches, num_stages, stage_devices, max_forward,
                  max_weight=None, forward_key=None):
    """A schedule built tick by tick by a greedy list scheduler.

    At each tick every device runs one ready action of its stages, in this
    priority: a `"W"` when `max_weight[d]` weight-gradient actions are
    pending (bounds the memory they hold), a `"B"` (the critical path:
    earliest micro-batch, deepest stage first), an `"F"` while fewer than
    `max_forward[d]` micro-batches are between their forward and backward
    pass on the device (bounds activation memory), a `"W"` to fill a slot
    that would be idle. With `max_weight=None` there are no `"W"` actions
    (`"B"` computes the weight gradients too).

    Args:
        num_micro_batches: `M`.
        num_stages: `K`.
        stage_devices: per stage, its device index.
        max_forward: per device, the most micro-batches in flight.
        max_weight: per device, the most pending `"W"`, or None.
        forward_key: orders ready forward actions, `key(i, j)`. Defaults
            to micro-batch, then stage.

    Returns:
        The list of ticks.

    Raises:
        ValueError: if the bounds leave every device waiting (deadlock).
    """
    m, k = num_micro_batches, num_stages
    split = max_weight is not None
    forward_key = forward_key or (lambda i, j: (i, j))
    num_devices = 1 + max(stage_devices)
    stages_of = [[j for j in range(k) if stage_devices[j] == d]
                 for d in range(num_devices)]
    done, ticks = set(), []
    total = m * k * (3 if split else 2)

    def did(kind, i, j):
        return Action(kind, i, j) in done

    while len(done) < total:
        tick = []
        for d, stages in enumerate(stages_of):
            cells = [(i, j) for i in range(m) for j in stages]
            forward = [Action("F", i, j) for i, j in cells
                       if not did("F", i, j) and (j == 0 or did("F", i, j - 1))
                       and (i == 0 or did("F", i - 1, j))]
            backward = [Action("B", i, j) for i, j in cells
                        if did("F", i, j) and not did("B", i, j)
                        and (j == k - 1 or did("B", i, j + 1))]
            weight = [Action("W", i, j) for i, j in cells if split
                      and did("B", i, j) and not did("W", i, j)]
            in_flight = sum(did("F", i, j) and not did("B", i, j)
                            for i, j in cells)
            if weight and len(weight) >= max_weight[d]:
                pick = min(weight)
            elif backward:
                pick = min(backward, key=lambda a: (a.i, -a.j))
            elif forward and in_flight < max_forward[d]:
                pick = min(forward, key=lambda a: forward_key(a.i, a.j))
            elif weight:
                pick = min(weight)
            else:
                continue
            tick.append(pick)
        if not tick:
            raise ValueError(
                f"The schedule deadlocks with max_forward={max_forward} for "
                f"M={m}, K={k}: raise the bound.")
        done.update(tick)
        ticks.append(tick)
    return ticks


def zb_h1(num_micro_batches, num_stages, num_devices=None):
    """Zero-bubble ZB-H1: 1F1B's order with weight gradients deferred.

    Backward passes are split: `"B"` (input gradient, on the critical path)
    runs as soon as it can and `"W"` (weight gradients) fills slots that
    would be idle, with at most 2 pending per stage. Activation memory is
    1F1B's (`K - j` micro-batches in flight on stage `j`); the bubble is
    about a third of 1F1B's (Qi et al.).

    Args and raises: as `gpipe`.
    """
    _check_counts(num_micro_batches, num_stages, num_devices)
    k = num_stages
    return list_schedule(num_micro_batches, k, list(range(k)),
                         [k - j for j in range(k)], [2] * k)


def zb_h2(num_micro_batches, num_stages, num_devices=None):
    """Zero-bubble ZB-H2: more warm-up, all weight gradients deferred.

    Stage `j` keeps up to `2 (K - j) - 1` micro-batches in flight (about
    twice 1F1B's activation memory) and defers every `"W"` until it has
    nothing else to do, so the drain is filled with weight gradients and
    the executor runs each stage's trailing `"W"`s as one call over the
    concatenated micro-batches.

    Args and raises: as `gpipe`.
    """
    _check_counts(num_micro_batches, num_stages, num_devices)
    m, k = num_micro_batches, num_stages
    return list_schedule(m, k, list(range(k)),
                         [2 * (k - j) - 1 for j in range(k)], [m + 1] * k)


def interleaved_1f1b(num_micro_batches, num_stages, num_devices=None):
    """Interleaved 1F1B (Megatron-LM): `V` stages per device, in a loop.

    Stage `j` runs on device `j % D`; forward passes go in groups of `D`
    micro-batches through one stage of each device before the next, which
    cuts the bubble by about `V` for the same number of micro-batches.

    Args:
        num_micro_batches: `M`, >= 1.
        num_stages: `K = V * D`.
        num_devices: `D`, a divisor of `K`. Defaults to `K // 2`.

    Raises:
        ValueError: if `D` does not divide `K`.
    """
    num_devices = num_devices or max(1, num_stages // 2)
    _check_counts(num_micro_batches, num_stages, num_devices)
    k, d = num_stages, num_devices
    if k % d:
        raise ValueError(f"interleaved_1f1b needs num_stages a multiple of "
                         f"num_devices. Received: num_stages={k}, "
                         f"num_devices={d}")
    return list_schedule(
        num_micro_batches, k, stage_placement(k, d, "loop"), [k + 1] * d,
        forward_key=lambda i, j: (i // d, j // d, i % d))


def zbv(num_micro_batches, num_stages, num_devices=None):
    """Zero-bubble V schedule: two stages per device in a V, `"W"` deferred.

    Device `d` holds stage `d` (down) and stage `2D - 1 - d` (back up), so
    the first and the last stage share device 0 and the loss is computed
    where the first stage's backward starts; weight gradients fill the
    remaining slots.

    Args:
        num_micro_batches: `M`, >= 1.
        num_stages: `K = 2 D`.
        num_devices: `D = K / 2`. Defaults to `K // 2`.

    Raises:
        ValueError: if `K != 2 D`.
    """
    num_devices = num_devices or max(1, num_stages // 2)
    _check_counts(num_micro_batches, num_stages, num_devices)
    m, k, d = num_micro_batches, num_stages, num_devices
    if k != 2 * d:
        raise ValueError(f"zbv needs num_stages == 2 * num_devices. "
                         f"Received: num_stages={k}, num_devices={d}")
    return list_schedule(m, k, stage_placement(k, d, "v"), [k] * d,
                         [m + 1] * d)


@dataclasses.dataclass(frozen=True)
class _Entry:
    build: object      # (num_micro_batches, num_stages, num_devices) -> ticks
    placement: object  # None (any) or "loop" / "v": see `stage_placement`
    stages_per_device: object  # None (any) or the required count


_REGISTRY = {}


def register_schedule(name, build, placement=None, stages_per_device=None):
    """Registers a schedule under `name` for `PipelineModel(schedule=name)`.

    ```python
    def backward_in_forward_order(num_micro_batches, num_stages,
                                  num_devices=None):
        m, k = num_micro_batches, num_stages
        return ticks_from_orders(
            [[Action("F", i, j) for i in range(m)] +
             [Action("B", i, j) for i in range(m)] for j in range(k)], k)

    register_schedule("gpipe_forward_order", backward_in_forward_order)
    ```

    Args:
        name: a new name.
        build: a pure function `(num_micro_batches, num_stages, num_devices)
            -> ticks`; every `(i, j)` must have one `"F"` and one `"B"`
            action (and at most one `"W"`).
        placement: the device order the schedule needs when several stages
            share a device: `"loop"` or `"v"` (see `stage_placement`), or
            `None` for any. Defaults to `None`.
        stages_per_device: the number of stages each device must hold, or
            `None` for any. Defaults to `None`.

    Raises:
        TypeError: if `name` is not a string or `build` is not callable.
        ValueError: if `name` is taken, `placement` unknown,
            `stages_per_device` not >= 1, or `build` returns ticks that
            `check_ticks` refuses for small counts (M = 1, 4; D = 1, 2).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string. Received: name={name!r}")
    if not callable(build):
        raise TypeError(f"build must be callable. Received: build={build!r}")
    if name in _REGISTRY:
        raise ValueError(f"A schedule named {name!r} is already registered; "
                         "choose another name.")
    if placement not in (None, "loop", "v"):
        raise ValueError(f"placement must be None, 'loop' or 'v'. Received: "
                         f"placement={placement!r}")
    if stages_per_device is not None:
        _validation.check_positive_int("stages_per_device", stages_per_device)
    _check_sample(name, build, stages_per_device or 1)
    _REGISTRY[name] = _Entry(build, placement, stages_per_device)


def _check_sample(name, build, stages_per_device):
    """Builds and checks a few small schedules (M = 1, 4; D = 1, 2).

    A `ValueError` from `build` is a schedule refusing those counts: those
    are skipped (the model's own counts are checked when it is built).
    """
    for d in (1, 2):
        k = d * stages_per_device
        for m in (1, 4):
            try:
                ticks = build(m, k, d)
            except ValueError:
                continue
            except Exception as exc:  # The user's build function failed.
                raise ValueError(
                    f"Schedule {name!r}: build({m}, {k}, {d}) raised "
                    f"{type(exc).__name__}: {exc}. build must take "
                    "(num_micro_batches, num_stages, num_devices) and "
                    "return a list of ticks.") from exc
            check_ticks(ticks, m, k, name)


def build_ticks(name, num_micro_batches, num_stages, num_devices):
    """The checked ticks of registered schedule `name` (see `check_ticks`)."""
    ticks = get_schedule(name).build(num_micro_batches, num_stages,
                                     num_devices)
    return check_ticks(ticks, num_micro_batches, num_stages, name)


def get_schedule(name):
    """The registered schedule `name` (`build`, `placement`, ...).

    Raises:
        ValueError: naming the registered schedules if `name` is unknown.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"schedule must be one of {schedule_names()}. "
                         "Received: "
                         f"schedule={name!r}")
    return _REGISTRY[name]


def schedule_names():
    """The names of the registered schedules."""
    return tuple(_REGISTRY)


def check_placement(name, stage_devices):
    """Checks the stages' device indices against schedule `name`'s needs.

    Args:
        name: a registered schedule.
        stage_devices: per stage, the index of its device (devices numbered
            in order of first appearance).

    Raises:
        ValueError: naming the device order the schedule needs.
    """
    entry = get_schedule(name)
    k = len(stage_devices)
    d = 1 + max(stage_devices)
    if entry.stages_per_device is not None and (
            k != d * entry.stages_per_device):
        raise ValueError(
            f"schedule={name!r} runs {entry.stages_per_device} stages per "
            f"device: got {k} stages on {d} devices. Pass "
            f"{d * entry.stages_per_device} stages, or devices repeated "
            f"{entry.stages_per_device} times.")
    if entry.placement is not None:
        want = stage_placement(k, d, entry.placement)
        if list(stage_devices) != want:
            raise ValueError(
                f"schedule={name!r} needs stage j on device "
                f"{'j % D' if entry.placement == 'loop' else 'V-shaped'}: "
                f"device indices {want} for {k} stages on {d} devices; got "
                f"{list(stage_devices)}. Reorder devices=[...] to match.")


def bubble_fraction(num_micro_batches, num_stages):
    """Returns the idle fraction `(K - 1) / (M + K - 1)` of a GPipe step."""
    _check_counts(num_micro_batches, num_stages)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def idle_fraction(ticks, stage_devices=None):
    """The share of (device, tick) slots without an action in `ticks`."""
    k = 1 + max(a.j for tick in ticks for a in tick)
    stage_devices = stage_devices or list(range(k))
    d = 1 + max(stage_devices)
    busy = sum(len(tick) for tick in ticks)
    return 1.0 - busy / (d * len(ticks))


def format_schedule(ticks):
    """Draws a schedule as a table: one row per stage, one column per tick.

    A cell holds the action the stage runs at that tick (`F3`, `B3`, `W3`
    for micro-batch 3), or `.` when the stage is idle (the bubble).

    Args:
        ticks: a schedule, as returned by `gpipe` or `get_schedule(name)`.

    Returns:
        The table as a multi-line string.
    """
    cells = {(a.j, k): f"{a.kind}{a.i}" for k, tick in enumerate(ticks)
             for a in tick}
    num_stages = 1 + max((j for j, _ in cells), default=-1)
    width = max([2, len(str(len(ticks) - 1))] + [len(c) for c in
                                                   cells.values()])
    label = max(len("tick"), len(f"stage {num_stages - 1}"))
    rows = ["tick".ljust(label) + "".join(
        f" {k:>{width}}" for k in range(len(ticks)))]
    for j in range(num_stages):
        rows.append(f"stage {j}".ljust(label) + "".join(
            f" {cells.get((j, k), '.'):>{width}}" for k in range(len(ticks))))
    return "\n".join(rows)


register_schedule("gpipe", gpipe)
register_schedule("1f1b", one_f_one_b)
register_schedule("zb_h1", zb_h1)
register_schedule("zb_h2", zb_h2)
register_schedule("interleaved_1f1b", interleaved_1f1b, placement="loop")
register_schedule("zbv", zbv, placement="v", stages_per_device=2)
