"""One test per hook into Keras/TF internals (`keras_pipe._compat`).

If a Keras or TF upgrade changes one of them, the test naming it fails.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import colocation, keyed_random


def test_version_check_names_the_supported_series():
    _compat.check_versions({"keras": "3.15.2", "tensorflow": "2.21.0"})
    with pytest.raises(ImportError, match=r"supports Keras 3\.15\.x and "
                       r"TensorFlow 2\.21\.x; found keras 3\.16\.0.*"
                       r"'keras==3\.15\.\*'"):
        _compat.check_versions({"keras": "3.16.0", "tensorflow": "2.21.0"})
    with pytest.raises(ImportError, match="found tensorflow 2.210"):
        _compat.check_versions({"keras": "3.15.0", "tensorflow": "2.210"})


def test_eager_scope_leaves_and_restores_keras_scopes():
    with keras.StatelessScope():
        assert keras.backend.is_keras_tensor is not None
        from keras.src.backend.common.stateless_scope import in_stateless_scope  # noqa: PLC0415
        assert in_stateless_scope()
        with _compat.eager_scope():
            assert not in_stateless_scope()
            assert tf.executing_eagerly()
        assert in_stateless_scope()


def test_reinitialize_variable_moves_it_and_keeps_its_identity(devices):
    with tf.device(devices[0]):
        variable = keras.Variable(np.arange(3, dtype="float32"), name="v")
    path = variable.path
    with tf.device(devices[1]):
        _compat.reinitialize_variable(variable, tf.constant([5.0, 6, 7]))
    assert variable.value.device.endswith("CPU:1")
    assert variable.path == path
    np.testing.assert_array_equal(variable.numpy(), [5.0, 6, 7])


def test_replaced_losses_swaps_each_loss_and_restores_them():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    y, p = np.ones((4, 1), "float32"), np.zeros((4, 1), "float32")
    compile_loss = model._compile_loss
    compile_loss.build(y, p)
    before = float(compile_loss(y, p))
    with _compat.replaced_losses(
            compile_loss, lambda n, loss: lambda *a, **k: 42.0) as count:
        assert count == 1
        assert float(compile_loss(y, p)) == 42.0
    assert float(compile_loss(y, p)) == before == 1.0


def test_loss_helpers_reduce_like_keras():
    values = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    weights = tf.constant([[1.0], [0.0]])  # row weights
    total = _compat.reduce_weighted_values(values, weights,
                                             reduction="sum")
    assert float(total) == 3.0
    assert float(_compat.scale_loss_for_distribution(total)) == 3.0
    assert _compat.get_keras_mask(values) is None


def test_mask_hooks_are_the_ones_keras_layers_use():
    x = tf.constant([[3, 0], [1, 2]])
    embedded = keras.layers.Embedding(4, 2, mask_zero=True)(x)
    mask = _compat.get_keras_mask(embedded)
    assert mask.numpy().tolist() == [[True, False], [True, True]]
    values = tf.identity(embedded)
    _compat.set_keras_mask(values, mask)
    # A layer that reads masks sees it: the padded step is skipped.
    summed = keras.layers.GlobalAveragePooling1D()(values)
    np.testing.assert_allclose(summed[0], embedded[0, 0], rtol=1e-6)


@pytest.mark.parametrize("loss_scale", [False, True])
def test_colocate_optimizer_patches_the_object_not_the_class(loss_scale):
    optimizer = keras.optimizers.SGD(0.1, clipnorm=1.0)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    devices_seen = []

    def device_of(variable):
        devices_seen.append(variable.name)
        return "/device:CPU:0"

    assert colocation.colocate_optimizer(optimizer, device_of) is optimizer
    hooks = ["add_variable_from_reference", "update_step",
             "_distributed_tf_update_step", "_all_reduce_sum_gradients",
             "_clip_gradients"]
    if loss_scale:
        hooks += ["check_finite", "_stateful_handle_finite_grads"]
    for hook in hooks:
        assert hook in vars(optimizer), hook  # on the object
    assert "update_step" not in vars(keras.optimizers.SGD(0.1))
    # Idempotent: a second call wraps nothing twice.
    update_step = optimizer.update_step
    colocation.colocate_optimizer(optimizer, device_of)
    assert optimizer.update_step is update_step
    # Keras' own math after the patch: one SGD step with clipping.
    variable = keras.Variable([3.0, 4.0], name="w")
    optimizer.build([variable])
    grad = tf.constant([30.0, 40.0])  # norm 50, clipped to 1
    if loss_scale:
        grad = grad * optimizer.dynamic_scale
    optimizer.apply_gradients([(grad, variable)])
    np.testing.assert_allclose(variable.numpy(), [3.0 - 0.06, 4.0 - 0.08],
                               rtol=1e-6)
    assert {name.split(":")[0] for name in devices_seen} == {"w"}


def _two_per_device(values, devices):
    """Keras variables of `values`, two on each of the first devices."""
    variables = []
    for k, value in enumerate(values):
        with tf.device(devices[k // 2]):
            variables.append(keras.Variable(value, name=f"v{k}"))
    return variables


def _step(optimizer, grads, variables):
    return tf.function(lambda: optimizer.apply_gradients(
        zip(grads, variables)))


def _adam_with_schedule():
    return keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5))


@pytest.mark.parametrize("make_optimizer", [
    _adam_with_schedule,
    lambda: keras.optimizers.Adam(0.1, gradient_accumulation_steps=2),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
], ids=["adam_schedule", "adam_accumulation", "sgd_momentum"])
def test_colocated_update_reads_step_scalars_once_per_device(
        devices, make_optimizer):
    """Keras reads the learning rate and `iterations` in every variable's
    update: on workers each read was a transfer. Now one copy per device,
    and the updates are Keras' own, bitwise."""
    from keras_pipe.engine import placement  # noqa: PLC0415

    values = [np.full((3,), k + 1.0, "float32") for k in range(4)]
    grads = [tf.constant(np.full((3,), 0.5 * k - 1.0, "float32"))
             for k in range(4)]
    results = {}
    for name in ("plain", "colocated"):
        variables = _two_per_device(values, devices)
        optimizer = make_optimizer()
        if name == "colocated":
            colocation.colocate_optimizer(optimizer, placement.device_of)
        optimizer.build(variables)
        step = _step(optimizer, grads, variables)
        graph = step.get_concrete_function().graph
        inner = {id(outer): placeholder
                 for outer, placeholder in graph.captures}
        iterations = inner[id(optimizer._iterations.value.handle)]
        reads = [op for op in graph.get_operations()
                 if op.type == "ReadVariableOp" and op.inputs[0] is iterations
                 and "update_on_" in op.name]
        results[name] = (len(reads), step, variables)
    # The plain optimizer reads under no device scope (no "update_on_");
    # with accumulation the reads are inside a cond branch's graph.
    if make_optimizer is _adam_with_schedule:
        assert results["colocated"][0] == 2  # one per device, not 4
    for name in results:  # 4 steps: iterations 0-3 (2 updates when
        for _ in range(4):  # accumulating)
            results[name][1]()
    for plain, colocated in zip(results["plain"][2],
                                results["colocated"][2]):
        np.testing.assert_array_equal(colocated.numpy(), plain.numpy())
    assert not np.array_equal(colocated.numpy(), values[-1])  # updated
    assert colocated.value.device.endswith(devices[1].lstrip("/"))


