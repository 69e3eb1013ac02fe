"""AmoebaNet-D (or ResNet-50) on a TFDS image classification set, pipelined.

GPipe's image example: AmoebaNet-D(L, D) trained on ImageNet with
RMSProp, label smoothing and a warm-up + cosine learning rate, cut into
`--num-stages` stages by `keras_pipe.PipelineModel.from_model` and trained
with `model.fit`. See examples/README.md for real-run command lines and
measurements.

    python examples/imagenet.py --mock-data --steps 2 --num-stages 2 \
        --num-micro-batches 2 --export /tmp/amoebanet

`--export DIR` writes a SavedModel with two signatures, both returning
`{"probabilities": [batch, num_classes]}`:
`serving_default(images)`, a uint8 batch `[batch, height, width, 3]` of any
size (resized and center-cropped as in evaluation), and `classify_jpeg(jpeg)`,
a `[batch]` string tensor of encoded JPEG (or PNG) images.
"""

import argparse
import os
import sys

import common  # First: quiets TensorFlow's start-up logs.
import keras
import tensorflow as tf
import tensorflow_datasets as tfds

from keras_pipe.layers import defer_batch_norm

# AmoebaNet-D genotype (Real et al. 2019, as used by GPipe): pairs of
# (input state, operation); each pair's two results are added into a new
# state. A cell outputs the concatenation of the states listed in CONCAT.
NORMAL_OPERATIONS = [
    (1, "conv_1x1"), (1, "max_pool_3x3"),
    (1, "none"), (0, "conv_1x7_7x1"),
    (0, "conv_1x1"), (0, "conv_1x7_7x1"),
    (2, "max_pool_3x3"), (2, "none"),
    (1, "avg_pool_3x3"), (5, "conv_1x1"),
]
# The TensorFlow reference implementation concatenates [0, 3, 4, 6], which
# reproduces the parameter counts of GPipe's Table 1.
NORMAL_CONCAT = [0, 3, 4, 6]
REDUCTION_OPERATIONS = [
    (0, "max_pool_2x2"), (0, "max_pool_3x3"),
    (2, "none"), (1, "conv_3x3"),
    (2, "conv_1x7_7x1"), (2, "max_pool_3x3"),
    (3, "none"), (1, "max_pool_2x2"),
    (2, "avg_pool_3x3"), (3, "conv_1x1"),
]
REDUCTION_CONCAT = [4, 5, 6]

MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="amoebanet",
                        choices=["amoebanet", "resnet50"])
    parser.add_argument("--num-layers", type=int, default=18,
                        help="AmoebaNet-D L: normal cells, a multiple of 3")
    parser.add_argument("--filters", type=int, default=256,
                        help="AmoebaNet-D D: filters of the last stack / 4")
    parser.add_argument("--dataset", default="imagenet2012",
                        help="any TFDS image classification dataset with "
                        "'image' and 'label' features")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--optimizer", default="rmsprop",
                        choices=["rmsprop", "sgd"])
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="peak learning rate (default: 0.256 for "
                        "RMSProp, 0.1 for SGD, times batch size / 256)")
    parser.add_argument("--warmup-epochs", type=float, default=3.0)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=4e-5,
                        help="L2 on convolution and dense kernels")
    parser.add_argument("--batch-norm", default="deferred",
                        choices=["deferred", "per_micro_batch"],
                        help="deferred: moving statistics updated once per "
                        "mini-batch (keras_pipe.layers.defer_batch_norm); "
                        "per_micro_batch: GPipe's plain BatchNormalization")
    common.add_pipeline_flags(parser, batch_size=256)
    args = parser.parse_args(argv)
    common.resolve_batch_size(args)
    args.num_stacks, args.num_stem_cells = 3, 2
    if args.mock_data:
        # One reduction and one normal cell: the graph, and so the first
        # (tracing) step, stays small.
        args.num_layers, args.filters, args.image_size = 1, 16, 32
        args.num_stacks, args.num_stem_cells = 1, 1
        args.eval_steps = args.eval_steps or 1
    elif args.num_layers % 3:
        parser.error(f"--num-layers must be a multiple of 3, got "
                     f"{args.num_layers}")
    return args


# --------------------------------------------------------------------- model


def _relu_conv_bn(x, filters, kernel_size=1, strides=1, name=None):

    x = keras.layers.ReLU(name=f"{name}_relu")(x)
    x = keras.layers.Conv2D(filters, kernel_size, strides=strides,
                            padding="same", use_bias=False,
                            name=f"{name}_conv")(x)
    return keras.layers.BatchNormalization(name=f"{name}_bn")(x)


