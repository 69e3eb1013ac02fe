"""Split backward (B then W) gives the fused backward pass's gradients.

For each stage: B's input gradients per micro-batch and W's weight
gradients summed over 3-4 micro-batches of uneven sizes equal those of one
`tf.GradientTape` per micro-batch (float32: rtol 1e-5, and atol 1e-6 times
the largest magnitude in the gradient, for elements that are sums with
cancellation).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe.engine import gradients, weight_grad
from keras_pipe.engine import stage as stage_lib

SIZES = (3, 5, 2, 4)
RTOL, ATOL = 1e-5, 1e-6


def _stage(layer, example):
    """A built stage, its params and state."""
    layer(example)
    stage = stage_lib.Stage(layer, "/device:CPU:0")
    return stage, stage.read_params(), stage.read_state()


def _seeds(rng, outputs, losses):
    """Random output and loss gradients (None for non-float outputs)."""
    return ([tf.constant(rng.normal(size=o.shape), o.dtype)
             if o.dtype.is_floating else None
             for o in keras.tree.flatten(outputs)],
            [tf.constant(rng.normal(), l.dtype) for l in losses])


def _fused(stage, x, params, state, training, output_grads, loss_grads):
    """The reference: one tape per micro-batch; (input grads, param grads)."""
    flat = [t for t in keras.tree.flatten(x) if t.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(flat + params)
        outputs, _, losses = stage.call_inline(x, params, state, training)
    ys = keras.tree.flatten(outputs) + losses
    pairs = [(y, g) for y, g in zip(ys, output_grads + loss_grads)
             if g is not None]
    grads = tape.gradient([y for y, _ in pairs], flat + params,
                          output_gradients=[g for _, g in pairs])
    return grads[:len(flat)], grads[len(flat):]


def _dense(g):
    return None if g is None else tf.convert_to_tensor(g).numpy()


def _assert_close(got, want, rtol, atol, err_msg=""):
    got, want = _dense(got), _dense(want)
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale,
                               err_msg=err_msg)


def _check_input_grads(x, input_grads, expected, rtol, atol):
    """B's gradients for the float inputs of `x` equal the reference's."""
    floats = [g for g, t in zip(input_grads, keras.tree.flatten(x))
              if t.dtype.is_floating]
    assert [g is None for g in floats] == [g is None for g in expected]
    for got, want in zip(floats, expected):
        if want is not None:
            _assert_close(got, want, rtol, atol)


def _check(layer, make_input, training=True, rtol=RTOL, atol=ATOL,
           sizes=SIZES):
    """Asserts B and W equal the fused gradients; returns the split."""
    rng = np.random.default_rng(0)
    micro_batches = [make_input(rng, n) for n in sizes]
    stage, params, state = _stage(layer, micro_batches[0])
    split = weight_grad.SplitBackward(stage.call_inline, training)
    expected = [None] * len(params)
    stashes = []
    for x in micro_batches:
        outputs, _, losses = stage.call_inline(x, params, state, training)
        output_grads, loss_grads = _seeds(rng, outputs, losses)
        ref_inputs, ref_params = _fused(stage, x, params, state, training,
                                        output_grads, loss_grads)
        expected = [gradients.add_gradients(t, g)
                    for t, g in zip(expected, ref_params)]
        input_grads, stash = split.backward_input(
            x, params, state, output_grads, loss_grads)
        _check_input_grads(x, input_grads, ref_inputs, rtol, atol)
        stashes.append(stash)
    # W in two calls (2 micro-batches, then the rest) through `totals`.
    totals = split.backward_weight(params, stashes[:2])
    totals = split.backward_weight(params, stashes[2:], totals)
    for got, want, v in zip(totals, expected, stage.trainable_variables):
        assert (got is None) == (want is None), v.path
        if want is not None:
            _assert_close(got, want, rtol, atol, err_msg=v.path)
    return split, stage, params, stashes


def _floats(*shape):
    return lambda rng, n: tf.constant(rng.normal(size=(n,) + shape),
                                      "float32")


def test_dense_stack():
    layer = keras.Sequential([
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3)])
    split, *_ = _check(layer, _floats(6))
    assert split.splittable and split.reason == ""
    # One B for all micro-batch sizes; W for two micro-batches twice: once
    # without running sums, once adding to them.
    kinds = sorted(k[0] == "weight" for k in split._functions)
    assert kinds == [False, True, True]


def test_conv_batch_norm_pooling():
    layer = keras.Sequential([
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(3)])
    split, *_ = _check(layer, _floats(6, 6, 2), training=True)
    (plan,) = split._plans.values()
    concatenated = {m.op.type for m in plan.mixing if m.concat}
    assert {"Conv2D", "MatMul"} <= concatenated, plan.describe()


def test_embedding_layer_norm_attention():
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(tokens)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    logits = keras.layers.Dense(3)(h)
    layer = keras.Model(tokens, logits)
    split, *_ = _check(
        layer, lambda rng, n: tf.constant(rng.integers(0, 20, (n, 5)),
                                          "int32"))
    (plan,) = split._plans.values()
    concatenated = {m.op.type for m in plan.mixing if m.concat}
    # tf.einsum (EinsumDense) runs as BatchMatMulV2 here.
    assert {"BatchMatMulV2", "GatherV2"} <= concatenated, plan.describe()
    assert not [m for m in plan.mixing if not m.concat], plan.describe()


class _PenalizedDense(keras.layers.Dense):
    """A Dense layer that adds a loss of its kernel alone (a P loss)."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.sum(keras.ops.square(self.kernel)))
        return super().call(inputs)


