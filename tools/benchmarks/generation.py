"""Part generation: pipelined `generate` against the task's on one core.

A randomly initialised KerasHub `GPT2CausalLM` (or `LlamaCausalLM`),
greedy, 16 prompts of 8 to 16 tokens, 64 positions, no stop token (every
row runs to the end): the task's own `generate` in a process pinned to one
core, as the task comes and with `jit_compile=True` (XLA), then
`PipelineModel.generate` on 2 `keras_pipe.local_workers` (the model cut
into 2 stages at `MODELS`' balance), for each `num_micro_batches`
(`default`: generate's own, `K + 1`). A
time is the wall time of a warm call (after a first, tracing call), the
median of the rounds, with the CPU seconds of each process; tokens per
second count the generated positions.
The pipeline's process also checks the tokens against the unsplit model.

    python -m tools.benchmarks.generation [--models gpt2,llama]
        [--micro-batches default,2] [--rounds 3]
"""

import argparse
import json
import os
import time

from tools.benchmarks.harness import (
    _cpu_seconds,
    child,
    fmt,
    format_table,
    median,
    run_child,
)
from tools.benchmarks.peer import _worker_pids

# The models: about 6 decoder layers of width 512, a vocabulary of 8192
# (GPT-2's 50257 would make the head alone outweigh the layers). The cut,
# as layer-call counts, puts about as much of a decode tick's work on each
# worker: GPT-2's embedding and 4 decoder layers, then 2 layers and the
# head (about 1.3 layers of work per row at this vocabulary); Llama's 4
# decoder layers, then 2 and the head (its embedding layer, which holds
# the head's weights too, lives on the last stage, and generation embeds
# each token there).
MODELS = {
    "gpt2": {"layers": 6, "d": 512, "heads": 8, "ffn": 2048,
             "vocab": 8192, "balance": [8, 4]},
    "llama": {"layers": 6, "d": 512, "heads": 8, "kv_heads": 4,
              "ffn": 1536, "vocab": 8192, "balance": [5, 4]},
}
ROWS, LENGTH = 16, 64


def _task(kind):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import keras_hub
    c = MODELS[kind]
    keras.utils.set_random_seed(0)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=c["vocab"], num_layers=c["layers"],
            num_heads=c["heads"], hidden_dim=c["d"],
            intermediate_dim=c["ffn"], max_sequence_length=LENGTH,
            dropout=0.0)
        task = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                             preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=c["vocab"], num_layers=c["layers"],
            num_query_heads=c["heads"], num_key_value_heads=c["kv_heads"],
            hidden_dim=c["d"], intermediate_dim=c["ffn"])
        task = keras_hub.models.LlamaCausalLM(backbone=backbone,
                                              preprocessor=None)
    task.compile(sampler="greedy")
    return task


def _prompts():
    import numpy as np
    rng = np.random.default_rng(0)
    tokens = np.zeros((ROWS, LENGTH), "int32")
    mask = np.zeros((ROWS, LENGTH), "int32")
    lengths = rng.integers(8, 17, ROWS)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(1, MODELS["gpt2"]["vocab"], n)
        mask[r, :n] = 1
    return {"token_ids": tokens, "padding_mask": mask}, int(
        (LENGTH - lengths).sum())


def _timed(call, rounds, pids):
    """Wall seconds of `rounds` warm calls and the median CPU seconds per
    call of each process of `pids`."""
    call()
    times, cpu = [], []
    for _ in range(rounds):
        before = [_cpu_seconds(pid) for pid in pids]
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        cpu.append([_cpu_seconds(pid) - b for pid, b in zip(pids, before)])
    return times, [median(list(c)) for c in zip(*cpu)]


