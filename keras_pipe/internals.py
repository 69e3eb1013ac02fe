"""Keras and TensorFlow internals, behind one door.

keras_pipe needs a few things that Keras and TensorFlow do not offer as
public API. Every `keras.src` / `tensorflow.python` import and every patch
of a Keras object is here, so that a Keras or TF upgrade breaks one module,
loudly: the versions it was written for are checked at import, and
`tests/test_internals.py` has a test per hook.

Written for Keras 3.15.x and TensorFlow 2.21.x. Code copied from Keras
(gradient clipping, the loss-scale optimizer's unscaling) is Keras 3.15.0's,
with only the device placement changed, and says so where it stands.
"""

import contextlib
import re
import warnings
import weakref

import keras
import tensorflow as tf
from keras import ops

SUPPORTED = {"keras": "3.15", "tensorflow": "2.21"}


def check_versions(versions):
    """Raises ImportError unless each version is in the supported series.

    Args:
        versions: `{"keras": "3.15.0", "tensorflow": "2.21.0"}`.
    """
    bad = [f"{name} {version}" for name, version in versions.items()
           if not (version == SUPPORTED[name]
                   or version.startswith(SUPPORTED[name] + "."))]
    if bad:
        raise ImportError(
            f"keras_pipe supports Keras {SUPPORTED['keras']}.x and TensorFlow "
            f"{SUPPORTED['tensorflow']}.x; found {', '.join(bad)}. Install "
            f"'keras=={SUPPORTED['keras']}.*' and "
            f"'tensorflow=={SUPPORTED['tensorflow']}.*' (see pyproject.toml).")


check_versions({"keras": keras.__version__, "tensorflow": tf.__version__})

# Imported after the check: on another version these may not exist.
from keras.src.backend import get_keras_mask, set_keras_mask  # noqa: E402
from keras.src.backend.common import global_state  # noqa: E402
from keras.src.losses import loss as _loss_lib  # noqa: E402
from keras.src.models.functional import (  # noqa: E402
    Functional,
    operation_fn,
    unpack_singleton,
)
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402
from keras.src.utils import io_utils as _io_utils  # noqa: E402
from keras.src.utils import naming as _naming  # noqa: E402
from keras.src.utils import tracking as _tracking  # noqa: E402
from tensorflow.python.eager import cancellation  # noqa: E402
from tensorflow.python.eager import context as _tf_context  # noqa: E402

# Keras' Functional graph: the class, how it calls one operation, and how
# it unwraps a single output (`keras_pipe.graph`, `keras_pipe.saving`).
# `KerasSaveable`: the base of objects Keras saving walks (seed states).
# `cancellation`: TF's cancellation manager (`keras_pipe.cluster`).
to_snake_case = _naming.to_snake_case
ask_to_proceed_with_overwrite = _io_utils.ask_to_proceed_with_overwrite
no_automatic_tracking = _tracking.DotNotTrackScope
get_server_def = _tf_context.get_server_def


def set_initial_epoch(model, epoch):
    """Makes `fit` start at `epoch` (what Keras' BackupAndRestore sets)."""
    model._initial_epoch = epoch


def keras_global_state():
    """Keras' global state (scopes, seed generator) as a dict."""
    return dict(vars(global_state.GLOBAL_STATE_TRACKER))


def set_keras_global_attribute(name, value):
    """Sets one attribute of Keras' global state (in another thread)."""
    global_state.set_global_attribute(name, value)

__all__ = ["Functional", "KerasSaveable", "SUPPORTED",
           "ask_to_proceed_with_overwrite", "cancellation", "check_versions",
           "colocate_optimizer", "eager_scope", "get_keras_mask",
           "get_server_def", "keras_global_state", "keyed_random",
           "no_automatic_tracking", "operation_fn", "reduce_weighted_values",
           "reinitialize_variable", "replaced_losses",
           "scale_loss_for_distribution", "seed_state_variables",
           "set_initial_epoch", "set_keras_global_attribute", "set_keras_mask",
           "to_snake_case", "unpack_singleton"]

reduce_weighted_values = _loss_lib.reduce_weighted_values
scale_loss_for_distribution = _loss_lib.scale_loss_for_distribution


@contextlib.contextmanager
def eager_scope():
    """Leaves Keras' symbolic/stateless scopes and any FuncGraph.

    Keras builds a model inside `backend.compute_output_spec`, where new
    variables are deferred and later created outside any `tf.device` scope.
    Stages must be built eagerly under their device instead.
    """
    names = ("stateless_scope", "symbolic_scope")
    saved = {n: global_state.get_global_attribute(n) for n in names}
    for n in names:
        global_state.set_global_attribute(n, None)
    try:
        with tf.init_scope():
            yield
    finally:
        for n, value in saved.items():
            global_state.set_global_attribute(n, value)


