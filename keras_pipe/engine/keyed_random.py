"""Random draws keyed by row: a Dropout mask independent of the cut.

A layer's random draw (Dropout, GaussianNoise, ...) inside a stage sees one
micro-batch, not the whole batch: drawn as Keras draws it, the mask of a
row would depend on `num_micro_batches`, and a re-materialized stage would
draw a new mask in the backward pass (the "remat re-runs state" trap,
docs/design.md). `keyed_random` makes each row's numbers depend only on
the seed state at the start of the step and the row's place in the global
batch. It patches Keras' TF random backend,
reached through `keras_pipe._compat`.
"""

import contextlib

import keras
import tensorflow as tf

from keras_pipe import _compat

__all__ = ["keyed_random", "seed_state_variables"]

_PHILOX = 1  # RNG_ALG_PHILOX: counter-based, 4 numbers per counter step


def _philox_rows(kind, dims, rows, seed, dtype):
    """`kind` ("uniform" or "normal") numbers of this micro-batch's rows.

    Philox is counter-based: element `k` of a draw of the whole global
    batch comes from counter `k // 4`. Starting the counter at this
    micro-batch's first element gives exactly the rows that draw would have
    given there, without drawing the other rows.
    """
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    per_row = tf.cast(tf.reduce_prod(tf.stack(
        [tf.cast(d, tf.int64) for d in dims[1:]] + [tf.constant(1, tf.int64)])),
        tf.int64)
    first = tf.cast(rows[0], tf.int64) * per_row
    skip = first % 4
    counter = counter + tf.stack([tf.cast((first - skip) // 4, tf.uint64),
                                  tf.constant(0, tf.uint64)])
    count = tf.cast(dims[0], tf.int64) * per_row + skip
    op = (tf.raw_ops.StatelessRandomUniformV2 if kind == "uniform"
          else tf.raw_ops.StatelessRandomNormalV2)
    flat = op(shape=tf.reshape(count, [1]), key=key, counter=counter,
              alg=_PHILOX, dtype=dtype)
    return tf.reshape(flat[skip:], tf.stack(
        [tf.cast(d, tf.int32) for d in dims]))


def _batch_dims(shape, size=None):
    """The dims of `shape` if its first one is a batch, else None.

    The first dimension is a batch when it is unknown at trace time (a
    tensor: the stage function is traced with the batch size left open) or
    is the micro-batch's static size `size` (the stage's ops run in place,
    on inputs whose batch size is known, e.g. a DropPath mask of shape
    `(x.shape[0], 1, ...)`).
    """
    dims = list(shape) if not isinstance(shape, tf.Tensor) else [
        shape[k] for k in range(shape.shape[0])]
    if not dims or (isinstance(dims[0], int) and (
            size is None or dims[0] != size)):
        return None
    return dims


def _rows_of(shape, rows, size, draw):
    """`draw(shape)` for a batch-first shape, keyed by the global row.

    `rows` is `[offset, total]`: this micro-batch's first row in the global
    batch and the global batch's size; `size` the micro-batch's static
    size, if known. A shape whose first dimension is not a batch (see
    `_batch_dims`) is drawn as is, the same for every micro-batch;
    otherwise the rows of the whole global batch are drawn and
    this micro-batch's rows are sliced out, so row `r` sees the same numbers
    whatever micro-batch, stage or replica it lands in (uniform and normal
    draws start Philox's counter at the micro-batch's rows instead, which
    gives the same numbers without drawing the rest).
    """
    dims = _batch_dims(shape, size)
    if dims is None:
        return draw(shape)
    full = draw(tf.stack([tf.cast(rows[1], tf.int32)] + [
        tf.cast(d, tf.int32) for d in dims[1:]]))
    start = tf.cast(rows[0], tf.int32)
    return full[start:start + tf.cast(dims[0], tf.int32)]


@contextlib.contextmanager
def keyed_random(rows, size=None):
    """Random draws of Keras layers keyed by global row, meanwhile.

    Patches Keras' TF random backend (`uniform`, `normal`,
    `truncated_normal`, `dropout`: what Dropout, SpatialDropout,
    GaussianNoise, GaussianDropout, AlphaDropout and stochastic depth
    layers such as KerasHub's DropPath call) so that each row of a
    batch-first draw depends only on the seed (the layer's seed generator
    at the start of the step) and the row's index in the global batch (see
    `_rows_of`); `size` is the micro-batch's static size when the stage's
    ops run in place (None when traced with the batch size left open).
    Only while tracing a stage call. The seed is drawn once per draw, as
    Keras draws it: a draw that falls back to Keras' own function passes it
    the layer's seed (a `SeedGenerator`, int or None), not a drawn tensor.
    """
    originals = {name: getattr(_compat.tf_random, name) for name in (
        "uniform", "normal", "truncated_normal", "dropout")}

    def seeded(seed):
        return _compat.cast_seed(_compat.draw_seed(seed))

    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        dims = _batch_dims(shape, size)
        if dims is None or not _is_float_dtype(dtype):
            return _rows_of(shape, rows, size, lambda sh: originals["uniform"](
                sh, minval=minval, maxval=maxval, dtype=dtype, seed=seed))
        dtype = _float_dtype(dtype)
        u = _philox_rows("uniform", dims, rows, seeded(seed), dtype)
        return u * tf.cast(maxval - minval, dtype) + tf.cast(minval, dtype)

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        dims = _batch_dims(shape, size)
        if dims is None:
            return originals["normal"](shape, mean=mean, stddev=stddev,
                                       dtype=dtype, seed=seed)
        dtype = _float_dtype(dtype)
        n = _philox_rows("normal", dims, rows, seeded(seed), dtype)
        return n * tf.cast(stddev, dtype) + tf.cast(mean, dtype)

    def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        return _rows_of(shape, rows, size, lambda sh: originals[
            "truncated_normal"](sh, mean=mean, stddev=stddev, dtype=dtype,
                                seed=seed))

    def dropout(inputs, rate, noise_shape=None, seed=None):
        if rate == 1.0:
            return tf.zeros_like(inputs)
        if rate == 0.0:
            return inputs
        s = seeded(seed)
        noise_shape = _compat.concrete_noise_shape(inputs, noise_shape)
        dims = [tf.shape(inputs)[0]] + [noise_shape[k] for k in range(
            1, len(inputs.shape))]
        where = rows
        if isinstance(noise_shape, list) and isinstance(noise_shape[0], int):
            dims[0] = noise_shape[0]  # shared over the batch: every
            where = [0, 0]            # micro-batch draws the same
        keep = _philox_rows("uniform", dims, where, s, inputs.dtype) >= rate
        scale = tf.cast(1.0 / (1.0 - rate), inputs.dtype)
        return tf.where(keep, inputs * scale, tf.zeros_like(inputs))

    patched = {"uniform": uniform, "normal": normal,
               "truncated_normal": truncated_normal, "dropout": dropout}
    for name, fn in patched.items():
        setattr(_compat.tf_random, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(_compat.tf_random, name, fn)


def _float_dtype(dtype):
    return tf.as_dtype(keras.backend.standardize_dtype(
        dtype or keras.backend.floatx()))


def _is_float_dtype(dtype):
    return dtype is None or tf.as_dtype(
        keras.backend.standardize_dtype(dtype)).is_floating


def seed_state_variables(layer):
    """The state variables of the seed generators of `layer`'s sub-layers."""
    found = []
    for sub in _compat.flatten_layers(layer):
        for value in vars(sub).values():
            if isinstance(value, _compat.SeedGenerator):
                found.append(value.state)
    return found
