"""The logits behind a model's softmax and sigmoid outputs, kept for its loss.

Keras' crossentropy losses and metrics do not take the log of a softmax or
sigmoid output: they read the logits behind it, the `_keras_logits` that
Keras' activations attach to their output or the input of a `Softmax` /
`Sigmoid` op, and compute from those (exact where the probabilities round to
0 or 1). In a pipeline those logits are a tensor inside the last stage, so a
loss reading them would bypass the stage's outputs: the gradient for the
outputs would be None, and the backward pass would get nothing (no gradient
at all with one micro-batch, none from the micro-batches run in place with
several) or, where the outputs were merged first, the loss would be taken
from the probabilities and differ from the model's.

`keep` makes the logits outputs of the last stage beside the outputs, so
that they leave the stage (and its backward pass takes their gradients like
any output's); `view` gives the loss, the metrics and `predict` the outputs
again, each with its logits attached as the model had them.
"""

import keras
import tensorflow as tf

__all__ = ["keep", "view"]

# The op types whose input Keras' crossentropies read as logits.
_OPS = {"Softmax": lambda z: tf.raw_ops.Softmax(logits=z),
        "Sigmoid": lambda z: tf.raw_ops.Sigmoid(x=z)}
_ATTACHED = "attached"  # `_keras_logits`, set by Keras' activations


def _logits_of(t):
    """`(kind, logits)` behind output `t`, or `(None, None)`."""
    if hasattr(t, "_keras_logits"):
        return _ATTACHED, t._keras_logits
    if isinstance(t, tf.Tensor) and not tf.executing_eagerly() and (
            t.op.type in _OPS):
        return t.op.type, t.op.inputs[0]
    return None, None


def keep(outputs):
    """`(outputs, logits)`: `logits` maps `"k:kind"` to the logits behind
    flat output `k`, for the outputs that have them."""
    logits = {}
    for k, t in enumerate(keras.tree.flatten(outputs)):
        kind, z = _logits_of(t)
        if z is not None:
            logits[f"{k}:{kind}"] = z
    return outputs, logits


def view(kept):
    """The outputs of `keep(outputs)` (or of a merge of several), each with
    its logits behind it again: Keras' losses read them as they would have
    read the model's."""
    outputs, logits = kept
    flat = keras.tree.flatten(outputs)
    for key, z in logits.items():
        k, kind = key.split(":")
        k = int(k)
        if kind == _ATTACHED:
            flat[k] = tf.identity(flat[k])
            flat[k]._keras_logits = z
        else:
            flat[k] = _OPS[kind](z)
    return keras.tree.pack_sequence_as(outputs, flat)
