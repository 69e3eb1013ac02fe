"""The main demo: train a 4-stage pipelined classifier on a synthetic task.

    python -m keras_pipe.demo [--epochs 8] [--num-micro-batches 8] ...

No download and no GPU needed: without GPUs the host CPU is split into
logical CPU devices (they show placement and the schedule, not speed).
The task: 4 classes given by a random "teacher" network on 16 features;
chance is 25 %. Each stage holds Dense + BatchNormalization + Dropout and
is re-materialized in the backward pass.
"""

import argparse
import os
import sys


def parse_args(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_pipe import _validation  # noqa: PLC0415 (TF import)
    from keras_pipe.engine import schedule  # noqa: PLC0415 (TF import)

    parser = argparse.ArgumentParser(
        prog="python -m keras_pipe.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--num-micro-batches", type=int, default=8)
    parser.add_argument("--remat", default="except_last",
                        choices=_validation.REMAT_MODES)
    parser.add_argument("--schedule", default="gpipe",
                        choices=[n for n in schedule.schedule_names()
                                 if n in ("gpipe", "1f1b", "zb_h1", "zb_h2")])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_data(num_samples, seed, num_features=16, num_classes=4):
    """A learnable task: labels from a fixed random 2-layer teacher network."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(num_features, 32))
    w2 = rng.normal(size=(32, num_classes))
    x = rng.normal(size=(num_samples, num_features)).astype("float32")
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype("int32")
    return x, y


def make_stages(num_stages, num_classes=4, width=64):
    import keras

    stages = []
    for j in range(num_stages):
        layers = [keras.layers.Dense(width, activation="relu"),
                  keras.layers.BatchNormalization(),
                  keras.layers.Dropout(0.1)]
        if j == num_stages - 1:
            layers.append(keras.layers.Dense(num_classes))
        stages.append(keras.Sequential(layers, name=f"stage{j}"))
    return stages


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import tensorflow as tf

    import keras_pipe

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= args.num_stages:
        devices = [f"/device:GPU:{j}" for j in range(args.num_stages)]
    else:
        devices = keras_pipe.logical_cpu_devices(args.num_stages)
    import keras

    keras.utils.set_random_seed(args.seed)
    x, y = make_data(args.samples, args.seed)
    split = int(0.8 * len(x))
    train = tf.data.Dataset.from_tensor_slices((x[:split], y[:split]))
    train = train.shuffle(split, seed=args.seed).batch(args.batch_size)
    test = tf.data.Dataset.from_tensor_slices((x[split:], y[split:]))
    test = test.batch(args.batch_size)

    model = keras_pipe.PipelineModel(
        make_stages(args.num_stages), devices=devices,
        num_micro_batches=args.num_micro_batches, remat=args.remat,
        schedule=args.schedule)
    model.build((None, x.shape[1]))
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    print(model.summary_table())
    bubble = keras_pipe.engine.schedule.bubble_fraction(args.num_micro_batches,
                                                 args.num_stages)
    print(f"\n{args.schedule} schedule, {args.num_micro_batches} "
          f"micro-batches on {args.num_stages} stages (GPipe's bubble "
          f"{bubble:.0%}):")
    print(keras_pipe.engine.schedule.format_schedule(model.clock_ticks()))
    print(f"\nremat={args.remat!r}; training on {split} samples, "
          f"batch size {args.batch_size}\n")
    model.fit(train, epochs=args.epochs, validation_data=test, shuffle=False,
              verbose=1)
    _, accuracy = model.evaluate(test, verbose=0)
    print(f"\nheld-out accuracy: {accuracy:.3f} (chance: 0.250)")
    return accuracy


if __name__ == "__main__":
    main()
