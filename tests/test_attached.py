"""What Keras attaches to tensors crosses stages: logits and masks.

Keras' crossentropies compute from the logits behind a softmax or sigmoid
output, and masks (`Embedding(mask_zero=True)`) reach later layers and the
loss as tensor attributes (`keras_pipe.engine.attached`). Before they were carried
across stages, one micro-batch with a softmax head gave "No gradients
provided for any variable", 1F1B-like schedules silently dropped the
gradient of the micro-batches run in place (weights off by 0.07 after one
SGD step), and masks were lost at the first cut (an LSTM after it ran over
the padding; the loss counted it). Every model here is checked against its
own layers on one device (tests/test_transparency.py, same tolerances),
with saturated outputs where reading the probabilities instead of the
logits would give another loss.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from tests.support import helpers
from tests.test_transparency import (
    check_one_step,
    check_train_on_batch,
    close,
    compile_both,
)

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

# Logits this large put some true-class probabilities below Keras' epsilon
# (1e-7): computed from the probabilities, those rows' loss would be clipped
# at -log(1e-7) = 16.1 and their gradient would vanish.
LOGIT_SCALE = 40.0


class TfSoftmax(keras.layers.Layer):
    """A softmax as a bare TF op: no `_keras_logits`, Keras finds its input."""

    def call(self, x):
        return tf.nn.softmax(x)


def _stages(num_stages, head):
    """Dense stages whose last one ends in `head` ("softmax", "sigmoid" or
    "tf_softmax")."""
    stages = helpers.dense_stages(num_stages)
    last = stages[-1].layers
    if head == "tf_softmax":
        layers = last + [TfSoftmax()]
    else:
        layers = last[:-1] + [keras.layers.Dense(
            1 if head == "sigmoid" else helpers.NUM_CLASSES, activation=head)]
    stages[-1] = keras.Sequential(layers, name=stages[-1].name)
    return stages


def _pair(devices, num_stages, num_micro_batches, head, remat="except_last",
          schedule="gpipe"):
    pipe, reference = helpers.pair(
        lambda: _stages(num_stages, head), devices, num_micro_batches, remat,
        schedule=schedule)
    _saturate(pipe, reference)
    return pipe, reference


def _saturate(*models):
    """Scales each model's last Dense kernel: saturated logits."""
    for model in models:
        kernel = model.trainable_variables[-2]
        kernel.assign(kernel * LOGIT_SCALE)


def _data(rows, head):
    x, y, _ = helpers.data(rows)
    return (x, (y % 2).astype("float32")[:, None]) if head == "sigmoid" \
        else (x, y)


def _loss(head):
    return (keras.losses.BinaryCrossentropy() if head == "sigmoid" else
            keras.losses.SparseCategoricalCrossentropy())


def _compile(pipe, reference, head):
    metric = ("binary_crossentropy" if head == "sigmoid"
              else "sparse_categorical_crossentropy")
    compile_both(pipe, reference, loss=_loss(head), metrics=(metric,))


def test_the_outputs_are_saturated(devices):
    """Guard: from the probabilities the loss would differ, so the tests
    below tell the logits path from the probabilities path."""
    pipe, reference = _pair(devices, 2, 1, "softmax")
    x, y = _data(10, "softmax")
    probabilities = reference.predict(x, verbose=0)  # numpy: no logits
    assert probabilities[np.arange(10), y].min() < 1e-7
    per_row = keras.losses.SparseCategoricalCrossentropy(reduction=None)
    from_logits = per_row(y, reference(x))  # eager: has `_keras_logits`
    clipped = per_row(y, probabilities)
    assert np.max(from_logits - clipped) > 1.0


@pytest.mark.parametrize("schedule,devices_of,num_micro_batches,remat", [
    ("gpipe", [0, 1], 1, "except_last"),   # raised "No gradients provided"
    ("gpipe", [0, 1], 3, "except_last"),   # merged outputs: probabilities
    ("1f1b", [0, 1], 1, "never"),
    ("1f1b", [0, 1], 3, "except_last"),    # last micro-batch's gradient lost
    ("zb_h2", [0, 1, 2], 3, "always"),
    ("interleaved_1f1b", [0, 1, 0, 1], 2, "never"),
    ("zbv", [0, 1, 1, 0], 2, "except_last")])