def _xla_calls(function):
    """Devices of the calls of XLA-compiled functions in a `tf.function`,
    cond branches included."""
    graph_def = function.get_concrete_function().graph.as_graph_def()
    nodes = [*graph_def.node,
             *(n for f in graph_def.library.function for n in f.node_def)]
    return sorted(n.device for n in nodes if n.op.endswith("PartitionedCall")
                  and n.attr["_XlaMustCompile"].b)


@pytest.mark.parametrize("make_optimizer", [
    _adam_with_schedule,
    lambda: keras.optimizers.Adam(0.1, gradient_accumulation_steps=2),
    lambda: keras.optimizers.AdamW(0.1, weight_decay=0.1, clipnorm=1.0),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
], ids=["adam_schedule", "adam_accumulation", "adamw_clipnorm",
        "sgd_momentum"])
def test_xla_updates_compile_one_function_per_device(devices, make_optimizer):
    """With `xla_updates`, each device's updates are one XLA function on that
    device; the result is Keras' own update up to XLA's fused rounding."""
    from keras_pipe.engine import placement  # noqa: PLC0415

    values = [np.linspace(-1.0, 1.0, 6, dtype="float32") * (k + 1)
              for k in range(4)]
    grads = [tf.constant(np.cos(np.arange(6, dtype="float32") + k))
             for k in range(4)]
    results = {}
    for xla in (False, True):
        variables = _two_per_device(values, devices)
        optimizer = make_optimizer()
        colocation.colocate_optimizer(optimizer, placement.device_of,
                                     xla_updates=xla)
        optimizer.build(variables)
        step = _step(optimizer, grads, variables)
        calls = _xla_calls(step)
        for _ in range(4):
            step()
        results[xla] = (calls, [v.numpy() for v in variables])
    assert results[False][0] == []
    assert [c.rsplit(":", 1)[-1] for c in results[True][0]] == ["0", "1"]
    for plain, compiled in zip(results[False][1], results[True][1]):
        np.testing.assert_allclose(compiled, plain, rtol=1e-6, atol=1e-7)
    assert not np.allclose(results[True][1][-1], values[-1])  # updated


