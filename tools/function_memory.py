"""Resident cost of a worker's traced step functions, per graph node.

    python tools/function_memory.py --model transformer --optimizer adam \
        --micro-batches 4 --remat never [--rows 1]      # one JSON line
    python tools/function_memory.py --fit docs/benchmarks/function_memory.json
        # least squares of bytes against nodes (a JSON list of those lines)

Two fresh workers (heap "return", as `tools/memory_model.py --workers`);
the client builds the worker-size model of `tools/memory_model.py`, cut in
2 by parameters, and trains two steps on micro-batches of `--rows` rows,
so that activations and gradients passing through are small. Printed per
worker: resident memory after the steps minus the idle worker's minus the
stage's weights and optimizer slots (what the step's functions cost: TF's
graphs and executors, the kernels' code paged in), the number of graph
nodes placed on that worker (the step function's nodes on its device, and
every function its nodes call, once), and the model's count
(`resident.function_nodes`). One JSON line.

`docs/benchmarks/function_memory.json`: the 4 models of the table x (SGD
M = 1 never, Adam M = 1 always, SGD M = 2 always, Adam M = 4 never, SGD
M = 4 never), 5 December 2026 04:58-05:03 UTC; `--fit` over the ResNet's
and the Transformer's stages and GPT-2's last (87-6445 nodes; `fit`
says why the others are left out): `resident.FUNCTION_NODE_BYTES`.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_model  # noqa: E402


def worker_nodes(num_stages):
    """Per task, the graph nodes TF's eager context holds for it: nodes
    of every function placed on the task, and of the functions they call
    (each once per task)."""
    from tensorflow.python.eager import context
    ctx = context.context()
    defs = {name: ctx.get_function_def(name)
            for name in ctx.list_function_names()}
    counts = []
    for t in range(num_stages):
        tag = f"task:{t}/"
        seen, todo, total = set(), [], 0
        for fdef in defs.values():
            for node in fdef.node_def:
                if tag in node.device:
                    total += 1
                    for value in node.attr.values():
                        if value.func.name:
                            todo.append(value.func.name)
        while todo:
            name = todo.pop()
            if name in seen or name not in defs:
                continue
            seen.add(name)
            for node in defs[name].node_def:
                total += 1
                for value in node.attr.values():
                    if value.func.name:
                        todo.append(value.func.name)
        counts.append(total)
    return counts


def fit(rows, leave_out=(("mlp", 0), ("mlp", 1), ("gpt2", 0))):
    """`(bytes at 0 nodes, bytes per node, residual sd, stages)`: least
    squares of the stages' `functions` against their `nodes`, over the
    stages of `rows` (JSON lines of this tool) but `leave_out` (model,
    stage): the MLP's and GPT-2's first stage hold 7-28 MiB after the
    step at 69-469 nodes, tensors of their 16 MiB variables, not nodes."""
    import numpy as np
    points = [(s["nodes"], s["functions"]) for r in rows
              for s in r["stages"] if (r["model"], s["stage"]) not in
              leave_out]
    x, y = np.array(points, float).T
    a = np.stack([np.ones_like(x), x], axis=1)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    return coef[0], coef[1], float(np.std(y - a @ coef)), len(points)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default=None)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--remat", default="never")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    if args.fit:
        with open(args.fit) as f:
            base, per_node, sd, n = fit(json.load(f))
        print(f"{n} stages: {base / 2**20:.1f} MiB + {per_node / 1024:.2f} "
              f"KiB per node (residual sd {sd / 2**20:.1f} MiB)")
        return
    cluster = [f"127.0.0.1:{memory_model._free_port()}" for _ in range(2)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    workers = [subprocess.Popen(
        [sys.executable, "-m", "keras_pipe.distributed.worker", "--task",
         str(t), "--cluster", ",".join(cluster), "--intra-op-threads", "1",
         "--heap", "return"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for t in range(2)]
    try:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import keras

        import keras_pipe
        from keras_pipe.planning import partition, resident
        pids = [w.pid for w in workers]
        devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0"
                   for t in range(2)]
        memory_model.connect_idle(cluster, devices, pids)
        idle = [memory_model.status(p)["VmRSS"] for p in pids]
        keras.utils.set_random_seed(0)
        case = memory_model.build_model(keras, args.model, "worker")
        m = args.micro_batches
        batch = m * args.rows
        x = keras.tree.map_structure(lambda a: a[:batch], case["x"])
        y = case["y"][:batch]
        part = partition.cut(case["model"], 2, balance="params",
                             input_shape=case["input_shape"],
                             batch_size=case["batch"])
        optimizer, slots = memory_model.optimizer_of(keras, args.optimizer)
        predicted = resident.predict_resident(part, batch, m, args.remat,
                                            args.schedule, slots)
        pipe = keras_pipe.PipelineModel.from_model(
            case["model"], num_stages=2, devices=devices,
            num_micro_batches=m, balance=list(part.sizes), remat=args.remat,
            schedule=args.schedule, input_shape=case["input_shape"])
        pipe.compile(optimizer, case["loss"])
        pipe.train_on_batch(x, y)
        pipe.train_on_batch(x, y)
        after = [memory_model.status(p)["VmRSS"] for p in pids]
        peak = [memory_model.status(p)["VmHWM"] for p in pids]
        nodes = worker_nodes(2)
        out = []
        for j in range(2):
            held = predicted[j].weights + predicted[j].optimizer_slots
            out.append({
                "stage": j, "after": after[j] - idle[j],
                "peak": peak[j] - idle[j], "held": held,
                "functions": after[j] - idle[j] - held, "nodes": nodes[j],
                "predicted_nodes": predicted[j].functions //
                resident.FUNCTION_NODE_BYTES})
        print(json.dumps({"model": args.model, "optimizer": args.optimizer,
                          "num_micro_batches": m, "remat": args.remat,
                          "rows": args.rows, "stages": out}))
    finally:
        for w in workers:
            w.kill()
            w.wait()


if __name__ == "__main__":
    main()