def test_softmax_output_steps_like_the_model(devices, schedule, devices_of,
                                            num_micro_batches, remat):
    pipe, reference = _pair([devices[d] for d in devices_of],
                            len(devices_of), num_micro_batches, "softmax",
                            remat, schedule)
    _compile(pipe, reference, "softmax")
    x, y = _data(10, "softmax")  # uneven micro-batches for M = 3
    check_one_step(pipe, reference, x, y)


@pytest.mark.parametrize("schedule,num_micro_batches", [("gpipe", 1),
                                                        ("1f1b", 3)])
def test_sigmoid_output_steps_like_the_model(devices, schedule,
                                             num_micro_batches):
    pipe, reference = _pair(devices[:2], 2, num_micro_batches, "sigmoid",
                            schedule=schedule)
    _compile(pipe, reference, "sigmoid")
    x, y = _data(10, "sigmoid")
    check_one_step(pipe, reference, x, y)


@pytest.mark.parametrize("schedule,num_micro_batches", [("gpipe", 1),
                                                        ("1f1b", 3)])
def test_bare_softmax_op_steps_like_the_model_in_a_graph(
        devices, schedule, num_micro_batches):
    """Keras finds a `Softmax` op's input only in a graph (as in `fit`), so
    the reference runs in a `tf.function` too."""
    pipe, reference = _pair(devices[:2], 2, num_micro_batches, "tf_softmax",
                            schedule=schedule)
    _compile(pipe, reference, "tf_softmax")
    x, y = _data(10, "tf_softmax")
    loss, _, grads = helpers.pipeline_loss_and_gradients(pipe, x, y)
    ref_loss, ref_grads = tf.function(
        lambda: _loss_and_gradients(reference, x, y))()
    close(loss, ref_loss)
    for g, ref_g in zip(grads, ref_grads):
        close(g, ref_g)
    check_train_on_batch(pipe, reference, x, y)


def _loss_and_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x, y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("loss", [keras.losses.MeanSquaredError(),
                                  keras.losses.CategoricalFocalCrossentropy()])
@pytest.mark.parametrize("schedule,num_micro_batches", [("gpipe", 1),
                                                        ("1f1b", 3)])
def test_softmax_output_with_a_loss_of_the_probabilities(
        devices, loss, schedule, num_micro_batches):
    """These losses read the probabilities, not the logits kept beside them:
    the logits' gradient is only the path through the softmax, taken once
    (it was taken twice: weights off by 6e-3 with MSE)."""
    pipe, reference = _pair(devices[:2], 2, num_micro_batches, "softmax",
                            schedule=schedule)
    compile_both(pipe, reference, loss=loss)
    x, y = _data(10, "softmax")
    check_one_step(pipe, reference, x,
                   np.eye(helpers.NUM_CLASSES, dtype="float32")[y])


def test_replicas_keep_the_logits(devices):
    pipe, reference = _pair(devices[:2], 2, 4, "softmax", schedule="1f1b")
    pipe.replicate(devices)  # 2 replicas x 2 stages
    _compile(pipe, reference, "softmax")
    x, y = _data(10, "softmax")
    check_one_step(pipe, reference, x, y)


def test_from_model_with_a_softmax_head_fits_like_the_model(devices):
    """The reported case: a classifier with a softmax head, one micro-batch
    (`fit` raised "No gradients provided for any variable")."""
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((helpers.IN_DIM,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Dense(8, activation="relu")(h)
        outputs = keras.layers.Dense(helpers.NUM_CLASSES,
                                     activation="softmax")(h)
        return keras.Model(inputs, outputs)

    x, y = _data(16, "softmax")
    reference = build()
    pipe = keras_pipe.PipelineModel.from_model(
        build(), num_stages=2, devices=devices[:2], num_micro_batches=1)
    compile_both(pipe, reference, loss=_loss("softmax"))
    history = pipe.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                       verbose=0).history
    ref_history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                                verbose=0).history
    close(history["loss"], ref_history["loss"])
    for w, ref_w in zip(pipe.get_weights(), reference.get_weights()):
        close(w, ref_w)
    close(pipe.predict(x, verbose=0), reference.predict(x, verbose=0))


