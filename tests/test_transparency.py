"""The pipeline computes what the unsplit model computes on one device.

Tolerances: float32, rtol=1e-5 and atol=1e-6 for losses, gradients,
weights and outputs (micro-batching only changes the order of sums).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.engine import colocation
from tests.support import helpers

RTOL, ATOL = 1e-5, 1e-6


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def compile_both(pipe, reference, loss=None, optimizer="sgd", metrics=()):
    for model in (pipe, reference):
        model.compile(
            optimizer=keras.optimizers.get(optimizer).__class__.from_config(
                keras.optimizers.get(optimizer).get_config()),
            loss=loss or keras.losses.SparseCategoricalCrossentropy(
                from_logits=True),
            metrics=[_fresh(m) for m in metrics])
        helpers.build_optimizer(model)


def _fresh(metric):
    """A metric object of its own per model: one shared by two compiled
    models accumulates both models' batches (plain Keras' epoch top-k
    accuracy moved from 0.692 to 0.714 with it)."""
    if isinstance(metric, keras.metrics.Metric):
        return metric.__class__.from_config(metric.get_config())
    return metric


def check_one_step(pipe, reference, x, y, sample_weight=None):
    loss, y_pred, grads = helpers.pipeline_loss_and_gradients(
        pipe, x, y, sample_weight)
    ref_loss, ref_pred, ref_grads = helpers.reference_loss_and_gradients(
        reference, x, y, sample_weight)
    close(loss, ref_loss)
    keras.tree.assert_same_structure(y_pred, ref_pred)
    for out, ref_out in zip(keras.tree.flatten(y_pred),
                            keras.tree.flatten(ref_pred)):
        close(out, ref_out)
    assert len(grads) == len(ref_grads)
    for g, ref_g in zip(grads, ref_grads):
        close(g, ref_g)
    check_train_on_batch(pipe, reference, x, y, sample_weight)


def check_train_on_batch(pipe, reference, x, y, sample_weight=None):
    """One `train_on_batch` each: every log by name, then every weight."""
    logs = pipe.train_on_batch(x, y, sample_weight, return_dict=True)
    ref_logs = reference.train_on_batch(x, y, sample_weight,
                                        return_dict=True)
    for name in ref_logs:
        close(logs[name], ref_logs[name])
    for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
        close(w, ref_w)


# The fast tier takes each M and each K once (M=1: no sums, M=3 and 8:
# uneven micro-batches, K=1: no cut); the full suite takes the 12 pairs.
FAST_PAIRS = {(1, 1), (2, 4), (3, 2), (8, 4)}  # (M, K)


@pytest.mark.parametrize("num_micro_batches,num_stages", [
    pytest.param(m, k, marks=() if (m, k) in FAST_PAIRS else pytest.mark.slow)
    for k in (1, 2, 4) for m in (1, 2, 3, 8)])
def test_stages_and_micro_batches(devices, num_stages, num_micro_batches):
    pipe, reference = helpers.pipeline_and_reference(
        num_stages, num_micro_batches, "except_last", devices)
    compile_both(pipe, reference, optimizer="adam")
    x, y, _ = helpers.data(10)  # 10 rows: uneven for M = 3, 8
    check_one_step(pipe, reference, x, y)


# Each remat mode under each schedule: tests/test_every_schedule.py.


@pytest.mark.slow
@pytest.mark.parametrize(
    "reduction",
    ["sum_over_batch_size", "sum", "mean_with_sample_weight", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_reductions_uneven_micro_batches(devices, reduction, weighted):
    """Each branch of `keras_pipe.engine.losses` (and of Keras'
    `reduce_values`): "mean" takes "sum_over_batch_size"'s, None takes
    "none"'s, in both."""
    pipe, reference = helpers.pipeline_and_reference(2, 4, "always", devices)
    compile_both(pipe, reference, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction))
    x, y, sample_weight = helpers.data(10)  # micro-batches of 3, 3, 2, 2
    check_one_step(pipe, reference, x, y, sample_weight if weighted else None)


