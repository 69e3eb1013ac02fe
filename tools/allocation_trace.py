"""What a stage holds at its allocator peak, tensor by tensor (TF's profiler).

    python tools/allocation_trace.py resnet adam 4 gpipe never 0
    python tools/allocation_trace.py gpt2 adam 4 gpipe never 1
    python tools/allocation_trace.py --logical resnet sgd 1 gpipe never 1

Builds the worker-size model of `tools/memory_model.py --workers`, cuts it
in two as that tool does, runs stage `j` alone on a logical device (BFC
allocator) with a weightless head, as `memory_model.measure_stage` does,
and profiles its third training step. `--logical`: the logical table's
model and cut instead (`memory_model.measure_model`: the small model, cut
by FLOPs). From the profile's allocator events
(`MemoryAllocation` / `MemoryDeallocation`, with the op that made each
tensor) it replays the step, finds the moment the allocator's bytes in use
peak, and prints the tensors the step allocated that are alive then
(weights, slots and inputs allocated before the step are not listed),
grouped by op and shape (the largest first), with the op that allocated
at the peak.

It found the grouped W call's one scratch buffer and converted stash
(`memory.weight_call_transient`) and the folded transposed token table
(`backward._folded_transpose`).
"""

import argparse
import collections
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import memory_model as mm  # noqa: E402


def _events(folder):
    """The profile's allocator events in time order: `(kind, stats)`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    path = sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        kinds = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = kinds.get(event.metadata_id, "")
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for s in event.stats:
                    stats[names.get(s.metadata_id)] = (
                        s.str_value or s.int64_value or s.uint64_value or (
                            plane.stat_metadata[s.ref_value].name
                            if s.ref_value else 0))
                events.append((line.timestamp_ns * 1000 + event.offset_ps,
                               kind, stats))
    events.sort(key=lambda e: e[0])
    return [(kind, stats) for _, kind, stats in events]


def peak_tensors(events):
    """`(bytes in use at the peak, the peak's event stats, the tensors
    alive then as stats)` from allocator events."""
    live, best, at, alive = {}, -1, None, {}
    for kind, stats in events:
        if kind == "MemoryAllocation":
            live[stats.get("addr")] = stats
        else:
            live.pop(stats.get("addr"), None)
        if stats.get("bytes_allocated", 0) > best:
            best, at, alive = stats["bytes_allocated"], stats, dict(live)
    return best, at, list(alive.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mm.add_configuration_arguments(parser)
    parser.add_argument("stage", type=int)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--logical", action="store_true", help="the "
                        "logical table's model and cut (small, by FLOPs)")
    args = parser.parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_pipe
    from keras_pipe.planning import partition
    devices = keras_pipe.logical_cpu_devices(2)
    keras.utils.set_random_seed(0)
    case = mm.build_model(keras, args.model,
                          "small" if args.logical else "worker")
    batch, j = case["batch"], args.stage
    part = partition.cut(case["model"], 2,
                         balance="flops" if args.logical else "params",
                         input_shape=case["input_shape"], batch_size=batch)
    stage = partition.build_stages(part)[j]
    x = case["x"] if j == 0 else mm._like(part, j, batch,
                                            np.random.default_rng(1))
    layers = [keras.layers.Identity(), keras.layers.Identity()]
    layers[j] = stage
    y, loss = case["y"], case["loss"]
    if j == 0:
        layers[1] = mm._head()
        y, loss = np.zeros((batch, 1), "float32"), "mse"
    pipe = keras_pipe.PipelineModel(
        layers, devices=devices, num_micro_batches=args.m,
        remat=args.remat, schedule=args.schedule)
    pipe.compile(mm.optimizer_of(keras, args.optimizer)[0], loss)
    pipe.train_on_batch(x, y)
    pipe.train_on_batch(x, y)
    with tempfile.TemporaryDirectory() as folder:
        tf.profiler.experimental.start(folder)
        pipe.train_on_batch(x, y)
        tf.profiler.experimental.stop()
        best, at, alive = peak_tensors(_events(folder))
    mib = 2**20
    print(f"peak {best / mib:.1f} MiB in use (all of the process's "
          f"tensors), at {at.get('tf_op')} {at.get('shape')}")
    groups = collections.Counter()
    for stats in alive:
        groups[(str(stats.get("tf_op")), str(stats.get("shape")))] += \
            stats.get("requested_bytes", 0) or 0
    for (op, shape), size in groups.most_common(args.top):
        print(f"{size / mib:8.2f}  {shape:18s} {op}")
    print(f"the step's tensors alive at the peak: "
          f"{sum(groups.values()) / mib:.1f} MiB")


if __name__ == "__main__":
    main()