def reinitialize_variable(variable, value):
    """Re-creates the tf.Variable behind a Keras variable, in the device scope.

    `_initialize` is the one place where Keras' TF backend creates the
    underlying `tf.Variable`; the Keras variable, its name and path stay.
    """
    variable._initialize(value)


@contextlib.contextmanager
def replaced_losses(compile_loss, make):
    """Replaces each loss of a `CompileLoss` by `make(n, loss)` meanwhile.

    Keras still matches outputs, targets, per-output sample weights and
    loss weights; the losses it calls are ours for the length of the block.
    """
    originals = compile_loss._flat_losses
    compile_loss._flat_losses = [
        entry._replace(loss=make(n, entry.loss))
        for n, entry in enumerate(originals)]
    try:
        yield len(originals)
    finally:
        compile_loss._flat_losses = originals


def colocate_optimizer(optimizer, device_of, xla_updates=False):
    """Patches `optimizer`'s per-variable hooks onto each variable's device.

    Patched on the object, not its class: `add_variable_from_reference`
    and `update_step` (slots and update math under
    `tf.device(device_of(variable))`), `_all_reduce_sum_gradients` (skipped
    without a `tf.distribute` strategy), `_clip_gradients` (Keras' math,
    each gradient on its device), `_distributed_tf_update_step` (with
    `xla_updates`, each device's updates as one XLA function; see
    `_compiled_updates`) and, for a `LossScaleOptimizer`, `check_finite` and
    `_stateful_handle_finite_grads`. Idempotent; a later call sets
    `xla_updates` anew.
    """
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if getattr(optimizer, "_keras_pipe_colocated", False):
        optimizer._keras_pipe_xla_updates = bool(xla_updates)
        if inner is not None:
            colocate_optimizer(inner, device_of, xla_updates)
        return optimizer
    if inner is not None:
        colocate_optimizer(inner, device_of, xla_updates)
        _colocate_loss_scaling(optimizer)
    add_slot = optimizer.add_variable_from_reference
    update_step = optimizer.update_step

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(device_of(reference_variable)):
            return add_slot(reference_variable, *args, **kwargs)

    local_scalars = weakref.WeakKeyDictionary()  # graph -> {device: ...}

    def step_scalars(device, learning_rate):
        per_device = local_scalars.setdefault(
            tf.compat.v1.get_default_graph(), {})
        given = per_device.get(device)
        if given is None or given[0] is not learning_rate:
            given = per_device[device] = (learning_rate, *_local_copies(
                learning_rate, optimizer._iterations))
        return given[1:]

    def colocated_update_step(gradient, variable, learning_rate, *args,
                              **kwargs):
        device = device_of(variable)
        with tf.device(device), tf.name_scope(_update_scope(device)):
            if not tf.inside_function():  # eager: nothing to share
                return update_step(gradient, variable, learning_rate, *args,
                                   **kwargs)
            learning_rate, iterations = step_scalars(device, learning_rate)
            with _swapped(optimizer, "_iterations", iterations):
                return update_step(gradient, variable, learning_rate, *args,
                                   **kwargs)

    distributed_update = optimizer._distributed_tf_update_step

    def updates_per_device(distribution, grads_and_vars, learning_rate):
        if (not optimizer._keras_pipe_xla_updates
                or tf.distribute.has_strategy() or not tf.inside_function()):
            return distributed_update(distribution, grads_and_vars,
                                      learning_rate)
        for device, pairs in _by_device(grads_and_vars, device_of):
            with tf.device(device), tf.name_scope(_update_scope(device)):
                learning_rate_copy, iterations = step_scalars(
                    device, learning_rate)
                _compiled_updates(optimizer, update_step, pairs,
                                  learning_rate_copy, iterations, device)

    all_reduce = optimizer._all_reduce_sum_gradients

    def local_sum_gradients(grads_and_vars):
        # Under the default strategy the "all-reduce" is one IdentityN op
        # over every gradient: TF would ship all of them to one device
        # and back (on worker processes, over gRPC, each step).
        if not tf.distribute.has_strategy():
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer.update_step = colocated_update_step
    optimizer._distributed_tf_update_step = updates_per_device
    optimizer._all_reduce_sum_gradients = local_sum_gradients
    optimizer._clip_gradients = lambda grads: _clip_on_devices(optimizer,
                                                               grads)
    optimizer._keras_pipe_xla_updates = bool(xla_updates)
    optimizer._keras_pipe_colocated = True
    return optimizer


def _update_scope(device):
    """Name scope of a device's update ops, which placement tests read."""
    return "update_on_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", device)