def test_add_loss_of_activations_and_of_weights():
    layer = keras.Sequential([
        keras.layers.Dense(8, activation="tanh",
                           activity_regularizer=keras.regularizers.L2(0.1),
                           kernel_regularizer=keras.regularizers.L2(0.1)),
        _PenalizedDense(3)])
    split, *_ = _check(layer, _floats(6))
    (plan,) = split._plans.values()
    assert len(plan.direct) == 1  # the kernel's loss reaches W directly


class _TwoHeads(keras.layers.Layer):
    """Outputs x @ k1, tanh(x @ k2) and 2 * k1 itself (a P output)."""

    def build(self, input_shape):
        self.k1 = self.add_weight((input_shape[-1], 3))
        self.k2 = self.add_weight((input_shape[-1], 4))

    def call(self, inputs):
        return (keras.ops.matmul(inputs, self.k1),
                keras.ops.tanh(keras.ops.matmul(inputs, self.k2)),
                2.0 * self.k1)


def test_weight_as_output_and_output_without_gradient():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(3, 6)), "float32")
    stage, params, state = _stage(_TwoHeads(name="two_heads"), x)
    split = weight_grad.SplitBackward(stage.call_inline, True)
    stashes, expected = [], [None, None]
    for n in (3, 5, 2):
        x = tf.constant(rng.normal(size=(n, 6)), "float32")
        output_grads = [tf.constant(rng.normal(size=(n, 3)), "float32"),
                        None,  # the second head does not reach the loss
                        tf.constant(rng.normal(size=(6, 3)), "float32")]
        _, ref = _fused(stage, x, params, state, True, output_grads, [])
        expected = [gradients.add_gradients(t, g) for t, g in zip(expected, ref)]
        _, stash = split.backward_input(x, params, state, output_grads, [])
        stashes.append(stash)
    (plan,) = split._plans.values()
    assert len(plan.direct) == 1 and len(plan.mixing) == 1, plan.describe()
    k1, k2 = split.backward_weight(params, stashes)
    assert expected[1] is None and k2 is None
    _assert_close(k1, expected[0], RTOL, ATOL)


def test_dropout_same_state_same_mask():
    layer = keras.Sequential([
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.Dense(3)])
    _check(layer, _floats(6), training=True)


def test_mixed_float16_dense():
    layer = keras.Sequential([
        keras.layers.Dense(8, activation="tanh", dtype="mixed_float16"),
        keras.layers.Dense(3)])
    # W's kernel gradient is one float16 product over all micro-batches, the
    # reference sums float16 products per micro-batch in float32: float16
    # rounding (eps 9.8e-4) of the gradient's scale.
    split, *_ = _check(layer, _floats(6), rtol=1e-3, atol=1e-3)
    (plan,) = split._plans.values()
    assert "Cast" in {op.type for op in plan.replay}


class _RawEinsum(keras.layers.Layer):
    """tf.einsum of the inputs and a kernel, then a learned per-row scale."""

    def build(self, input_shape):
        self.k = self.add_weight((input_shape[-1], 3, 2))
        self.s = self.add_weight((3, 2), initializer="ones")

    def call(self, inputs):
        y = tf.einsum("btc,cde->btde", inputs, self.k)
        # x's batch axis is summed out: rows mix, replayed per micro-batch.
        z = tf.einsum("btc,cde->de", inputs, self.k)
        return y - self.s, z * self.s


def test_einsum_concatenated_only_when_rows_stay_apart():
    split, *_ = _check(_RawEinsum(name="raw_einsum"), _floats(4, 5),
                       sizes=(3, 5, 2))
    (plan,) = split._plans.values()
    kinds = [(m.op.type, m.concat) for m in plan.mixing]
    assert ("Einsum", True) in kinds and ("Einsum", False) in kinds, kinds


