"""Model-zoo equivalence sweep: keras_pipe.verify on KerasHub tiny configs
and the keras.applications families, cut into 2-3 stages.

Each case is one `keras_pipe.verify` call: predictions at the start and 3
Adam steps (lr 1e-2) against plain Keras on one device, within verify's
tolerance (1e-3 of each variable's update; measured values are ~1e-5, see
docs/zoo.md). M=1 and M>1 are separate cases on different models and the
schedules rotate over the cases (gpipe, 1f1b, zb_h1, zb_h2,
interleaved_1f1b, zbv), not every model x every schedule. Every model is
built from its constructor at a tiny size (no download); the
keras.applications families use their generic builders
(`keras.src.applications.<family>.<Family>(blocks...)`) at one block per
stack where the named models (ResNet50, DenseNet121, ...) would cost a
minute of tracing each (MobileNet itself at alpha 0.25; Xception,
InceptionV3 and NASNet, 48-72 s of CPU each, run by name only). Stages are
on different devices: verify's plain Keras run is on a copy of the model
on the first one. BatchNormalization at M > 1 is the one stated
exception: verify must name it (plain BatchNormalization, and
`keras_pipe.layers.defer_batch_norm`'s DeferredBatchNormalization, which
defers only the moving statistics) and flag nothing else.

The README's test command runs 18 of the 34 cases; the other 16 carry the
`zoo` marker (`python -m pytest -q -m zoo tests/test_zoo.py` runs them,
`python -m tests.test_zoo` runs all 34). What a case proves about
keras_pipe is the path it takes through it: the schedule, the number of
stages K and micro-batches M (M=1: no sums), the placement (two stages per
device for interleaved_1f1b and zbv), the inputs (a dict of token ids and
masks, four seq2seq inputs, images), how each weight's gradient is summed
(dense; a batch-independent gather: a position table, repeated relative
buckets; a data-dependent one: an Embedding, MoE routing; a weight read
twice: tied embeddings), random layers (Dropout, DropPath) and the
verdicts verify names (BatchNormalization at M>1, plain and deferred;
add_loss at M>1). The 18 take every one of those; each `zoo` case names
in `covered_by` the suite's cases that take its paths (its own layers run
inside a stage, where keras_pipe calls them as Keras does). Every
schedule runs at M=1 and M>1 but interleaved_1f1b and zbv (M=2 only, as
in the 34).

    python -m tests.test_zoo [MODEL ...]   prints the table of docs/zoo.md
                                           with each case's CPU seconds
"""

import dataclasses
import os
import sys
import time

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.slow

keras_hub = pytest.importorskip("keras_hub")

CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SEQ, VOCAB, BATCH, CLASSES = 8, 32, 8, 3

EQUAL, BATCH_NORM_NAMED = "equal", "BatchNormalization at M>1 (named)"
ADDED_LOSS_NAMED = "add_loss at M>1 (named)"


@dataclasses.dataclass(frozen=True)
class Case:
    """One verify call: `build() -> (model, x, y, from_model kwargs)`."""

    name: str
    build: object
    num_stages: int
    num_micro_batches: int
    schedule: str
    expect: str = EQUAL        # EQUAL, BATCH_NORM_NAMED, ADDED_LOSS_NAMED
    xfail: str = None          # reason, for a known difference
    learning_rate: float = 1e-2
    # The suite's cases whose paths this one's are (see the module
    # docstring): set, the case runs with `-m zoo` and in `main`, not by
    # the README's test command.
    covered_by: str = None

    @property
    def id(self):
        return (f"{self.name}-K{self.num_stages}-M{self.num_micro_batches}"
                f"-{self.schedule}")


# ------------------------------------------------------------------ inputs

def _labels():
    return (np.arange(BATCH) % CLASSES).astype("int32")


def _tokens(*names, seed=0, padding_mask=True):
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32")}
    if padding_mask:
        x["padding_mask"] = np.ones((BATCH, SEQ), "int32")
    if "segment_ids" in names:
        x["segment_ids"] = np.zeros((BATCH, SEQ), "int32")
    return x


