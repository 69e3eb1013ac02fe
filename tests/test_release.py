"""Weight gradients released as applied (`keras_pipe.engine.release`).

Without the chain, a stage's W call makes every weight gradient of the
stage before the optimizer frees any (a worker held its weights plus all
its gradients, `tests/test_worker_memory.py`). With it, on each device the
ops that make one variable's gradient wait for the previous variable's
update. With remat, a backward call makes its stage's gradients in one
traced call; the stage's last one is split so that its W call, in place,
can be chained the same way (`keras_pipe.engine.weight_calls`). Exactness
is the transparency tests' (train_on_batch against plain Keras,
tests/test_every_schedule.py for every schedule and remat mode); these
check the graph: which ops wait, and that nothing is chained where an
update reads every gradient.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import release
from keras_pipe.engine import release as release_lib


def _mlp(width=32, depth=4):
    return keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(3)])


def _trained(devices, monkeypatch, optimizer, remat="never", m=2,
             schedule="gpipe", num_stages=2):
    """Trains one step; returns what `apply_in_turn` saw and did."""
    seen, original = {}, release.apply_in_turn

    def spy(update_ops, gradients, variables, weight_ops, device_of):
        seen.update(gated=original(
            update_ops, gradients, variables, weight_ops, device_of),
            weight_ops=dict(weight_ops), variables=list(variables))
        return seen["gated"]

    monkeypatch.setattr(release_lib, "apply_in_turn", spy)
    pipe = keras_pipe.PipelineModel.from_model(
        _mlp(), num_stages=num_stages,
        devices=[devices[j % 2] for j in range(num_stages)],
        num_micro_batches=m, balance="params", remat=remat,
        schedule=schedule)
    pipe.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    y = np.arange(8) % 3
    loss = pipe.train_on_batch(x, y)
    assert np.isfinite(loss)
    return seen


def _check_chained(seen):
    """Every variable's W ops are known; on each of the 2 devices all but
    the first variable of the chain wait for an update."""
    variables = seen["variables"]
    assert set(seen["weight_ops"]) == {id(v) for v in variables}

    def applied_gates(op):
        # Not the executor's NoOp of the device's last call (`_done`).
        return [c for c in op.control_inputs if c.type == "NoOp"
                and c.name.split("/")[-1].startswith("applied")]

    waiting = [op for ops in seen["weight_ops"].values() for op in ops
               if applied_gates(op)]
    assert seen["gated"] == len(waiting) >= len(variables) - 2
    for op in waiting:
        applied, = applied_gates(op)
        assert any(u.type.startswith("AssignSub")
                   for u in applied.control_inputs), applied.control_inputs


@pytest.mark.slow
@pytest.mark.parametrize("schedule, m", [("gpipe", 2), ("gpipe", 1),
                                         ("1f1b", 4)])
def test_each_weight_gradient_waits_for_the_previous_update(
        devices, monkeypatch, schedule, m):
    # W calls and backward calls that would run whole under a tape (GPipe's
    # last stage at M = 1, 1F1B's) alike.
    _check_chained(_trained(devices, monkeypatch, keras.optimizers.SGD(0.1),
                            m=m, schedule=schedule))


@pytest.mark.slow
@pytest.mark.parametrize("remat, schedule, num_stages", [
    ("always", "gpipe", 2),
    ("except_last", "1f1b", 2),
    (["always", "never"], "gpipe", 2),
    ("always", "zb_h1", 2),
    ("always", "interleaved_1f1b", 4),
])
def test_with_remat_each_weight_gradient_waits_too(
        devices, monkeypatch, remat, schedule, num_stages):
    # Each stage's last backward call with remat is split: its weight
    # gradients come from a W call in place, one variable at a time (before:
    # one traced call made them all, and nothing was chained). zb_h1's own
    # W calls after a recompute ran as a traced call too.
    _check_chained(_trained(devices, monkeypatch, keras.optimizers.SGD(0.1),
                            remat=remat, schedule=schedule,
                            num_stages=num_stages))


@pytest.mark.slow
def test_nothing_is_chained_where_an_update_reads_every_gradient(
        devices, monkeypatch):
    # A global norm reads every gradient before any update: no gain, and a
    # chain would make a cycle.
    seen = _trained(devices, monkeypatch,
                    keras.optimizers.SGD(0.1, global_clipnorm=1.0))
    assert seen["weight_ops"] and seen["gated"] == 0


def test_exclusive_ops_are_those_only_one_tensor_needs():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.constant(1.0, name="a")
        shared = tf.identity(a, name="shared")
        x = tf.identity(shared, name="x")
        y = tf.square(shared, name="y")
        ops = [shared.op, x.op, y.op]
        own = release.exclusive_ops(ops, [x, y, None, a])
    assert [[op.name for op in o] for o in own] == [["x"], ["y"], [], []]
