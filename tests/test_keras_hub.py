"""KerasHub task models, cut in one line: their backbones are opened.

A KerasHub task calls its backbone as one layer; `from_model` cuts inside
it. Tiny backbones built from config (no download), dropout 0. Tolerances:
predictions rtol = atol = 1e-5; one SGD step: loss rtol 1e-5, every weight
rtol 1e-5 and atol 1e-6 (`tests/test_partition.py`'s `_assert_step_matches`,
whose reference step runs eagerly on the original model).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_pipe
from tests.test_partition import _assert_predictions_match, _assert_step_matches

keras_hub = pytest.importorskip(
    "keras_hub", reason="KerasHub task models need keras_hub")

pytestmark = pytest.mark.slow  # 15-30 s each: a pipeline step per model

SEQ, VOCAB = 12, 50
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _tokens(batch, *names, seed=0):
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(1, VOCAB, (batch, SEQ)).astype("int32"),
         "padding_mask": np.ones((batch, SEQ), "int32")}
    if "segment_ids" in names:
        x["segment_ids"] = np.zeros((batch, SEQ), "int32")
    return x


def _bert_classifier():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)


def _gpt2_lm():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _stage_calls(pipe):
    return [[c.name for c in s.calls] for s in pipe.stages]


def test_bert_text_classifier_one_line(devices):
    model = _bert_classifier()
    x, y = _tokens(8, "segment_ids"), np.arange(8) % 2
    shape = {name: (None, SEQ) for name in x}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no guess, no 0-weight
        pipe = _assert_step_matches(model, x, y, CE, devices, 3, 2,
                                    balance="flops", input_shape=shape)
    # Today's cut is [whole backbone] + [Dropout] + [head]: here the
    # backbone is cut and every stage holds weights.
    calls = _stage_calls(pipe)
    # The backbone's name: another test in this process may have taken
    # "bert_backbone" (Keras numbers repeated names process-wide).
    b = model.backbone.name
    assert calls[0][0] == f"{b}/token_embedding"
    assert any(n.startswith(f"{b}/") for n in calls[2])
    assert all(s.weights for s in pipe.stages)
    _assert_predictions_match(model, pipe, x)
    p = keras_pipe.plan(model, 3, 2, balance="flops", input_shape=shape)
    assert [n for n, _, _ in p.opaque] == [
        f"{b}/transformer_layer_0",
        f"{b}/transformer_layer_1"]


def test_gpt2_causal_lm_trains_saves_and_generates(devices, tmp_path):
    model = _gpt2_lm()
    x = _tokens(8)
    y = np.random.default_rng(1).integers(0, VOCAB, (8, SEQ))
    pipe = _assert_step_matches(model, x, y, CE, devices, 3, 2,
                                balance="params")
    calls = _stage_calls(pipe)
    # The output projection reuses the token embedding (tied weights).
    assert calls[0][0] == f"{model.backbone.name}/token_embedding"
    assert calls[-1][-1] == "token_embedding#2"
    _assert_predictions_match(model, pipe, x)

    prompt = {"token_ids": np.array([[5, 6, 7] + [0] * (SEQ - 3)], "int32"),
              "padding_mask": np.array([[1] * 3 + [0] * (SEQ - 3)], "int32")}
    plain = pipe.to_model()
    assert plain is model  # the GPT2CausalLM itself, with generate()
    plain.compile(sampler="greedy")
    expected = plain.generate(prompt, stop_token_ids=None)["token_ids"]

    path = str(tmp_path / "gpt2.keras")
    pipe.save(path)
    loaded = keras_pipe.load_model(path, devices=devices[1:4])
    assert loaded.devices == devices[1:4]
    assert _stage_calls(loaded) == calls
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  pipe.predict(x, verbose=0))
    served = loaded.to_model()
    assert type(served).__name__ == "GPT2CausalLM"
    served.compile(sampler="greedy")
    np.testing.assert_array_equal(
        served.generate(prompt, stop_token_ids=None)["token_ids"], expected)


def test_resnet_image_classifier_with_batch_norm(devices):
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 8], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3))
    model = keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=None,
        activation=None)
    x = np.random.default_rng(0).random((8, 16, 16, 3)).astype("float32")
    y = np.arange(8) % 3
    # One micro-batch: BatchNormalization then sees the batch's statistics,
    # as in the original (with M > 1 it would see each micro-batch's).
    pipe = _assert_step_matches(model, x, y, CE, devices, 3, 1,
                                balance="flops", atol=1e-5)
    assert [len(c) for c in _stage_calls(pipe)] == [4, 5, 17]
    _assert_predictions_match(model, pipe, x)


@pytest.mark.slow  # trains a pipeline of a clone
def test_the_planners_step_calibration_trains_a_clone_of_a_task_model(
        devices):
    """`calibration.step_seconds` clones a KerasHub task (its clone holds
    one variable more than the model: weights are not copied) and trains
    it with a sparse cross-entropy on token-id inputs."""
    from keras_pipe import calibration
    from keras_pipe.planning import graph as graph_lib
    from keras_pipe.planning.balance import shapes as shapes_lib
    model = _gpt2_lm()
    shape = {"token_ids": (None, 8), "padding_mask": (None, 8)}
    graph = graph_lib.read_graph(model)
    shapes = shapes_lib.infer_shapes(graph, shape)
    before = [w.copy() for w in model.get_weights()]
    seconds = calibration.step_seconds(
        model, devices[:2], [len(graph.calls) // 2,
                             len(graph.calls) - len(graph.calls) // 2],
        2, "never", 4, shapes, input_shape=shape,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps=2, runs=1)
    assert 0 < seconds < 10
    assert all(np.array_equal(a, b)
               for a, b in zip(before, model.get_weights()))