def _next_tokens():
    return np.random.default_rng(1).integers(
        0, VOCAB, (BATCH, SEQ)).astype("int32")


def _images(size, channels=3):
    return np.random.default_rng(0).normal(
        size=(BATCH, size, size, channels)).astype("float32")


def _shapes(x):
    return {"input_shape": {k: (None,) + v.shape[1:] for k, v in x.items()}}


# ------------------------------------------------- KerasHub text and LMs

def _classifier(task, backbone, *names, padding_mask=True):
    model = task(backbone=backbone, num_classes=CLASSES, preprocessor=None)
    x = _tokens(*names, padding_mask=padding_mask)
    return model, x, _labels(), _shapes(x)


def _bert():
    return _classifier(keras_hub.models.BertTextClassifier,
                       keras_hub.models.BertBackbone(
                           vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                           hidden_dim=8, intermediate_dim=16,
                           max_sequence_length=SEQ), "segment_ids")


def _distilbert():
    return _classifier(keras_hub.models.DistilBertTextClassifier,
                       keras_hub.models.DistilBertBackbone(
                           vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                           hidden_dim=8, intermediate_dim=16,
                           max_sequence_length=SEQ))


def _roberta():
    return _classifier(keras_hub.models.RobertaTextClassifier,
                       keras_hub.models.RobertaBackbone(
                           vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                           hidden_dim=8, intermediate_dim=16,
                           max_sequence_length=SEQ))


def _albert():
    return _classifier(keras_hub.models.AlbertTextClassifier,
                       keras_hub.models.AlbertBackbone(
                           vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                           embedding_dim=8, hidden_dim=8, intermediate_dim=16,
                           num_groups=1, max_sequence_length=SEQ),
                       "segment_ids")


def _deberta():
    return _classifier(keras_hub.models.DebertaV3TextClassifier,
                       keras_hub.models.DebertaV3Backbone(
                           vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                           hidden_dim=8, intermediate_dim=16,
                           max_sequence_length=SEQ, bucket_size=4))


def _fnet():
    # Fourier token mixing, no attention and no padding mask.
    return _classifier(keras_hub.models.FNetTextClassifier,
                       keras_hub.models.FNetBackbone(
                           vocabulary_size=VOCAB, num_layers=1, hidden_dim=8,
                           intermediate_dim=16, max_sequence_length=SEQ),
                       "segment_ids", padding_mask=False)


def _roformer_v2():
    # Rotary positions in a BERT-like encoder, no padding mask.
    return _classifier(keras_hub.models.RoformerV2TextClassifier,
                       keras_hub.models.RoformerV2Backbone(
                           vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                           hidden_dim=8, intermediate_dim=16, head_size=4,
                           max_wavelength=100),
                       "segment_ids", padding_mask=False)


def _causal_lm(task, backbone):
    model = task(backbone=backbone, preprocessor=None)
    x = _tokens()
    return model, x, _next_tokens(), _shapes(x)


def _gpt2():
    return _causal_lm(keras_hub.models.GPT2CausalLM,
                      keras_hub.models.GPT2Backbone(
                          vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                          hidden_dim=8, intermediate_dim=16,
                          max_sequence_length=SEQ))


def _gemma():
    return _causal_lm(keras_hub.models.GemmaCausalLM,
                      keras_hub.models.GemmaBackbone(
                          vocabulary_size=VOCAB, num_layers=2,
                          num_query_heads=2, num_key_value_heads=1,
                          hidden_dim=8, intermediate_dim=16, head_dim=4))


def _llama():
    return _causal_lm(keras_hub.models.LlamaCausalLM,
                      keras_hub.models.LlamaBackbone(
                          vocabulary_size=VOCAB, num_layers=2,
                          num_query_heads=2, num_key_value_heads=1,
                          hidden_dim=8, intermediate_dim=16))


