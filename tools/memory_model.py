"""Predicted vs measured peak memory per stage (validates keras_pipe.planning.memory).

    python tools/memory_model.py --out docs/memory_model.json  # ~6 min
    python tools/memory_model.py --predict docs/memory_model.json
                                   # new predictions, stored measurements

Each stage `j` of a K-stage cut is measured alone at its place in the
schedule: the pipeline runs stage `j`'s real layers on logical CPU device
`j`, a weightless head averaging its outputs next, identity stages
elsewhere, so the process-wide TF allocator peak
(`tf.config.experimental.get_memory_info`; logical CPU devices share one
allocator, so per-device stats of a full pipeline are not separable) is
the peak of that stage's device, plus the mini-batch it is fed, which the
prediction counts too (`first=True`). Measured: the peak of a warm
training step minus the allocator's bytes before the pipeline was built,
plus the stage's weights (the model, built before, already holds them).
One child process per model.
"""

import argparse
import gc
import json
import os
import subprocess
import sys

MODELS = ("mlp", "resnet", "transformer")
SCHEDULES = ("gpipe", "1f1b")
REMATS = ("never", "except_last", "always")


def build_model(keras, name):
    """A small MLP, ResNet or Transformer, and its (batch_size, x, y)."""
    import numpy as np
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = keras.Input((512,))
        h = x
        for _ in range(6):
            h = keras.layers.Dense(512, activation="relu")(h)
        out = keras.layers.Dense(10)(h)
        batch = 1024
        data = rng.normal(size=(batch, 512)).astype("float32")
    elif name == "resnet":
        x = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        for _ in range(3):
            r = keras.layers.Conv2D(32, 3, padding="same")(h)
            r = keras.layers.BatchNormalization()(r)
            r = keras.layers.Activation("relu")(r)
            r = keras.layers.Conv2D(32, 3, padding="same")(r)
            r = keras.layers.BatchNormalization()(r)
            h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
        h = keras.layers.GlobalAveragePooling2D()(h)
        out = keras.layers.Dense(10)(h)
        batch = 64
        data = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    else:
        x = keras.Input((64,), dtype="int32")
        h = keras.layers.Embedding(1000, 128)(x)
        for _ in range(3):
            a = keras.layers.MultiHeadAttention(4, 32)(h, h)
            h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
            f = keras.layers.Dense(512, activation="gelu")(h)
            f = keras.layers.Dense(128)(f)
            h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
        h = keras.layers.GlobalAveragePooling1D()(h)
        out = keras.layers.Dense(10)(h)
        batch = 64
        data = rng.integers(0, 1000, size=(batch, 64)).astype("int32")
    model = keras.Model(x, out, name=name)
    labels = rng.integers(0, 10, size=(batch,)).astype("int32")
    return model, batch, data, labels


def _like(tensors, batch, rng):
    """Random float32 arrays shaped like `tensors`, `batch` rows."""
    return tuple(rng.normal(size=(batch,) + tuple(t.shape[1:])).astype(
        "float32") for t in tensors)


