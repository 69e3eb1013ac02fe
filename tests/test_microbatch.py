"""Splitting batches into micro-batches and merging them back."""

import numpy as np
import pytest
import tensorflow as tf

from keras_pipe.engine import microbatch


@pytest.mark.parametrize("batch,m,sizes", [
    (10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (3, 8, [1, 1, 1]),
    (1, 4, [1]), (7, 1, [7])])
def test_split_sizes(batch, m, sizes):
    assert microbatch.split_sizes(batch, m) == sizes


def test_static_batch_never_gives_an_empty_micro_batch():
    x = {"a": np.arange(6).reshape(3, 2), "b": (np.arange(3),)}
    parts = microbatch.scatter(tf.nest.map_structure(tf.constant, x), 5)
    assert [p.size for p in parts] == [1, 1, 1]
    merged = microbatch.gather([p.inputs for p in parts], parts)
    np.testing.assert_array_equal(merged["a"], x["a"])
    np.testing.assert_array_equal(merged["b"][0], x["b"][0])


@pytest.mark.parametrize("batch", [2, 5, 9])
def test_dynamic_batch_pads_instead_of_running_empty(batch):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int32)])
    def roundtrip(x):
        parts = microbatch.scatter(x, 4)
        rows = tf.stack([tf.shape(p.inputs)[0] for p in parts])
        valid = tf.stack([p.valid for p in parts])
        return microbatch.gather([p.inputs for p in parts], parts), rows, valid

    x = np.arange(2 * batch, dtype="int32").reshape(batch, 2)
    merged, rows, valid = roundtrip(x)
    np.testing.assert_array_equal(merged, x)
    assert rows.numpy().min() >= 1  # no micro-batch is ever empty
    np.testing.assert_array_equal(valid, [i < batch for i in range(4)])