def _mistral():
    return _causal_lm(keras_hub.models.MistralCausalLM,
                      keras_hub.models.MistralBackbone(
                          vocabulary_size=VOCAB, num_layers=1,
                          num_query_heads=2, num_key_value_heads=1,
                          hidden_dim=8, intermediate_dim=16,
                          sliding_window=SEQ))


def _qwen():
    return _causal_lm(keras_hub.models.QwenCausalLM,
                      keras_hub.models.QwenBackbone(
                          vocabulary_size=VOCAB, num_layers=2,
                          num_query_heads=2, num_key_value_heads=1,
                          hidden_dim=8, intermediate_dim=16))


def _bloom():
    # ALiBi attention biases instead of position embeddings.
    return _causal_lm(keras_hub.models.BloomCausalLM,
                      keras_hub.models.BloomBackbone(
                          vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                          hidden_dim=8, intermediate_dim=16))


def _opt():
    # A learned position table (a batch-independent gather).
    return _causal_lm(keras_hub.models.OPTCausalLM,
                      keras_hub.models.OPTBackbone(
                          vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                          hidden_dim=8, intermediate_dim=16,
                          max_sequence_length=SEQ))


def _gpt_neox():
    # Partial rotary embeddings, parallel attention and MLP residual.
    return _causal_lm(keras_hub.models.GPTNeoXCausalLM,
                      keras_hub.models.GPTNeoXBackbone(
                          vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                          hidden_dim=16, intermediate_dim=16,
                          max_sequence_length=SEQ))  # rotary dim 0.25 * 8


def _mixtral(router_aux_loss_coef=0.0):
    # Mixture of experts: top-2 routing of 4 experts per token. The
    # router's load-balancing loss (KerasHub's default coefficient 0.02,
    # an `add_loss`) is a product of batch means, not a sum over rows, so
    # micro-batches change it: verify names it at M>1 (its own case).
    return _causal_lm(keras_hub.models.MixtralCausalLM,
                      keras_hub.models.MixtralBackbone(
                          vocabulary_size=VOCAB, num_layers=1,
                          num_query_heads=2, num_key_value_heads=1,
                          hidden_dim=8, intermediate_dim=16, num_experts=4,
                          top_k=2,
                          router_aux_loss_coef=router_aux_loss_coef))


def _seq2seq(task, backbone):
    model = task(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {"encoder_token_ids": rng.integers(1, VOCAB, (BATCH, SEQ)),
         "encoder_padding_mask": np.ones((BATCH, SEQ)),
         "decoder_token_ids": rng.integers(1, VOCAB, (BATCH, SEQ)),
         "decoder_padding_mask": np.ones((BATCH, SEQ))}
    x = {k: v.astype("int32") for k, v in x.items()}
    return model, x, _next_tokens(), _shapes(x)


def _bart():
    return _seq2seq(keras_hub.models.BartSeq2SeqLM,
                    keras_hub.models.BartBackbone(
                        vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                        hidden_dim=8, intermediate_dim=16,
                        max_sequence_length=SEQ))


def _t5():
    return _seq2seq(keras_hub.models.T5Seq2SeqLM,
                    keras_hub.models.T5Backbone(
                        vocabulary_size=VOCAB, num_layers=1, num_heads=2,
                        hidden_dim=8, intermediate_dim=16))


# --------------------------------------------------- KerasHub image models

def _image_classifier(task, backbone, size):
    model = task(backbone=backbone, num_classes=CLASSES, preprocessor=None)
    return model, _images(size), _labels(), {}


def _vit():
    return _image_classifier(
        keras_hub.models.ViTImageClassifier,
        keras_hub.models.ViTBackbone(
            image_shape=(16, 16, 3), patch_size=8, num_layers=2,
            num_heads=2, hidden_dim=8, mlp_dim=16), 16)


def _deit():
    # Class and distillation tokens, a learned position table.
    return _image_classifier(
        keras_hub.models.DeiTImageClassifier,
        keras_hub.models.DeiTBackbone(
            image_shape=(16, 16, 3), patch_size=8, num_layers=1,
            num_heads=2, hidden_dim=8, intermediate_dim=16), 16)


def _swin():
    # Shifted-window attention with a relative position bias table;
    # KerasHub's default stochastic depth (drop_path=0.1: DropPath layers,
    # which verify sets aside as it sets Dropout aside).
    return _image_classifier(
        keras_hub.models.SwinTransformerImageClassifier,
        keras_hub.models.SwinTransformerBackbone(
            image_shape=(16, 16, 3), patch_size=2, embed_dim=8,
            depths=[1, 1], num_heads=[2, 2], window_size=4), 16)


def _hub_resnet():
    return _image_classifier(
        keras_hub.models.ResNetImageClassifier,
        keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3],
            stackwise_num_filters=[64, 8], stackwise_num_blocks=[1, 1],
            stackwise_num_strides=[1, 2], block_type="basic_block",
            image_shape=(16, 16, 3)), 16)


