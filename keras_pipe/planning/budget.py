"""Choosing the cut, `num_micro_batches` and per-stage remat for a budget.

GPipe's capacity promise needs three choices made together: where to cut,
how many micro-batches, which stages recompute. Memory per stage comes from
`keras_pipe.planning.memory` (a stage's peak depends only on its own calls, its
remat mode and its place in the schedule), time from forward FLOPs, so
`search` can try every cut: for each candidate `M` a dynamic program over
the calls picks the cut minimizing the slowest stage, each stage taking the
fastest remat mode that fits its device's budget. The step time it
minimizes is `(M + K - 1) / M` (the bubble) times the slowest stage's work
per mini-batch (forward, backward, recompute, a fixed cost per stage call
and the running-sum traffic per micro-batch).
"""

import dataclasses

import numpy as np

from keras_pipe import _validation
from keras_pipe.planning import graph as graph_lib
from keras_pipe.planning import memory as memory_lib
from keras_pipe.planning import partition as partition_lib
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["Choice", "pipeline_arguments", "search"]

# Fastest first: the search takes the first mode that fits.
_MODES = ("never", "except_last", "always")


@dataclasses.dataclass
class Choice:
    """What `search` picked, and why.

    Attributes:
        sizes: layer calls per stage (`from_model(..., balance=sizes)`).
        num_micro_batches: `M`.
        remat: one remat mode per stage.
        peaks: predicted `keras_pipe.planning.memory.StageMemory` per stage.
        budgets: bytes per device.
        step_time: predicted seconds per step.
        considered: per `M` tried, `(M, step_time or None, smallest
            per-device peak any cut reaches)`.
    """

    sizes: list
    num_micro_batches: int
    remat: list
    peaks: list
    budgets: list
    step_time: float
    considered: list

    def table(self):
        """The choice as text: per stage, remat and peak against budget."""
        lines = ["memory budget: per stage, remat and predicted peak / "
                 "budget"]
        for j, (size, mode, peak, budget) in enumerate(zip(
                self.sizes, self.remat, self.peaks, self.budgets)):
            lines.append(
                f"  stage {j}: {size} calls, remat={mode!r}, peak "
                f"{_mib(peak.total)} / {_mib(budget)} (weights+slots "
                f"{_mib(peak.weights + peak.optimizer_slots)}, gradients "
                f"{_mib(peak.gradients)}, boundary {_mib(peak.boundary)}, "
                f"activations {_mib(peak.activations)})")
        tried = ", ".join(
            f"M={m}: " + (f"{t * 1e3:.1f} ms" if t is not None else
                          f"does not fit (needs {_mib(need)})")
            for m, t, need in self.considered)
        lines.append(f"  chosen M={self.num_micro_batches} for the least "
                     f"predicted step time ({self.step_time * 1e3:.1f} ms, "
                     f"bubble and recompute included); tried {tried}")
        return "\n".join(lines)


def _mib(value):
    return f"{value / 2**20:.1f} MiB"


def budgets_per_device(memory_budget, num_stages):
    """One memory budget per device: a number repeated, or a checked list."""
    if isinstance(memory_budget, (list, tuple)):
        if len(memory_budget) != num_stages:
            raise ValueError(
                f"memory_budget as a list needs one budget per device: got "
                f"{len(memory_budget)} for {num_stages} devices. Received: "
                f"memory_budget={list(memory_budget)}")
        return [_validation.check_positive_number(f"memory_budget[{j}]", b)
                for j, b in enumerate(memory_budget)]
    _validation.check_positive_number("memory_budget", memory_budget)
    return [memory_budget] * num_stages


