"""Part (e): schedule fidelity with stages that sleep a fixed time."""

import time

from tools.benchmarks.harness import _tf_env, child, ratio


@child("fidelity")
def child_fidelity(p):
    """Stages that sleep `t` s per op vs the schedule's (M+K-1) ticks."""
    import threading
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(
        max(k for k, _ in p["grid"]), inter_op_threads=p["inter_op_threads"])
    t = p["stage_seconds"]
    log = []
    locks = {}

    def sleeper(stage, phase):
        lock = locks.setdefault(stage, threading.Lock())

        def wait(value):
            # One op at a time per stage, as on a real device.
            with lock:
                start = time.perf_counter()
                time.sleep(t)
                log.append((stage, phase, start, time.perf_counter()))
            return value
        return wait

    class Sleep(keras.layers.Layer):
        """Identity that takes `t` s forward and `t` s backward."""

        def __init__(self, stage, **kwargs):
            super().__init__(**kwargs)
            self.stage = stage

        def build(self, shape):
            self.scale = self.add_weight(shape=(), initializer="ones")

        def call(self, inputs):
            forward = sleeper(self.stage, "forward")
            backward = sleeper(self.stage, "backward")

            @tf.custom_gradient
            def op(x):
                y = tf.numpy_function(forward, [x], tf.float32,
                                      stateful=False)
                y = tf.ensure_shape(y, x.shape)

                def grad(dy):
                    # Reads the forward output, as a real layer's backward
                    # reads saved activations: under remat the recompute is
                    # needed, and not pruned.
                    dx = tf.numpy_function(backward, [dy + 0.0 * y],
                                           tf.float32, stateful=False)
                    return tf.ensure_shape(dx, dy.shape)
                return y, grad

            # Scaled first: the weight's gradient then needs the op's
            # backward on every stage, the first one included.
            return op(inputs * self.scale)

    def bubble(elapsed, k):
        busy = sum(e - s for _, _, s, e in log)
        return 1 - busy / (k * elapsed)

    runs = []
    for k, m in p["grid"]:
        for run in p["runs"]:
            remat = "always" if run == "train_remat" else "never"
            model = keras_pipe.PipelineModel(
                [Sleep(j) for j in range(k)], devices=devices[:k],
                num_micro_batches=m, remat=remat,
                schedule="1f1b" if run == "train_1f1b" else "gpipe")
            model.build((None, 3))
            x = np.ones((2 * m, 3), "float32")
            if run == "forward":
                step = tf.function(lambda v: model(v))  # noqa: B023
                call = lambda: step(x).numpy()  # noqa: E731, B023
                ticks = m + k - 1
            else:
                model.compile(keras.optimizers.SGD(0.0), "mse")
                call = lambda: model.train_on_batch(x, x)  # noqa: E731, B023
                # Forward, then backward (with its recompute first under
                # remat="always"): each (M+K-1) ticks of t. 1F1B has the
                # same bubble as GPipe, in other places.
                ticks = (3 if run == "train_remat" else 2) * (m + k - 1)
            call()
            best = None
            for _ in range(p["repeats"]):
                log.clear()
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                if best is None or elapsed < best[0]:
                    best = (elapsed, bubble(elapsed, k), len(log))
            runs.append({"run": run, "K": k, "M": m, "stage_seconds": t,
                         "stage_times": ticks, "seconds": best[0],
                         "bubble_measured": best[1],
                         "bubble_theory": (k - 1) / (m + k - 1),
                         "ops_logged": best[2],
                         "ops_expected": ticks // (m + k - 1) * m * k})
    return {"runs": runs}


def fidelity_rows(result):
    """Rows of table (e): measured time over the schedule's prediction."""
    rows = []
    for entry in result["runs"]:
        t = entry["stage_seconds"]
        expected = entry["stage_times"] * t
        rows.append({**entry, "expected_seconds": expected,
                     "ratio": ratio(entry["seconds"], expected)})
    return rows