def _by_device(grads_and_vars, device_of):
    """`[(device, [(gradient, variable), ...])]`, devices in first-seen order."""
    groups = {}
    for gradient, variable in grads_and_vars:
        groups.setdefault(device_of(variable), []).append((gradient, variable))
    return list(groups.items())


def _compiled_updates(optimizer, update_step, pairs, learning_rate,
                      iterations, device):
    """Keras' `update_step` for every pair on `device`, as one XLA function.

    Un-compiled, Adam's update of 4 1024 x 1024 kernels is about ten
    memory-bound element-wise passes per variable (28.7 ms on one core of
    this machine); fused by XLA 12.2 ms. A function that would read a
    resource on another device (an optimizer variable outside the slots,
    such as Nadam's `u_product`, lives on the client) cannot be compiled for
    `device` (XLA compiles for one device): those updates run un-compiled,
    with a warning naming the variable and its device.
    """
    def update():
        with _swapped(optimizer, "_iterations", iterations):
            for gradient, variable in pairs:
                update_step(gradient, variable, learning_rate)

    function = tf.function(update, jit_compile=True, autograph=False)
    concrete = function.get_concrete_function()
    strays = [t for t in concrete.captured_inputs
              if t.dtype == tf.resource and t.device != device]
    if strays:
        owner = type(optimizer).__name__
        names = {id(v.value.handle): f"{owner} variable {v.path!r}"
                 for v in optimizer.variables}
        warnings.warn(
            f"XLA cannot compile the optimizer update on {device}: it reads "
            f"{', '.join(names.get(id(t), 'a resource') for t in strays)} "
            f"on {strays[0].device}; those updates run un-compiled. "
            "compile(jit_compile=False) avoids this warning.", stacklevel=2)
        update()
        return
    concrete()


def _local_copies(learning_rate, iterations):
    """The optimizer's step scalars, read once onto the current device.

    Keras' `update_step` reads the learning rate and `iterations` (both on
    the client's device) once per variable: each read was its own transfer
    to the variable's worker, 2 x 16 gRPC calls per step for 8 Dense
    layers on 2 workers. Copies made once per device per traced step cut
    that to 2 per worker. Read before the step's `iterations.assign_add`,
    as Keras' own reads are (automatic control dependencies keep program
    order on the variable).
    """
    return tf.identity(learning_rate), tf.identity(iterations)


@contextlib.contextmanager
def _swapped(obj, name, value):
    """`obj.name = value` while the block runs, bypassing Keras tracking."""
    saved = obj.__dict__[name]
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        object.__setattr__(obj, name, saved)


def _colocate_loss_scaling(optimizer):
    """A `LossScaleOptimizer`'s checks and unscaling on each gradient's device.

    Keras runs its finiteness check and its division by the loss scale under
    no device scope, so TF moved every gradient to one device and back.
    `_stateful_handle_finite_grads` is Keras 3.15's, with the division placed.
    """
    optimizer.check_finite = lambda grads: ops.all(ops.stack([
        _on_device(g, lambda g: ops.all(ops.isfinite(g)))
        for g in grads if g is not None]))

    def handle_finite_grads(grads, trainable_variables):
        scale = optimizer.dynamic_scale
        tvs = trainable_variables or optimizer._trainable_variables
        unscaled = [
            g if g is None or optimizer._overwrite_variable_with_gradient(v)
            else _on_device(g, lambda g: ops.divide(g, scale))
            for g, v in zip(grads, tvs)]
        optimizer.inner_optimizer.apply(
            unscaled, trainable_variables=trainable_variables)

        def upscale():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(
                ops.multiply(optimizer.dynamic_scale, 2.0))

        def increment():
            optimizer.step_counter.assign_add(1)

        ops.cond(ops.equal(optimizer.step_counter,
                           optimizer.dynamic_growth_steps - 1),
                 upscale, increment)

    optimizer._stateful_handle_finite_grads = handle_finite_grads


def _on_device(g, fn):
    """`fn(g)` on the device of gradient `g` (None stays None)."""
    if g is None:
        return None
    with tf.device(g.device):
        return fn(g)


def _clip_on_devices(optimizer, grads):
    """Keras' `_clip_gradients`, with each gradient's ops on its device.

    Keras creates the clipping ops under no device scope, so TF would run
    them (and move the gradients) on one device. Same math as Keras.
    """
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return [_on_device(g, optimizer._clip_by_norm) for g in grads]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        clip_norm = optimizer.global_clipnorm
        squares = [_on_device(g, lambda g: ops.sum(ops.square(g)))
                   for g in grads if g is not None]
        norm = ops.sqrt(ops.sum(ops.stack(squares)))
        scale = clip_norm * ops.minimum(1.0 / norm, 1.0 / clip_norm)
        scale = scale + (norm - norm)  # NaN for a non-finite norm, as Keras
        return [_on_device(g, lambda g: g * scale) for g in grads]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        v = optimizer.clipvalue
        return [_on_device(g, lambda g: ops.clip(g, -v, v)) for g in grads]
    return grads


