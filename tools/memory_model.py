"""Predicted vs measured peak memory per stage (validates keras_pipe.planning.memory).

    python tools/memory_model.py --out docs/benchmarks/memory_model.json
        # logical devices: mlp, resnet, transformer, gpt2 x LOGICAL_GRID
    python tools/memory_model.py --workers \
        --out docs/benchmarks/worker_memory_model.json
        # 2 worker processes: the same models, bigger, x WORKER_GRID
    python tools/memory_model.py --quick [--workers]   # one small case
    python tools/memory_model.py [--workers] --predict FILE.json
        # new predictions for stored measurements (after a model change)

Logical devices (`keras_pipe.planning.memory.predict` against TF's
allocator peak): each stage `j` of a K-stage cut is measured alone at its
place in the schedule: the pipeline runs stage `j`'s real layers on
logical CPU device `j`, a weightless head averaging its outputs next,
identity stages elsewhere, so the process-wide allocator peak
(`tf.config.experimental.get_memory_info`; logical CPU devices share one
allocator) is the peak of that stage's device, plus the mini-batch it is
fed, which the prediction counts too (`first=True`). Measured: the peak of
a warm training step minus the allocator's bytes before the pipeline was
built, plus the stage's weights (the model, built before, holds them).
TF's default CPU allocator keeps no statistics ("Allocator stats not
available") unless `tsl::EnableCPUAllocatorStats()` ran, so every child
runs with `TF_CPU_ALLOCATOR_USE_BFC=true` (the BFC allocator always
counts). One child process per model.

Workers (`keras_pipe.planning.resident.predict_resident` against resident
memory): per configuration two fresh `python -m keras_pipe.distributed.worker`
processes (glibc heap as the worker sets it, `keras_pipe.distributed.heap`;
TF's default allocator) and a client that connects, runs one op on each,
resets each worker's `VmHWM` to its `VmRSS` (`/proc/<pid>/clear_refs`),
then builds `from_model(num_stages=2, balance="params")`, compiles and
runs two training steps. Measured: each worker's `VmHWM` minus its idle
`VmRSS`, the median over 3 such runs in fresh workers (`--repeats`): one
run of the same configuration moved by up to 23% against another.
The logical measurements too are the median of 3 runs, each in a fresh
process (`--repeats`): one logical peak moved by up to 27% from one run
to another (ResNet stage 1, SGD, M = 1, GPipe, never: 88.2, 104.2 x 3,
112.1 MiB; the MLP's stage 0 at SGD M = 4 always: 13.0 to 20.9), more
than the goal of 25%. The summary line gives the spread of the repeats.
"""

import argparse
import gc
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = ("mlp", "resnet", "transformer", "gpt2")
OPTIMIZERS = ("sgd", "adam")
MICRO_BATCHES = (1, 2, 4)
SCHEDULES = ("gpipe", "1f1b")
REMATS = ("never", "except_last", "always")
# TF's default CPU allocator keeps no statistics unless something calls
# `tsl::EnableCPUAllocatorStats()` (its `GetStats` returns nothing, and
# `get_memory_info` raises "Allocator stats not available"); the BFC CPU
# allocator, chosen by this variable before TF starts, always keeps them.
ALLOCATOR_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


# Warm steps whose allocator peak is the measured one (`measure_stage`).
WARM_STEPS = 3


