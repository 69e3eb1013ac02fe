"""A pre-norm Transformer translating TFDS text, pipelined with keras_pipe.

GPipe's translation example: an encoder-decoder Transformer (pre-norm
blocks) on WMT'14 German-English (`--dataset`: `wmt14_translate/de-en`,
`ted_hrlr_translate/pt_to_en`, or any TFDS translation set with supervised
keys), cut into `--num-stages` stages by
`keras_pipe.PipelineModel.from_model` and trained with `model.fit`. A cut in
the decoder carries the encoder output and its padding mask along with the
decoder activations (`keras_pipe.planning.partition` finds the live tensors).

A WordPiece vocabulary is learnt from a sample of the training text
(keras_hub, no pre-made vocabulary); sentences are padded to
`--max-length` tokens and the loss is a per-token mean over real tokens
only (padding has sample weight 0); training uses teacher forcing. After
training, the validation split is translated greedily and scored with
sacrebleu. See examples/README.md for real-run command lines.

    python examples/translate.py --mock-data --steps 2 --num-stages 2 \
        --num-micro-batches 2 --export /tmp/transformer

`--export DIR` writes a SavedModel whose `serving_default(source)` maps a
`[batch]` string tensor of source sentences to `{"translation": [batch]}`
strings. Its tokenizer runs tensorflow-text ops: `import tensorflow_text`
before `tf.saved_model.load` (TF Serving ships these ops).
"""

import argparse
import math
import os
import sys

import common  # First: quiets TensorFlow's start-up logs.
import keras
import keras_hub
import sacrebleu
import tensorflow as tf
import tensorflow_datasets as tfds

RESERVED_TOKENS = ["[PAD]", "[UNK]", "[START]", "[END]"]
PAD, UNK, START, END = 0, 1, 2, 3


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="wmt14_translate/de-en")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="WordPiece vocabulary, shared by both languages")
    parser.add_argument("--vocab-sample", type=int, default=200_000,
                        help="training pairs the vocabulary is learnt from")
    parser.add_argument("--max-length", type=int, default=64,
                        help="tokens per sentence (longer ones are cut)")
    parser.add_argument("--num-layers", type=int, default=6,
                        help="encoder blocks, and as many decoder blocks")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--ff-dim", type=int, default=2048)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--learning-rate", type=float, default=7e-4,
                        help="peak learning rate, after warm-up")
    parser.add_argument("--warmup-steps", type=int, default=4000)
    parser.add_argument("--bleu-examples", type=int, default=None,
                        help="validation pairs to translate for BLEU "
                        "(default: all)")
    common.add_pipeline_flags(parser, batch_size=256)
    args = parser.parse_args(argv)
    common.resolve_batch_size(args)
    if args.mock_data:
        args.vocab_size, args.vocab_sample, args.max_length = 200, 64, 12
        args.num_layers, args.d_model, args.num_heads = 1, 16, 2
        args.ff_dim, args.warmup_steps = 32, 1
        args.eval_steps = args.eval_steps or 1
        args.bleu_examples = args.bleu_examples or 8
    return args


# --------------------------------------------------------------------- model


@keras.saving.register_keras_serializable(package="examples")
class PaddingMask(keras.layers.Layer):
    """Token ids [B, S] -> attention mask [B, 1, S], false on padding."""

    def call(self, ids):
        return keras.ops.expand_dims(keras.ops.not_equal(ids, PAD), 1)

    def compute_output_spec(self, ids):
        return keras.KerasTensor((ids.shape[0], 1, ids.shape[1]), "bool")


@keras.saving.register_keras_serializable(package="examples")
class AddPositions(keras.layers.Layer):
    """Scales embeddings by sqrt(d) and adds sinusoidal positions."""

    def call(self, x):
        length, depth = keras.ops.shape(x)[1], x.shape[-1]
        positions = keras.ops.cast(keras.ops.arange(length), x.dtype)
        rates = keras.ops.exp(
            keras.ops.cast(keras.ops.arange(0, depth, 2), x.dtype)
            * (-math.log(10000.0) / depth))
        angles = positions[:, None] * rates[None, :]
        signal = keras.ops.reshape(keras.ops.stack(
            [keras.ops.sin(angles), keras.ops.cos(angles)], axis=-1),
            (length, depth))
        return x * math.sqrt(depth) + signal[None]