@pytest.mark.slow
def test_mean_of_micro_batch_means_would_be_wrong():
    # Guards the premise of the test above: with sizes 3, 3, 2, 2 and
    # weights, the mean of per-micro-batch means differs from the batch mean,
    # so a pipeline that averaged micro-batch losses would fail it.
    _, _, w = helpers.data(10)
    losses = np.arange(10, dtype="float64") * w
    means = [losses[a:b].mean() for a, b in [(0, 3), (3, 6), (6, 8), (8, 10)]]
    assert abs(np.mean(means) - losses.mean()) > 1e-3


@pytest.mark.slow
def test_metrics_equal_plain_keras_on_the_full_batch(devices):
    pipe, reference = helpers.pipeline_and_reference(2, 3, "always", devices)
    compile_both(pipe, reference, metrics=[
        "accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2),
        keras.metrics.SparseCategoricalCrossentropy(from_logits=True)])
    x, y, sample_weight = helpers.data(11)
    check_one_step(pipe, reference, x, y, sample_weight)


@pytest.mark.slow
def test_evaluate_and_predict_equal_the_unpipelined_model(devices):
    pipe, reference = helpers.pipeline_and_reference(
        3, 4, "always", devices, batch_norm=True, dropout=0.3)
    compile_both(pipe, reference, metrics=["accuracy"])
    x, y, _ = helpers.data(23)
    close(pipe.predict(x, batch_size=7, verbose=0),
          reference.predict(x, batch_size=7, verbose=0))
    results = pipe.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    expected = reference.evaluate(x, y, batch_size=7, verbose=0,
                                  return_dict=True)
    for name in expected:
        close(results[name], expected[name])


def count_traces(model, step_name):
    """Replaces `model.<step_name>` by a counting wrapper; returns the list
    it appends to. Keras runs a step method only while tracing it."""
    traces = []
    step = getattr(model, step_name)

    def counted(data):
        traces.append(step_name)
        return step(data)

    setattr(model, step_name, counted)
    return traces


def cycled_batches(x, y, sample_weight, batch_size):
    """A generator of `(x, y, sample_weight)` batches, round and round."""
    while True:
        for i in range(0, len(x), batch_size):
            yield tuple(a[i:i + batch_size] for a in (x, y, sample_weight))


@pytest.mark.parametrize("optimizer,data", [
    ("sgd", "arrays"), pytest.param("adam", "generator",
                                    marks=pytest.mark.slow)])
def test_fit_with_metrics_traces_its_steps_once(devices, optimizer, data):
    # Broke: the compiled metrics were made while the train (and test)
    # function was traced, and variables made in a trace make TF trace the
    # whole pipeline step a second time (seconds to minutes for a large
    # pipeline). They are built from the data's element spec first, which
    # takes no batch from a generator (weights equal to Keras' after it).
    pipe, reference = helpers.pipeline_and_reference(
        2, 3, "except_last", devices)
    for model in (pipe, reference):  # metric objects of its own each
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=[
                "accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
            weighted_metrics=["accuracy"])
        helpers.build_optimizer(model)
    # Validation runs as a stream of batches (`model/inference.py`): its
    # step function traces `_forward_batches` once per trace.
    traces = [count_traces(pipe, "train_step"),
              count_traces(pipe, "_forward_batches")]
    x, y, sample_weight = helpers.data(26)
    val_x, val_y, _ = helpers.data(9, seed=1)
    arguments = dict(epochs=2, validation_data=(val_x, val_y), verbose=0)
    if data == "arrays":
        def fit(model):
            return model.fit(x, y, sample_weight=sample_weight,
                             batch_size=8, **arguments)
    else:
        def fit(model):
            return model.fit(cycled_batches(x, y, sample_weight, 8),
                             steps_per_epoch=4, **arguments)
    history = fit(pipe)
    assert [len(t) for t in traces] == [1, 1]
    ref_history = fit(reference)
    assert set(history.history) == set(ref_history.history)
    for name, values in ref_history.history.items():
        close(history.history[name], values)
    for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
        close(w, ref_w)


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_evaluate_and_predict_of_an_unbuilt_pipeline_trace_once(devices,
                                                                method):
    # Broke as fit did: the stages (and evaluate's metrics) were made in
    # the first trace of the step, so it was traced twice.
    pipe = keras_pipe.PipelineModel(
        helpers.dense_stages(2), devices=devices[:2], num_micro_batches=2)
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    # Both run as streams of batches (`model/inference.py`).
    traces = count_traces(pipe, "_forward_batches")
    x, y, _ = helpers.data(12)  # Whole batches: predict's tf.function
    if method == "evaluate":  # retraces for a partial one (a new shape).
        pipe.evaluate(x, y, batch_size=4, verbose=0)
    else:
        pipe.predict(x, batch_size=4, verbose=0)
    assert len(traces) == 1 and pipe.built


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fit_on_dataset_equals_unpipelined_fit(devices, schedule):
    # A dataset has a dynamic batch size, and its last batch (2 rows) is
    # smaller than num_micro_batches=4: padding slots must not change
    # anything.
    pipe, reference = helpers.pipeline_and_reference(
        3, 4, "except_last", devices, schedule=schedule)
    compile_both(pipe, reference, optimizer="adam")
    x, y, sample_weight = helpers.data(26)
    dataset = tf.data.Dataset.from_tensor_slices(
        (x, y, sample_weight)).batch(8)
    history = pipe.fit(dataset, epochs=2, verbose=0)
    ref_history = reference.fit(dataset, epochs=2, verbose=0)
    close(history.history["loss"], ref_history.history["loss"])
    for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
        close(w, ref_w)