@child("generation_baseline")
def child_generation_baseline(p):
    """The task's own generate in this process (pinned by the parent), as
    the task comes (Keras leaves XLA off on a CPU) and with
    `jit_compile=True` (the whole decode loop compiled, one device)."""
    task = _task(p["model"])
    prompts, tokens = _prompts()
    out = {"tokens": tokens}
    for name, jit in (("", False), ("_xla", True)):
        task.jit_compile = jit
        task.generate_function = None  # made again, with the setting
        times, cpu = _timed(
            lambda: task.generate(prompts, stop_token_ids=None),
            p["rounds"], [os.getpid()])
        out["seconds" + name], out["cpu" + name] = times, cpu
    return out


@child("generation_pipeline")
def child_generation_pipeline(p):
    """PipelineModel.generate on 2 local workers, per M."""
    import numpy as np

    import keras_pipe
    prompts, tokens = _prompts()
    out = {"tokens": tokens, "runs": {}}
    with keras_pipe.local_workers(num_workers=2) as devices:
        pids = _worker_pids() + [os.getpid()]
        task = _task(p["model"])
        expected = task.generate(prompts, stop_token_ids=None)["token_ids"]
        pipe = keras_pipe.PipelineModel.from_model(
            task, num_stages=2, devices=devices,
            balance=MODELS[p["model"]]["balance"])
        for m in p["micro_batches"]:
            got = pipe.generate(prompts, stop_token_ids=None,
                                num_micro_batches=m)["token_ids"]
            seconds, cpu = _timed(lambda m=m: pipe.generate(
                prompts, stop_token_ids=None, num_micro_batches=m),
                p["rounds"], pids)
            out["runs"][_label(m)] = {
                "seconds": seconds, "cpu": cpu,
                "tokens_equal": bool(np.array_equal(got, expected))}
    return out


def _label(m):
    return "default M" if m is None else f"M={m}"


def run(models, micro_batches, rounds, log=print):
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = {}
    for model in models:
        log(f"{model}: {MODELS[model]}")
        common = {"model": model, "rounds": rounds}
        result[model] = {
            "baseline_before": run_child("generation_baseline",
                                         dict(common, cpus=cores[:1]), 1800,
                                         log=log),
            "pipeline": run_child("generation_pipeline",
                                  dict(common, micro_batches=micro_batches),
                                  3600, log=log),
            "baseline_after": run_child("generation_baseline",
                                        dict(common, cpus=cores[:1]), 1800,
                                        log=log)}
    return result


def table(result):
    headers = ["model", "run", "tokens/s", "x 1 core", "x 1 core XLA",
               "CPU s (1 core; worker 0 / 1 / client)", "tokens equal"]
    rows = []
    for model, entry in result.items():
        base = median(entry["baseline_before"].get("seconds", []) +
                      entry["baseline_after"].get("seconds", []))
        tokens = entry["pipeline"].get("tokens")
        if base is None or tokens is None:
            rows.append([model, "error"] + [""] * (len(headers) - 2))
            continue
        xla = median(entry["baseline_before"].get("seconds_xla", []) +
                     entry["baseline_after"].get("seconds_xla", []))
        for name, seconds, key in (("1 core (task.generate)", base, "cpu"),
                                   ("1 core, jit_compile=True", xla,
                                    "cpu_xla")):
            cpu = median([(entry[w].get(key) or [None])[0]
                          for w in ("baseline_before", "baseline_after")])
            rows.append([model, name, fmt(tokens / seconds, 0),
                         fmt(base / seconds), fmt(xla / seconds), fmt(cpu),
                         ""])
        for m, r in entry["pipeline"]["runs"].items():
            seconds = median(r["seconds"])
            rows.append([model, f"2 workers, {m}", fmt(tokens / seconds, 0),
                         fmt(base / seconds), fmt(xla / seconds),
                         " / ".join(fmt(c) for c in r["cpu"]),
                         str(r["tokens_equal"])])
    return format_table(headers, rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument(
        "--micro-batches", default="default,2",
        help="M per run; 'default': generate's own (K + 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    result = run(args.models.split(","),
                 [None if m == "default" else int(m)
                  for m in args.micro_batches.split(",")],
                 args.rounds)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