# ------------------------------------------- keras.applications families

def _application(model, size, defer=False):
    if defer:
        import keras_pipe  # noqa: PLC0415 (after the devices are made)
        model = keras_pipe.layers.defer_batch_norm(model)
    return model, _images(size), _labels(), {}


_TOP = dict(weights=None, classes=CLASSES, classifier_activation=None)


def _mobilenet_v3():
    from keras.src.applications import mobilenet_v3  # noqa: PLC0415

    def stack_fn(x, kernel, activation, se_ratio):
        x = mobilenet_v3._inverted_res_block(
            x, 1, 16, 3, 2, se_ratio, mobilenet_v3.relu, 0)
        return mobilenet_v3._inverted_res_block(
            x, 4, 16, kernel, 1, se_ratio, activation, 1)

    return _application(mobilenet_v3.MobileNetV3(
        stack_fn, 64, input_shape=(32, 32, 3), model_type="small",
        include_top=True, weights=None, classes=CLASSES,
        classifier_activation=None, include_preprocessing=False,
        name="mobilenet_v3"), 32)


def _resnet(preact, defer=False):
    from keras.src.applications import resnet  # noqa: PLC0415

    def stack_fn(x):
        if preact:  # (a v2 stack of 1 block names two layers alike)
            return resnet.stack_residual_blocks_v2(x, 4, 2, name="conv2")
        x = resnet.stack_residual_blocks_v1(x, 4, 1, name="conv2")
        return resnet.stack_residual_blocks_v1(x, 8, 1, name="conv3")

    return _application(resnet.ResNet(
        stack_fn, preact, use_bias=True, input_shape=(32, 32, 3),
        name="resnet_v2" if preact else "resnet", **_TOP), 32, defer)


def _densenet():
    from keras.src.applications import densenet  # noqa: PLC0415
    return _application(densenet.DenseNet(
        [1, 1, 1, 1], input_shape=(32, 32, 3), **_TOP), 32)


def _efficientnet():
    from keras.src.applications import efficientnet  # noqa: PLC0415
    blocks = [dict(kernel_size=3, repeats=1, filters_in=32, filters_out=16,
                   expand_ratio=1, id_skip=True, strides=1, se_ratio=0.25),
              dict(kernel_size=3, repeats=1, filters_in=16, filters_out=24,
                   expand_ratio=6, id_skip=True, strides=2, se_ratio=0.25)]
    return _application(efficientnet.EfficientNet(
        0.25, 1.0, 32, blocks_args=blocks, input_shape=(32, 32, 3),
        **_TOP), 32)


def _efficientnet_v2():
    from keras.src.applications import efficientnet_v2  # noqa: PLC0415
    blocks = [dict(kernel_size=3, num_repeat=1, input_filters=24,
                   output_filters=24, expand_ratio=1, se_ratio=0.0,
                   strides=1, conv_type=1),
              dict(kernel_size=3, num_repeat=1, input_filters=24,
                   output_filters=32, expand_ratio=4, se_ratio=0.25,
                   strides=2, conv_type=0)]
    return _application(efficientnet_v2.EfficientNetV2(
        0.25, 1.0, 32, blocks_args=blocks, input_shape=(32, 32, 3),
        include_preprocessing=False, **_TOP), 32)