# ------------------------------------------------------------------ masks

SEQ, VOCAB = 5, 6


def _masked_layers():
    keras.utils.set_random_seed(5)
    return [keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.Dense(helpers.NUM_CLASSES, activation="softmax")]


def _masked_pair(devices, num_micro_batches, schedule="gpipe"):
    """Embedding | LSTM + softmax head: the mask crosses the cut, and the
    LSTM and the loss read it."""
    embedding, lstm, head = _masked_layers()
    stages = [keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                                embedding]),
              keras.Sequential([keras.Input((SEQ, 8)), lstm, head])]
    pipe = keras_pipe.PipelineModel(
        stages, devices=devices[:2], num_micro_batches=num_micro_batches,
        schedule=schedule)
    pipe.build((None, SEQ))
    with tf.device("/device:CPU:0"):
        reference = keras.Sequential([keras.Input((SEQ,), dtype="int32")]
                                     + _masked_layers())
    reference.set_weights(pipe.get_weights())
    _saturate(pipe, reference)
    return pipe, reference


def _masked_data(rows):
    rng = np.random.default_rng(2)
    x = rng.integers(1, VOCAB, (rows, SEQ)).astype("int32")
    x[:, 3:] = 0  # padding, masked
    x[::3, 2:] = 0
    y = rng.integers(0, helpers.NUM_CLASSES, (rows, SEQ)).astype("int32")
    return x, y


@pytest.mark.parametrize("num_micro_batches", [1, 3])
def test_mask_crosses_stages_to_the_layers_and_the_loss(devices,
                                                        num_micro_batches):
    pipe, reference = _masked_pair(devices, num_micro_batches)
    compile_both(pipe, reference, loss=_loss("softmax"),
                 metrics=("sparse_categorical_accuracy",))
    x, y = _masked_data(10)
    # The mask changes what the reference computes (else this proves
    # nothing): the LSTM's outputs at padding and the loss.
    unmasked = keras.losses.SparseCategoricalCrossentropy()(
        y, tf.convert_to_tensor(reference.predict(x, verbose=0)))
    assert abs(float(unmasked) - float(reference.compute_loss(
        x, y, reference(x)))) > 1e-3
    close(pipe.predict(x, verbose=0), reference.predict(x, verbose=0))
    # Not check_one_step: the Embedding's gradient is IndexedSlices.
    check_train_on_batch(pipe, reference, x, y)


def test_masked_outputs_under_a_schedule_seeded_by_parts_are_refused(
        devices):
    pipe, _ = _masked_pair(devices, 2, schedule="1f1b")
    pipe.compile("sgd", _loss("softmax"))
    x, y = _masked_data(4)
    with pytest.raises(ValueError, match=r"outputs carry a Keras mask .* "
                       r"schedule='1f1b' .* Use schedule='gpipe'"):
        pipe.train_on_batch(x, y)


def test_from_model_cuts_between_a_mask_and_its_users(devices):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True,
                               name="embedding")(inputs)
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(h)
    outputs = keras.layers.Dense(helpers.NUM_CLASSES, activation="softmax",
                                 name="dense")(h)
    model = keras.Model(inputs, outputs)
    x, y = _masked_data(10)
    model.compile(keras.optimizers.SGD(0.5), _loss("softmax"))
    expected_pred = model.predict(x, verbose=0)
    start = model.get_weights()
    expected_loss = model.train_on_batch(x, y)
    expected = model.get_weights()
    model.set_weights(start)
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=3, devices=devices[:3], num_micro_batches=2,
        balance=[2, 1, 1])
    # The mask crosses both cuts: computed in stage 0 for the LSTM, and
    # attached by the LSTM to its outputs for the loss.
    assert [[c.name.split("_")[0] for c in stage.calls]
            for stage in pipe.stages] == [["embedding", "not"], ["lstm"],
                                          ["dense"]]
    close(pipe.predict(x, verbose=0), expected_pred)
    pipe.compile(keras.optimizers.SGD(0.5), _loss("softmax"))
    close(pipe.train_on_batch(x, y), expected_loss)
    for w, e in zip(pipe.get_weights(), expected):
        close(w, e)