def build_model(keras, name, size="small"):
    """A model of the table and its data: a dict with `model`, `batch`, `x`,
    `y`, `loss` (of the model's outputs) and `input_shape` (for the cut).

    `size="worker"` makes the models bigger (weights of tens of MiB per
    stage) for the resident-memory table, where TF's own share is ~700 MiB.
    """
    import numpy as np
    rng = np.random.default_rng(0)
    big = size == "worker"
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    input_shape = None
    if name == "mlp":
        # The capacity demo's MLP (`tools/capacity_demo.py`), narrower.
        width, inputs = (2048, 1024) if big else (512, 512)
        layers = [keras.Input((inputs,))]
        layers += [keras.layers.Dense(width, activation="relu")
                   for _ in range(7 if big else 6)]
        model = keras.Sequential(layers + [keras.layers.Dense(10)],
                                 name=name)
        batch = 64 if big else 1024
        x = rng.normal(size=(batch, inputs)).astype("float32")
    elif name == "resnet":
        filters = 128 if big else 32
        inp = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(filters, 3, padding="same",
                                activation="relu")(inp)
        for _ in range(3):
            r = keras.layers.Conv2D(filters, 3, padding="same")(h)
            r = keras.layers.BatchNormalization()(r)
            r = keras.layers.Activation("relu")(r)
            r = keras.layers.Conv2D(filters, 3, padding="same")(r)
            r = keras.layers.BatchNormalization()(r)
            h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
        h = keras.layers.GlobalAveragePooling2D()(h)
        h = keras.layers.Dense(1024 if big else 10, activation="relu")(h)
        if big:
            h = keras.layers.Dense(4096, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h), name=name)
        batch = 16 if big else 64
        x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    elif name == "transformer":
        dim, seq = (512, 64) if big else (128, 64)
        inp = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(1000, dim)(inp)
        for _ in range(3):
            a = keras.layers.MultiHeadAttention(4, dim // 4)(h, h)
            h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
            f = keras.layers.Dense(4 * dim, activation="gelu")(h)
            f = keras.layers.Dense(dim)(f)
            h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h), name=name)
        batch = 16 if big else 64
        x = rng.integers(0, 1000, size=(batch, seq)).astype("int32")
    elif name == "gpt2":
        import keras_hub
        dim, seq, vocab = (512, 64, 8000) if big else (128, 64, 1000)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, num_layers=2, num_heads=4,
            hidden_dim=dim, intermediate_dim=4 * dim,
            max_sequence_length=seq, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                              preprocessor=None)
        batch = 8 if big else 32
        x = {"token_ids": rng.integers(1, vocab, (batch, seq)).astype(
                 "int32"),
             "padding_mask": np.ones((batch, seq), "int32")}
        input_shape = {k: (None, seq) for k in x}
        y = rng.integers(0, vocab, (batch, seq)).astype("int32")
        return {"model": model, "batch": batch, "x": x, "y": y,
                "loss": ce, "input_shape": input_shape}
    else:
        raise ValueError(f"Unknown model {name!r}: one of {MODELS}.")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return {"model": model, "batch": batch, "x": x, "y": y, "loss": ce,
            "input_shape": input_shape}


def configs(optimizers=OPTIMIZERS, micro_batches=MICRO_BATCHES,
            schedules=SCHEDULES, remats=REMATS):
    """`(optimizer, M, schedule, remat)` of the grid, without duplicates:
    at M = 1 the schedules run the same passes and `except_last` is
    `never`."""
    out = []
    for optimizer in optimizers:
        for m in micro_batches:
            for schedule in schedules if m > 1 else schedules[:1]:
                for remat in remats:
                    if m == 1 and remat == "except_last" and \
                            "never" in remats:
                        continue
                    out.append((optimizer, m, schedule, remat))
    return out


def _like(part, j, batch, rng):
    """Random arrays shaped like stage `j`'s inputs, `batch` rows (ones
    for integer tensors: token ids, masks)."""
    import numpy as np

    from keras_pipe.planning.balance import cost
    out = []
    for t in part.stage_inputs(j):
        shape = (batch,) + tuple(cost.dims(cost.shape_of(t, part.shapes),
                                           batch)[1:])
        if "float" in str(t.dtype):
            out.append(rng.normal(size=shape).astype(t.dtype))
        else:
            out.append(np.ones(shape, t.dtype))
    return tuple(out)


def optimizer_of(keras, name):
    """The optimizer and its slots per trainable variable."""
    if name == "sgd":
        return keras.optimizers.SGD(0.01), 0
    return keras.optimizers.Adam(1e-4), 2