def measure_model(name, num_stages, num_micro_batches, known=None):
    """Child: measured and predicted peaks of every stage, schedule, remat.

    With `known` ({(stage, schedule, remat): bytes}, from an earlier run)
    nothing is trained: only the predictions are recomputed.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(num_stages)
    import keras
    import numpy as np

    from keras_pipe.planning import memory, partition
    keras.utils.set_random_seed(0)
    model, batch, data, labels = build_model(keras, name)
    part = partition.cut(model, num_stages, balance="flops")
    stages = partition.build_stages(part)
    rng = np.random.default_rng(1)
    rows = -(-batch // num_micro_batches)
    profile = memory.Profile(part.graph, rows)
    results, start = [], 0
    for j, size in enumerate(part.sizes):
        block = profile.block(start, start + size)
        start += size
        x = data if j == 0 else _like(part.stage_inputs(j), batch, rng)
        last = j == num_stages - 1
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for schedule in SCHEDULES:
            actions = memory.stage_actions(schedule, num_micro_batches,
                                           num_stages)[j]
            for remat in REMATS:
                predicted = memory.stage_memory(
                    block, actions, remat, num_micro_batches, first=True,
                    last=last)
                if known is not None:
                    measured = known[f"{j}/{schedule}/{remat}"]
                else:
                    measured = measure_stage(stages[j], j, devices,
                                             num_micro_batches, remat,
                                             schedule, x, labels, loss)
                results.append({
                    "model": name, "stage": j, "schedule": schedule,
                    "remat": remat, "measured": measured,
                    "predicted": predicted.total,
                    "parts": {k: v for k, v in vars(predicted).items()},
                    "error": predicted.total / measured - 1})
    return results


def measure_stage(stage, j, devices, num_micro_batches, remat, schedule,
                  x, y=None, loss=None):
    """Allocator peak of a warm step of stage `j` alone at its place.

    Stage `j`'s layers run on device `j`; stage `j + 1` is a weightless
    head that averages stage `j`'s outputs to one number per row (its
    gradient keeps nothing, so stage `j` sees the output gradients it would
    see in the pipeline), the other stages are identities. `x` is a
    mini-batch of stage `j`'s inputs; for the last stage, `y` and `loss`
    are the targets and the loss. Returns bytes: the step's peak minus what
    was allocated before, plus the stage's weights (the model allocated
    them before).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_pipe
    info = tf.config.experimental.get_memory_info
    num_stages = len(devices)
    layers = [keras.layers.Identity() for _ in range(num_stages)]
    layers[j] = stage
    if j < num_stages - 1:
        layers[j + 1] = _head()
        rows = len(keras.tree.flatten(x)[0])
        y, loss = np.zeros((rows, 1), "float32"), "mse"
    gc.collect()
    before = info("CPU:0")["current"]
    pipe = keras_pipe.PipelineModel(
        layers, devices=devices,
        num_micro_batches=num_micro_batches, remat=remat,
        schedule=schedule)
    pipe.compile(keras.optimizers.Adam(1e-4), loss)
    pipe.train_on_batch(x, y)
    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    pipe.train_on_batch(x, y)
    # The model's weights were allocated before `before`: add the stage's.
    weights = sum(v.numpy().nbytes for v in stage.weights)
    measured = info("CPU:0")["peak"] - before + weights
    del pipe
    return measured


def _head():
    """A weightless layer: the mean of each row over every tensor: (B, 1)."""
    import keras

    class Head(keras.layers.Layer):

        def call(self, inputs):
            parts = [keras.ops.mean(keras.ops.reshape(
                t, (keras.ops.shape(t)[0], -1)), axis=1, keepdims=True)
                for t in keras.tree.flatten(inputs)]
            return sum(parts[1:], parts[0])

    return Head()


def format_table(results):
    rows = ["| model | schedule | remat | " + " | ".join(
        f"stage {j} MiB pred / meas (err)" for j in range(
            1 + max(r["stage"] for r in results))) + " |"]
    rows.append("|---" * (3 + 1 + max(r["stage"] for r in results)) + "|")
    keys = []
    for r in results:
        key = (r["model"], r["schedule"], r["remat"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        cells = []
        for r in results:
            if (r["model"], r["schedule"], r["remat"]) == key:
                cells.append(f"{r['predicted'] / 2**20:.1f} / "
                             f"{r['measured'] / 2**20:.1f} "
                             f"({r['error']:+.0%})")
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | "
                    + " | ".join(cells) + " |")
    errors = [abs(r["error"]) for r in results]
    rows.append("")
    rows.append(f"{len(errors)} stage peaks: mean |error| "
                f"{sum(errors) / len(errors):.1%}, max {max(errors):.1%}, "
                f"{sum(e <= 0.15 for e in errors)} within 15%.")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--num-stages", type=int, default=3)
    parser.add_argument("--num-micro-batches", type=int, default=4)
    parser.add_argument("--out", default=None, help="write results as JSON")
    parser.add_argument("--predict", default=None, help="recompute the "
                        "predictions for the measurements of this JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--known", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        known = json.loads(args.known) if args.known else None
        print(json.dumps(measure_model(args.child, args.num_stages,
                                       args.num_micro_batches, known)))
        return
    old = {}
    if args.predict:
        with open(args.predict) as f:
            for r in json.load(f):
                old.setdefault(r["model"], {})[
                    f"{r['stage']}/{r['schedule']}/{r['remat']}"] = \
                    r["measured"]
    results = []
    names = list(old) if old else args.models.split(",")
    for name in names:
        extra = ["--known", json.dumps(old[name])] if old else []
        done = subprocess.run(
            [sys.executable, __file__, "--child", name, "--num-stages",
             str(args.num_stages), "--num-micro-batches",
             str(args.num_micro_batches)] + extra, capture_output=True,
            text=True, check=True)
        results += json.loads(done.stdout.strip().splitlines()[-1])
    print(format_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
