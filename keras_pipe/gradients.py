"""Sums of gradients: running sums that keep IndexedSlices sparse."""

import tensorflow as tf

__all__ = ["add_gradients", "sum_gradients"]


def add_gradients(total, gradient):
    """`total + gradient`; either may be None; IndexedSlices stay sparse."""
    if total is None:
        return gradient
    if gradient is None:
        return total
    return sum_gradients([total, gradient])


def sum_gradients(parts):
    """Sums gradients; a sum of IndexedSlices stays sparse (concatenated)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(g, tf.IndexedSlices) for g in parts):
        return tf.IndexedSlices(tf.concat([g.values for g in parts], 0),
                                tf.concat([g.indices for g in parts], 0),
                                parts[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in parts])
