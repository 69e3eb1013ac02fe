"""Optimizer colocation: slots and update math on each variable's device.

Inside `fit`, Keras creates an optimizer's slots, runs its update math, its
default-strategy "all-reduce", gradient clipping and a loss-scale
optimizer's checks under no device scope, so TensorFlow would place them all
on one device and ship every gradient there and back (the "one-device
optimizer" trap, docs/design.md). `colocate_optimizer` patches those hooks
on the optimizer object so that each runs on its variable's device. The
Keras code it replaces is Keras 3.15.0's, with only the device placement
changed; every private attribute it touches is reached through
`keras_pipe._compat`.
"""

import re
import warnings
import weakref

import tensorflow as tf
from keras import ops

from keras_pipe import _compat

__all__ = ["colocate_optimizer", "xla_updates"]

# The optimizers patched here, each with its `xla_updates` setting.
_XLA_UPDATES = weakref.WeakKeyDictionary()


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
    if optimizer in _XLA_UPDATES:
        _XLA_UPDATES[optimizer] = bool(xla_updates)
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
                learning_rate, _compat.optimizer_iterations(optimizer)))
        return given[1:]

    def colocated_update_step(gradient, variable, learning_rate, *args,
                              **kwargs):
        device = device_of(variable)
        with tf.device(device), tf.name_scope(_update_scope(device)):
            if not tf.inside_function():  # eager: nothing to share
                return update_step(gradient, variable, learning_rate, *args,
                                   **kwargs)
            learning_rate, iterations = step_scalars(device, learning_rate)
            with _compat.swapped_iterations(optimizer, iterations):
                return update_step(gradient, variable, learning_rate, *args,
                                   **kwargs)

    distributed_update = _compat.optimizer_hook(
        optimizer, "_distributed_tf_update_step")

    def updates_per_device(distribution, grads_and_vars, learning_rate):
        if (not _XLA_UPDATES[optimizer]
                or tf.distribute.has_strategy() or not tf.inside_function()):
            return distributed_update(distribution, grads_and_vars,
                                      learning_rate)
        for device, pairs in _by_device(grads_and_vars, device_of):
            with tf.device(device), tf.name_scope(_update_scope(device)):
                learning_rate_copy, iterations = step_scalars(
                    device, learning_rate)
                _compiled_updates(optimizer, update_step, pairs,
                                  learning_rate_copy, iterations, device)

    all_reduce = _compat.optimizer_hook(optimizer,
                                          "_all_reduce_sum_gradients")

    def local_sum_gradients(grads_and_vars):
        # Under the default strategy the "all-reduce" is one IdentityN op
        # over every gradient: TF would ship all of them to one device
        # and back (on worker processes, over gRPC, each step).
        if not tf.distribute.has_strategy():
            return list(grads_and_vars)
        return all_reduce(grads_and_vars)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer.update_step = colocated_update_step
    _compat.set_optimizer_hooks(
        optimizer, _distributed_tf_update_step=updates_per_device,
        _all_reduce_sum_gradients=local_sum_gradients,
        _clip_gradients=lambda grads: _clip_on_devices(optimizer, grads))
    _XLA_UPDATES[optimizer] = bool(xla_updates)
    return optimizer


def xla_updates(optimizer):
    """Whether `optimizer`'s updates run as one XLA function per device
    (None if `colocate_optimizer` never patched it)."""
    return _XLA_UPDATES.get(optimizer)


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

    Un-compiled, Adam's update is about ten memory-bound element-wise
    passes per variable; XLA fuses them. A function that would read a
    resource on another device (an optimizer variable outside the slots,
    such as Nadam's `u_product`, lives on the client) cannot be compiled for
    `device` (the "one-device XLA" trap: XLA compiles for one device): those
    updates run un-compiled, with a warning naming the variable and its
    device.
    """
    def update():
        with _compat.swapped_iterations(optimizer, iterations):
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

    Keras' `update_step` reads the learning rate and `iterations` (both on the
    client's device) once per variable: each read would be its own transfer
    to the variable's worker, two per variable per step. Copies made once
    per device per traced step cut that to two per worker. Read before the
    step's `iterations.assign_add`, as Keras' own reads are (automatic
    control dependencies keep program order on the variable).
    """
    return tf.identity(learning_rate), tf.identity(iterations)


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
        tvs = trainable_variables or _compat.optimizer_variables(
            optimizer)
        unscaled = [
            g if g is None
            or _compat.overwrites_with_gradient(optimizer, v)
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

    _compat.set_optimizer_hooks(
        optimizer, _stateful_handle_finite_grads=handle_finite_grads)


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
        return [_on_device(g, lambda g: _compat.clip_by_norm(optimizer, g))
                for g in grads]
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
