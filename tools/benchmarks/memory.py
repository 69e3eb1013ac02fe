"""Part (c): peak memory of a training step per remat mode, schedule and M."""


from tools.benchmarks.harness import _split, _tf_env, child


@child("memory")
def child_memory(p):
    """Peak memory of one training step for one (remat, M), K=4."""
    import resource
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.logical_cpu_devices(4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(p["batch"], p["width"])).astype("float32")
    y = rng.normal(size=(p["batch"], p["width"])).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras_pipe.PipelineModel(
        _split(keras, p["layers"], p["width"], 4), devices=devices,
        num_micro_batches=p["M"], remat=p["remat"],
        schedule=p.get("schedule", "gpipe"))
    model.build((None, p["width"]))
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.train_on_batch(x, y)  # trace and warm up
    info = tf.config.experimental.get_memory_info
    # Process-wide: every logical CPU device reports the same allocator.
    tf.config.experimental.reset_memory_stats("CPU:0")
    resting = info("CPU:0")["current"]
    model.train_on_batch(x, y)
    peak = info("CPU:0")["peak"]
    same = info("CPU:3")["peak"] == peak
    return {"M": p["M"], "remat": p["remat"],
            "schedule": p.get("schedule", "gpipe"), "peak_bytes": peak,
            "resting_bytes": resting, "step_bytes": peak - resting,
            "all_devices_report_same_peak": same,
            "maxrss_bytes": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024}