def _live_ops(function):
    """The ops of a concrete function's graph that its outputs depend on."""
    graph = function.graph
    live, stack = set(), [t.op for t in graph.outputs]
    while stack:
        op = stack.pop()
        if op not in live:
            live.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return live


def test_weight_gradients_of_micro_batches_are_one_matmul_per_kernel():
    layer = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    split, stage, params, stashes = _check(layer, _floats(6))
    # Per Dense: its input and dY (the bias gradient needs no input).
    assert len(stashes[0]) == 4
    (key,) = split._plans
    dense = (False,) * len(params)
    function = split._traced_weight(key, 4, params, dense)
    matmuls = [op for op in _live_ops(function) if op.type == "MatMul"]
    assert len(matmuls) == 2  # one per kernel, not one per micro-batch
    concats = [op for op in _live_ops(function) if op.type == "ConcatV2"]
    assert concats
    # B's outputs need dX per Dense and the first Dense's product (for the
    # ReLU), not dW (its tape builds dW too; nothing reads it, so it does
    # not run), nor the product of the last Dense (its output is unused).
    (b,) = [f for k, f in split._functions.items() if k == key]
    matmuls = [op for op in _live_ops(b) if op.type == "MatMul"]
    assert len(matmuls) == 3


def test_a_convolutions_bias_gradient_is_not_a_bias_add_grad():
    # With oneDNN, TF merges a Conv2DBackpropFilter and a BiasAddGrad into
    # one node; in a W over several micro-batches that node closed a cycle
    # ("N nodes in a cycle": GPipe and zb_h2 at M >= 4 failed on any conv
    # net with biases). W differentiates the bias as a broadcast add.
    layer = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same"),
                              keras.layers.Conv2D(2, 3, padding="same",
                                                  activation="relu")])
    split, stage, params, stashes = _check(layer, _floats(6, 6, 2))
    (key,) = split._plans
    function = split._traced_weight(key, 4, params, (False,) * len(params))
    live = {op.type for op in _live_ops(function)}
    assert "Conv2DBackpropFilter" in live and "BiasAddGrad" not in live


_ONEDNN_CONV = """
import numpy as np, keras, keras_pipe
devices = keras_pipe.logical_cpu_devices(2)
def conv():
    return keras.layers.Conv2D(4, 3, padding="same", activation="relu")
stages = [keras.Sequential([conv()]),
          keras.Sequential([conv(), keras.layers.GlobalAveragePooling2D(),
                            keras.layers.Dense(3)])]
pipe = keras_pipe.PipelineModel(stages, devices=devices, remat="never",
                                num_micro_batches=2, schedule="gpipe")
pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
    from_logits=True))
rng = np.random.default_rng(0)
pipe.fit(rng.normal(size=(16, 6, 6, 3)).astype("float32"),
         rng.integers(0, 3, 16), batch_size=8, verbose=0)
print("trained")
"""


@pytest.mark.slow
def test_gpipe_trains_a_conv_net_with_onednn():
    # The symptom of the test above, in a process with oneDNN on (TF leaves
    # it off on AMD CPUs, as on this suite's machine).
    import os
    import subprocess
    import sys
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _ONEDNN_CONV], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trained" in done.stdout, (
        done.stderr[-2000:])


def test_lstm_falls_back_to_fused_backward():
    layer = keras.Sequential([keras.layers.LSTM(4), keras.layers.Dense(3)])
    split, *_ = _check(layer, _floats(5, 3), sizes=(3, 5, 2))
    assert not split.splittable
    assert "While" in split.reason, split.reason


class _Unusual(keras.layers.Layer):
    """x @ k through a custom gradient or a Python function."""

    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        self.route = path

    def build(self, input_shape):
        self.k = self.add_weight((input_shape[-1], 3))

    def call(self, inputs):
        k = tf.convert_to_tensor(self.k)
        if self.route == "custom_gradient":
            @tf.custom_gradient
            def product(x, k):
                def grad(dy):  # twice the true gradient, on purpose
                    return (2.0 * tf.matmul(dy, k, transpose_b=True),
                            2.0 * tf.matmul(x, dy, transpose_a=True))
                return tf.matmul(x, k), grad
            return product(inputs, k)
        y = tf.numpy_function(lambda a, b: a @ b, [inputs, k], tf.float32,
                              stateful=True)
        return tf.ensure_shape(y, (None, 3)) * tf.reduce_sum(k)


@pytest.mark.parametrize("path, reason", [
    ("custom_gradient", "custom gradient"), ("numpy_function", "stateful")])
