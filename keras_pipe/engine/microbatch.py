"""Manipulation of micro-batches: split a nested batch, merge outputs back.

A batch of `B` rows is cut into `m = min(M, B)` micro-batches whose sizes
differ by at most one (`B = 10, M = 4` gives 3, 3, 2, 2): never an empty
micro-batch, which would give NaN statistics in BatchNormalization and break
layers such as `Flatten`.

When `B` is only known when the step runs (the last, smaller batch of a
dataset), the graph has `M` micro-batch slots. A slot that would be empty
(`B < M`) instead carries one real row that is dropped at the merge: its
outputs never reach the loss and its state updates are discarded (`valid` is
false), so it behaves as if it did not exist.
"""

import dataclasses

import keras
import tensorflow as tf

__all__ = ["MicroBatch", "split_sizes", "scatter", "gather"]


def split_sizes(batch_size, num_micro_batches):
    """Sizes of the `min(M, B)` micro-batches of a batch of `batch_size` rows.

    ```python
    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    >>> split_sizes(2, 4)
    [1, 1]
    ```
    """
    m = max(1, min(num_micro_batches, batch_size))
    base, rest = divmod(batch_size, m)
    return [base + (1 if i < rest else 0) for i in range(m)]


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch: its inputs and how many of its rows are real.

    Attributes:
        inputs: the nested structure of tensors for this micro-batch.
        size: the number of real rows: an int, or a scalar int32 tensor when
            the batch size is dynamic.
        valid: `True`, or a scalar bool tensor that is false for a padding
            slot (dynamic batch smaller than `M`).
        offset: the index in the batch of its first row (int or tensor).
    """

    inputs: object
    size: object
    valid: object = True
    offset: object = 0  # the index of its first row in the batch

    @property
    def padded(self):
        """Whether outputs may carry a padding row to drop (dynamic sizes)."""
        return not isinstance(self.size, int)

    def real_rows(self, structure):
        """`structure` (this micro-batch's rows) without its padding row."""
        if not self.padded:
            return structure
        return keras.tree.map_structure(
            lambda t: None if t is None else t[:self.size], structure)


def _batch_size(batch):
    leaves = [t for t in keras.tree.flatten(batch) if t is not None]
    if not leaves:
        raise ValueError("Cannot split a batch without tensors.")
    static = leaves[0].shape[0]
    if static is not None:
        return int(static)
    return tf.shape(leaves[0])[0]


def _rows(batch, start, stop):
    return keras.tree.map_structure(
        lambda t: None if t is None else t[start:stop], batch)


def scatter(batch, num_micro_batches):
    """Splits a nested batch along axis 0 into micro-batches.

    Returns:
        A list of `MicroBatch`: `min(M, B)` of them when the batch size `B`
        is static, `M` when it is dynamic.
    """
    batch_size = _batch_size(batch)
    if isinstance(batch_size, int):
        micro_batches, start = [], 0
        for size in split_sizes(batch_size, num_micro_batches):
            stop = start + size
            micro_batches.append(MicroBatch(
                _rows(batch, start, stop), size, offset=start))
            start = stop
        return micro_batches

    base = batch_size // num_micro_batches
    rest = batch_size % num_micro_batches
    micro_batches = []
    for i in range(num_micro_batches):
        start = i * base + tf.minimum(i, rest)
        size = base + tf.cast(i < rest, tf.int32)
        # A padding slot (size 0) reads the last real row instead.
        lo = tf.minimum(start, batch_size - 1)
        hi = lo + tf.maximum(size, 1)
        micro_batches.append(MicroBatch(
            _rows(batch, lo, hi), size,
            valid=size > 0, offset=lo))
    return micro_batches


def gather(outputs, micro_batches):
    """Concatenates micro-batch outputs along axis 0, dropping padding rows."""
    trimmed = [micro_batch.real_rows(output)
               for output, micro_batch in zip(outputs, micro_batches)]
    if len(trimmed) == 1:
        return trimmed[0]
    return keras.tree.map_structure(
        lambda *parts: tf.concat(parts, axis=0), *trimmed)
