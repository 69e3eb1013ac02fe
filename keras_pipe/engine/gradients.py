"""Sums of gradients: running sums that keep IndexedSlices sparse and exact.

Keras' TF optimizers apply the rows of an `IndexedSlices` gradient one by
one, non-linearly: Adam, RMSprop and clipping by norm treat two rows of one
index differently from one row holding their sum. So a sum of sparse
gradients must have the rows the unsplit model's gradient has, not only
its dense value.

* Micro-batches of one read (`add_gradients`, `sum_micro_batches`): a
  gather whose indices do not depend on the batch (a position table,
  `take(table, arange(T))`; a relative attention bias) gives every
  micro-batch the same rows, and the unsplit gradient has each of them once
  with the summed value: equal rows add their values. A lookup over the
  batch (an `Embedding` over token ids) gives each micro-batch its own rows,
  and the unsplit gradient is all of them, one per token: other rows are
  concatenated. Checked at run time: the same indices, in the same order,
  each index once, add their values. (Indices with repeats stay
  concatenated: segment ids all 0 are the same in every micro-batch yet a
  lookup over the batch; so a relative bias with repeated buckets is
  concatenated too, and not exact under Adam-like optimizers.)
* Different reads of a variable (`sum_gradients`: stages that share a
  layer, a regularization term): the unsplit model's tape concatenates
  their rows too, so they are concatenated.
"""

import functools

import tensorflow as tf

__all__ = ["add_gradients", "sum_gradients", "sum_micro_batches"]


def add_gradients(total, gradient):
    """`total + gradient` over micro-batches; either may be None.

    Two `IndexedSlices` with the same indices (in the same order) add their
    values; other `IndexedSlices` are concatenated; anything else is added
    densely.
    """
    if total is None:
        return gradient
    if gradient is None:
        return total
    if isinstance(total, tf.IndexedSlices) and isinstance(
            gradient, tf.IndexedSlices):
        return _add_slices(total, gradient)
    return sum_gradients([total, gradient])


def sum_micro_batches(parts):
    """`add_gradients` over a list of micro-batch gradients."""
    return functools.reduce(add_gradients, parts)


def sum_gradients(parts):
    """Sums the gradients of different reads; IndexedSlices concatenated."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(g, tf.IndexedSlices) for g in parts):
        return _concat(parts)
    return tf.add_n([tf.convert_to_tensor(g) for g in parts])


def _concat(parts):
    return tf.IndexedSlices(tf.concat([g.values for g in parts], 0),
                            tf.concat([g.indices for g in parts], 0),
                            parts[0].dense_shape)


def _add_slices(a, b):
    """Values added where the rows are equal and unique, else concatenated."""
    a_rows, b_rows = a.indices.shape, b.indices.shape
    if (a_rows.is_fully_defined() and b_rows.is_fully_defined()
            and a_rows != b_rows) or a.values.dtype != b.values.dtype:
        return _concat([a, b])
    a_flat = tf.reshape(a.indices, [-1])
    b_flat = tf.cast(tf.reshape(b.indices, [-1]), a_flat.dtype)
    # Equal rows, each index once (a position table: arange(T)). Rows with
    # repeated indices stay concatenated: segment ids all 0, or padding,
    # are the same in every micro-batch, yet a lookup over the batch.
    same = tf.cond(
        tf.equal(tf.size(a_flat), tf.size(b_flat)),
        lambda: tf.logical_and(
            tf.reduce_all(tf.equal(a_flat, tf.reshape(b_flat, tf.shape(
                a_flat)))),
            tf.equal(tf.size(tf.unique(a_flat).y), tf.size(a_flat))),
        lambda: tf.constant(False))
    if tf.executing_eagerly():
        return (tf.IndexedSlices(a.values + tf.reshape(
            b.values, tf.shape(a.values)), a.indices, a.dense_shape)
                if bool(same) else _concat([a, b]))
    b = tf.IndexedSlices(b.values, tf.cast(b.indices, a.indices.dtype),
                         a.dense_shape)
    values = tf.cond(
        same,
        lambda: a.values + tf.reshape(b.values, tf.shape(a.values)),
        lambda: tf.concat([a.values, b.values], 0))
    indices = tf.cond(same, lambda: a.indices,
                      lambda: tf.concat([a.indices, b.indices], 0))
    return tf.IndexedSlices(values, indices, a.dense_shape)