def test_custom_gradient_and_python_function_fall_back(path, reason):
    split, *_ = _check(_Unusual(path, name="unusual"), _floats(6),
                       sizes=(3, 5, 2))
    assert not split.splittable
    assert reason in split.reason, split.reason


def test_call_must_be_callable():
    with pytest.raises(TypeError, match="`call` must be callable"):
        weight_grad.SplitBackward("not a function", training=True)


# ---------------------------------------------------- B from the forward tape


def _check_recorded(layer, make_input, training=True, rtol=RTOL, atol=ATOL,
                    sizes=SIZES):
    """As `_check`, with B taken from the forward pass's own tape.

    The forward pass runs in place (`Stage.forward(split=True)`, as the
    executor runs it when a split backward follows without remat), inside a
    `tf.function`; B reuses its activations. Returns the split and the ops B
    built for the first micro-batch.
    """
    rng = np.random.default_rng(0)
    micro_batches = [make_input(rng, n) for n in sizes]
    stage, params, state = _stage(layer, micro_batches[0])
    seeds, expected = [], [None] * len(params)
    ref_inputs = []
    for x in micro_batches:
        outputs, _, losses = stage.call_inline(x, params, state, training)
        output_grads, loss_grads = _seeds(rng, outputs, losses)
        seeds.append((output_grads, loss_grads))
        inputs, ref = _fused(stage, x, params, state, training, output_grads,
                             loss_grads)
        ref_inputs.append(inputs)
        expected = [gradients.add_gradients(t, g)
                    for t, g in zip(expected, ref)]
    b_ops = []

    @tf.function(autograph=False)
    def step(micro_batches, params, state):
        stashes, input_grads = [], []
        for x, (output_grads, loss_grads) in zip(micro_batches, seeds):
            run, _ = stage.forward(x, params, state, training, remat=False,
                                   split=True)
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            grads, stash = stage.backward_input(run, output_grads,
                                                loss_grads, training)
            if not b_ops:
                b_ops.extend(graph.get_operations()[first:])
            input_grads.append(grads)
            stashes.append(stash)
        totals = stage.backward_weight(params, stashes[:2], [None] *
                                       len(params), training)
        return input_grads, stage.backward_weight(params, stashes[2:],
                                                  totals, training)

    input_grads, totals = step(micro_batches, params, state)
    for x, got, want in zip(micro_batches, input_grads, ref_inputs):
        _check_input_grads(x, got, want, rtol, atol)
    for got, want, v in zip(totals, expected, stage.trainable_variables):
        assert (got is None) == (want is None), v.path
        if want is not None:
            _assert_close(got, want, rtol, atol, err_msg=v.path)
    (split,) = stage._split.values()
    return split, b_ops


def test_recorded_backward_reuses_the_forward_activations():
    layer = keras.Sequential([
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3)])
    split, b_ops = _check_recorded(layer, _floats(6))
    assert split.splittable, split.reason
    types = {op.type for op in b_ops}
    # No recompute: B neither calls a function (the recomputing B is one)
    # nor runs the forward's activations again; it differentiates them.
    assert not types & {"PartitionedCall", "StatefulPartitionedCall",
                        "Tanh"}, types
    assert "TanhGrad" in types, types
    # Every micro-batch size shares one plan; W concatenates the kernels'.
    (plan,) = split._plans.values()
    assert {m.op.type for m in plan.mixing if m.concat} == {"MatMul",
                                                            "BiasAdd"}


def test_recorded_backward_conv_batch_norm_dropout():
    layer = keras.Sequential([
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.Flatten(),
        keras.layers.Dense(3)])
    split, _ = _check_recorded(layer, _floats(6, 6, 2))
    assert split.splittable, split.reason


def test_recorded_backward_attention_and_losses():
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(tokens)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(
        0.1), kernel_regularizer=keras.regularizers.L2(0.1))(h)
    logits = _PenalizedDense(3)(h)
    split, _ = _check_recorded(
        keras.Model(tokens, logits),
        lambda rng, n: tf.constant(rng.integers(0, 20, (n, 5)), "int32"))
    assert split.splittable, split.reason


@pytest.mark.parametrize("path, reason", [
    ("custom_gradient", "custom gradient"), ("lstm", "While")])
def test_recorded_backward_falls_back_to_fused(path, reason):
    if path == "lstm":
        layer = keras.Sequential([keras.layers.LSTM(4),
                                  keras.layers.Dense(3)])
        make = _floats(5, 3)
    else:
        layer, make = _Unusual(path, name="unusual"), _floats(6)
    split, _ = _check_recorded(layer, make, sizes=(3, 5, 2))
    assert not split.splittable
    assert reason in split.reason, split.reason