# ------------------------------------------------ randomness keyed by row

from keras.src.backend.tensorflow import random as _tf_random  # noqa: E402
from keras.src.random.seed_generator import SeedGenerator, draw_seed  # noqa: E402

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


def _batch_dims(shape):
    """The dims of `shape` if its first one is a batch (unknown when traced)."""
    dims = list(shape) if not isinstance(shape, tf.Tensor) else [
        shape[k] for k in range(shape.shape[0])]
    if not dims or isinstance(dims[0], int):
        return None
    return dims


def _rows_of(shape, rows, draw):
    """`draw(shape)` for a batch-first shape, keyed by the global row.

    `rows` is `[offset, total]`: this micro-batch's first row in the global
    batch and the global batch's size. A shape whose first dimension is
    known at trace time is not a batch (stage functions are traced with the
    batch size left open) and is drawn as is, the same for every
    micro-batch; otherwise the rows of the whole global batch are drawn and
    this micro-batch's rows are sliced out, so row `r` sees the same numbers
    whatever micro-batch, stage or replica it lands in (uniform and normal
    draws start Philox's counter at the micro-batch's rows instead, which
    gives the same numbers without drawing the rest).
    """
    dims = _batch_dims(shape)
    if dims is None:
        return draw(shape)
    full = draw(tf.stack([tf.cast(rows[1], tf.int32)] + [
        tf.cast(d, tf.int32) for d in dims[1:]]))
    start = tf.cast(rows[0], tf.int32)
    return full[start:start + tf.cast(dims[0], tf.int32)]


@contextlib.contextmanager
def keyed_random(rows):
    """Random draws of Keras layers keyed by global row, meanwhile.

    Patches Keras' TF random backend (`uniform`, `normal`,
    `truncated_normal`, `dropout`: what Dropout, SpatialDropout,
    GaussianNoise, GaussianDropout and AlphaDropout call) so that each row
    of a batch-first draw depends only on the seed (the layer's seed
    generator at the start of the step) and the row's index in the global
    batch (see `_rows_of`). Only while tracing a stage call.
    """
    originals = {name: getattr(_tf_random, name) for name in (
        "uniform", "normal", "truncated_normal", "dropout")}

    def seeded(seed):
        return originals_cast(draw_seed(seed))

    def originals_cast(seed):
        return _tf_random._cast_seed(seed)

    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        s = seeded(seed)
        dims = _batch_dims(shape)
        if dims is None or not _is_float_dtype(dtype):
            return _rows_of(shape, rows, lambda sh: originals["uniform"](
                sh, minval=minval, maxval=maxval, dtype=dtype, seed=s))
        dtype = _float_dtype(dtype)
        u = _philox_rows("uniform", dims, rows, s, dtype)
        return u * tf.cast(maxval - minval, dtype) + tf.cast(minval, dtype)

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        s = seeded(seed)
        dims = _batch_dims(shape)
        if dims is None:
            return originals["normal"](shape, mean=mean, stddev=stddev,
                                       dtype=dtype, seed=s)
        dtype = _float_dtype(dtype)
        n = _philox_rows("normal", dims, rows, s, dtype)
        return n * tf.cast(stddev, dtype) + tf.cast(mean, dtype)

    def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        s = seeded(seed)
        return _rows_of(shape, rows, lambda sh: originals[
            "truncated_normal"](sh, mean=mean, stddev=stddev, dtype=dtype,
                                seed=s))

    def dropout(inputs, rate, noise_shape=None, seed=None):
        if rate == 1.0:
            return tf.zeros_like(inputs)
        if rate == 0.0:
            return inputs
        s = seeded(seed)
        noise_shape = _tf_random._get_concrete_noise_shape(inputs,
                                                           noise_shape)
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
        setattr(_tf_random, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(_tf_random, name, fn)


def _float_dtype(dtype):
    return tf.as_dtype(keras.backend.standardize_dtype(
        dtype or keras.backend.floatx()))


def _is_float_dtype(dtype):
    return dtype is None or tf.as_dtype(
        keras.backend.standardize_dtype(dtype)).is_floating


def seed_state_variables(layer):
    """The state variables of the seed generators of `layer`'s sub-layers."""
    found = []
    for sub in layer._flatten_layers():
        for value in vars(sub).values():
            if isinstance(value, SeedGenerator):
                found.append(value.state)
    return found