def block_grid(profile, n):
    """Features of every block `[a, e)` as an `(n + 1, n + 1, F)` array."""
    idx = np.arange(n + 1)
    a, e = idx[:, None], idx[None, :]
    gap = np.array([profile.input_bytes] + profile.gap + [0], float)
    outputs = np.array([0] + profile.gap + [profile.output_bytes], float)
    saved = np.array(profile.saved, float)
    mixed = np.array(profile.mixed, float)
    recomputed = np.array(profile.recomputed, float)
    stashed = np.array(profile.stashed, float)
    trainable = np.array(profile.trainable, float)
    weights = np.array(profile.weights, float)
    largest = np.zeros((n + 1, n + 1))
    largest_var = np.zeros((n + 1, n + 1))
    workspace = np.zeros((n + 1, n + 1))
    broadcast = np.zeros((n + 1, n + 1))
    after = np.zeros((n + 1, n + 1))
    out = np.array(profile.out, float)
    var = np.array(profile.largest_var, float)
    second_var = np.array(profile.second_var, float)
    second = np.zeros((n + 1, n + 1))
    scratch = np.array(profile.workspace, float)
    per_call = np.array(profile.broadcast, float)
    for start in range(n):
        largest[start, start + 1:] = np.maximum.accumulate(out[start:])
        largest_var[start, start + 1:] = np.maximum.accumulate(var[start:])
        second[start, start + 1:] = memory_lib.second_largest(
            var[start:], second_var[start:])
        workspace[start, start + 1:] = np.maximum.accumulate(
            scratch[start:])
        broadcast[start, start + 1:] = np.maximum.accumulate(
            per_call[start:])
        after[start, start + 1:] = profile.after_broadcast_from(start, n)
    grid = {
        "inputs": np.broadcast_to(gap[:, None], (n + 1, n + 1)),
        "outputs": np.broadcast_to(outputs[None, :], (n + 1, n + 1)),
        "activations": saved[e] - saved[a],
        "recompute": recomputed[e] - recomputed[a],
        "trainable": trainable[e] - trainable[a],
        "largest": largest, "largest_variable": largest_var,
        "second_variable": second,
        "mixing": mixed[e] - mixed[a], "workspace": workspace,
        "broadcast": broadcast, "after_broadcast": after,
        "stash": stashed[e] - stashed[a],
        "transposed": np.array(profile.transposed, float)[e]
        - np.array(profile.transposed, float)[a],
        "seeded": np.broadcast_to(
            np.array([0] + profile.seeded, float)[None, :], (n + 1, n + 1))}
    return (np.stack([grid[f] for f in memory_lib.FEATURES], -1),
            weights[e] - weights[a], trainable[e] - trainable[a])


def min_max_cut(costs, allowed, num_stages):
    """DP: the cut minimizing the largest stage cost; (value, sizes)."""
    n = costs[0].shape[0] - 1
    ok = np.ones(n + 1, bool)
    ok[1:n] = allowed
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = []
    for j in range(num_stages):
        c = np.where(ok[:, None] & ok[None, :], costs[j], np.inf)
        c = np.where(np.triu(np.ones((n + 1, n + 1), bool), 1), c, np.inf)
        total = np.maximum(best[:, None], c)
        back.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
    if not np.isfinite(best[n]):
        return np.inf, None
    sizes, e = [], n
    for j in reversed(range(num_stages)):
        a = int(back[j][e])
        sizes.append(e - a)
        e = a
    return float(best[n]), sizes[::-1]