def test_xla_updates_fall_back_with_a_warning_for_a_foreign_variable(
        devices):
    """Nadam reads its `u_product` (on the default device) in every update:
    the update of a variable on another device cannot be one XLA function
    there, so it runs un-compiled, said with a warning."""
    from keras_pipe.engine import placement  # noqa: PLC0415

    with tf.device(devices[1]):
        variable = keras.Variable(np.ones(3, "float32"), name="far")
    with tf.device(devices[0]):
        optimizer = keras.optimizers.Nadam(0.1)
    colocation.colocate_optimizer(optimizer, placement.device_of,
                                 xla_updates=True)
    optimizer.build([variable])
    step = _step(optimizer, [tf.constant([1.0, -1.0, 0.5])], [variable])
    with pytest.warns(UserWarning, match=r"XLA cannot compile the optimizer "
                      r"update on .*CPU:1: it reads Nadam variable "
                      r"'variable(_\d+)?' on .*CPU:0; .*jit_compile=False"):
        assert _xla_calls(step) == []
    step()
    reference = keras.Variable(np.ones(3, "float32"))
    plain = keras.optimizers.Nadam(0.1)
    plain.build([reference])
    plain.apply_gradients([(tf.constant([1.0, -1.0, 0.5]), reference)])
    np.testing.assert_allclose(variable.numpy(), reference.numpy(),
                               rtol=1e-6)


