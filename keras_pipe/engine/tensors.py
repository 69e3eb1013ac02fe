"""Small helpers on tensors shared by the stage runner and the split backward.

Which leaves of a nested structure carry gradients, which (output,
gradient) pairs take part in a backward pass, and the `TensorSpec`s stage
functions are traced with (the batch dimension left open, no names: a name
would make every micro-batch's cache key different).
"""

import keras
import tensorflow as tf

__all__ = ["exact_spec", "float_leaves", "is_float", "pairs",
           "relaxed_spec"]


def is_float(t):
    """Whether `t` is a floating-point tensor (None is not)."""
    return t is not None and t.dtype.is_floating


def float_leaves(structure):
    """The floating-point tensors of a nested structure, in flatten order."""
    return [t for t in keras.tree.flatten(structure) if is_float(t)]


def pairs(ys, grads):
    """The (output, gradient) pairs that take part in a backward pass."""
    kept = [(y, g) for y, g in zip(ys, grads)
            if g is not None and is_float(y)]
    return [y for y, _ in kept], [g for _, g in kept]


def exact_spec(t):
    """A TensorSpec of `t` (without its name, which would be in a key)."""
    return tf.TensorSpec(t.shape, t.dtype)


def relaxed_spec(t):
    """A TensorSpec of `t` with the batch dimension left open."""
    if t.shape.rank:
        return tf.TensorSpec((None,) + tuple(t.shape[1:]), t.dtype)
    return exact_spec(t)