def search(model, num_stages, memory_budget, batch_size, schedule="gpipe",
           optimizer_slots=2, micro_batch_choices=None,
           flops_per_second=2e10, call_seconds=2e-4, bytes_per_second=5e9):
    """Picks the cut, `M` and per-stage remat that fit and run fastest.

    ```python
    choice = keras_pipe.planning.budget.search(model, num_stages=2,
                                      memory_budget=512 * 2**20,
                                      batch_size=256)
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=2, devices=devices, balance=choice.sizes,
        num_micro_batches=choice.num_micro_batches, remat=choice.remat)
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.
        num_stages: `K`, one stage per device.
        memory_budget: bytes per device, or a list of one per device.
        batch_size: rows per mini-batch.
        schedule: `"gpipe"`, `"1f1b"` or a clock-tick function. Defaults to
            `"gpipe"`.
        optimizer_slots: optimizer variables per trainable weight (Adam 2,
            SGD 0). Defaults to `2`.
        micro_batch_choices: the `M` values to try. Defaults to `None`
            (powers of two up to `batch_size`, at most 64).
        flops_per_second: a device's sustained FLOP rate. Defaults to
            `2e10`.
        call_seconds: fixed cost of one stage call. Defaults to `2e-4`.
        bytes_per_second: memory bandwidth, for the running sums of weight
            gradients (read and written once per micro-batch). Defaults to
            `5e9`.

    Returns:
        A `Choice`.

    Raises:
        TypeError, ValueError: for a bad count or budget, and a
            `ValueError` naming the smallest per-device budget that would
            fit when no cut, `M` and remat fit `memory_budget`.
    """
    _validation.check_positive_int("num_stages", num_stages)
    if batch_size is None:
        raise ValueError(
            "memory_budget needs batch_size: activation memory grows with "
            "the rows per step. Received: batch_size=None")
    _validation.check_positive_int("batch_size", batch_size)
    _validation.check_positive_int("optimizer_slots + 1", optimizer_slots + 1)
    budgets = budgets_per_device(memory_budget, num_stages)
    if micro_batch_choices is None:
        micro_batch_choices = [2**p for p in range(7) if 2**p <= batch_size]
    for m in micro_batch_choices:
        _validation.check_positive_int("micro_batch_choices[...]", m)
    graph = graph_lib.read_graph(model)
    n = len(graph.calls)
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} is larger than the number of layer "
            f"calls of {model.name!r} ({n}). Use num_stages <= {n}.")
    allowed = np.array(partition_lib.allowed_cuts(graph), bool)
    best, considered, smallest = None, [], None
    for m in micro_batch_choices:
        m = min(m, batch_size)
        rows = -(-batch_size // m)
        profile = memory_lib.Profile(graph, rows)
        grid, weights, trainable = block_grid(profile, n)
        fl = np.concatenate([[0.0], np.cumsum(cost_lib.flops(graph, rows))])
        flops = fl[None, :] - fl[:, None]
        actions = memory_lib.stage_actions(schedule, m, num_stages)
        times, needs, modes = [], [], []
        for j in range(num_stages):
            fixed = weights + optimizer_slots * trainable
            time_j = np.full((n + 1, n + 1), np.inf)
            mode_j = np.full((n + 1, n + 1), -1)
            need_j = np.full((n + 1, n + 1), np.inf)
            for index, mode in enumerate(_MODES):
                forms = memory_lib.moments(
                    actions[j], mode, m, j == 0, j == num_stages - 1,
                    optimizer_slots, memory_lib.transposes(
                        mode, batch_size, m)).sum(axis=1)
                peak = fixed + (grid @ forms.T).max(axis=-1)
                recomputed = {"never": 0, "except_last": m - 1,
                              "always": m}[mode]
                t = ((3 * m + recomputed) * flops / flops_per_second
                     + 2 * m * call_seconds
                     + 3 * m * trainable / bytes_per_second)
                fits = (peak <= budgets[j]) & ~np.isfinite(time_j)
                time_j = np.where(fits, t, time_j)
                mode_j = np.where(fits, index, mode_j)
                need_j = np.minimum(need_j, peak)
            times.append(time_j)
            needs.append(need_j)
            modes.append(mode_j)
        slowest, sizes = min_max_cut(times, allowed, num_stages)
        need, _ = min_max_cut(needs, allowed, num_stages)
        smallest = need if smallest is None else min(smallest, need)
        if sizes is None:
            considered.append((m, None, need))
            continue
        step = slowest * (m + num_stages - 1) / m
        considered.append((m, step, need))
        if best is None or step < best[0]:
            best = (step, m, sizes, modes)
    if best is None:
        raise ValueError(
            f"No cut of {model.name!r} into {num_stages} stages, "
            f"num_micro_batches in {list(micro_batch_choices)} and remat "
            f"mode per stage fits memory_budget={_show(memory_budget)} "
            f"with batch_size={batch_size}: the smallest budget that fits "
            f"is {int(np.ceil(smallest))} bytes "
            f"({_mib(smallest)}) per device. Raise memory_budget to at "
            f"least that, lower batch_size, or use more devices.")
    step, m, sizes, modes = best
    remat, start = [], 0
    for j, size in enumerate(sizes):
        remat.append(_MODES[int(modes[j][start, start + size])])
        start += size
    part = partition_lib.cut(model, num_stages, balance=sizes)
    peaks = memory_lib.predict(part, batch_size, m, remat, schedule,
                               optimizer_slots)
    return Choice(sizes, m, remat, peaks, budgets, step, considered)


def _show(budget):
    if isinstance(budget, (list, tuple)):
        return "[" + ", ".join(_mib(b) for b in budget) + "]"
    return f"{budget} ({_mib(budget)})"


def pipeline_arguments(model, num_stages, memory_budget, batch_size,
                       **kwargs):
    """`(balance, num_micro_batches, remat)` for `PipelineModel.from_model`.

    ```python
    balance, m, remat = keras_pipe.planning.budget.pipeline_arguments(
        model, 2, memory_budget=512 * 2**20, batch_size=256)
    ```

    Args:
        model, num_stages, memory_budget, batch_size: as in `search`.
        **kwargs: the other arguments of `search` (`schedule`,
            `optimizer_slots`, ...).

    Returns:
        The cut as layer-call counts per stage, `M`, and one remat mode per
        stage.

    Raises:
        TypeError, ValueError: as `search`.
    """
    choice = search(model, num_stages, memory_budget, batch_size, **kwargs)
    return list(choice.sizes), choice.num_micro_batches, list(choice.remat)
