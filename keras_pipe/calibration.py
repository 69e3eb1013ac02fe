"""The fixed costs of a training step, measured with the real executor.

Why: a step costs more than its layers' work. `fit` runs its own loop on
the client, sends the batch in, dispatches the step function to each
device and reads the results back, and each stage call inside the step
adds a cost of its own (its launch, the sends of what crosses a cut). On a
CPU with small stages these are a large share of a step (about 8 ms of a
15 ms step of a 9-layer MLP on two workers), and no per-layer timing sees
them. So `measure` trains a pipeline of stages that compute next to
nothing on the devices, with 1 and 8 micro-batches, and reads the step's
fixed cost and a call's cost from the two step times: the planner
(`keras_pipe.planning.profiling.step_overhead`) costs every configuration
with them.
"""

import statistics
import time

import keras
import numpy as np

from keras_pipe import model as model_lib
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import profiling, simulator

__all__ = ["least_median", "measure", "solve"]

_MICRO_BATCHES = (1, 8)


def _path(m, stage_devices, call, latency):
    """Simulated step of GPipe on 2 stages whose calls cost `call` each."""
    costs = simulator.Costs([0.0, 0.0], [0.0, 0.0], call=call,
                            latency=latency)
    return simulator.simulate(schedule_lib.gpipe(m, 2), stage_devices,
                              costs).step_time


def solve(step_times, stage_devices, latency=0.0):
    """The `Overhead` that makes the simulated steps of GPipe on 2 stages
    that compute nothing match `step_times` (`{M: seconds}` for two `M`).

    The difference of the two steps is calls: the call cost is the one
    whose simulated difference is the measured one; the step's fixed cost
    is what the fewer-call step has beyond its simulated calls.

    ```python
    # 1 micro-batch: 4 calls on the critical path; 8: 19 calls.
    solve({1: 0.010, 8: 0.0175}, [0, 1])  # step 0.008 s, call 0.0005 s
    ```
    """
    (m1, t1), (m2, t2) = sorted(step_times.items())
    low, high = 0.0, max(t2, t1, 1e-9)
    if t2 - t1 <= (_path(m2, stage_devices, 0.0, latency)
                   - _path(m1, stage_devices, 0.0, latency)):
        high = 0.0
    for _ in range(60):  # bisection: the simulated step grows with `call`
        if high - low < 1e-9:
            break
        mid = (low + high) / 2
        grown = (_path(m2, stage_devices, mid, latency)
                 - _path(m1, stage_devices, mid, latency))
        low, high = (mid, high) if grown < t2 - t1 else (low, mid)
    call = (low + high) / 2
    step = max(t1 - _path(m1, stage_devices, call, latency), 0.0)
    return profiling.Overhead(step, call)


class _StepClock(keras.callbacks.Callback):
    """The time at the end of each training step."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):

        self.ends.append(time.perf_counter())


def least_median(runs):
    """The least of the runs' median step times.

    Why: on a shared machine other processes only ever add time to a step,
    and they come in bursts. One run's median is robust to a few slow
    steps, not to a burst covering the run; the least of a few runs'
    medians is the fixed cost this pipeline pays when it has the cores.

    ```python
    least_median([[0.002, 0.002, 0.009], [0.006, 0.007, 0.006]])  # 0.002
    ```
    """
    return min(statistics.median(run) for run in runs)


def _step_seconds(devices, m, steps, runs):
    """Least median step of `runs` `fit` epochs on a 2-stage pipeline of
    `Dense(1)` stages."""
    pipe = model_lib.PipelineModel(
        [keras.layers.Dense(1), keras.layers.Dense(1)], devices=devices,
        num_micro_batches=m, remat="never", schedule="gpipe")
    pipe.compile(keras.optimizers.Adam(1e-3), "mse")
    rows = max(_MICRO_BATCHES)
    x = np.ones((rows * (steps + 3), 1), "float32")
    pipe.fit(x[:rows * 3], x[:rows * 3], batch_size=rows, verbose=0)  # warm
    medians = []
    for _ in range(runs):
        clock = _StepClock()
        pipe.fit(x, x, batch_size=rows, verbose=0, shuffle=False,
                 callbacks=[clock])
        medians.append(np.diff(clock.ends))
    return least_median(medians)


def measure(devices, steps=16, runs=3):
    """Measured `Overhead` of a training step on `devices`.

    Trains GPipe on two stages of `Dense(1)` (on the first two distinct
    devices, or both on the one) with 1 and 8 micro-batches of 8-row
    batches, `runs` epochs of `steps` steps each, and `solve`s for the
    fixed costs from the least of the runs' medians (`least_median`).

    Args:
        devices: the devices (TF device strings; empty for the CPU).
        steps: timed steps per run. Defaults to `16`.
        runs: timed runs per micro-batch count. Defaults to `3`.

    Returns:
        A `keras_pipe.planning.profiling.Overhead`.
    """
    distinct = [d for d in dict.fromkeys(devices) if d] or ["/device:CPU:0"]
    layout = [distinct[0], distinct[1]] if len(distinct) > 1 else [
        distinct[0], distinct[0]]
    stage_devices = [0, 1] if len(distinct) > 1 else [0, 0]
    latency = 0.0
    if len(distinct) > 1:
        latency = profiling.link(distinct[0], distinct[1]).latency
    times = {m: _step_seconds(layout, m, steps, runs)
             for m in _MICRO_BATCHES}
    return solve(times, stage_devices, latency)