@pytest.mark.slow
def test_regularization_losses_are_exact(devices):
    def stages():
        return [
            keras.Sequential([keras.layers.Dense(
                8, kernel_regularizer="l2", activity_regularizer="l1")]),
            keras.Sequential([keras.layers.Dense(
                3, bias_regularizer=keras.regularizers.L2(0.1))]),
        ]

    pipe, reference = helpers.pair(stages, devices, 3, "always")
    compile_both(pipe, reference)
    x, y, _ = helpers.data(10)
    check_one_step(pipe, reference, x, y)


@pytest.mark.slow
@pytest.mark.parametrize("num_stages,num_micro_batches,remat", [
    (1, 2, "always"), (2, 3, "except_last"), (4, 3, "never"),
    (4, 8, "never")])
def test_one_f_one_b_equals_unpipelined(devices, num_stages,
                                        num_micro_batches, remat):
    """1F1B's shapes: one stage (its first stage holds the loss), fewer
    micro-batches than stages (4, 3: no steady phase), more (4, 8), and
    uneven micro-batches (10 rows). Each remat mode under 1F1B is
    tests/test_every_schedule.py's (3 stages, 5 micro-batches); here one
    mode per shape, "never" twice: without remat the shape decides which
    weight passes run deferred (`Executor._with_deferred_weights`)."""
    pipe, reference = helpers.pipeline_and_reference(
        num_stages, num_micro_batches, remat, devices, schedule="1f1b")
    compile_both(pipe, reference, optimizer="adam")
    x, y, sample_weight = helpers.data(10)
    check_one_step(pipe, reference, x, y, sample_weight)


@pytest.mark.slow
@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight",
                  "none"])
def test_one_f_one_b_loss_reductions(devices, reduction):
    pipe, reference = helpers.pipeline_and_reference(
        2, 4, "always", devices, schedule="1f1b")
    compile_both(pipe, reference, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction), metrics=["accuracy"])
    x, y, sample_weight = helpers.data(10)
    check_one_step(pipe, reference, x, y, sample_weight)


@pytest.mark.slow
@pytest.mark.parametrize("clip", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05},
                                  {"clipvalue": 0.01}])
