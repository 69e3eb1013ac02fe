"""Array inputs batched on the first stage's device instead of the client.

Keras turns the arrays given to `fit` into a `tf.data` pipeline that runs
in the calling process (the "client"), which then sends every batch to the
stages' workers through gRPC at every step. When the first stage lives on a
remote worker, `PlacedArrays` builds Keras' own pipeline for those arrays
(`keras.src.trainers.data_adapters.ArrayDataAdapter`: same order, same
batches, same shuffling) under that worker's device: the arrays are copied
there once per `fit`, each batch is cut there, and the client only drives
the step. The inputs then never leave that worker, and the targets go from
it to the last stage's device directly.
"""

import inspect

import keras
import tensorflow as tf

from keras_pipe import _compat

__all__ = ["PlacedArrays", "placed_call"]


class _Ready(tf.distribute.DistributedDataset):
    """A dataset on a remote device whose iterators are ready to read.

    `iter` of a dataset on a remote device only queues the iterator's
    initialisation there (an eager op without outputs); the step function
    called next could read it first ("GetNext() failed because the
    iterator has not been initialized", seen in 4 of 5 tries). Keras'
    `fit` takes a `DistributedDataset` as it is and calls `iter` on it.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        iterator = iter(self.dataset)
        _compat.sync_executors()
        return iterator

    @property
    def element_spec(self):
        return self.dataset.element_spec


class PlacedArrays(_compat.DataAdapter):
    """Keras' adapter of array data, its `tf.data` pipeline on `device`."""

    def __init__(self, adapter, device):
        self._adapter = adapter
        self._device = device
        self._dataset = None

    @property
    def device(self):
        return self._device

    def get_tf_dataset(self):
        """Keras' dataset of the arrays, built on `device`, each of its
        iterators ready to read when `iter` returns it (`_Ready`)."""
        if self._dataset is None:
            with tf.device(self._device):
                self._dataset = _Ready(self._adapter.get_tf_dataset())
        return self._dataset

    def get_numpy_iterator(self):
        return self._adapter.get_numpy_iterator()

    @property
    def num_batches(self):
        return self._adapter.num_batches

    @property
    def batch_size(self):
        return self._adapter.batch_size

    @property
    def has_partial_batch(self):
        return self._adapter.has_partial_batch

    @property
    def partial_batch_size(self):
        return self._adapter.partial_batch_size

    def on_epoch_begin(self):
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()


_SIGNATURES = {name: inspect.signature(getattr(keras.Model, name))
               for name in ("fit", "evaluate", "predict")}


def placed_call(method, model, device, args, kwargs):
    """`(args, kwargs)` of a `fit`/`evaluate`/`predict` call, array data placed.

    Returns the call unchanged unless its data are arrays (what Keras'
    `ArrayDataAdapter` takes) and `device` is not None; else `x` becomes a
    `PlacedArrays` adapter on `device` that holds `x`, `y`,
    `sample_weight`, the batch size, `shuffle` and `class_weight`, with
    `validation_split` applied first as Keras applies it.
    """
    if device is None:
        return args, kwargs
    bound = _SIGNATURES[method].bind(model, *args, **kwargs)
    call = dict(bound.arguments)
    call.pop("self")
    call.update(call.pop("kwargs", {}))
    if call.get("_use_cached_eval_dataset"):
        return args, kwargs  # fit's validation: its own cached iterator
    x, y = call.get("x"), call.get("y")
    sample_weight = call.get("sample_weight")
    if not _compat.can_convert_arrays((x, y, sample_weight)):
        return args, kwargs
    if method == "fit" and call.get("validation_split") and call.get(
            "validation_data") is None:
        (x, y, sample_weight), call["validation_data"] = (
            _compat.train_validation_split(
                (x, y, sample_weight),
                validation_split=call["validation_split"]))
        call["validation_split"] = 0.0
    steps = call.get("steps_per_epoch" if method == "fit" else "steps")
    adapter = _compat.ArrayDataAdapter(
        x, y, sample_weight=sample_weight,
        class_weight=call.pop("class_weight", None),
        shuffle=call.get("shuffle", True) if method == "fit" else False,
        batch_size=call.get("batch_size"), steps=steps)
    call["x"] = PlacedArrays(adapter, device)
    if method != "predict":
        call.update(y=None, sample_weight=None)
    return (), call
