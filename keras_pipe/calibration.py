"""The fixed costs of a training step, measured with the real executor.

Why: a step costs more than its layers' work. `fit` runs its own loop on the
client, sends the batch in, dispatches the step function to each device and
reads the results back, and each stage call inside the step adds a cost of
its own (its launch, the sends of what crosses a cut). On a CPU with small
stages these are a large share of a step, and no per-layer timing sees them.
So `measure` trains a pipeline of stages that compute next to nothing on the
devices, with 1 and 8 micro-batches, and reads the step's fixed cost and a
call's cost from the two step times: the planner
(`keras_pipe.planning.profiling.step_overhead`) costs every configuration
with them.
"""

import gc
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe import model as model_lib
from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import profiling, simulator
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["least_median", "measure", "solve", "step_seconds"]

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
    # 1 micro-batch: 5 calls on the critical path; 8: 19 calls.
    solve({1: 0.010, 8: 0.017}, [0, 1])  # step 0.0075 s, call 0.0005 s
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
    return _least_median_step(pipe, (x[:rows * 3], x[:rows * 3]), (x, x),
                              rows, runs)


def _least_median_step(pipe, warm, timed, batch_size, runs):
    """`fit`s `pipe` on `warm` (untimed), then `runs` times on `timed`,
    each step timed at its end inside the epoch; the least of the epochs'
    median steps (`least_median`)."""
    pipe.fit(*warm, batch_size=batch_size, verbose=0)
    medians = []
    for _ in range(runs):
        clock = _StepClock()
        pipe.fit(*timed, batch_size=batch_size, verbose=0, shuffle=False,
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


def _structure(model, name):
    """`model.input` or `model.output` (`name`); a Sequential never called
    has neither, only its single tensor in `inputs` / `outputs`."""
    try:
        return getattr(model, name)
    except AttributeError:
        tensors = getattr(model, name + "s")
        return tensors[0] if len(tensors) == 1 else list(tensors)


def _inputs(model, rows, shapes):
    """Numpy inputs of `rows` rows in `model.input`'s structure (as the
    planner costs them: normal floats, zero integers)."""
    return keras.tree.map_structure(
        lambda kt: cost_lib.sample_input(kt, rows, shapes).numpy(),
        _structure(model, "input"))


def _targets(model, rows, shapes, loss):
    """Numpy targets the loss takes for each of `model`'s outputs."""
    function = keras.losses.get(loss)

    def target(kt):
        y_pred = tf.zeros(cost_lib.dims(cost_lib.shape_of(kt, shapes),
                                        rows), "float32")
        return profiling.loss_target(function, y_pred).numpy()

    return keras.tree.map_structure(target, _structure(model, "output"))


def _optimizer(optimizer_slots):
    """An optimizer with `optimizer_slots` variables per weight."""
    if optimizer_slots >= 2:
        return keras.optimizers.Adam(1e-6)
    if optimizer_slots == 1:
        return keras.optimizers.SGD(1e-6, momentum=0.9)
    return keras.optimizers.SGD(1e-6)


def step_seconds(model, devices, sizes, num_micro_batches, remat,
                 batch_size, shapes, input_shape=None, sample_inputs=None,
                 loss=None, optimizer_slots=2, schedule="gpipe", steps=8,
                 runs=2):
    """Measured seconds of a training step of `model` cut in `sizes`.

    What the planner's layer costs miss is what a step adds to them on the
    devices: its calls' inputs arriving from another process, buffers
    not reused from the run before as in a loop, the host process sharing
    the cores with the workers: a call runs longer in the step than in
    the profile's loop.
    So the planner (`keras_pipe.planning.autoplan`) trains the real
    pipeline in a few configurations (`autoplan.calibration_points`) and
    fits its costs to the steps it measured.

    Builds `PipelineModel.from_model` of a clone of `model` (its own
    weights: `model` is not touched) with `schedule` on `devices`
    (one per stage), trains it on random data of `batch_size` rows (a warm
    epoch of 2 steps first) and returns the least of `runs` epochs' median
    step (`least_median`), each step timed at its end inside the epoch.

    Args:
        model: a built Functional or Sequential `keras.Model`.
        devices: one device per stage.
        sizes: layer calls per stage.
        num_micro_batches: `M`.
        remat: a remat mode or one per stage.
        batch_size: rows per step.
        shapes: `{id(KerasTensor): shape}` of `model`'s tensors
            (`keras_pipe.planning.balance.shapes.infer_shapes`).
        input_shape, sample_inputs: as in `PipelineModel.from_model`.
        loss: the loss to train with. Defaults to `None` ("mse").
        optimizer_slots: the optimizer's variables per weight (Adam 2,
            SGD with momentum 1, SGD 0). Defaults to `2`.
        schedule: a registered schedule's name. Defaults to `"gpipe"`.
        steps: timed steps per epoch. Defaults to `8`.
        runs: timed epochs. Defaults to `2`.

    Returns:
        Seconds per step.
    """
    loss = loss if isinstance(loss, str) or callable(loss) else "mse"
    # A clone has its own weights, drawn by the same initializers (a
    # KerasHub model's clone may even hold one variable more, a seed
    # state: its weights are not copied).
    clone = keras.models.clone_model(model)
    pipe = model_lib.PipelineModel.from_model(
        clone, num_stages=len(sizes), devices=list(devices),
        num_micro_batches=num_micro_batches, remat=remat, balance=list(sizes),
        schedule=schedule, input_shape=input_shape,
        sample_inputs=sample_inputs)
    try:
        pipe.compile(_optimizer(optimizer_slots), loss)
        x = _inputs(model, batch_size, shapes)
        y = _targets(model, batch_size, shapes, loss)

        def repeat(times):
            return keras.tree.map_structure(
                lambda a: np.concatenate([a] * times), (x, y))

        return _least_median_step(pipe, repeat(2), repeat(steps + 1),
                                  batch_size, runs)
    finally:
        # The clone's variables live on the devices while anything holds
        # them: the train function's graph does, for the life of the
        # process (`_compat.release_graphs_capturing`), and a Keras model is
        # a reference cycle. Released and collected now, the next
        # calibration point (and the real pipeline after the plan) reuses
        # the memory instead of adding to it.
        _compat.release_graphs_capturing(
            list(pipe.variables) + list(clone.variables)
            + list(getattr(pipe.optimizer, "variables", [])))
        del pipe, clone
        gc.collect()
