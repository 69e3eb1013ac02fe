"""Devices: logical CPUs, resolution of device strings, and colocation.

Three things go wrong by default when a Keras model spans devices, and this
module fixes each of them:

* stages built outside a `tf.device` scope keep their variables on the
  default device: `place_variables` moves them;
* Keras optimizers create slot variables and run their update arithmetic
  where the default device is: `colocate_optimizer` pins both to the device
  of each variable;
* on a machine without GPUs there is only one CPU device:
  `logical_cpu_devices` splits it into several.
"""

import keras
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import colocation

__all__ = ["IN_TURN_BYTES", "logical_cpu_devices", "resolve_devices",
           "default_devices", "place_variables", "colocate_optimizer",
           "device_of", "process_of"]

# `place_variables` waits until a moved variable of at least this many bytes
# is on its device before it sends the next (see there).
IN_TURN_BYTES = 1 << 20


def logical_cpu_devices(num_devices, inter_op_threads=None):
    """Splits the host CPU into `num_devices` logical CPU devices.

    Must run before TensorFlow initializes its runtime (before the first
    tensor is created). Calling it again with the same count is a no-op.
    Logical CPU devices share one thread pool: they show placement and the
    schedule, not speed.

    ```python
    devices = keras_pipe.logical_cpu_devices(4)
    # ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    ```

    Args:
        num_devices: how many logical CPU devices to create, >= 1.
        inter_op_threads: if given, the size of TF's inter-op thread pool,
            which bounds how many stages can run at once. Defaults to `None`
            (TF's choice).

    Returns:
        The device strings, `["/device:CPU:0", ...]`.

    Raises:
        TypeError: if `num_devices` is not an int.
        ValueError: if `num_devices < 1`.
        RuntimeError: if TensorFlow is already initialized with another
            configuration.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int):
        raise TypeError(
            f"num_devices must be an int. Received: num_devices={num_devices!r}")
    if num_devices < 1:
        raise ValueError(
            f"num_devices must be >= 1. Received: num_devices={num_devices}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    names = [f"/device:CPU:{k}" for k in range(num_devices)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_devices:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
        if inter_op_threads is not None:
            tf.config.threading.set_inter_op_parallelism_threads(
                inter_op_threads)
    except RuntimeError as exc:
        existing = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"Cannot create {num_devices} logical CPU devices: TensorFlow is "
            f"already initialized with {existing}. Call "
            "keras_pipe.logical_cpu_devices() at the start of the program, "
            "before any tensor or model is created.") from exc
    return names


def _local_devices():
    return [d.name for d in tf.config.list_logical_devices()]


def default_devices(num_stages):
    """Returns one GPU per stage, or raises a ValueError saying what to do."""
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    if len(gpus) >= num_stages:
        return gpus[:num_stages]
    raise ValueError(
        f"devices=None needs one GPU per stage, but there are {len(gpus)} "
        f"GPUs for {num_stages} stages. Pass devices=[...] explicitly, e.g. "
        f"devices=keras_pipe.logical_cpu_devices({num_stages}) at the start "
        "of the program on a machine without GPUs.")


def process_of(device):
    """The process a device string's kernels run in: `(job, replica, task)`
    for a device of a cluster job (a worker process), None for a device of
    this process (no job, or `localhost`)."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.job in (None, "localhost"):
        return None
    return (spec.job, spec.replica or 0, spec.task or 0)


def _matches(spec, full):
    """Whether the (partial) DeviceSpec `spec` names the device `full`."""
    full = tf.DeviceSpec.from_string(full)
    if full.job is None:  # a local device, listed without its job
        full = full.replace(job="localhost", replica=0, task=0)
    for field in ("job", "replica", "task", "device_index"):
        want = getattr(spec, field)
        if want is not None and want != getattr(full, field):
            return False
    return (spec.device_type is None
            or spec.device_type.upper() == (full.device_type or "").upper())


def resolve_devices(devices):
    """Maps each device string to the full name of an existing device.

    A partial name (`"/CPU:1"`, `"GPU:0"`, `"/job:worker/task:1/device:CPU:0"`)
    resolves to the first existing device it names, local ones first.

    Raises:
        TypeError: if a device is not a string.
        ValueError: listing every device string that names no existing
            device, and the devices that exist.
    """
    available = _local_devices()
    resolved, problems = [], []
    for j, device in enumerate(devices):
        if not isinstance(device, str):
            raise TypeError(
                f"devices[{j}] must be a device string such as "
                f"'/device:CPU:0'. Received: {device!r}")
        try:
            spec = tf.DeviceSpec.from_string(device)
        except ValueError as exc:
            problems.append(f"devices[{j}]={device!r} is not a device "
                            f"string ({exc})")
            continue
        found = [name for name in available if _matches(spec, name)]
        if not found:
            problems.append(f"devices[{j}]={device!r} names no device")
            continue
        resolved.append(found[0])
    if problems:
        raise ValueError(
            "; ".join(problems) + f". Available devices: {available}. On a "
            "machine without GPUs, create logical CPU devices with "
            "keras_pipe.logical_cpu_devices(n) at the start of the program.")
    return resolved


def device_of(variable):
    """The full device name of a Keras (or TF) variable."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return variable.device


def _same_device(a, b):
    return tf.DeviceSpec.from_string(a) == tf.DeviceSpec.from_string(b)


def place_variables(layer, device):
    """Moves every variable of `layer` that is not on `device` onto it.

    Keras creates a variable on the device in scope when the layer is built;
    a stage built before it was handed to the pipeline (a Functional model,
    say) has its variables on the default device. The value is copied into a
    new `tf.Variable` created under `tf.device(device)`; the Keras variable
    object, its name and path stay the same.

    An eager op on a worker is only queued there, so without waiting every
    transfer of a stage would be queued at once and a worker would receive
    them while its first training step ran, on top of the step's own
    peak. So each variable of `IN_TURN_BYTES` or more is waited for
    (`sync_executors`) before the next is sent: the build ends with every
    weight in place (measured by `tools/worker_memory.py`,
    docs/capacity.md). A wait costs a round trip per big variable.

    Returns:
        The number of variables moved.
    """
    moved = 0
    for variable in layer.variables:
        if _same_device(device_of(variable), device):
            continue
        value = tf.identity(variable.value)
        with tf.device(device):
            _compat.reinitialize_variable(variable, tf.identity(value))
        moved += 1
        if value.shape.num_elements() * value.dtype.size >= IN_TURN_BYTES:
            _compat.sync_executors()
    return moved


def colocate_optimizer(optimizer, xla_updates=False):
    """Makes `optimizer` create slots and do update math on each variable's device.

    Keras' TF optimizer colocates a slot with its variable only through the
    distribution strategy, which is a no-op for the default strategy, and
    runs `update_step`, gradient clipping, its default-strategy
    "all-reduce" (one `IdentityN` op over every gradient) and a
    `LossScaleOptimizer`'s finiteness check and unscaling under no device
    scope: every slot and every update op land on one device, and TF moves
    every gradient there and back each step. This patches the hooks of this
    optimizer object (not its class) so that each runs on the device of its
    variable or gradient (see `keras_pipe.engine.colocation.colocate_optimizer`).
    Idempotent; a later call sets `xla_updates` anew.

    Args:
        optimizer: a Keras optimizer (a `LossScaleOptimizer` included).
        xla_updates: whether each device's updates run as one XLA function
            (`PipelineModel.compile(jit_compile=True)`). Defaults to `False`.

    Returns:
        `optimizer`.
    """
    return colocation.colocate_optimizer(optimizer, device_of, xla_updates)
