"""The torch side of the peer comparison: torch.distributed.pipelining.

torch (CPU build, the `bench` extra: `pip install torch==2.13.0`) runs the
same job as keras_pipe, in the same run: a one-core process for the
reference, and two processes (gloo, one core each) for the pipeline, one
rank per worker, the stages laid out as keras_pipe lays them out. Each step
is timed between two barriers of both ranks (every rank's work done), warm.
"""

import os
import time

from tools.benchmarks import peer_jobs
from tools.benchmarks.harness import child, median

# keras_pipe's schedule names and torch's classes of the same schedule.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved_1f1b": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble"}


def _torch(threads=1):
    import torch
    torch.set_num_threads(threads)
    return torch


def _step_function(torch, model, loss_fn, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def _timed(step, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


@child("torch_baseline")
def child_torch_baseline(p):
    """The whole job in this process (pinned by the parent), one thread."""
    torch = _torch()
    import numpy as np
    job = p["job"]
    model = torch.nn.Sequential(*peer_jobs.torch_stages(torch, job, 1))
    x, y = peer_jobs.torch_data(torch, np, job, job["batch"])
    optimizer = torch.optim.SGD(model.parameters(), lr=job["lr"])
    step = _step_function(torch, model, peer_jobs.torch_loss(torch, job),
                          optimizer, x, y)
    _timed(step, p["warm"])
    start = time.process_time()
    steps = _timed(step, p["steps"])
    cpu = (time.process_time() - start) / p["steps"]
    flops = None
    try:
        from torch.utils.flop_counter import FlopCounterMode
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        flops = counter.get_total_flops()
    except Exception:  # noqa: BLE001 - reported as not counted
        pass
    return {"step_seconds": median(steps), "best_step_seconds": min(steps),
            "steps": steps, "cpu_seconds_per_step": cpu,
            "parameters": sum(v.numel() for v in model.parameters()),
            "flops_per_step": flops, "torch": torch.__version__}


def _layout(schedule):
    """`{rank: [stage indices]}` and K of a schedule on 2 ranks."""
    order = peer_jobs.FOUR_STAGE_LAYOUTS.get(schedule, (0, 1))
    return ({r: [j for j, w in enumerate(order) if w == r] for r in (0, 1)},
            len(order))


def _pipeline(torch, job, schedule, m, rank):
    """One configuration on this rank: `(step function, parameters)`."""
    import numpy as np
    from torch.distributed import pipelining
    layout, k = _layout(schedule)
    modules = peer_jobs.torch_stages(torch, job, k)
    mine = layout[rank]
    device = torch.device("cpu")
    stages = [pipelining.PipelineStage(modules[j], j, k, device)
              for j in mine]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    loss_fn = peer_jobs.torch_loss(torch, job)
    if k == 2:
        runner = cls(stages[0], m, loss_fn=loss_fn)
    else:
        runner = cls(stages, m, loss_fn=loss_fn)
    params = [v for j in mine for v in modules[j].parameters()]
    optimizer = torch.optim.SGD(params, lr=job["lr"])
    x, y = peer_jobs.torch_data(torch, np, job, job["batch"])
    first, last = 0 in mine, k - 1 in mine

    def step():
        optimizer.zero_grad(set_to_none=True)
        args = (x,) if first else ()
        if last:
            runner.step(*args, target=y, losses=[])
        else:
            runner.step(*args)
        optimizer.step()
    return step


@child("torch_rank")
def child_torch_rank(p):
    """One rank of the torch pipeline: every (schedule, M) in turn.

    Rank 0 returns the step times; each step starts and ends at a barrier
    of both ranks. A configuration that fails is reported, and the others
    go on (both ranks fail alike: the same code on the same shapes).
    """
    torch = _torch()
    import torch.distributed as dist
    rank = p["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://{p['address']}",
                            rank=rank, world_size=2)
    results, errors = [], []
    try:
        for schedule, m in p["configs"]:
            label = f"{schedule} M={m}"
            try:
                step = _pipeline(torch, p["job"], schedule, m, rank)
                for _ in range(p["warm"]):
                    step()
                dist.barrier()
                steps = []
                cpu0, sys0 = time.process_time(), os.times().system
                for _ in range(p["steps"]):
                    start = time.perf_counter()
                    step()
                    dist.barrier()
                    steps.append(time.perf_counter() - start)
                cpu = (time.process_time() - cpu0) / p["steps"]
                system = (os.times().system - sys0) / p["steps"]
            except Exception as exc:  # noqa: BLE001 - reported, others go on
                errors.append({"run": label,
                               "error": f"{type(exc).__name__}: {exc}"})
                continue
            results.append({"schedule": schedule, "num_micro_batches": m,
                            "num_stages": _layout(schedule)[1],
                            "step_seconds": median(steps),
                            "best_step_seconds": min(steps),
                            "steps": steps,
                            "cpu_seconds_per_step": cpu,
                            "system_cpu_seconds_per_step": system})
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "runs": results, "errors": errors,
            "pid": os.getpid()}
