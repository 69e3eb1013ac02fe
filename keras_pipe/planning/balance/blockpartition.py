"""Optimal block partition: cut a sequence into blocks of least maximal cost.

Greedy filling (start a new block when the running sum passes the average)
can be far from the best cut; here a dynamic program finds the cut that
minimizes the largest block cost exactly, in `O(num_blocks * n)` vectorized
steps of length `n`. Among the cuts that reach that optimum, a second pass
picks the one whose largest block is smallest by a tie-breaking cost (by
default the number of items), so that a stage of zero-cost layers does not
end up holding almost everything.
"""

import numpy as np

__all__ = ["block_partition"]


def _check(costs, num_blocks, allowed_cuts, tie_costs):
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ValueError(f"costs must be a flat sequence. Received shape "
                         f"{costs.shape}.")
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"costs must be finite and >= 0. Received: "
                         f"costs={costs.tolist()}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise TypeError(
            f"num_blocks must be an int. Received: num_blocks={num_blocks!r}")
    n = len(costs)
    if not 1 <= num_blocks <= n:
        raise ValueError(
            f"Cannot cut {n} items into {num_blocks} non-empty blocks: "
            f"num_blocks must be between 1 and {n}.")
    if allowed_cuts is None:
        allowed = np.ones(max(n - 1, 0), dtype=bool)
    else:
        allowed = np.asarray(allowed_cuts, dtype=bool)
        if allowed.shape != (n - 1,):
            raise ValueError(
                f"allowed_cuts must have one flag per gap between items "
                f"({n - 1}). Received {allowed.shape[0]} flags.")
    if int(allowed.sum()) < num_blocks - 1:
        raise ValueError(
            f"Cannot cut {n} items into {num_blocks} blocks: only "
            f"{int(allowed.sum())} of the {n - 1} gaps may be cut.")
    ties = np.ones(n) if tie_costs is None else np.asarray(
        tie_costs, dtype=np.float64)
    if ties.shape != costs.shape:
        raise ValueError(f"tie_costs must have one cost per item ({n}). "
                         f"Received {ties.shape[0]}.")
    return costs, allowed, ties


def _solve(prefix, num_blocks, open_at, limit=None, limit_prefix=None):
    """min over cuts of max block sum of `prefix`; returns (value, choices).

    `open_at[j]` says whether a block may start after item `j - 1` (`j` in
    `1..n-1`); `limit` bounds the `limit_prefix` sum of every block.
    """
    n = len(prefix) - 1
    best = np.full(n + 1, np.inf)
    best[1:] = prefix[1:]
    if limit is not None:
        best[1:][limit_prefix[1:] > limit] = np.inf
    choices = []
    starts = np.arange(n + 1)
    for _ in range(1, num_blocks):
        new = np.full(n + 1, np.inf)
        choice = np.zeros(n + 1, dtype=np.int64)
        for i in range(2, n + 1):
            j = starts[1:i]                       # last block is items j..i-1
            value = np.maximum(best[j], prefix[i] - prefix[j])
            bad = ~open_at[j]
            if limit is not None:
                bad |= (limit_prefix[i] - limit_prefix[j]) > limit
            value[bad] = np.inf
            k = int(np.argmin(value))
            new[i], choice[i] = value[k], j[k]
        best = new
        choices.append(choice)
    return best[n], choices


def _sizes(choices, n):
    bounds = [n]
    for choice in reversed(choices):
        bounds.append(int(choice[bounds[-1]]))
    bounds.append(0)
    bounds.reverse()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def block_partition(costs, num_blocks, allowed_cuts=None, tie_costs=None):
    """Cuts `costs` into `num_blocks` blocks, minimizing the largest sum.

    ```python
    >>> block_partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    [5, 2, 2]    # sums 15, 13, 17: no cut has a largest block below 17
    ```

    Args:
        costs: one non-negative cost per item.
        num_blocks: number of non-empty blocks, `1 <= num_blocks <= n`.
        allowed_cuts: `n - 1` flags; `allowed_cuts[j]` says whether a block
            may end after item `j`. Defaults to `None` (every gap).
        tie_costs: one cost per item, used to choose among the optimal cuts
            the one whose largest block has the least tie cost. Defaults to
            `None` (one per item: the most even item counts).

    Returns:
        The list of block sizes, which sums to `n`.

    Raises:
        TypeError: if `num_blocks` is not an int.
        ValueError: if a cost is negative or not finite, `num_blocks` is
            not in `1..n`, or fewer than `num_blocks - 1` gaps may be cut.
    """
    costs, allowed, ties = _check(costs, num_blocks, allowed_cuts, tie_costs)
    n = len(costs)
    open_at = np.concatenate([[False], allowed, [False]])
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    optimum, _ = _solve(prefix, num_blocks, open_at)
    # Summation order differs between a block sum and a prefix difference.
    limit = optimum + 1e-9 * max(1.0, abs(optimum))
    tie_prefix = np.concatenate([[0.0], np.cumsum(ties)])
    _, choices = _solve(tie_prefix, num_blocks, open_at, limit, prefix)
    return _sizes(choices, n)