class Transformer:
    """The layers of a pre-norm encoder-decoder Transformer.

    Each layer is made once; `training_model`, `encoder` and `decoder` wire
    the same layer objects, so the models share weights: the pipeline
    trains `training_model`, and greedy decoding runs `encoder` once and
    `decoder` once per output token.
    """
    def __init__(self, vocab_size, num_layers, d_model, num_heads, ff_dim,
                 dropout):

        layers = keras.layers
        self.d_model = d_model
        self.mask = PaddingMask(name="source_mask")
        # One embedding for both languages (the vocabulary is shared).
        self.embedding = layers.Embedding(vocab_size, d_model,
                                          name="embedding")
        self.source_positions = AddPositions(name="source_positions")
        self.target_positions = AddPositions(name="target_positions")
        self.source_dropout = layers.Dropout(dropout, name="source_dropout")
        self.target_dropout = layers.Dropout(dropout, name="target_dropout")
        key_dim = d_model // num_heads

        def block(name, attentions):
            made = {"ffn_norm": layers.LayerNormalization(
                        epsilon=1e-6, name=f"{name}_ffn_norm"),
                    "ffn_in": layers.Dense(ff_dim, activation="relu",
                                           name=f"{name}_ffn_in"),
                    "ffn_out": layers.Dense(d_model, name=f"{name}_ffn_out"),
                    "ffn_dropout": layers.Dropout(
                        dropout, name=f"{name}_ffn_dropout"),
                    "ffn_add": layers.Add(name=f"{name}_ffn_add")}
            for kind in attentions:
                made[f"{kind}_norm"] = layers.LayerNormalization(
                    epsilon=1e-6, name=f"{name}_{kind}_norm")
                made[kind] = layers.MultiHeadAttention(
                    num_heads, key_dim, dropout=dropout, name=f"{name}_{kind}")
                made[f"{kind}_dropout"] = layers.Dropout(
                    dropout, name=f"{name}_{kind}_dropout")
                made[f"{kind}_add"] = layers.Add(name=f"{name}_{kind}_add")
            return made

        self.encoder_blocks = [block(f"encoder{i}", ["self"])
                               for i in range(num_layers)]
        self.decoder_blocks = [block(f"decoder{i}", ["self", "cross"])
                               for i in range(num_layers)]
        self.encoder_norm = layers.LayerNormalization(epsilon=1e-6,
                                                      name="encoder_norm")
        self.decoder_norm = layers.LayerNormalization(epsilon=1e-6,
                                                      name="decoder_norm")
        self.logits = layers.Dense(vocab_size, name="logits")

    @staticmethod
    def _feed_forward(x, b):
        h = b["ffn_out"](b["ffn_in"](b["ffn_norm"](x)))
        return b["ffn_add"]([x, b["ffn_dropout"](h)])

    def encode(self, source):
        """Source ids -> (encoder output, source attention mask)."""
        mask = self.mask(source)
        x = self.source_dropout(self.source_positions(self.embedding(source)))
        for b in self.encoder_blocks:
            h = b["self_norm"](x)
            h = b["self"](h, h, attention_mask=mask)
            x = b["self_add"]([x, b["self_dropout"](h)])
            x = self._feed_forward(x, b)
        return self.encoder_norm(x), mask

    def decode(self, encoded, mask, target):
        """Target ids (shifted right) -> next-token logits, causal."""
        x = self.target_dropout(self.target_positions(self.embedding(target)))
        for b in self.decoder_blocks:
            h = b["self_norm"](x)
            h = b["self"](h, h, use_causal_mask=True)
            x = b["self_add"]([x, b["self_dropout"](h)])
            h = b["cross_norm"](x)
            h = b["cross"](h, encoded, attention_mask=mask)
            x = b["cross_add"]([x, b["cross_dropout"](h)])
            x = self._feed_forward(x, b)
        return self.logits(self.decoder_norm(x))

    def training_model(self, max_length):
        """{"source", "target_in"} -> logits: the model the pipeline cuts."""

        source = keras.Input((max_length,), dtype="int32", name="source")
        target = keras.Input((max_length,), dtype="int32", name="target_in")
        encoded, mask = self.encode(source)
        return keras.Model({"source": source, "target_in": target},
                           self.decode(encoded, mask, target),
                           name="transformer")

    def inference_models(self, max_length):
        """(encoder, decoder) Functional models sharing the trained layers."""

        source = keras.Input((max_length,), dtype="int32", name="source")
        encoded, mask = self.encode(source)
        encoder = keras.Model(source, [encoded, mask], name="encoder")
        enc_in = keras.Input((max_length, self.d_model), name="encoded")
        mask_in = keras.Input((1, max_length), dtype="bool", name="mask")
        target = keras.Input((max_length,), dtype="int32", name="target_in")
        decoder = keras.Model([enc_in, mask_in, target],
                              self.decode(enc_in, mask_in, target),
                              name="decoder")
        return encoder, decoder


