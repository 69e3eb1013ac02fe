"""The choices a user leaves to the pipeline (keras_pipe.planning.choices).

`from_model(model, devices=...)` alone plans the schedule, stages per device,
`M`, the cut and remat for the batch size `fit` first sees, and chooses as
`keras_pipe.plan` does for the same call; `PipelineModel(stages, devices)`
takes `M` from the first batch and the fastest exact schedule; explicit
arguments win. Training with the chosen configuration equals the unsplit
model (SGD, 1e-5).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe.planning import choices


def _mlp(width=32, depth=4, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h), name="mlp")


def _data(rows=96):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((rows, 16)).astype("float32"),
            rng.standard_normal((rows, 4)).astype("float32"))


def test_from_model_alone_plans_for_the_batch_fit_sees(devices):
    model = _mlp()
    pipe = keras_pipe.PipelineModel.from_model(model, devices=devices[:2])
    assert pipe.__dict__.get("_deferred") is not None  # nothing cut yet
    x, y = _data()
    pipe.compile(keras.optimizers.SGD(0.01), "mse")
    pipe.fit(x, y, batch_size=48, epochs=1, verbose=0)
    chosen = pipe.plan
    assert chosen is not None and chosen.micro_batch_size == -(
        -48 // chosen.num_micro_batches)
    # The same call of `keras_pipe.plan` chooses the same configuration:
    # the batch, and the compiled loss and optimizer (SGD: no slots).
    alone = keras_pipe.plan(model, devices=devices[:2], batch_size=48,
                            loss="mse", optimizer_slots=0)
    assert (alone.schedule, alone.num_stages, alone.num_micro_batches,
            alone.sizes, list(alone.remat)) == (
        chosen.schedule, chosen.num_stages, chosen.num_micro_batches,
        chosen.sizes, list(chosen.remat))
    assert (pipe.schedule, pipe.num_stages, pipe.num_micro_batches) == (
        chosen.schedule, chosen.num_stages, chosen.num_micro_batches)
    # Planned once: a later call with another batch size keeps the plan.
    pipe.fit(x, y, batch_size=96, epochs=1, verbose=0)
    assert pipe.plan is chosen


def test_from_model_with_a_batch_size_plans_at_once(devices):
    model = _mlp()
    pipe = keras_pipe.PipelineModel.from_model(model, devices=devices[:2],
                                               batch_size=64)
    assert pipe.__dict__.get("_deferred") is None
    alone = keras_pipe.plan(model, devices=devices[:2], batch_size=64)
    assert (pipe.plan.schedule, pipe.plan.num_micro_batches,
            pipe.plan.sizes) == (alone.schedule, alone.num_micro_batches,
                                 alone.sizes)


def test_anything_needing_the_stages_first_plans_for_keras_default_batch(
        devices):
    pipe = keras_pipe.PipelineModel.from_model(_mlp(), devices=devices[:2])
    assert pipe.num_stages >= 2  # the stages are needed: planned now
    assert pipe.plan.micro_batch_size == -(
        -choices.DEFAULT_BATCH_SIZE // pipe.plan.num_micro_batches)


def test_explicit_choices_win_and_the_rest_take_fixed_defaults(devices):
    model = _mlp()
    pipe = keras_pipe.PipelineModel.from_model(
        model, devices=devices[:2], num_micro_batches=3)
    assert pipe.plan is None  # nothing planned
    assert (pipe.num_micro_batches, pipe.schedule, pipe.remat) == (
        3, "zb_h2", "except_last")
    pipe = keras_pipe.PipelineModel.from_model(
        model, devices=devices[:2], schedule="gpipe", batch_size=64)
    assert (pipe.num_micro_batches, pipe.schedule) == (4, "gpipe")
    p = keras_pipe.plan(model, devices=devices[:2], remat="never",
                        batch_size=64)
    assert (p.schedule, p.num_micro_batches, p.remat, p.balance) == (
        "zb_h2", 4, "never", "params")


@pytest.mark.parametrize("rows, expected", [(3, 3), (64, 4)])
def test_hand_cut_stages_take_m_from_the_first_batch_and_zero_bubble(
        devices, rows, expected):
    keras.utils.set_random_seed(0)
    pipe = keras_pipe.PipelineModel(
        [keras.Sequential([keras.layers.Dense(8, activation="relu")]),
         keras.Sequential([keras.layers.Dense(4)])], devices=devices[:2])
    assert pipe.schedule == "zb_h2"
    x, y = _data(rows)
    pipe.compile(keras.optimizers.SGD(0.01), "mse")
    pipe.fit(x, y, batch_size=rows, verbose=0)
    assert pipe.num_micro_batches == expected  # min(2K, rows)
    pipe.fit(*_data(2), batch_size=2, verbose=0)
    assert pipe.num_micro_batches == expected  # fixed once chosen


def test_the_default_schedule_follows_the_placement():
    assert choices.default_schedule([0, 1, 2]) == "zb_h2"
    assert choices.default_micro_batches(None, 3) == 6
    assert choices.default_micro_batches(5, 4) == 5
    assert choices.default_micro_batches(1, 4) == 1


def test_training_with_the_chosen_defaults_equals_the_unsplit_model(devices):
    """One SGD epoch on the pipeline from `from_model(model, devices=...)`
    alone and on the same layers unsplit: weights equal within 1e-5."""
    x, y = _data()
    reference = _mlp(seed=1)
    reference.compile(keras.optimizers.SGD(0.05), "mse")
    pipe = keras_pipe.PipelineModel.from_model(_mlp(seed=1),
                                               devices=devices[:2])
    pipe.compile(keras.optimizers.SGD(0.05), "mse")
    history = pipe.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                       verbose=0).history["loss"]
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                             verbose=0).history["loss"]
    np.testing.assert_allclose(history, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(pipe.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pipe.predict(x, verbose=0),
                               reference.predict(x, verbose=0), atol=1e-5)


def test_batch_size_of_each_kind_of_data():
    x, y = _data(40)
    assert choices.batch_size_of("fit", (x, y), {"batch_size": 8}) == 8
    assert choices.batch_size_of("fit", (x, y, 16), {}) == 16
    assert choices.batch_size_of("predict", (x, 5), {}) == 5
    assert choices.batch_size_of("fit", (x, y), {}) == 32  # Keras' default
    assert choices.batch_size_of("evaluate", (x[:10], y[:10]), {}) == 10
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        12, drop_remainder=True)
    assert choices.batch_size_of("fit", (batched,), {}) == 12
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).batch(7)
    assert choices.batch_size_of("fit", (), {"x": unknown}) == 7

    def generator():
        while True:
            yield x[:4], y[:4]

    with pytest.warns(UserWarning, match=r"cannot see the batch size of "
                      r"fit's data \(generator\).*batch_size=32"):
        assert choices.batch_size_of("fit", (generator(),), {}) == 32


def test_only_separate_processes_and_gpus_are_measured():
    assert not choices.measured(["/device:CPU:0", "/device:CPU:1"])
    assert not choices.measured(["/job:localhost/replica:0/task:0/"
                                 "device:CPU:0"])
    assert choices.measured(["/device:CPU:0", "/device:GPU:0"])
    assert choices.measured(["/job:worker/replica:0/task:1/device:CPU:0"])


def test_a_deferred_plan_checks_its_arguments_before_anything(devices):
    with pytest.raises(ValueError, match="num_stages, or devices"):
        keras_pipe.PipelineModel.from_model(_mlp())
    with pytest.raises(TypeError, match="devices must be a list"):
        keras_pipe.PipelineModel.from_model(_mlp(), devices="/CPU:0")
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        keras_pipe.PipelineModel.from_model(_mlp(), num_stages=0,
                                            devices=devices[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on logical devices
        keras_pipe.plan(_mlp(), devices=devices[:2], batch_size=32)


def test_train_on_batch_plans_for_its_rows(devices):
    pipe = keras_pipe.PipelineModel.from_model(_mlp(), devices=devices[:2])
    pipe.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(40)
    pipe.train_on_batch(x, y)
    assert pipe.plan.micro_batch_size == -(-40 // pipe.plan.num_micro_batches)


@pytest.mark.parametrize("optimizer, slots", [
    (keras.optimizers.SGD(0.1), 0),
    (keras.optimizers.SGD(0.1, momentum=0.9), 1),
    (keras.optimizers.Adam(), 2),
    (keras.optimizers.RMSprop(), 1),
])
def test_the_plan_costs_the_compiled_optimizers_slots(optimizer, slots):
    assert choices.optimizer_slots(optimizer) == slots


def test_a_model_with_masked_outputs_gets_gpipe(devices):
    """Its loss is divided by the whole batch's unmasked positions: only
    GPipe runs it; the choices left to keras_pipe must not pick another."""
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    assert choices.outputs_masked(model) and not choices.outputs_masked(
        _mlp())
    planned = keras_pipe.PipelineModel.from_model(model, devices=devices[:2],
                                                  batch_size=8)
    assert planned.schedule == "gpipe"
    given_m = keras_pipe.PipelineModel.from_model(
        model, devices=devices[:2], num_micro_batches=2)
    assert given_m.schedule == "gpipe"
    x = np.random.default_rng(0).integers(1, 10, size=(8, 6))
    y = np.random.default_rng(1).standard_normal((8, 6, 3)).astype("float32")
    given_m.compile(keras.optimizers.SGD(0.01), "mse")
    given_m.fit(x, y, batch_size=8, verbose=0)  # trains, no schedule error


def test_a_plan_on_stages_that_share_devices_costs_their_memory(devices):
    # Broke: the plan's stage peaks ran the schedule with one device per
    # stage, and zbv (two stages per device) refused that, so a default
    # plan that picked zbv on two workers failed.
    p = keras_pipe.plan(_mlp(depth=6), 4, devices=[devices[0], devices[1],
                                                   devices[1], devices[0]],
                        schedule="zbv", num_micro_batches=2, batch_size=16)
    assert p.schedule == "zbv" and all(
        s.peak_memory_bytes > 0 for s in p.stages)