def _factorized_reduce(x, filters, name):
    """Halves height and width with two offset stride-2 1x1 convolutions."""
    x = keras.layers.ReLU(name=f"{name}_relu")(x)
    a = keras.layers.Conv2D(filters // 2, 1, strides=2, use_bias=False,
                            name=f"{name}_conv1")(x)
    shifted = keras.layers.ZeroPadding2D(((0, 1), (0, 1)),
                                         name=f"{name}_pad")(x)
    shifted = keras.layers.Cropping2D(((1, 0), (1, 0)),
                                      name=f"{name}_shift")(shifted)
    b = keras.layers.Conv2D(filters - filters // 2, 1, strides=2,
                            use_bias=False, name=f"{name}_conv2")(shifted)
    x = keras.layers.Concatenate(name=f"{name}_concat")([a, b])
    return keras.layers.BatchNormalization(name=f"{name}_bn")(x)


def _operation(x, kind, filters, strides, name):

    if kind == "none":
        return x if strides == 1 else _factorized_reduce(x, filters, name)
    if kind in ("max_pool_3x3", "avg_pool_3x3", "max_pool_2x2"):
        size = 2 if kind == "max_pool_2x2" else 3
        pool = (keras.layers.AveragePooling2D if kind.startswith("avg")
                else keras.layers.MaxPooling2D)
        return pool(size, strides=strides, padding="same", name=name)(x)
    if kind == "conv_1x1":
        return _relu_conv_bn(x, filters, 1, strides, name=name)
    bottleneck = max(filters // 4, 1)
    x = _relu_conv_bn(x, bottleneck, 1, name=f"{name}_a")
    if kind == "conv_3x3":
        x = _relu_conv_bn(x, bottleneck, 3, strides, name=f"{name}_b")
    else:  # conv_1x7_7x1
        x = _relu_conv_bn(x, bottleneck, (1, 7), (1, strides),
                          name=f"{name}_b")
        x = _relu_conv_bn(x, bottleneck, (7, 1), (strides, 1),
                          name=f"{name}_c")
    return _relu_conv_bn(x, filters, 1, name=f"{name}_d")


def _cell(prev, prev_prev, filters, reduction, reduction_prev, name):
    """One AmoebaNet cell: (output, prev) from the two previous outputs."""
    s1 = _relu_conv_bn(prev, filters, name=f"{name}_in1")
    if reduction_prev:
        s0 = _factorized_reduce(prev_prev, filters, name=f"{name}_in0")
    elif prev_prev.shape[-1] != filters:
        s0 = _relu_conv_bn(prev_prev, filters, name=f"{name}_in0")
    else:
        s0 = prev_prev
    states = [s1, s0]
    operations = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
    for k in range(0, len(operations), 2):
        parts = []
        for index, kind in operations[k:k + 2]:
            strides = 2 if reduction and index < 2 else 1
            parts.append(_operation(states[index], kind, filters, strides,
                                    name=f"{name}_op{k + len(parts)}"))
        states.append(keras.layers.Add(name=f"{name}_add{k // 2}")(parts))
    concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
    out = keras.layers.Concatenate(name=f"{name}_out")(
        [states[i] for i in concat])
    return out, prev


def amoebanet_d(num_classes, num_layers=18, filters=256, image_size=224,
                num_stacks=3, num_stem_cells=2):
    """AmoebaNet-D(L=num_layers, D=filters) as a Functional Keras model.

    ImageNet stem (a stride-2 convolution and two reduction cells), then
    three stacks of `L / 3` normal cells separated by reduction cells that
    double the filters, global average pooling and a dense classifier. The
    model takes uint8-range RGB images and returns logits. `num_stacks` and
    `num_stem_cells` shrink it for smoke tests (`--mock-data`: one stem
    reduction cell and one normal cell, ~100 layers instead of ~330).
    """
    inputs = keras.Input((image_size, image_size, 3), name="images")
    x = keras.layers.Normalization(
        mean=MEAN_RGB, variance=[s * s for s in STDDEV_RGB],
        name="normalize")(inputs)
    channels = filters // 4
    x = keras.layers.Conv2D(channels, 3, strides=2, padding="same",
                            use_bias=False, name="stem_conv")(x)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    prev, prev_prev, reduction_prev = x, x, False
    plan = [(f"stem{i + 2}", True) for i in range(num_stem_cells)]
    for stack in range(num_stacks):
        if stack:
            plan.append((f"cell{2 * stack}_reduction", True))
        plan += [(f"cell{2 * stack + 1}_normal{i + 1}", False)
                 for i in range(num_layers // num_stacks)]
    for name, reduction in plan:
        if reduction:
            channels *= 2
        prev, prev_prev = _cell(prev, prev_prev, channels, reduction,
                                reduction_prev, name)
        reduction_prev = reduction
    x = keras.layers.ReLU(name="head_relu")(prev)
    x = keras.layers.GlobalAveragePooling2D(name="head_pool")(x)
    x = keras.layers.Dropout(0.5, name="head_dropout")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs,
                       name=f"amoebanet_d_{num_layers}_{filters}")


def resnet50(num_classes, image_size=224):
    """keras.applications.ResNet50 (random weights) after normalization."""
    inputs = keras.Input((image_size, image_size, 3), name="images")
    x = keras.layers.Normalization(
        mean=MEAN_RGB, variance=[s * s for s in STDDEV_RGB],
        name="normalize")(inputs)
    return keras.applications.ResNet50(
        weights=None, input_tensor=x, classes=num_classes,
        classifier_activation=None)


def add_weight_decay(model, weight_decay):
    """L2 on every convolution and dense kernel, as in the paper's setup.

    Set on the variables, so that it also covers keras.applications models.
    """
    if not weight_decay:
        return
    for layer in model._flatten_layers():
        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
            layer.kernel.regularizer = keras.regularizers.L2(weight_decay)


# ---------------------------------------------------------------------- data


def _center_crop_window(height, width, image_size):
    """The eval crop: image_size / (image_size + 32) of the short side."""
    ratio = image_size / (image_size + 32)
    side = tf.cast(ratio * tf.cast(tf.minimum(height, width), tf.float32),
                   tf.int32)
    side = tf.maximum(side, 1)
    return (height - side + 1) // 2, (width - side + 1) // 2, side, side


def preprocess_encoded(encoded, image_size, training, is_jpeg=True):
    """Encoded image -> float32 [image_size, image_size, 3] in 0..255.

    JPEG crops are decoded with `decode_and_crop_jpeg`, which decodes only
    the crop window. Training: random-resized crop (8 % - 100 % of the
    area, aspect 3/4 - 4/3) and a random horizontal flip. Evaluation: the
    central crop, resized.
    """
    if is_jpeg:
        shape = tf.image.extract_jpeg_shape(encoded)
    else:
        image = tf.io.decode_image(encoded, channels=3,
                                   expand_animations=False)
        shape = tf.shape(image)
    height, width = shape[0], shape[1]
    if training:
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, bounding_boxes=tf.zeros([1, 0, 4]),
            min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        top, left, h, w = begin[0], begin[1], size[0], size[1]
    else:
        top, left, h, w = _center_crop_window(height, width, image_size)
    if is_jpeg:
        image = tf.image.decode_and_crop_jpeg(
            encoded, tf.stack([top, left, h, w]), channels=3)
    else:
        image = tf.image.crop_to_bounding_box(image, top, left, h, w)
    image = tf.image.resize(image, [image_size, image_size],
                            method="bicubic", antialias=True)
    image = tf.clip_by_value(image, 0.0, 255.0)
    if training:
        image = tf.image.random_flip_left_right(image)
    return image


def preprocess_decoded(images, image_size):
    """A uint8 batch of any size -> the evaluation crop, float32 0..255."""
    shape = tf.shape(images)
    top, left, h, w = _center_crop_window(shape[1], shape[2], image_size)
    images = images[:, top:top + h, left:left + w, :]
    images = tf.image.resize(tf.cast(images, tf.float32),
                             [image_size, image_size], method="bicubic",
                             antialias=True)
    return tf.clip_by_value(images, 0.0, 255.0)


def _splits(info):
    """(train split, eval split) names for a TFDS dataset."""
    names = set(info.splits.keys()) if info.splits else set()
    if not names or "validation" in names:
        return "train", "validation"
    if "test" in names:
        return "train", "test"
    return "train[5%:]", "train[:5%]"


def load_data(args):
    """(train dataset, eval dataset, num_classes, train examples)."""
    builder = tfds.builder(args.dataset, data_dir=args.data_dir)
    info = builder.info
    train_split, eval_split = _splits(info)
    image_feature = info.features["image"]
    is_jpeg = getattr(image_feature, "encoding_format", None) in (
        None, "jpeg")
    num_classes = info.features["label"].num_classes
    decoders = {"image": tfds.decode.SkipDecoding()}
    read_config = tfds.ReadConfig(shuffle_seed=args.seed)
    if not args.mock_data:
        builder.download_and_prepare()
    train = builder.as_dataset(split=train_split, shuffle_files=True,
                               decoders=decoders, as_supervised=True,
                               read_config=read_config)
    evaluation = builder.as_dataset(split=eval_split, decoders=decoders,
                                    as_supervised=True)
    try:
        num_train = info.splits[train_split].num_examples
    except (KeyError, ValueError):
        num_train = None

    def prepare(training):
        def fn(encoded, label):
            image = preprocess_encoded(encoded, args.image_size, training,
                                       is_jpeg)
            return image, tf.one_hot(label, num_classes)
        return fn

    autotune = tf.data.AUTOTUNE
    options = tf.data.Options()
    options.deterministic = False
    train = (train.shuffle(16 * args.batch_size, seed=args.seed).repeat()
             .map(prepare(True), num_parallel_calls=autotune)
             # Whole batches only: every step has the same micro-batches.
             .batch(args.batch_size, drop_remainder=True)
             .prefetch(autotune).with_options(options))
    evaluation = (evaluation.map(prepare(False), num_parallel_calls=autotune)
                  .batch(args.batch_size).prefetch(autotune))
    return train, evaluation, num_classes, num_train


# ------------------------------------------------------------------- export


def export(pipe, path, image_size):
    """SavedModel of the unpipelined model with image/JPEG signatures.

    Built on `pipe.to_model()`: the stages stitched back into one model
    sharing the trained weights, traced without device scopes, so the
    SavedModel loads on any single device.
    """
    model = pipe.to_model()

    def probabilities(images):
        return {"probabilities": keras.ops.softmax(
            model(images, training=False), axis=-1)}

    def serve_images(images):
        return probabilities(preprocess_decoded(images, image_size))

    def serve_jpeg(jpeg):
        images = tf.map_fn(
            lambda x: preprocess_encoded(x, image_size, False, False), jpeg,
            fn_output_signature=tf.TensorSpec([image_size, image_size, 3],
                                              tf.float32))
        return probabilities(images)

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        "serving_default", serve_images,
        [tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")])
    archive.add_endpoint("classify_jpeg", serve_jpeg,
                         [tf.TensorSpec([None], tf.string, name="jpeg")])
    archive.write_out(path, verbose=False)


# --------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    devices = common.setup_devices(args)
    keras.utils.set_random_seed(args.seed)
    train, evaluation, num_classes, num_train = common.load(args, load_data)
    steps = args.steps or max(1, (num_train or 0) // args.batch_size)
    if args.model == "amoebanet":
        model = amoebanet_d(num_classes, args.num_layers, args.filters,
                            args.image_size, args.num_stacks,
                            args.num_stem_cells)
    else:
        model = resnet50(num_classes, args.image_size)
    add_weight_decay(model, args.weight_decay)
    if args.batch_norm == "deferred":
        model = defer_batch_norm(model)
    trainable = sum(int(keras.ops.size(w)) for w in model.trainable_weights)
    print(f"{model.name}: {trainable:,} trainable parameters, "
          f"{num_classes} classes, {args.image_size}px")
    pipe = common.make_pipeline(model, args, devices)
    common.describe(pipe, args, devices)

    base = args.learning_rate or (
        0.256 if args.optimizer == "rmsprop" else 0.1) * args.batch_size / 256
    total = steps * args.epochs
    warmup = min(int(args.warmup_epochs * steps), total // 2)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0 if warmup else base, decay_steps=max(total - warmup, 1),
        warmup_target=base if warmup else None, warmup_steps=warmup)
    if args.optimizer == "rmsprop":
        optimizer = keras.optimizers.RMSprop(schedule, rho=0.9, momentum=0.9,
                                             epsilon=1.0)
    else:
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9,
                                         nesterov=True)
    pipe.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=args.label_smoothing),
        metrics=[keras.metrics.CategoricalAccuracy(name="top1"),
                 keras.metrics.TopKCategoricalAccuracy(5, name="top5")])
    throughput = common.Throughput(args.batch_size)
    history = pipe.fit(
        train, epochs=args.epochs, steps_per_epoch=steps,
        validation_data=evaluation, validation_steps=args.eval_steps,
        callbacks=common.make_callbacks(args, throughput), shuffle=False,
        verbose=1)
    results = {name[len("val_"):]: values[-1]
               for name, values in history.history.items()
               if name.startswith("val_")}
    print("evaluation: " + ", ".join(
        f"{k}={v:.4f}" for k, v in sorted(results.items())))
    if args.export:
        export(pipe, args.export, args.image_size)
        print(f"exported SavedModel to {os.path.abspath(args.export)}")
    return results, throughput.examples_per_second


if __name__ == "__main__":
    main()