def measure_model(name, num_stages, grid, known=None):
    """Child: measured and predicted peaks of every stage and configuration.

    `grid`: `(optimizer, M, schedule, remat)` tuples. With `known`
    ({"stage/optimizer/M/schedule/remat": bytes}, from an earlier run)
    nothing is trained: only the predictions are recomputed.
    """
    for key, value in ALLOCATOR_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(num_stages)
    import keras
    import numpy as np

    from keras_pipe.planning import memory, partition
    keras.utils.set_random_seed(0)
    case = build_model(keras, name)
    batch = case["batch"]
    part = partition.cut(case["model"], num_stages, balance="flops",
                         input_shape=case["input_shape"],
                         batch_size=batch)
    stages = partition.build_stages(part) if known is None else None
    rng = np.random.default_rng(1)
    results, start = [], 0
    for j, size in enumerate(part.sizes):
        x = case["x"] if j == 0 else _like(part, j, batch, rng)
        last = j == num_stages - 1
        for optimizer, m, schedule, remat in grid:
            rows = -(-batch // m)
            # Stage j alone (as measured): with the tied variables its
            # calls use, which a pipeline keeps on a later stage.
            block = memory.Profile(part.graph, rows, part.shapes).block(
                start, start + size, alone=True)
            actions = memory.stage_actions(schedule, m, num_stages)[j]
            predicted = memory.stage_memory(
                block, actions, remat, m, optimizer_of(keras, optimizer)[1],
                first=True, last=last,
                transposed=memory.transposes(remat, batch, m))
            key = f"{j}/{optimizer}/{m}/{schedule}/{remat}"
            if known is not None:
                measured = known[key]
            else:
                measured = measure_stage(
                    stages[j], j, devices, m, remat, schedule, x,
                    case["y"], case["loss"], optimizer)
            results.append({
                "model": name, "stage": j, "optimizer": optimizer,
                "num_micro_batches": m, "schedule": schedule,
                "remat": remat, "measured": measured,
                "predicted": predicted.total,
                "parts": dict(vars(predicted)),
                "error": predicted.total / measured - 1})
        start += size
    return results


def allocator_stats(tf):
    """`get_memory_info` of CPU:0, or a clear error when TF keeps none."""
    try:
        return tf.config.experimental.get_memory_info("CPU:0")
    except ValueError as exc:
        raise RuntimeError(
            f"{exc}: TF's default CPU allocator keeps statistics only once "
            "tsl::EnableCPUAllocatorStats() ran; start the process with "
            "TF_CPU_ALLOCATOR_USE_BFC=true (the tool's children do).") \
            from None


def measure_stage(stage, j, devices, num_micro_batches, remat, schedule,
                  x, y=None, loss=None, optimizer="adam"):
    """Allocator peak over `WARM_STEPS` warm steps of stage `j` alone at
    its place (TF's inter-op threads order a step's ops differently from
    step to step, and a budget must hold the worst: one step's peak of the
    same configuration measured 22.1 to 26.1 MiB over four runs).

    Stage `j`'s layers run on device `j`; stage `j + 1` is a weightless
    head that averages stage `j`'s outputs to one number per row (its
    gradient keeps nothing, so stage `j` sees the output gradients it would
    see in the pipeline), the other stages are identities. `x` is a
    mini-batch of stage `j`'s inputs; for the last stage, `y` and `loss`
    are the targets and the loss. Returns bytes: the step's peak minus what
    was allocated before, plus the stage's weights (the model allocated
    them before). Needs allocator statistics (`ALLOCATOR_ENV`).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_pipe
    num_stages = len(devices)
    layers = [keras.layers.Identity() for _ in range(num_stages)]
    layers[j] = stage
    if j < num_stages - 1:
        layers[j + 1] = _head()
        rows = len(keras.tree.flatten(x)[0])
        y, loss = np.zeros((rows, 1), "float32"), "mse"
    # Garbage that holds tensors would be freed at random during the
    # measurement: collect it first, then freeze what survived, so that
    # the collection after the first step walks only what it made.
    gc.collect()
    gc.freeze()
    try:
        before = allocator_stats(tf)["current"]
        pipe = keras_pipe.PipelineModel(
            layers, devices=devices,
            num_micro_batches=num_micro_batches, remat=remat,
            schedule=schedule)
        pipe.compile(optimizer_of(keras, optimizer)[0], loss)
        pipe.train_on_batch(x, y)
        gc.collect()
        tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(WARM_STEPS):  # op order varies step to step: the worst
            pipe.train_on_batch(x, y)
        # The model's weights were allocated before `before`: add the stage's.
        weights = sum(v.numpy().nbytes for v in stage.weights)
        measured = allocator_stats(tf)["peak"] - before + weights
        del pipe
        return measured
    finally:
        gc.unfreeze()


def _head():
    """A weightless layer: the mean of each row over every tensor: (B, 1)."""
    import keras

    class Head(keras.layers.Layer):

        def call(self, inputs):
            parts = [keras.ops.mean(keras.ops.reshape(
                keras.ops.cast(t, "float32"), (keras.ops.shape(t)[0], -1)),
                axis=1, keepdims=True) for t in keras.tree.flatten(inputs)]
            return sum(parts[1:], parts[0])

    return Head()


def status(pid="self"):
    """VmRSS and VmHWM (resident now, resident peak) of a process, bytes."""
    result = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                result[key] = int(value.split()[0]) * 1024
    return result


def reset_peak(pid):
    """Sets a process's VmHWM back to its VmRSS (Linux >= 4.0)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def connect_idle(cluster, devices, pids):
    """Connects this client to the workers `pids` of `cluster`, runs one op
    on each of `devices` (TF's own share after a client connected) and
    resets the workers' resident peaks to that (`reset_peak`)."""
    import tensorflow as tf

    import keras_pipe
    keras_pipe.connect({"worker": cluster}, timeout=120.0)
    for device in devices:
        with tf.device(device):
            tf.function(lambda: tf.reduce_sum(tf.ones([64, 64])))().numpy()
    for p in pids:
        reset_peak(p)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_workers(common, grid, num_stages, predict_only=False,
                    heap="return", repeats=1):
    """Per configuration of `grid`, `repeats` times: starts `num_stages`
    loopback workers (`--heap heap`, `keras_pipe.distributed.heap`), runs
    the client child on them, stops them; each worker's measured peak is
    the median over the repeats (`median_of`). (`predict_only`: no
    workers, predictions only.)"""
    common = common + ["--workers"]
    if predict_only:
        return run_child(common + ["--grid", json.dumps(grid), "--cluster",
                                   "", "--pids", ""])
    env = dict(_child_env())
    for key in ALLOCATOR_ENV:
        env.pop(key)   # workers as users run them: TF's default allocator
    results = []
    for config in grid:
        results += median_of([_worker_run(common, config, num_stages, env,
                                          heap) for _ in range(repeats)])
    return results


def median_of(runs):
    """One result per stage from `runs` (lists of results of the same
    configurations): the run whose measurement is the median of the
    stage's (the lower middle for an even count), with every run's
    measurement in `runs` and their spread, `(max - min) / median`.

    Why: a worker's resident peak of the same configuration, measured in
    fresh workers, moved by up to 23% between runs (ResNet worker 0, M = 1:
    229 / 212 / 191 MiB), more than the model's goal (15%)."""
    out = []
    for same in zip(*runs):
        ordered = sorted(same, key=lambda r: r["measured"])
        middle = dict(ordered[(len(ordered) - 1) // 2])
        measured = [r["measured"] for r in same]
        middle["runs"] = measured
        middle["spread"] = (max(measured) - min(measured)) / middle[
            "measured"]
        out.append(middle)
    return out


def _worker_run(common, config, num_stages, env, heap):
    """One configuration in `num_stages` fresh workers: their results."""
    cluster = [f"127.0.0.1:{_free_port()}" for _ in range(num_stages)]
    workers = [subprocess.Popen(
        [sys.executable, "-m", "keras_pipe.distributed.worker",
         "--task", str(t), "--cluster", ",".join(cluster),
         "--intra-op-threads", "1", "--heap", heap],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for t in range(num_stages)]
    try:
        return run_child(common + [
            "--grid", json.dumps([config]),
            "--cluster", ",".join(cluster),
            "--pids", ",".join(str(w.pid) for w in workers)])
    finally:
        for w in workers:
            w.kill()
            w.wait()


def worker_client(name, grid, cluster, pids, known=None):
    """Child: resident peak of each worker per configuration, predicted
    (`resident.predict_resident`) and measured.

    Measured: the worker's `VmHWM` over building the pipeline, compiling
    and two training steps, minus its resident size when idle after this
    client connected and ran one op on it (its peak reset to that with
    `/proc/<pid>/clear_refs`). One configuration per pair of fresh
    workers: a worker does not give back all of a deleted pipeline's
    memory, so configurations run one after another would not start from
    the same base.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import keras_pipe
    from keras_pipe.planning import partition, resident
    num_stages = len(pids) if known is None else 2
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0"
               for t in range(num_stages)]
    if known is None:
        connect_idle(cluster, devices, pids)
        idle = [status(p)["VmRSS"] for p in pids]
    keras.utils.set_random_seed(0)
    case = build_model(keras, name, "worker")
    batch = case["batch"]
    part = partition.cut(case["model"], num_stages, balance="params",
                         input_shape=case["input_shape"], batch_size=batch)
    results = []
    for optimizer, m, schedule, remat in grid:
        slots = optimizer_of(keras, optimizer)[1]
        predicted = resident.predict_resident(
            part, batch, m, remat, schedule, slots)
        if known is None:
            pipe = keras_pipe.PipelineModel.from_model(
                case["model"], num_stages=num_stages, devices=devices,
                num_micro_batches=m, balance=list(part.sizes), remat=remat,
                schedule=schedule, input_shape=case["input_shape"])
            built = [status(p)["VmHWM"] for p in pids]
            pipe.compile(optimizer_of(keras, optimizer)[0], case["loss"])
            pipe.train_on_batch(case["x"], case["y"])
            pipe.train_on_batch(case["x"], case["y"])
            peaks = [status(p)["VmHWM"] for p in pids]
            after = [status(p)["VmRSS"] for p in pids]
        for j in range(num_stages):
            key = f"{j}/{optimizer}/{m}/{schedule}/{remat}"
            measured = known[key] if known else peaks[j] - idle[j]
            results.append({
                "model": name, "stage": j, "optimizer": optimizer,
                "num_micro_batches": m, "schedule": schedule,
                "remat": remat, "measured": measured,
                "predicted": predicted[j].total,
                "parts": dict(vars(predicted[j])),
                "error": predicted[j].total / measured - 1,
                "idle": None if known else idle[j],
                "built": None if known else built[j] - idle[j],
                "after": None if known else after[j] - idle[j]})
    return results


def summary(results):
    """Median, mean and max |error| of a list of results, in one line."""
    import statistics
    errors = [abs(r["error"]) for r in results]
    line = (f"{len(errors)} peaks: median |error| "
            f"{statistics.median(errors):.1%}, mean "
            f"{sum(errors) / len(errors):.1%}, max {max(errors):.1%}; "
            f"{sum(e <= 0.10 for e in errors)} within 10%, "
            f"{sum(e <= 0.15 for e in errors)} within 15%, "
            f"{sum(e <= 0.25 for e in errors)} within 25%.")
    spreads = [r["spread"] for r in results if len(r.get("runs") or ()) > 1]
    if spreads:
        line += (f" Measured as the median of {len(results[0]['runs'])} "
                 f"runs; spread (max - min) / median per peak: median "
                 f"{statistics.median(spreads):.1%}, max {max(spreads):.1%}.")
    return line


def format_table(results, what="stage"):
    """A Markdown table: one row per configuration, one cell per stage."""
    count = 1 + max(r["stage"] for r in results)
    rows = ["| model | optimizer | M | schedule | remat | " + " | ".join(
        f"{what} {j} MiB pred / meas (err)" for j in range(count)) + " |"]
    rows.append("|---" * (5 + count) + "|")
    cells = {}
    for r in results:
        key = (r["model"], r["optimizer"], r["num_micro_batches"],
               r["schedule"], r["remat"])
        cells.setdefault(key, []).append(
            f"{r['predicted'] / 2**20:.1f} / {r['measured'] / 2**20:.1f} "
            f"({r['error']:+.0%})")
    for key, row in cells.items():
        rows.append("| " + " | ".join(str(k) for k in key) + " | "
                    + " | ".join(row) + " |")
    rows += ["", summary(results)]
    return "\n".join(rows)


# The default grids: on this shared machine (2 cores, load 10-20) a
# stage measurement takes 5-30 s and a worker configuration, which starts
# two fresh workers, 1-3 minutes. Each grid covers SGD and Adam, M = 1, 2,
# 4, every remat mode (workers: both ends) and both schedules (logical).
LOGICAL_GRID = (("sgd", 1, "gpipe", "never"), ("adam", 1, "gpipe", "always"),
                ("sgd", 2, "gpipe", "except_last"),
                ("adam", 2, "gpipe", "never"), ("sgd", 4, "gpipe", "always"),
                ("adam", 4, "gpipe", "except_last"),
                ("adam", 4, "1f1b", "never"))
WORKER_GRID = (("sgd", 1, "gpipe", "never"), ("adam", 1, "gpipe", "always"),
               ("sgd", 2, "gpipe", "always"), ("adam", 4, "gpipe", "never"))


def _grid(args):
    """The configurations to run: `--quick`, `--full` (every combination
    of the options), or the default grid (`LOGICAL_GRID`,
    `WORKER_GRID`)."""
    if args.quick and args.workers:
        return [["adam", 2, "gpipe", "never"]]
    if args.quick:
        return configs(("adam",), (2,), ("gpipe",), ("never", "always"))
    if args.full:
        return configs(args.optimizers.split(","),
                       [int(m) for m in args.micro_batches.split(",")],
                       args.schedules.split(","), args.remats.split(","))
    return [list(c) for c in (WORKER_GRID if args.workers else LOGICAL_GRID)]


def _child_env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow", **ALLOCATOR_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def run_child(argv):
    """Runs this tool as a child process; its last stdout line is JSON."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__)]
                          + argv, capture_output=True, text=True,
                          env=_child_env())
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_configuration_arguments(parser):
    """The positional arguments naming one configuration of the tables:
    model, optimizer, M, schedule and remat mode (the probing tools')."""
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("optimizer", choices=OPTIMIZERS)
    parser.add_argument("m", type=int)
    parser.add_argument("schedule")
    parser.add_argument("remat", choices=REMATS)


def _key(result):
    return tuple(result[k] for k in ("model", "stage", "optimizer",
                                     "num_micro_batches", "schedule",
                                     "remat"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated; "
                        f"default {','.join(MODELS)} (--quick: mlp)")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--micro-batches", default=",".join(
        str(m) for m in MICRO_BATCHES))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--full", action="store_true", help="every "
                        "combination of --optimizers, --micro-batches, "
                        "--schedules and --remats (default: a covering "
                        "subset, LOGICAL_GRID or WORKER_GRID)")
    parser.add_argument("--remats", default=",".join(REMATS))
    parser.add_argument("--quick", action="store_true",
                        help="a small subset: Adam, M=2, GPipe, never and "
                        "always")
    parser.add_argument("--workers", action="store_true",
                        help="resident peaks of 2 worker processes instead "
                        "of allocator peaks on logical devices")
    parser.add_argument("--heap", default="return", choices=("return",
                        "reuse"), help="--workers: the workers' heap "
                        "setting (keras_pipe.distributed.heap); the model "
                        "predicts 'return' (default)")
    parser.add_argument("--repeats", type=int, default=None, help="measure "
                        "each configuration this many times (workers: in "
                        "fresh workers; logical: in fresh processes) and "
                        "keep the median per peak (default 3)")
    parser.add_argument("--out", default=None, help="write results as JSON")
    parser.add_argument("--predict", default=None, help="recompute the "
                        "predictions for the measurements of this JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--grid", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--known", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pids", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        grid = [tuple(g) for g in json.loads(args.grid)]
        known = json.loads(args.known) if args.known else None
        if args.workers:
            out = worker_client(args.child, grid, args.cluster.split(","),
                                [int(p) for p in args.pids.split(",") if p],
                                known)
        else:
            out = measure_model(args.child, args.num_stages, grid, known)
        print(json.dumps(out))
        return
    old, grids, stored = {}, {}, {}
    repeats = args.repeats or 3
    if args.predict:
        with open(args.predict) as f:
            for r in json.load(f):
                stored[_key(r)] = r
                config = [r["optimizer"], r["num_micro_batches"],
                          r["schedule"], r["remat"]]
                old.setdefault(r["model"], {})[
                    "/".join(str(c) for c in [r["stage"]] + config)] = \
                    r["measured"]
                if config not in grids.setdefault(r["model"], []):
                    grids[r["model"]].append(config)
    default = "mlp" if args.quick else ",".join(MODELS)
    names = list(old) if old else (args.models or default).split(",")
    grid = _grid(args)
    results = []
    for name in names:
        grid = grids.get(name, grid)
        common = ["--child", name, "--num-stages", str(args.num_stages)]
        if old:
            common += ["--known", json.dumps(old[name])]
        if args.workers:
            results += measure_workers(common, grid, args.num_stages,
                                       bool(old), args.heap,
                                       1 if old else repeats)
        else:
            results += median_of([
                run_child(common + ["--grid", json.dumps(grid)])
                for _ in range(1 if old else repeats)])
    for r in results:
        # Re-predicted: the stored measurements' own records.
        for field in ("runs", "spread", "idle", "built", "after"):
            if field in stored.get(_key(r), {}):
                r[field] = stored[_key(r)][field]
    print(format_table(results, "worker" if args.workers else "stage"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