@keras.saving.register_keras_serializable(package="examples")
class InverseSqrt(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak`, then decay as 1 / sqrt(step)."""

    def __init__(self, peak, warmup_steps):
        self.peak = peak
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = keras.ops.cast(step, "float32") + 1.0
        warmup = float(max(self.warmup_steps, 1))
        return self.peak * keras.ops.minimum(
            step / warmup, keras.ops.sqrt(warmup / step))

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps}


# ---------------------------------------------------------------------- data


def load_text(args):
    """(train, validation): datasets of (source, target) strings."""
    builder = tfds.builder(args.dataset, data_dir=args.data_dir)
    if not args.mock_data:
        builder.download_and_prepare()
    train = builder.as_dataset(split="train", shuffle_files=True,
                               as_supervised=True)
    validation = builder.as_dataset(split="validation", as_supervised=True)
    return train, validation


def train_tokenizer(train, args):
    """A WordPiece tokenizer learnt from `--vocab-sample` training pairs."""
    sample = train.take(args.vocab_sample)
    text = sample.flat_map(lambda s, t: tf.data.Dataset.from_tensor_slices(
        tf.stack([s, t])))
    vocabulary = keras_hub.tokenizers.compute_word_piece_vocabulary(
        text.batch(1000), vocabulary_size=args.vocab_size,
        reserved_tokens=RESERVED_TOKENS)
    return keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=vocabulary, oov_token="[UNK]"), vocabulary


def encode_source(tokenizer, text, max_length):
    """Strings [B] -> ids [B, max_length], cut and padded with PAD."""
    ids = tokenizer(text)[:, :max_length]
    return ids.to_tensor(default_value=PAD, shape=[None, max_length])


def make_batches(pairs, tokenizer, args, training):
    """(source, target) strings -> ({"source", "target_in"}, target_out, w).

    Teacher forcing: the decoder reads the target shifted right behind
    [START] and predicts it followed by [END]; padding gets weight 0.
    """
    length = args.max_length

    def prepare(source, target):
        source_ids = encode_source(tokenizer, source, length)
        target_ids = tokenizer(target)[:, :length - 1]
        rows = target_ids.nrows()
        start = tf.fill([rows, 1], tf.cast(START, target_ids.dtype))
        end = tf.fill([rows, 1], tf.cast(END, target_ids.dtype))
        target_in = tf.concat([start, target_ids], axis=1).to_tensor(
            default_value=PAD, shape=[None, length])
        target_out = tf.concat([target_ids, end], axis=1).to_tensor(
            default_value=PAD, shape=[None, length])
        weights = tf.cast(tf.not_equal(target_out, PAD), tf.float32)
        inputs = {"source": tf.cast(source_ids, tf.int32),
                  "target_in": tf.cast(target_in, tf.int32)}
        return inputs, tf.cast(target_out, tf.int32), weights

    autotune = tf.data.AUTOTUNE
    if training:
        pairs = pairs.shuffle(64 * args.batch_size, seed=args.seed).repeat()
    return (pairs.batch(args.batch_size, drop_remainder=training)
            .map(prepare, num_parallel_calls=autotune).prefetch(autotune))


# ---------------------------------------------------------- decoding & BLEU


def make_translate(tokenizer, encoder, decoder, max_length):
    """A function: source strings [N] -> greedy translations [N]."""
    def translate(source):
        ids = tf.cast(encode_source(tokenizer, source, max_length), tf.int32)
        encoded, mask = encoder(ids, training=False)
        rows = tf.shape(ids)[0]
        tokens = tf.concat([tf.fill([rows, 1], START),
                            tf.zeros([rows, max_length - 1], tf.int32)], 1)
        done = tf.zeros([rows], tf.bool)

        def body(t, tokens, done):
            logits = decoder([encoded, mask, tokens], training=False)
            step = tf.cast(tf.argmax(logits[:, t], axis=-1), tf.int32)
            step = tf.where(done, PAD, step)
            tokens += step[:, None] * tf.one_hot(t + 1, max_length,
                                                 dtype=tf.int32)[None, :]
            return t + 1, tokens, done | tf.equal(step, END)

        # Stops early once every row has emitted [END].
        _, tokens, _ = tf.while_loop(
            lambda t, tokens, done: (t < max_length - 1) & ~tf.reduce_all(
                done), body, (tf.constant(0), tokens, done))
        out = tokens[:, 1:]
        # [END] and what follows become trailing padding.
        out = tf.where(tf.equal(out, END), PAD, out)
        ragged = tf.RaggedTensor.from_tensor(out, padding=PAD)
        return tokenizer.detokenize(ragged)

    return translate


def bleu(translate, validation, args):
    """Corpus BLEU (sacrebleu, 13a tokenization) on the validation pairs."""
    pairs = validation
    if args.bleu_examples:
        pairs = pairs.take(args.bleu_examples)
    run = tf.function(translate)
    hypotheses, references = [], []
    for source, target in pairs.batch(args.batch_size):
        hypotheses += [s.decode("utf-8") for s in run(source).numpy()]
        references += [s.decode("utf-8") for s in target.numpy()]
    score = sacrebleu.corpus_bleu(hypotheses, [references])
    return score, list(zip(hypotheses[:3], references[:3]))


def export(path, tokenizer, encoder, decoder, max_length):
    """SavedModel: source strings -> greedy translations, any one device.

    Built on the encoder and decoder Functional models, which share the
    pipeline's trained layers and carry no device scope.
    """
    translate = make_translate(tokenizer, encoder, decoder, max_length)
    archive = keras.export.ExportArchive()
    archive.track(encoder)
    archive.track(decoder)
    archive.track(tokenizer)
    archive.add_endpoint(
        "serving_default", lambda source: {"translation": translate(source)},
        [tf.TensorSpec([None], tf.string, name="source")])
    archive.write_out(path, verbose=False)


# --------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    devices = common.setup_devices(args)

    keras.utils.set_random_seed(args.seed)
    train_text, validation_text = common.load(args, load_text)
    tokenizer, vocabulary = train_tokenizer(train_text, args)
    print(f"WordPiece vocabulary: {len(vocabulary)} tokens")
    if args.model_dir:
        os.makedirs(args.model_dir, exist_ok=True)
        with open(os.path.join(args.model_dir, "vocabulary.txt"), "w",
                  encoding="utf-8") as f:
            f.write("\n".join(vocabulary) + "\n")
    train = make_batches(train_text, tokenizer, args, training=True)
    validation = make_batches(validation_text, tokenizer, args,
                              training=False)
    steps = args.steps
    if steps is None:
        info = tfds.builder(args.dataset, data_dir=args.data_dir).info
        steps = max(1, info.splits["train"].num_examples // args.batch_size)

    layers = Transformer(len(vocabulary), args.num_layers, args.d_model,
                         args.num_heads, args.ff_dim, args.dropout)
    model = layers.training_model(args.max_length)
    print(f"{model.name}: {model.count_params():,} parameters")
    pipe = common.make_pipeline(model, args, devices)
    common.describe(pipe, args, devices)
    pipe.compile(
        optimizer=keras.optimizers.Adam(
            InverseSqrt(args.learning_rate, args.warmup_steps),
            beta_2=0.98, epsilon=1e-9),
        # Mean over real tokens: padding has sample weight 0.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(
            name="token_accuracy")])
    throughput = common.Throughput(args.batch_size)
    pipe.fit(train, epochs=args.epochs, steps_per_epoch=steps,
             validation_data=validation, validation_steps=args.eval_steps,
             callbacks=common.make_callbacks(args, throughput), shuffle=False,
             verbose=1)

    encoder, decoder = layers.inference_models(args.max_length)
    translate = make_translate(tokenizer, encoder, decoder, args.max_length)
    score, samples = bleu(translate, validation_text, args)
    print(f"BLEU (greedy, {args.dataset} validation): {score.score:.2f}")
    for hypothesis, reference in samples:
        print(f"  {hypothesis!r}\n    reference: {reference!r}")
    if args.export:
        export(args.export, tokenizer, encoder, decoder, args.max_length)
        print(f"exported SavedModel to {os.path.abspath(args.export)}")
    return score.score, throughput.examples_per_second


if __name__ == "__main__":
    main()
