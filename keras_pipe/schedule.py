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

__all__ = ["gpipe", "format_schedule", "bubble_fraction"]


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


def bubble_fraction(num_micro_batches, num_stages):
    """Returns the idle fraction `(K - 1) / (M + K - 1)` of a GPipe step."""
    _check_positive_int("num_micro_batches", num_micro_batches)
    _check_positive_int("num_stages", num_stages)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def format_schedule(ticks):
    """Draws a schedule as a table: one row per stage, one column per tick.

    A cell holds the micro-batch the stage works on at that tick, or `.`
    when the stage is idle (the bubble).

    Args:
        ticks: a schedule as returned by `gpipe`.

    Returns:
        The table as a multi-line string.
    """
    num_stages = 1 + max((j for tick in ticks for _, j in tick), default=-1)
    width = max(2, len(str(len(ticks) - 1)),
                len(str(max((i for t in ticks for i, _ in t), default=0))))
    label = max(len("tick"), len(f"stage {num_stages - 1}"))
    rows = ["tick".ljust(label) + "".join(
        f" {k:>{width}}" for k in range(len(ticks)))]
    for j in range(num_stages):
        cells = []
        for tick in ticks:
            busy = [i for i, jj in tick if jj == j]
            cells.append(f" {busy[0] if busy else '.':>{width}}")
        rows.append(f"stage {j}".ljust(label) + "".join(cells))
    return "\n".join(rows)
