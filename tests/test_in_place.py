"""Updates in place (`keras_pipe.engine.in_place`).

TF copies a whole resource variable before an update while a tensor read
from it is alive. A pipeline step reads each weight once and the update
needs only the summed gradient, so without an order the update can race
ahead of the last input gradient that uses the read: a copy of the
variable at the step's peak. These check the order in the graph (every
use of a read comes before the variable's update) and its effect: a
variable keeps its buffer from step to step. Exactness is the
transparency tests' (the values do not change, only the order).
"""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import in_place


def _pipe(devices, optimizer, width=32, depth=4, m=2, remat="never"):
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu")
           for _ in range(depth)]
        + [keras.layers.Dense(3)])
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=2, devices=devices[:2], num_micro_batches=m,
        balance="params", remat=remat)
    pipe.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, width)).astype("float32")
    return pipe, x, np.arange(64) % 3


def _update_ops(devices, monkeypatch, optimizer, **kwargs):
    """Trains one step; returns the model and the optimizer's ops."""
    seen, original = {}, in_place.update_in_place

    def spy(update_ops):
        seen["ops"] = list(update_ops)
        return original(update_ops)

    monkeypatch.setattr(in_place, "update_in_place", spy)
    pipe, x, y = _pipe(devices, optimizer, **kwargs)
    assert np.isfinite(pipe.train_on_batch(x, y))
    return pipe, seen["ops"]


@pytest.mark.parametrize("optimizer, remat", [
    (keras.optimizers.SGD(0.1), "never"),
    (keras.optimizers.Adam(1e-3), "always"),
    (keras.optimizers.SGD(0.1, momentum=0.9), "except_last"),
])
def test_each_update_waits_for_every_use_of_its_variables_read(
        devices, monkeypatch, optimizer, remat):
    pipe, ops = _update_ops(devices, monkeypatch, optimizer, remat=remat)
    inside = set(ops)
    checked = 0
    for op in ops:
        if not in_place.writes(op):
            continue
        users = [u for u in in_place.read_users(op.inputs[0])
                 if u not in inside]
        missing = [u.name for u in users if u not in op.control_inputs]
        assert not missing, (op.name, missing)
        checked += bool(users)
    # Every trainable variable is read by its stage and written once.
    assert checked == len(pipe.trainable_variables)


def _address(variable):
    """Where the variable's buffer is (a read aliases it)."""
    return np.asarray(tf.convert_to_tensor(variable.value)).ctypes.data


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, m", [
    (keras.optimizers.SGD(0.1), 1), (keras.optimizers.Adam(1e-3), 2)])
def test_a_variable_keeps_its_buffer_from_step_to_step(devices, optimizer,
                                                       m):
    # 16 MiB kernels and one or two micro-batches: without the order,
    # 5 of 50 updates over 5 steps moved a kernel to a copy (SGD, M = 1).
    pipe, x, y = _pipe(devices, optimizer, width=2048, m=m)
    pipe.train_on_batch(x, y)
    moved = []
    for step in range(8):
        before = [_address(v) for v in pipe.trainable_variables]
        pipe.train_on_batch(x, y)
        moved += [(step, v.path) for v, b in zip(pipe.trainable_variables,
                                                  before)
                  if _address(v) != b]
    assert not moved


def test_what_writes_in_place():
    def op(kind, inputs=1):
        return types.SimpleNamespace(type=kind, inputs=[None] * inputs)

    for kind in ("AssignSubVariableOp", "AssignAddVariableOp",
                 "ResourceApplyAdam", "ResourceApplyGradientDescent",
                 "ResourceSparseApplyAdagrad", "ResourceScatterSub"):
        assert in_place.writes(op(kind)), kind
    # AssignVariableOp takes its value's buffer: it copies nothing.
    for kind in ("AssignVariableOp", "ReadVariableOp", "MatMul"):
        assert not in_place.writes(op(kind)), kind
    assert not in_place.writes(op("AssignSubVariableOp", inputs=0))