def _convnext():
    from keras.src.applications import convnext  # noqa: PLC0415
    return _application(convnext.ConvNeXt(
        [1, 1, 1, 1], [8, 16, 16, 16], input_shape=(32, 32, 3),
        include_preprocessing=False, **_TOP), 32)


def _vgg16():
    return _application(keras.applications.VGG16(
        input_shape=(32, 32, 3), **_TOP), 32)


def _mobilenet():
    return _application(keras.applications.MobileNet(
        input_shape=(32, 32, 3), alpha=0.25, **_TOP), 32)


def _mobilenet_v2():
    # MobileNetV2 has no builder with a depth: its stem, its first three
    # inverted residual blocks (expansion 1 and 6, stride 1 and 2, one
    # with the residual add) and its head, from the family's own block
    # (the 17 blocks of keras.applications.MobileNetV2 at alpha 0.35:
    # 40 s of CPU at K=3, 54 s at M=2).
    from keras.src.applications import mobilenet_v2 as v2  # noqa: PLC0415
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False,
                      name="Conv1")(inputs)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999,
                                  name="bn_Conv1")(x)
    x = layers.ReLU(6.0, name="Conv1_relu")(x)
    x = v2._inverted_res_block(x, filters=16, alpha=0.5, stride=1,
                               expansion=1, block_id=0)
    x = v2._inverted_res_block(x, filters=24, alpha=0.5, stride=2,
                               expansion=6, block_id=1)
    x = v2._inverted_res_block(x, filters=24, alpha=0.5, stride=1,
                               expansion=6, block_id=2)
    x = layers.Conv2D(32, 1, use_bias=False, name="Conv_1")(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999,
                                  name="Conv_1_bn")(x)
    x = layers.ReLU(6.0, name="out_relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(CLASSES, name="predictions")(x)
    return _application(keras.Model(inputs, outputs, name="mobilenet_v2"),
                        32)


# Out of the suite (each costs 48-72 s of CPU, see docs/zoo.md), run by
# name: `python -m tests.test_zoo Xception InceptionV3 NASNetMobile`.

def _xception():
    return _application(keras.applications.Xception(
        input_shape=(71, 71, 3), **_TOP), 71)


def _inception_v3():
    return _application(keras.applications.InceptionV3(
        input_shape=(75, 75, 3), **_TOP), 75)


def _nasnet():
    from keras.src.applications import nasnet  # noqa: PLC0415
    # NASNetMobile's cells (num_blocks=4, penultimate_filters=1056) at one
    # cell per stack and the least filters the builder accepts.
    return _application(nasnet.NASNet(
        input_shape=(32, 32, 3), penultimate_filters=96, num_blocks=1,
        stem_block_filters=8, skip_reduction=False, filter_multiplier=2,
        default_size=224, name="nasnet_mobile", **_TOP), 32)


CASES = [
    # KerasHub text classifiers
    Case("BertTextClassifier", _bert, 2, 2, "zb_h2"),
    Case("DistilBertTextClassifier", _distilbert, 2, 1, "gpipe"),
    Case("RobertaTextClassifier", _roberta, 3, 4, "1f1b",
         covered_by="ViT (K=3, M=4, 1f1b, a position table), BERT"),
    Case("AlbertTextClassifier", _albert, 2, 2, "zb_h1",
         covered_by="BERT (its inputs), Bloom (zb_h1 at M=2)"),
    Case("DebertaV3TextClassifier", _deberta, 2, 2, "gpipe",
         covered_by="T5 (repeated relative buckets, gpipe at M=2)"),
    Case("FNetTextClassifier", _fnet, 2, 2, "1f1b",
         covered_by="GPT2 (1f1b at M=2), BERT (token inputs)"),
    Case("RoformerV2TextClassifier", _roformer_v2, 2, 1, "zb_h2",
         covered_by="Gemma, Mistral, Qwen (rotary positions), "
         "ResNetV2 (zb_h2 at M=1)"),
    # KerasHub causal LMs
    Case("GPT2CausalLM", _gpt2, 2, 2, "1f1b"),
    Case("GemmaCausalLM", _gemma, 4, 2, "zbv"),
    Case("LlamaCausalLM", _llama, 3, 1, "gpipe",
         covered_by="Qwen, Mistral (the same decoder), DistilBERT "
         "(gpipe at M=1), MobileNetV2 (K=3 at M=1)"),
    Case("MistralCausalLM", _mistral, 2, 4, "zb_h2"),
    Case("QwenCausalLM", _qwen, 4, 2, "interleaved_1f1b"),
    Case("BloomCausalLM", _bloom, 2, 2, "zb_h1"),
    Case("OPTCausalLM", _opt, 2, 4, "gpipe",
         covered_by="ViT (a position table at M=4), GPT2"),
    Case("GPTNeoXCausalLM", _gpt_neox, 2, 1, "1f1b",
         covered_by="Gemma/Qwen (rotary), MobileNetV2 (1f1b at M=1)"),
    Case("MixtralCausalLM", _mixtral, 2, 2, "zb_h2"),
    Case("MixtralCausalLM+router_aux_loss", lambda: _mixtral(0.02), 2, 2,
         "zb_h2", ADDED_LOSS_NAMED),
    # KerasHub seq2seq
    Case("BartSeq2SeqLM", _bart, 2, 2, "1f1b",
         covered_by="T5 (the four seq2seq inputs), GPT2 (1f1b at M=2)"),
    Case("T5Seq2SeqLM", _t5, 2, 2, "gpipe"),
    # KerasHub image classifiers
    Case("ViTImageClassifier", _vit, 3, 4, "1f1b"),
    Case("ResNetImageClassifier", _hub_resnet, 2, 1, "zb_h1"),
    Case("DeiTImageClassifier", _deit, 2, 2, "zb_h2",
         covered_by="ViT (its position table), BERT (zb_h2 at M=2)"),
    Case("SwinTransformerImageClassifier", _swin, 2, 2, "1f1b"),
    # keras.applications
    Case("MobileNetV3", _mobilenet_v3, 2, 1, "1f1b",
         covered_by="EfficientNetV2 (squeeze-and-excite), MobileNetV2"),
    Case("ResNet", lambda: _resnet(False), 2, 1, "gpipe",
         covered_by="ResNet+defer_batch_norm, ResNetV2, DistilBERT"),
    Case("ResNet+defer_batch_norm", lambda: _resnet(False, True), 2, 2,
         "interleaved_1f1b", BATCH_NORM_NAMED),
    Case("ResNetV2", lambda: _resnet(True), 3, 1, "zb_h2"),
    Case("DenseNet", _densenet, 2, 1, "zb_h2",
         covered_by="ResNetV2 (zb_h2, BatchNormalization at M=1)"),
    Case("EfficientNet", _efficientnet, 2, 1, "gpipe",
         covered_by="EfficientNetV2, MobileNetV2, DistilBERT"),
    Case("EfficientNetV2", _efficientnet_v2, 2, 2, "zb_h1",
         BATCH_NORM_NAMED),
    # Cut over two devices: verify's plain Keras run is on a copy of the
    # weights on the first device (a grouped Conv2D runs as XLA there).
    Case("ConvNeXt", _convnext, 2, 2, "zb_h2"),
    # At 1e-2 the first step sends VGG16's loss to 9.3e5 and the rounding
    # of the micro-batch sums grows to 6.7e-2 of the update by step 3
    # (losses equal to 6 digits): a trajectory too unstable to compare.
    Case("VGG16", _vgg16, 2, 4, "1f1b", learning_rate=1e-4,
         covered_by="ViT (1f1b at M=4), ConvNeXt"),
    Case("MobileNet", _mobilenet, 2, 1, "zb_h1",
         covered_by="MobileNetV2 (depthwise), ResNetImageClassifier "
         "(zb_h1, BatchNormalization at M=1)"),
    Case("MobileNetV2", _mobilenet_v2, 3, 1, "1f1b"),
]

# Run by `main` when named, not by the suite: 48-72 s of CPU each.
OUT_OF_SUITE = [
    Case("Xception", _xception, 2, 1, "zb_h2", learning_rate=1e-4),
    Case("InceptionV3", _inception_v3, 3, 1, "gpipe", learning_rate=1e-4),
    Case("NASNetMobile", _nasnet, 2, 1, "1f1b"),
]

BATCH_NORM = ("BatchNormalization at M > 1: training normalizes each "
              "micro-batch")


def _devices_for(case, devices):
    """One device per stage; two stages per device for the V and loop
    schedules that need it (`keras_pipe.schedule.stage_placement`)."""
    from keras_pipe import schedule  # noqa: PLC0415
    placement = {"zbv": "v", "interleaved_1f1b": "loop"}.get(case.schedule)
    if placement is None:
        return devices[:case.num_stages]
    return [devices[d] for d in schedule.stage_placement(
        case.num_stages, case.num_stages // 2, placement)]


def run_case(case, devices):
    """`keras_pipe.verify` on one case; returns its report."""
    import keras_pipe  # noqa: PLC0415 (after the devices are made)
    keras.utils.set_random_seed(0)
    model, x, y, kwargs = case.build()
    return keras_pipe.verify(
        model, x, y, loss=CE,
        optimizer=keras.optimizers.Adam(case.learning_rate),
        num_stages=case.num_stages, num_micro_batches=case.num_micro_batches,
        schedule=case.schedule, devices=_devices_for(case, devices), steps=3,
        **kwargs)


def verdict(report):
    if report.ok:
        return EQUAL
    if report.flagged:
        return "FLAGGED"
    if any(c.startswith(BATCH_NORM) for c in report.causes):
        return BATCH_NORM_NAMED
    from keras_pipe.verification import ADDED_LOSSES  # noqa: PLC0415
    return ADDED_LOSS_NAMED if ADDED_LOSSES in report.causes else "explained"


def _marks(case):
    marks = [pytest.mark.zoo] if case.covered_by else []
    if case.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=case.xfail))
    return marks


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=_marks(c)) for c in CASES],
    ids=[c.id for c in CASES])