def test_set_initial_epoch_is_what_fit_reads():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    class Skip(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.set_initial_epoch(self.model, 2)

    x = np.zeros((4, 2), "float32")
    model.fit(x, x[:, :1], epochs=3, verbose=0, callbacks=[Skip(), Record()])
    assert seen == [2]


def test_compiled_state_is_what_a_step_builds():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    assert _compat.compiled_state(model)[1] is None
    model.compile("sgd", "mse", metrics=["mae"])
    state = _compat.compiled_state(model)
    assert [s.built for s in state] == [False, False]
    model.evaluate(np.zeros((4, 2)), np.zeros((4, 3)), verbose=0)
    assert [s.built for s in state] == [True, True]
    assert [v.name for v in state[1].variables] == ["total", "count"]


def test_save_weights_to_writes_the_file_keras_writes(tmp_path):
    import io

    import h5py
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    buffer = io.BytesIO()
    _compat.save_weights_to(model, buffer)
    model.save_weights(str(tmp_path / "k.weights.h5"))

    def contents(f):
        found = {}
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
        return found

    with h5py.File(buffer, "r") as ours, \
            h5py.File(tmp_path / "k.weights.h5", "r") as theirs:
        a, b = contents(ours), contents(theirs)
    assert sorted(a) == sorted(b) and "layers/dense/vars/0" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    with pytest.raises(ValueError, match="not yet been built"):
        _compat.save_weights_to(keras.Sequential([keras.layers.Dense(1)]),
                                io.BytesIO())


def test_keras_global_state_round_trips():
    state = _compat.keras_global_state()
    assert isinstance(state, dict)
    _compat.set_keras_global_attribute("keras_pipe_probe", 1)
    assert _compat.keras_global_state()["keras_pipe_probe"] == 1
    _compat.set_keras_global_attribute("keras_pipe_probe", None)


def test_graph_hooks_exist_with_the_expected_shapes():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    assert isinstance(model, _compat.Functional)
    assert _compat.unpack_singleton([5]) == 5
    assert _compat.to_snake_case("DenseLayer") == "dense_layer"
    assert callable(_compat.operation_fn(model.layers[-1], training=False))
    with _compat.no_automatic_tracking():
        pass
    assert _compat.cancellation.CancellationManager() is not None


@pytest.mark.parametrize("draw", ["uniform", "normal", "dropout"])
def test_keyed_random_rows_match_the_global_draw(draw):
    # Philox counter offsets give a micro-batch's rows of the global draw
    # without drawing the rest: the rows of 3 micro-batches concatenate to
    # the whole batch's draw, and the same rows come out of any cut.
    generator = keras.random.SeedGenerator(5)
    state = generator.state.numpy().copy()

    def rows_of(offset, size, total=10):
        generator.state.assign(state)
        x = tf.ones((size, 6))
        with keyed_random.keyed_random(tf.constant([offset, total])):
            if draw == "dropout":
                return keras.random.dropout(x, 0.5, seed=generator)
            fn = getattr(keras.random, draw)
            return fn(tf.shape(x), seed=generator)

    whole = rows_of(0, 10)
    parts = tf.concat([rows_of(0, 3), rows_of(3, 3), rows_of(6, 4)], 0)
    np.testing.assert_array_equal(parts.numpy(), whole.numpy())
    np.testing.assert_array_equal(rows_of(5, 2).numpy(), whole[5:7].numpy())
    assert np.std(whole.numpy()) > 0.1  # random, not constant


def test_called_graph_is_the_function_a_call_op_runs():
    inner = tf.function(lambda x: 2 * x, autograph=False,
                        experimental_attributes={"_noinline": True})
    found = {}

    @tf.function(autograph=False)
    def outer(x):
        y = inner(x)
        found["graph"] = _compat.called_graph(y.op)
        found["not a call"] = _compat.called_graph(x.op)
        return y

    outer(tf.ones([2]))
    assert found["not a call"] is None
    graph = found["graph"]
    assert [t.op.type for t in graph.inputs] == ["Placeholder"]
    assert len(graph.outputs) == 1


def test_op_callback_replaces_outputs_for_later_ops_and_the_tape():
    # The hook of keras_pipe.engine.products: an op callback's returned
    # tensors replace the op's outputs for the ops built after it, and the
    # tape records the original op with the replacement as its output (so
    # the gradient is the original op's); ops built under stop_recording
    # are not on the tape.
    seen = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if op_type != "Square":
            return None
        seen.append(op_type)
        with _compat.stop_recording():
            return [3.0 * outputs[0]]  # not the square's value

    @tf.function(autograph=False)
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with _compat.op_callback(callback):
                y = tf.square(x)
            z = y + 0.0
        return z, tape.gradient(z, x)

    z, grad = run(tf.constant(2.0))
    assert seen == ["Square"]
    assert float(z) == 12.0  # 3 * 2^2: later ops read the replacement
    assert float(grad) == 4.0  # d(x^2)/dx: the tape's op is the Square


def test_fit_takes_a_data_adapter_as_it_is():
    """`keras_pipe.placed_data` hands `fit` Keras' own `ArrayDataAdapter`
    wrapped in a `DataAdapter`: Keras must use it as given, with the
    batches the arrays make, and split validation data as Keras does."""
    from keras.src.trainers.data_adapters import get_data_adapter  # noqa: PLC0415
    x = np.arange(20, dtype="float32").reshape(10, 2)
    y = np.arange(10, dtype="float32")
    assert _compat.can_convert_arrays((x, y, None))
    assert not _compat.can_convert_arrays((tf.data.Dataset.range(3), None,
                                           None))
    adapter = _compat.ArrayDataAdapter(x, y, batch_size=4, shuffle=False)
    assert isinstance(adapter, _compat.DataAdapter)
    assert get_data_adapter(adapter, batch_size=2, shuffle=True) is adapter
    batches = [b[0].numpy() for b in adapter.get_tf_dataset()]
    assert [len(b) for b in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(batches), x)
    (train, _, _), (val_x, _, _) = _compat.train_validation_split(
        (x, y, None), validation_split=0.2)
    np.testing.assert_array_equal(train, x[:8])
    np.testing.assert_array_equal(val_x, x[8:])


def test_disable_thread_spinning_sets_the_context_config():
    """What `keras_pipe.connect` sets (the workers' contexts copy it)."""
    from tensorflow.python.eager import context  # noqa: PLC0415
    saved = context.context()._config
    try:
        _compat.disable_thread_spinning()
        assert context.context().config.experimental.disable_thread_spinning
    finally:
        context.context()._config = saved
    _compat.sync_executors()  # no remote executor here: returns at once


def test_release_graphs_capturing_lets_a_trained_models_variables_go():
    """Keras' train function graph keeps the handles of the variables it
    captured after the model is gone (the trap "undying train graph");
    released, they go with the model."""
    import gc
    import weakref

    def trained():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        model.compile("sgd", "mse")
        model.fit(np.zeros((8, 4)), np.zeros((8, 3)), verbose=0)
        return model

    alive = {}
    for release in (False, True):
        model = trained()
        handles = [weakref.ref(v.value.handle) for v in model.variables]
        if release:
            assert _compat.release_graphs_capturing(
                model.variables + model.optimizer.variables) >= 1
        del model
        gc.collect()
        alive[release] = sum(h() is not None for h in handles)
    assert alive == {False: 2, True: 0}
