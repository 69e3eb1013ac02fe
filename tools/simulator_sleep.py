"""Simulator against the executor: stages that sleep known times.

```
python tools/simulator_sleep.py [--micro-batches 1,2,4,8] [--repeats 3]
```

Every registered schedule runs a `PipelineModel` whose stages sleep a known
time per forward and backward call (`tf.numpy_function` around
`time.sleep`, one call at a time per device, as a device runs one op at a
time) on logical CPU devices with enough inter-op threads for every sleep
at once (sleeps need no CPU, so trap 7, one shared thread pool, does not
blur them). Stages per device: one, or two where the schedule places
several (interleaved_1f1b in a loop, zbv in a V). The step's time, the best
of `--repeats` warm `train_on_batch` calls, is printed against
`keras_pipe.planning.simulator.simulate` of the same ticks with the sleeps as costs
and a per-call cost measured on the same pipeline with zero sleeps.

A timing run, not a test: the suite asserts the simulator exactly on
cases computable by hand (`tests/test_simulator.py`).
"""

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import keras_pipe  # noqa: E402
from keras_pipe.engine import schedule as schedule_lib  # noqa: E402
from keras_pipe.planning import simulator  # noqa: E402

DEVICES = keras_pipe.logical_cpu_devices(4, inter_op_threads=32)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

FORWARD = [0.060, 0.090, 0.045, 0.075]  # seconds per stage call
BACKWARD = [0.120, 0.135, 0.090, 0.105]


class Sleep(keras.layers.Layer):
    """Identity taking `forward` s per call and `backward` s per gradient."""

    def __init__(self, forward, backward, lock, **kwargs):
        super().__init__(**kwargs)
        self.seconds = (forward, backward)
        self.lock = lock

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def _sleeper(self, seconds):
        def wait(value):
            with self.lock:
                time.sleep(seconds)
            return value
        return wait

    def call(self, inputs):
        forward, backward = (self._sleeper(s) for s in self.seconds)

        @tf.custom_gradient
        def op(x):
            y = tf.ensure_shape(tf.numpy_function(
                forward, [x], tf.float32, stateful=False), x.shape)

            def grad(dy):
                dx = tf.numpy_function(backward, [dy + 0.0 * y], tf.float32,
                                       stateful=False)
                return tf.ensure_shape(dx, dy.shape)
            return y, grad

        return op(inputs * self.scale)


def layout(name):
    """`(num_stages, stage_devices)` on 2 or 4 devices for schedule `name`."""
    entry = schedule_lib.get_schedule(name)
    if entry.stages_per_device or entry.placement:
        return 4, schedule_lib.stage_placement(4, 2, entry.placement
                                               or "loop")
    return 4, [0, 1, 2, 3]


def step_seconds(name, m, forward, backward, repeats):
    k, stage_devices = layout(name)
    locks = [threading.Lock() for _ in range(1 + max(stage_devices))]
    stages = [Sleep(forward[j], backward[j], locks[stage_devices[j]])
              for j in range(k)]
    model = keras_pipe.PipelineModel(
        stages, devices=[DEVICES[d] for d in stage_devices],
        num_micro_batches=m, remat="never", schedule=name)
    model.build((None, 3))
    model.compile(keras.optimizers.SGD(0.0), "mse")
    x = np.ones((2 * m, 3), "float32")
    model.train_on_batch(x, x)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.train_on_batch(x, x)
        samples.append(time.perf_counter() - start)
    return min(samples), model.clock_ticks(m), stage_devices


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ms = [int(v) for v in args.micro_batches.split(",")]
    rows, errors = [], []
    for name in schedule_lib.schedule_names():
        for m in ms:
            # The executor's own cost per call: the same pipeline, no sleep.
            empty, ticks, devices = step_seconds(name, m, [0.0] * 4,
                                                 [0.0] * 4, args.repeats)
            num_calls = sum(len(t) for t in ticks)
            measured, ticks, devices = step_seconds(name, m, FORWARD,
                                                    BACKWARD, args.repeats)
            costs = simulator.Costs(FORWARD, BACKWARD,
                                    call=empty / num_calls)
            predicted = simulator.simulate(ticks, devices, costs).step_time
            error = predicted / measured - 1
            errors.append(abs(error))
            rows.append((name, m, len(set(devices)), measured, predicted,
                         error, empty))
            print(f"{name:17s} M={m} devices={len(set(devices))} measured "
                  f"{measured * 1e3:7.1f} ms predicted {predicted * 1e3:7.1f}"
                  f" ms error {error:+.1%} (empty step {empty * 1e3:.1f} ms)",
                  flush=True)
    print()
    print("| schedule | M | devices | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|")
    for name, m, d, meas, pred, err, _ in rows:
        print(f"| {name} | {m} | {d} | {meas * 1e3:.1f} | {pred * 1e3:.1f} "
              f"| {err:+.1%} |")
    print(f"\nmedian |error| {statistics.median(errors):.1%}, max "
          f"{max(errors):.1%} over {len(errors)} runs")


if __name__ == "__main__":
    main()