def test_zoo_model_trains_as_keras(devices, case):
    report = run_case(case, devices)
    assert report.prediction_difference < 1e-4, report
    assert verdict(report) == case.expect, report
    if case.expect == BATCH_NORM_NAMED:
        assert report.causes[0].startswith(BATCH_NORM), report
    else:
        assert not any(c.startswith(BATCH_NORM) for c in report.causes), (
            report)


def main(names):
    import keras_pipe  # noqa: PLC0415
    devices = keras_pipe.logical_cpu_devices(4, inter_op_threads=16)
    print("| model | stages | M | schedule | prediction diff | step diff "
          "| verdict | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    total = 0.0
    for case in CASES + OUT_OF_SUITE:
        if (case in OUT_OF_SUITE or names) and case.name not in names:
            continue
        start = time.process_time()
        try:
            report = run_case(case, devices)
        except Exception as error:  # noqa: BLE001 (a row, not the end)
            print(f"| {case.name} | ERROR {error!r:.300} |", flush=True)
            continue
        seconds = time.process_time() - start
        total += seconds
        print(f"| {case.name} | {case.num_stages} | "
              f"{case.num_micro_batches} | {case.schedule} | "
              f"{report.prediction_difference:.1e} | {report.largest:.1e} | "
              f"{verdict(report)}{' (xfail)' if case.xfail else ''} | "
              f"{seconds:.1f} |", flush=True)
        if verdict(report) != case.expect:
            print(report, flush=True)
    print(f"total CPU {total:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
