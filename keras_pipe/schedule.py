"""Clock-tick schedules of micro-batches over stages (pure Python, no TF).

A schedule is a list of clock ticks; tick ``k`` lists the ``(i, j)`` pairs
(micro-batch ``i``, stage ``j``) that may run at the same time. The executor in
`keras_pipe.model` follows it: it issues the forward of every pair of tick 0,
then of tick 1, and so on, and the backward in reverse tick order.

GPipe with 3 micro-batches on 2 stages (``format_schedule(gpipe(3, 2))``)::

    tick     0  1  2  3
    stage 0  0  1  2  .
    stage 1  .  0  1  2
"""

__all__ = ["SCHEDULES", "gpipe", "one_f_one_b", "format_schedule",
           "bubble_fraction"]

SCHEDULES = ("gpipe", "1f1b")


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1. Received: {name}={value}")


def gpipe(num_micro_batches, num_stages):
    """Returns the GPipe fill-drain schedule as a list of clock ticks.

    Micro-batch `i` runs on stage `j` at tick `k = i + j`: after micro-batch
    `i` left stage `j - 1` and after micro-batch `i - 1` left stage `j`.
    There are `num_micro_batches + num_stages - 1` ticks.

    ```python
    >>> gpipe(2, 2)
    [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    ```

    Args:
        num_micro_batches: `M`, the number of micro-batches, >= 1.
        num_stages: `K`, the number of stages, >= 1.

    Returns:
        A list of `M + K - 1` lists of `(i, j)` tuples, ordered by stage
        within a tick.

    Raises:
        TypeError: if a count is not an int.
        ValueError: if a count is < 1.
    """
    _check_positive_int("num_micro_batches", num_micro_batches)
    _check_positive_int("num_stages", num_stages)
    m, n = num_micro_batches, num_stages
    return [
        [(k - j, j) for j in range(max(0, k - m + 1), min(k + 1, n))]
        for k in range(m + n - 1)
    ]


def one_f_one_b(num_micro_batches, num_stages):
    """Returns the 1F1B (PipeDream-flush) schedule as a list of clock ticks.

    Stage `j` runs `min(K - j - 1, M)` forward passes to fill the pipeline,
    then alternates one forward and one backward pass, then drains the
    remaining backward passes. A stage holds the activations of at most
    `K - j` micro-batches at a time (GPipe: all `M`), for the same bubble.
    Ticks assume a backward pass takes as long as a forward pass.

    ```python
    >>> one_f_one_b(2, 2)
    [[('F', 0, 0)], [('F', 1, 0), ('F', 0, 1)], [('B', 0, 1)],
     [('B', 0, 0), ('F', 1, 1)], [('B', 1, 1)], [('B', 1, 0)]]
    ```

    Args:
        num_micro_batches: `M`, the number of micro-batches, >= 1.
        num_stages: `K`, the number of stages, >= 1.

    Returns:
        A list of ticks, each a list of `(kind, i, j)` with `kind` `"F"` or
        `"B"`, micro-batch `i` and stage `j`; `2 (M + K - 1)` ticks.

    Raises:
        TypeError: if a count is not an int.
        ValueError: if a count is < 1.
    """
    _check_positive_int("num_micro_batches", num_micro_batches)
    _check_positive_int("num_stages", num_stages)
    m, n = num_micro_batches, num_stages
    orders = []
    for j in range(n):
        warmup = min(n - j - 1, m)
        order = [("F", i) for i in range(warmup)]
        for step in range(m - warmup):
            order += [("F", warmup + step), ("B", step)]
        order += [("B", i) for i in range(m - warmup, m)]
        orders.append(order)
    done, position, ticks = set(), [0] * n, []
    while any(position[j] < len(orders[j]) for j in range(n)):
        tick = []
        for j in range(n):
            if position[j] == len(orders[j]):
                continue
            kind, i = orders[j][position[j]]
            if kind == "F":
                ready = j == 0 or ("F", i, j - 1) in done
            else:
                ready = ("F", i, j) in done and (
                    j == n - 1 or ("B", i, j + 1) in done)
            if ready:
                tick.append((kind, i, j))
        done.update(tick)
        for _, _, j in tick:
            position[j] += 1
        ticks.append(tick)
    return ticks


def bubble_fraction(num_micro_batches, num_stages):
    """Returns the idle fraction `(K - 1) / (M + K - 1)` of a GPipe step."""
    _check_positive_int("num_micro_batches", num_micro_batches)
    _check_positive_int("num_stages", num_stages)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def format_schedule(ticks):
    """Draws a schedule as a table: one row per stage, one column per tick.

    A cell holds the micro-batch the stage works on at that tick (`F3`,
    `B3` for the 1F1B schedule's forward and backward passes), or `.` when
    the stage is idle (the bubble).

    Args:
        ticks: a schedule as returned by `gpipe` or `one_f_one_b`.

    Returns:
        The table as a multi-line string.
    """
    cells = {}
    for k, tick in enumerate(ticks):
        for op in tick:
            *kind, i, j = op
            cells[(j, k)] = "".join(kind) + str(i)
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
