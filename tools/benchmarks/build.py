"""Part (d): time to build the training step against M and K."""

import time

from tools.benchmarks.harness import _tf_env, child


@child("build")
def child_build(p):
    """Build time of the training step for each (K, M) in one process."""
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(max(k for k, _ in p["grid"]))

    def build_seconds(k, m):
        keras.utils.set_random_seed(0)
        stages = [keras.Sequential([
            keras.layers.Dense(p["width"], activation="relu"),
            keras.layers.Dense(p["width"])]) for _ in range(k)]
        model = keras_pipe.PipelineModel(stages, devices=devices[:k],
                                          num_micro_batches=m,
                                          remat="except_last")
        model.build((None, p["width"]))
        model.compile("adam", "mse")
        x = np.ones((2 * m, p["width"]), "float32")
        calls, cpu = [], []
        for _ in range(3):
            start, start_cpu = time.perf_counter(), time.process_time()
            model.train_on_batch(x, x)
            calls.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return {"K": k, "M": m, "build_seconds": calls[0] - min(calls[1:]),
                "build_cpu_seconds": cpu[0] - min(cpu[1:]), "calls": calls,
                "cpu": cpu}

    build_seconds(2, 2)  # one-time costs of the first traced function
    return {"runs": [build_seconds(k, m) for k, m in p["grid"]]}

