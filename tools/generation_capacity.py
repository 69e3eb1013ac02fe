"""A causal LM over one process's memory limit generates on two workers.

    python tools/generation_capacity.py --out /tmp/generation_capacity.json
    python tools/generation_capacity.py --layers 12 --width 768 --heads 12 \
        --balance 12,6 --limit-mib 100000    # GPT-2 base; peaks only

(about 7 minutes on 2 shared cores; the processes hold up to 4.5 GiB each)

The model: a randomly initialised KerasHub `GPT2CausalLM`, by default of
GPT-2 large's sizes (36 layers, width 1280, 20 heads, vocabulary 50257:
773M parameters, 2,948 MiB in float32) cut after 20 decoder layers,
greedy, `--prompts` prompts of 3 to 8 tokens generated to `--length`
positions, no stop token. The default limit, 2,700 MiB, is below the
weights alone. Every process
that holds model memory runs under one resident-memory limit,
`--limit-mib`, enforced by `tools/capacity_demo.py`'s watchdog (the
process's `VmHWM` read every 10 ms, SIGKILL once it is over the limit).
Three runs, each in processes of its own:

1. unsplit, limited: the task's own `generate` in one watched process,
   built from the same seed: killed for memory, or the limit is too high
   for the demonstration (the tool says so).
2. unsplit, unlimited: the same, unwatched: the reference tokens and its
   resident peak.
3. pipelined: two watched workers (`python -m keras_pipe.distributed.worker
   --heap return`, the heap for a memory budget, docs/capacity.md) and an
   unwatched client that builds the model (holding its initial values
   until they are placed on the workers) and cuts it into 2 stages by
   `--balance` (layer-call counts); `PipelineModel.generate` must return
   the reference tokens, and each worker stay under the limit.

Every run also reports the sum of the model's weights, so that the three
are seen to build the same model.
"""

import argparse
import json
import os
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
import capacity_demo  # noqa: E402  (a script next to this one)

MiB = 2**20


def _task(args):
    """The model, from `args` and seed 0 (the same in every process)."""
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocab, num_layers=args.layers,
        num_heads=args.heads, hidden_dim=args.width,
        intermediate_dim=4 * args.width, max_sequence_length=args.length,
        dropout=0.0)
    task = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                         preprocessor=None)
    task.compile(sampler="greedy")
    return task


def _prompts(args):
    import numpy as np
    rng = np.random.default_rng(0)
    tokens = np.zeros((args.prompts, args.length), "int32")
    mask = np.zeros((args.prompts, args.length), "int32")
    for r, n in enumerate(rng.integers(3, 9, args.prompts)):
        tokens[r, :n] = rng.integers(1, args.vocab, n)
        mask[r, :n] = 1
    return {"token_ids": tokens, "padding_mask": mask}


def _summary(task, out):
    import numpy as np
    return {"params": int(task.count_params()),
            "weights_sum": float(sum(np.sum(v.numpy(), dtype="float64")
                                     for v in task.weights)),
            "token_ids": out["token_ids"].tolist()}


def child_unsplit(args):
    from keras_pipe.distributed import heap
    heap.configure("return")  # as the workers: like for like
    task = _task(args)
    start = time.perf_counter()
    out = task.generate(_prompts(args), stop_token_ids=None)
    return dict(_summary(task, out), seconds=time.perf_counter() - start)


def child_client(args):
    import keras_pipe
    cluster = args.cluster.split(",")
    keras_pipe.connect({"worker": cluster}, timeout=120.0)
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0"
               for t in range(len(cluster))]
    task = _task(args)
    pipe = keras_pipe.PipelineModel.from_model(
        task, num_stages=2, devices=devices,
        balance=[int(b) for b in args.balance.split(",")])
    start = time.perf_counter()
    out = pipe.generate(_prompts(args), stop_token_ids=None)
    return dict(_summary(task, out), seconds=time.perf_counter() - start)


def _model_args(args):
    return ["--layers", str(args.layers), "--width", str(args.width),
            "--heads", str(args.heads), "--vocab", str(args.vocab),
            "--length", str(args.length), "--prompts", str(args.prompts),
            "--balance", args.balance]


def _child(name, args, watchdog=None, role=None):
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", name] + args,
        env=capacity_demo._env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    if watchdog is not None:
        watchdog.watch(proc.pid, role)
    out, err = proc.communicate(timeout=1800)
    lines = out.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"failed": True, "returncode": proc.returncode,
            "stderr": err.strip().splitlines()[-3:]}


def run_unsplit(args, limit):
    """The task's generate in one process, watched when `limit` is set."""
    watchdog = capacity_demo.Watchdog(limit or 2**62)
    try:
        result = _child("unsplit", _model_args(args), watchdog, "unsplit")
    finally:
        watchdog.close()
    result["peak"] = watchdog.peaks.get("unsplit")
    if watchdog.killed:
        result.update(failed=True, killed=watchdog.killed)
    return result


def run_pipelined(args, limit):
    """Two watched workers and an unwatched client."""
    return capacity_demo.run_on_watched_workers(
        limit, lambda cluster: _child("client", _model_args(args) + cluster))


def _mib(value):
    return "-" if value is None else f"{value / MiB:,.0f} MiB"


def parse_args(argv=None):
    """The tool's arguments (`--help`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=2700,
                        help="resident-memory limit of every process that "
                        "holds model memory")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--length", type=int, default=32,
                        help="positions of each generated sequence")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--balance", default="24,18",
                        help="layer-call counts of the 2 stages")
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps({"unsplit": child_unsplit,
                          "client": child_client}[args.child](args)))
        return
    limit = args.limit_mib * MiB
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(f"load average {os.getloadavg()}; GPT2CausalLM {args.layers} "
        f"layers, width {args.width}, vocabulary {args.vocab}; limit per "
        f"process {args.limit_mib:,} MiB (resident peak, watchdog)")
    report = {"argv": sys.argv[1:], "limit": limit}
    report["unsplit_limited"] = limited = run_unsplit(args, limit)
    say(f"unsplit, limited:   {'killed' if limited.get('killed') else 'ran'}"
        f", peak {_mib(limited['peak'])}")
    report["unsplit"] = reference = run_unsplit(args, None)
    if reference.get("failed"):
        say(f"unsplit, unlimited: failed: {reference}")
        return report
    say(f"unsplit, unlimited: {reference['params']:,} parameters "
        f"({reference['params'] * 4 / MiB:,.0f} MiB), peak "
        f"{_mib(reference['peak'])}, {reference['seconds']:.1f} s")
    report["pipelined"] = piped = run_pipelined(args, limit)
    if piped.get("failed"):
        say(f"pipelined:          failed: {piped}")
    else:
        piped["tokens_equal"] = piped["token_ids"] == reference["token_ids"]
        piped["same_weights"] = piped["weights_sum"] == \
            reference["weights_sum"]
        say(f"pipelined:          worker peaks "
            f"{' / '.join(_mib(p) for p in piped['peaks'])}, "
            f"{piped['seconds']:.1f} s, tokens equal: "
            f"{piped['tokens_equal']}, same weights: "
            f"{piped['same_weights']}")
    report["demonstrated"] = bool(
        limited.get("killed") and not piped.get("failed")
        and piped.get("tokens_equal") and piped.get("same_weights"))
    say("demonstrated" if report["demonstrated"] else
        "NOT demonstrated (see above)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
