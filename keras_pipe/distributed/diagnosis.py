"""Recovering the error a stage raised when TensorFlow reports a cancellation.

When an op fails inside a stage (a wrong input width that tracing could not
see, out of memory), TF aborts the step and every other device's pending
receive is cancelled. A stage is a non-inlined function called from the
step, which Keras calls from its own `tf.function`; with that nesting TF
keeps only a *derived* status and drops the root one, so `fit`, `evaluate`
and `predict` raise `CancelledError: RecvAsync is cancelled` (reproduced
with plain TF: a non-inlined function on one device, its consumer on
another, called from an outer `tf.function`; logical CPUs and worker
processes alike). TF only logs the root error, as a warning.

`explain` turns such an error back into the stage's own: it replays the
call's first batch through the stages one by one, eagerly, each on its
device, in inference mode and without keeping any state change, and raises
the first stage error with its original type and message, naming the stage
and its device. An error TF reports itself (not derived) gets the stage,
micro-batch and device named from its node name (`stage{j}/mb{i}/...`).
When the replay does not fail (the bad batch was a later one), the
cancellation is raised with a note saying so and how to see TF's log.
"""

import re

import keras
import tensorflow as tf

__all__ = ["explain", "is_derived"]

_DERIVED = b"type.googleapis.com/tensorflow.DerivedStatus"
# A stage's forward ops run in place get their gradients from a tape, under
# "gradient_tape/stage{j}/mb{i}/forward/...": those are the backward pass.
_NODE = re.compile(r"(gradient_tape/)?stage(\d+)/mb(\d+)/(forward|backward)")


def is_derived(error):
    """Whether `error` is a TF error that only follows another one."""
    if not isinstance(error, tf.errors.OpError):
        return False
    payloads = getattr(error, "experimental_payloads", None) or {}
    return _DERIVED in payloads or isinstance(error, tf.errors.CancelledError)


def _with_message(error, message):
    """A new exception of `error`'s type with `message`, else None."""
    try:
        if isinstance(error, tf.errors.OpError):
            new = type(error)(error.node_def, error.op, message)
        else:
            new = type(error)(message)
    except Exception:  # A type whose constructor takes other arguments.
        return None
    return new


def _first_batch(action, args, kwargs):
    """Model inputs of the first batch of a fit/evaluate/predict call."""
    x = args[0] if args else kwargs.get("x")
    size = kwargs.get("batch_size")
    if size is None and len(args) > (1 if action == "predict" else 2):
        size = args[1 if action == "predict" else 2]
    size = size or 32
    if isinstance(x, tf.data.Dataset):
        batch = next(iter(x.take(1)))
        return keras.utils.unpack_x_y_sample_weight(batch)[0]
    if isinstance(x, keras.utils.PyDataset):
        return keras.utils.unpack_x_y_sample_weight(x[0])[0]
    leaves = keras.tree.flatten(x) if x is not None else []
    if not leaves or not all(hasattr(a, "shape") and len(a.shape) for a in
                             leaves):
        return None  # A generator, or nothing to slice.
    return keras.tree.map_structure(lambda a: a[:size], x)


def _replay(model, inputs):
    """Runs `inputs` through the stages eagerly; `(j, error)` of a failure."""
    values = keras.tree.map_structure(
        lambda a: tf.convert_to_tensor(a), inputs)
    with keras.StatelessScope():
        for j, (stage, device) in enumerate(zip(model.stages,
                                                model.devices)):
            try:
                with tf.device(device):
                    values = stage(values, training=False)
            except Exception as exc:  # Whatever the stage raised.
                return j, exc
    return None, None


def explain(model, action, args, kwargs, error):
    """The error to raise for `error`, raised by `model.<action>(...)`.

    Args:
        model: the `PipelineModel` whose call failed.
        action: `"fit"`, `"evaluate"` or `"predict"`.
        args, kwargs: the call's arguments (to replay its first batch).
        error: what the call raised.

    Returns:
        An exception of the stage error's type naming the stage and its
        device, or `error` itself (with a note when TF hid the root error).
    """
    if (not isinstance(error, tf.errors.OpError)
            or not hasattr(model, "stages") or hasattr(error, "stage")):
        return error
    devices = list(model.devices)
    if not is_derived(error):
        found = _NODE.search(error.message or "")
        if not found:
            return error
        j, i = int(found[2]), int(found[3])
        part = "backward" if found[1] else found[4]
        if j >= len(devices):
            return error
        new = _with_message(
            error, f"Stage {j} ({model.stages[j].name!r}) on {devices[j]} "
            f"failed in the {part} pass of micro-batch {i} during {action}: "
            f"{error.message}")
        return error if new is None else _tagged(new, j, devices[j], error)
    try:
        inputs = _first_batch(action, args, kwargs)
    except Exception:  # The data cannot be read again: keep TF's error.
        inputs = None
    if inputs is not None:
        j, stage_error = _replay(model, inputs)
        if stage_error is not None:
            text = getattr(stage_error, "message", None) or str(stage_error)
            new = _with_message(
                stage_error, f"Stage {j} ({model.stages[j].name!r}) on "
                f"{devices[j]} failed during {action}: {text}")
            if new is not None:
                return _tagged(new, j, devices[j], error)
    error.add_note(
        f"keras_pipe: TF reported this cancellation instead of the error "
        f"that a stage raised during {action}, and replaying the first "
        "batch stage by stage did not fail. Run with TF_CPP_MIN_LOG_LEVEL=1 "
        "to see TF's log line 'Local rendezvous is aborting with status: "
        "...', which names the root error.")
    return error


def _tagged(new, j, device, reported):
    """Adds `stage` and `device` attributes; the caller chains `reported`."""
    del reported
    new.stage = j
    new.device = device
    return new
