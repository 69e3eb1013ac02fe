"""A stage's passes in the order the executor runs them, from a schedule.

How many micro-batches a stage holds comes from the schedule's clock ticks
(`stage_actions`), not from a formula per schedule: a new schedule plugs in
by name or as a function `(num_micro_batches, num_stages) -> ticks`. Where
the executor splits a backward pass (`engine.weight_calls`),
`executor_order` says so, as the executor decides it.
"""

from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.engine import weight_calls

__all__ = ["StageActions", "executor_order", "in_flight", "stage_actions"]


def _ticks(schedule, num_micro_batches, num_stages):
    if callable(schedule):
        return schedule(num_micro_batches, num_stages)
    return schedule_lib.get_schedule(schedule).build(
        num_micro_batches, num_stages, num_stages)


class StageActions(list):
    """One stage's passes `(kind, i)` in order (a list), knowing the whole
    schedule: `executor_order` places the weight-gradient calls where the
    executor does."""

    def __init__(self, items, ticks, j, num_stages):
        super().__init__(items)
        self.ticks, self.j, self.num_stages = ticks, j, num_stages
        self._orders = {}

    def executor_order(self, mode, num_micro_batches):
        """The stage's passes as the executor runs them with remat `mode`
        on every stage: `"F"`; `"B"` (input and weight gradients, one
        call); `"Bi"` (input gradients only) and `"Wg"` (its weight
        gradients, a later call) where the executor splits a backward pass
        (`schedule.defer_weight_runs` with `num_stages`, as
        `engine.executor` calls it: right after its `"B"`, or at the end of
        a run fed back to back), and for the stage's last backward pass if
        whole (`engine.weight_calls`); `"W"` for a backward pass the
        schedule splits itself (the micro-batch is held until then)."""
        key = (mode, num_micro_batches)
        if key not in self._orders:
            flat = [a for tick in self.ticks for a in tick]
            self._orders[key] = _stage_order(
                flat, self.j, mode, num_micro_batches, self.num_stages)
        return self._orders[key]



def _stage_order(flat, j, mode, m, num_stages=None):
    """`StageActions.executor_order` of stage `j` among the actions `flat`
    (issue order); `num_stages=None`: every run of two or more backward
    passes deferred, lone ones whole (`defer_weight_runs` without it)."""
    split = {(a.i, a.j) for a in flat if a.kind == "W"}
    added = weight_calls.place_weight_calls(
        flat, lambda a: a.j, lambda a: a.j,
        lambda a: schedule_lib.is_remat(mode, a.i, m), num_stages)
    weights = {(a.i, a.j) for a in added if a.kind == "W"} - split
    out = []
    for a in added:
        if a.j != j or (a.kind == "B" and (a.i, a.j) in split):
            continue
        if a.kind == "B":
            out.append(("Bi" if (a.i, a.j) in weights else "B", a.i))
        elif a.kind == "W":
            out.append(("W" if (a.i, a.j) in split else "Wg", a.i))
        else:
            out.append((a.kind, a.i))
    return out


def stage_actions(schedule, num_micro_batches, num_stages):
    """Per stage, its passes `("F", i)` / `("B", i)` in the order they run.

    A split backward pass (`"W"` actions, zero-bubble schedules) holds the
    micro-batch until its `"W"`, which is listed as `("W", i)` (its `"B"`
    is not listed). Each list is a `StageActions`, which also knows where
    the executor splits backward passes (`executor_order`).

    ```python
    >>> stage_actions("1f1b", 2, 2)[1]
    [('F', 0), ('B', 0), ('F', 1), ('B', 1)]
    ```
    """
    ticks = _ticks(schedule, num_micro_batches, num_stages)
    split = {(a.i, a.j) for tick in ticks for a in tick if a.kind == "W"}
    actions = [[] for _ in range(num_stages)]
    for tick in ticks:
        for a in tick:
            if a.kind == "F":
                actions[a.j].append(("F", a.i))
            elif (a.kind == "W") == ((a.i, a.j) in split):
                actions[a.j].append((a.kind, a.i))
    return [StageActions(a, ticks, j, num_stages)
            for j, a in enumerate(actions)]


def in_flight(schedule, num_micro_batches, num_stages):
    """Per stage, the most micro-batches whose forward ran and backward not.

    ```python
    >>> in_flight("gpipe", 8, 4), in_flight("1f1b", 8, 4)
    ([8, 8, 8, 8], [4, 3, 2, 1])
    ```
    """
    result = []
    for actions in stage_actions(schedule, num_micro_batches, num_stages):
        live = most = 0
        for kind, _ in actions:
            live += 1 if kind == "F" else -1
            most = max(most, live)
        result.append(most)
    return result



def executor_order(actions, mode, m):
    """A stage's passes as the executor runs them (`StageActions.
    executor_order`); for a plain list of `(kind, i)` (a stage alone,
    without the schedule), every run of two or more backward passes
    defers its weight gradients to its end."""
    if isinstance(actions, StageActions):
        return actions.executor_order(mode, m)
    flat = [schedule_lib.Action(kind, i, 0) for kind, i in actions]
    return _stage_order(flat, 0, mode, m)