def test_gradient_clipping_equals_unpipelined(devices, clip):
    # The pipeline clips each gradient on its own device (placement.py);
    # the values must be Keras' own. Small bounds: clipping is active.
    pipe, reference = helpers.pipeline_and_reference(3, 4, "always", devices)
    compile_both(pipe, reference,
                 optimizer=keras.optimizers.SGD(0.5, **clip))
    x, y, sample_weight = helpers.data(10)
    check_one_step(pipe, reference, x, y, sample_weight)


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True])
def test_mixed_precision_equals_unpipelined(devices, jit_compile):
    # float16 compute: Keras wraps the optimizer in a LossScaleOptimizer,
    # whose check and unscaling the pipeline places per gradient; with
    # jit_compile=True its inner optimizer's updates are XLA's. Tolerance
    # atol=1e-4 (float16 rounding differs with the micro-batch split).
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def stages():
            return [keras.Sequential([keras.layers.Dense(8, activation="tanh")]),
                    keras.Sequential([keras.layers.Dense(
                        helpers.NUM_CLASSES, dtype="float32")])]

        pipe, reference = helpers.pair(stages, devices, 2, "always")
        compile_both(pipe, reference, optimizer="sgd")
        if jit_compile:
            pipe.compile(optimizer="sgd", loss=pipe.loss, jit_compile=True)
            assert colocation.xla_updates(pipe.optimizer.inner_optimizer)
        assert type(pipe.optimizer).__name__ == "LossScaleOptimizer"
        x, y, sample_weight = helpers.data(10)
        for _ in range(3):
            logs = pipe.train_on_batch(x, y, sample_weight, return_dict=True)
            ref_logs = reference.train_on_batch(x, y, sample_weight,
                                                return_dict=True)
            np.testing.assert_allclose(logs["loss"], ref_logs["loss"],
                                       atol=1e-4)
        for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(w, ref_w, atol=1e-4)
        np.testing.assert_allclose(
            pipe.optimizer.dynamic_scale.numpy(),
            reference.optimizer.dynamic_scale.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h2"])
def test_xla_updates_equal_unpipelined(devices, schedule):
    # compile(jit_compile=True): each device's Adam update is one XLA
    # function; the reference is plain Keras, un-compiled, on one device.
    # XLA fuses the update's element-wise math, which may round the last
    # bit differently: the tolerances above hold over three steps.
    pipe, reference = helpers.pair(lambda: helpers.dense_stages(3), devices,
                                   4, "never", schedule=schedule)
    compile_both(pipe, reference, optimizer=keras.optimizers.Adam(0.01))
    pipe.compile(optimizer=keras.optimizers.Adam(0.01),
                 loss=pipe.loss, jit_compile=True)
    assert pipe.xla_updates and pipe.jit_compile is False
    x, y, sample_weight = helpers.data(10)
    for _ in range(3):
        logs = pipe.train_on_batch(x, y, sample_weight, return_dict=True)
        ref_logs = reference.train_on_batch(x, y, sample_weight,
                                            return_dict=True)
        close(logs["loss"], ref_logs["loss"])
    for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
        close(w, ref_w)
    assert int(pipe.optimizer.iterations.numpy()) == 3


@pytest.mark.slow
@pytest.mark.parametrize("schedule,num_micro_batches", [("gpipe", 1),
                                                        ("1f1b", 3)])
def test_an_output_computed_from_another_output(devices, schedule,
                                                num_micro_batches):
    """Outputs `a` and `b = Dense(a)`, a loss on each, both in the last
    stage: `a`'s seed is the partial gradient, the path through `b` is the
    stage's (taking it in the seed too counted it twice: weights off by
    0.23 after one SGD step)."""
    def build():
        keras.utils.set_random_seed(4)
        inputs = keras.Input((helpers.IN_DIM,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        a = keras.layers.Dense(4, name="a")(h)
        b = keras.layers.Dense(2, name="b")(a)
        return keras.Model(inputs, [a, b])

    reference = build()
    pipe = keras_pipe.PipelineModel.from_model(
        build(), num_stages=2, devices=devices[:2],
        num_micro_batches=num_micro_batches, schedule=schedule,
        balance=[1, 2])
    compile_both(pipe, reference, loss=["mse", "mse"])
    x, _, _ = helpers.data(10)
    rng = np.random.default_rng(1)
    y = [rng.normal(size=(10, 4)).astype("float32"),
         rng.normal(size=(10, 2)).astype("float32")]
    check_one_step(pipe, reference, x, y)
