"""Argument checks shared by the library, `demo.py`, `examples/` and `tools/`.

Each check raises before anything is built, with the bad value and the fix:
`TypeError` for the wrong kind of object, `ValueError` for a bad value.
"""

import math

__all__ = ["REMAT_MODES", "check_backend", "check_positive_int",
           "check_non_negative_number", "check_positive_number",
           "check_remat", "check_device_list", "check_data"]

def check_backend(backend):
    """Raises ImportError unless Keras' backend `backend` is TensorFlow's."""
    if backend != "tensorflow":
        raise ImportError(
            "keras_pipe needs the TensorFlow backend of Keras, but the "
            f"backend is {backend!r}. Set KERAS_BACKEND=tensorflow before "
            "importing keras.")


# Which micro-batches recompute their stage in the backward pass.
REMAT_MODES = ("always", "except_last", "never")


def check_positive_int(name, value):
    """Returns `value` if it is an int >= 1 (not a bool), else raises."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1. Received: {name}={value}")
    return value


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number. Received: {name}={value!r}")
    if not math.isfinite(value):
        raise ValueError(
            f"{name} must be a finite number. Received: {name}={value!r}")


def check_positive_number(name, value):
    """Returns `value` if it is a finite int or float > 0, else raises."""
    _check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0. Received: {name}={value!r}")
    return value


def check_non_negative_number(name, value):
    """Returns `value` if it is a finite int or float >= 0, else raises."""
    _check_number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0. Received: {name}={value!r}")
    return value


def check_remat(remat, num_stages=None):
    """Checks a remat mode, or a list of one mode per stage.

    Returns:
        The list of `num_stages` modes when `num_stages` is given (a single
        mode is repeated), else `remat` unchanged.

    Raises:
        TypeError: if `remat` is neither a string nor a list of strings.
        ValueError: if a mode is unknown or the list's length is not
            `num_stages`.
    """
    if isinstance(remat, str):
        modes = [remat]
    elif isinstance(remat, (list, tuple)):
        modes = list(remat)
        if num_stages is not None and len(modes) != num_stages:
            raise ValueError(
                f"remat as a list needs one mode per stage: got {len(modes)} "
                f"modes for {num_stages} stages. Received: remat={modes!r}")
        if not modes:
            raise ValueError("remat must not be an empty list. Received: "
                             "remat=[]")
    else:
        raise TypeError(
            f"remat must be one of {REMAT_MODES} or a list of them, one per "
            f"stage. Received: remat={remat!r}")
    bad = [m for m in modes if m not in REMAT_MODES]
    if bad:
        raise ValueError(
            f"remat must be one of {REMAT_MODES}. Received: remat={remat!r}. "
            "Pass one mode, or a list of one mode per stage.")
    if num_stages is None:
        return remat
    return modes * num_stages if isinstance(remat, str) else modes


def check_device_list(devices, count=None, what="stage"):
    """Checks a list of device strings, `count` of them when given.

    Returns:
        The devices as a list.

    Raises:
        TypeError: if `devices` is not a list or tuple of strings.
        ValueError: if the length is not `count`.
    """
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise TypeError(
            f"devices must be a list of device strings, one per {what}. "
            f"Received: devices={devices!r}")
    for j, device in enumerate(devices):
        if not isinstance(device, str):
            raise TypeError(
                f"devices[{j}] must be a device string such as "
                f"'/device:CPU:0'. Received: {device!r}")
    if count is not None and len(devices) != count:
        raise ValueError(
            f"devices must name one device per {what}: got {len(devices)} "
            f"devices for {count} {what}s. Received: devices={list(devices)}")
    return list(devices)


def check_compile_arguments(jit_compile, run_eagerly):
    """Raises ValueError for a `PipelineModel.compile` it cannot honour."""
    if jit_compile not in (True, False, "auto"):
        raise ValueError(
            f"jit_compile={jit_compile!r} is not one of True, False or "
            "'auto'. Pass True to compile each device's optimizer "
            "update with XLA.")
    if run_eagerly:
        raise ValueError(
            "run_eagerly=True is not supported by PipelineModel: its "
            "per-device backward pass uses tf.gradients, which needs "
            "graph mode. Use run_eagerly=False.")


def check_data(method, args, kwargs):
    """Raises ValueError if `fit`/`evaluate`/`predict` got no input data.

    Keras accepts `x=None` and fails inside the step; a pipeline would
    fail there with an AttributeError on `None.shape`.
    """
    x = args[0] if args else kwargs.get("x")
    if x is None:
        raise ValueError(
            f"{method}() needs input data: x is None. Pass x= (an array, a "
            "dict of arrays, a tf.data.Dataset or a keras.utils.PyDataset). "
            "Received: x=None")
