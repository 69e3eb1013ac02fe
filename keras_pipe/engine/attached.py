"""What Keras attaches to a tensor (a mask, the logits behind a softmax),
carried across stages.

Keras passes two things beside a tensor's values as attributes of the
tensor object, and neither survives a stage boundary (a function call, a
transfer, a micro-batch merge):

* **masks** (`_keras_mask`, from `Embedding(mask_zero=True)`, `Masking`,
  ...): the layers after a cut would run unmasked (an LSTM would not skip
  padding) and the loss would count padded positions;
* **logits** (`_keras_logits`, set by Keras' softmax and sigmoid, or the
  input of a bare `Softmax` / `Sigmoid` op): Keras' crossentropies and
  their metrics compute from the logits behind such an output, exact
  where the probabilities round to 0 or 1. Read behind the last stage's
  back, the loss had no gradient for the stage's outputs (no gradient at
  all with one micro-batch, none from the micro-batches run in place with
  several), or was taken from the clipped probabilities once merged.

`keep(outputs)` returns `(outputs, attached)`: `attached` holds, as tensors
of their own, the masks of the outputs (and, with `logits=True`, for the
last stage only, their logits), so that they are sent, split and merged
with the outputs and, for logits, differentiated like an output. `view`
undoes it: the outputs again, each with what it had attached.
"""

import keras
import tensorflow as tf

from keras_pipe import _compat

__all__ = ["keep", "masks", "view"]

# The op types whose input Keras' crossentropies read as logits.
_OPS = {"Softmax": lambda z: tf.raw_ops.Softmax(logits=z),
        "Sigmoid": lambda z: tf.raw_ops.Sigmoid(x=z)}
_ATTRIBUTE = "attribute"  # `_keras_logits`, set by Keras' activations
_MASK = "mask"


def _logits_of(t):
    """`(kind, logits)` behind output `t`, or `(None, None)`."""
    if _compat.keras_logits(t) is not None:
        return _ATTRIBUTE, _compat.keras_logits(t)
    if isinstance(t, tf.Tensor) and not tf.executing_eagerly() and (
            t.op.type in _OPS):
        return t.op.type, t.op.inputs[0]
    return None, None


def keep(outputs, logits=False):
    """`(outputs, attached)`; `attached` maps `"k:kind"` to the mask
    (`kind` "mask") or the logits (`kind` "attribute", "Softmax" or
    "Sigmoid") of flat output `k`."""
    attached = {}
    for k, t in enumerate(keras.tree.flatten(outputs)):
        mask = _compat.get_keras_mask(t)
        if mask is not None:
            attached[f"{k}:{_MASK}"] = mask
        kind, z = _logits_of(t) if logits else (None, None)
        if z is not None:
            attached[f"{k}:{kind}"] = z
    return outputs, attached


def view(kept):
    """The outputs of `keep(outputs)` (or of a split or merge of it), each
    with its mask and logits attached again, as Keras reads them."""
    outputs, attached = kept
    flat = keras.tree.flatten(outputs)
    extra = {}
    for key, value in attached.items():
        k, kind = key.split(":")
        extra.setdefault(int(k), {})[kind] = value
    for k, parts in extra.items():
        mask = parts.pop(_MASK, None)
        kind, z = next(iter(parts.items()), (None, None))
        t = _OPS[kind](z) if kind in _OPS else tf.identity(flat[k])
        if kind == _ATTRIBUTE:
            _compat.set_keras_logits(t, z)
        if mask is not None:
            _compat.set_keras_mask(t, mask)
        flat[k] = t
    return keras.tree.pack_sequence_as(outputs, flat)


def masks(kept):
    """Whether any output of `keep(outputs)` has a mask."""
    return any(key.endswith(":" + _MASK) for key in kept[1])
