"""Random inputs and targets for the tests, drawn from one seeded generator."""

import numpy as np


def random_data(rows, x_shape, *, classes=None, y_dim=None, weights=None,
                seed=0):
    """`(x, y)` or `(x, y, sample_weight)` of `rows` rows, float32 / int32.

    Draws, in this order from `np.random.default_rng(seed)`: `x` normal of
    shape `(rows, *x_shape)`; `y` integer labels below `classes`, or normal
    of shape `(rows, y_dim)`; and, if `weights=(low, high)`, uniform sample
    weights.
    """
    if (classes is None) == (y_dim is None):
        raise ValueError(f"Pass one of classes={classes} or y_dim={y_dim}.")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, *x_shape)).astype("float32")
    if classes is not None:
        y = rng.integers(0, classes, size=(rows,)).astype("int32")
    else:
        y = rng.normal(size=(rows, y_dim)).astype("float32")
    if weights is None:
        return x, y
    w = rng.uniform(*weights, size=(rows,)).astype("float32")
    return x, y, w
