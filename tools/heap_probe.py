"""Where a worker's resident memory sits: glibc's heap and RSS, per moment.

    python tools/heap_probe.py transformer adam 4 gpipe never
    python tools/heap_probe.py transformer adam 4 gpipe never --heap glibc \
        --env MALLOC_ARENA_MAX=2 --env MALLOC_MMAP_THRESHOLD_=1048576
    python tools/heap_probe.py ... --steps 30    # also times 30 more steps

Starts two workers of `tools/memory_model.py --workers` (the same models,
`--heap` as given), each with a probe thread that, when asked, reads
glibc's `mallinfo2` (bytes in use and free in the arenas, bytes mapped on
their own) and `/proc/self/status` (VmRSS, VmHWM, RssAnon, RssFile) in the
worker's own process, and at the end calls `malloc_trim(0)` and reads
them again. Moments: idle (after the client ran one op), built, after
each of two training steps, end. MiB above the idle worker.

It found what the Transformer's workers held beyond the model
(`keras_pipe.distributed.heap`, "Why 128 KiB").
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_model as mm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]


def _reading(libc):
    """mallinfo2's fields and the process's resident sizes, bytes."""
    info = libc.mallinfo2()
    out = {name: getattr(info, name) for name, _ in _MallInfo2._fields_}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _serve_probe(folder):
    """Worker side: answers `folder/req.<pid>` in `folder/resp.<pid>`."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    pid = os.getpid()
    request = os.path.join(folder, f"req.{pid}")
    response = os.path.join(folder, f"resp.{pid}")
    while True:
        if os.path.exists(request):
            with open(request) as f:
                what = f.read().strip()
            os.remove(request)
            out = {"before": _reading(libc)}
            if what == "trim":
                libc.malloc_trim(0)
                out["after_trim"] = _reading(libc)
            with open(response + ".tmp", "w") as f:
                json.dump(out, f)
            os.rename(response + ".tmp", response)
        time.sleep(0.05)


def _ask(folder, pid, what="info"):
    response = os.path.join(folder, f"resp.{pid}")
    if os.path.exists(response):
        os.remove(response)
    with open(os.path.join(folder, f"req.{pid}"), "w") as f:
        f.write(what)
    for _ in range(600):
        if os.path.exists(response):
            with open(response) as f:
                return json.load(f)
        time.sleep(0.05)
    raise RuntimeError(f"worker {pid} did not answer the probe")


def _client(args, folder):
    cluster = [f"127.0.0.1:{mm._free_port()}" for _ in range(2)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT,
               **dict(e.split("=", 1) for e in args.env))
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    workers = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", folder,
         "--task", str(t), "--cluster", ",".join(cluster),
         "--intra-op-threads", "1", "--heap", args.heap],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for t in range(2)]
    pids = [w.pid for w in workers]
    try:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import keras

        import keras_pipe
        from keras_pipe.planning import partition, resident
        devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0"
                   for t in range(2)]
        mm.connect_idle(cluster, devices, pids)
        rows = {"idle": [_ask(folder, p) for p in pids]}
        keras.utils.set_random_seed(0)
        case = mm.build_model(keras, args.model, "worker")
        part = partition.cut(case["model"], 2, balance="params",
                             input_shape=case["input_shape"],
                             batch_size=case["batch"])
        slots = mm.optimizer_of(keras, args.optimizer)[1]
        predicted = resident.predict_resident(
            part, case["batch"], args.m, args.remat, args.schedule, slots)
        pipe = keras_pipe.PipelineModel.from_model(
            case["model"], num_stages=2, devices=devices,
            num_micro_batches=args.m, balance=list(part.sizes),
            remat=args.remat, schedule=args.schedule,
            input_shape=case["input_shape"])
        rows["built"] = [_ask(folder, p) for p in pids]
        pipe.compile(mm.optimizer_of(keras, args.optimizer)[0],
                     case["loss"])
        for n in (1, 2):
            pipe.train_on_batch(case["x"], case["y"])
            rows[f"step{n}"] = [_ask(folder, p) for p in pids]
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            pipe.train_on_batch(case["x"], case["y"])
            times.append(time.perf_counter() - start)
        rows["end"] = [_ask(folder, p, "trim") for p in pids]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    mib = 2**20
    print(args.model, args.optimizer, args.m, args.schedule, args.remat,
          "heap", args.heap, *args.env)
    if times:
        times.sort()
        print(f"{args.steps} steps: median {1e3 * times[len(times) // 2]:.1f}"
              f" ms, least {1e3 * times[0]:.1f} ms")
    for j in range(2):
        idle = rows["idle"][j]["before"]
        print(f"worker {j}: predicted {predicted[j].total / mib:.1f} MiB")
        for moment, readings in rows.items():
            for when, r in readings[j].items():
                print(f"  {moment:6s}{when:11s}"
                      f" rss {(r['VmRSS'] - idle['VmRSS']) / mib:6.1f}"
                      f" peak {(r['VmHWM'] - idle['VmRSS']) / mib:6.1f}"
                      f" anon {(r['RssAnon'] - idle['RssAnon']) / mib:6.1f}"
                      f" file {(r['RssFile'] - idle['RssFile']) / mib:5.1f}"
                      " | arenas: in use"
                      f" {(r['uordblks'] - idle['uordblks']) / mib:6.1f}"
                      f" free {r['fordblks'] / mib:6.1f};"
                      f" mapped {(r['hblkhd'] - idle['hblkhd']) / mib:6.1f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        threading.Thread(target=_serve_probe, args=(argv[1],),
                         daemon=True).start()
        from keras_pipe.distributed import worker
        worker.main(argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mm.add_configuration_arguments(parser)
    parser.add_argument("--heap", default="return")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for the workers (repeatable)")
    parser.add_argument("--steps", type=int, default=0,
                        help="time this many more steps")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        _client(args, folder)


if __name__ == "__main__":
    main()
