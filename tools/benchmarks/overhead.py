"""Part (b): a one-stage PipelineModel against the same plain Keras model."""


from tools.benchmarks.harness import (
    _fit_steps,
    _mlp,
    _tf_env,
    _throughput_data,
    child,
    median,
    ratio,
)


@child("overhead")
def child_overhead(p):
    """PipelineModel(K=1, M=1) vs the same plain Keras model, interleaved."""
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    out = []
    for spec in p["models"]:
        width, layers, batch = spec["width"], spec["layers"], spec["batch"]
        x, y = _throughput_data(np, p["steps"], batch, width)
        keras.utils.set_random_seed(0)
        plain = _mlp(keras, layers, width, "plain")
        plain.build((None, width))
        twin = _mlp(keras, layers, width, "twin")
        twin.build((None, width))
        twin.set_weights(plain.get_weights())
        pipe = keras_pipe.PipelineModel([twin], devices=["/device:CPU:0"],
                                         num_micro_batches=1)
        plain.compile(keras.optimizers.Adam(1e-4), "mse", jit_compile=False)
        pipe.compile(keras.optimizers.Adam(1e-4), "mse")
        for model in (plain, pipe):
            _fit_steps(keras, model, x[:3 * batch], y[:3 * batch], batch)
        times = {"plain": [], "pipeline": []}
        for _ in range(p["rounds"]):
            for name, model in (("plain", plain), ("pipeline", pipe)):
                times[name] += _fit_steps(keras, model, x, y, batch)
        plain_s, pipe_s = median(times["plain"]), median(times["pipeline"])
        out.append({"model": f"{layers} x Dense({width}), batch {batch}",
                    "plain_seconds": plain_s, "pipeline_seconds": pipe_s,
                    "ratio": ratio(pipe_s, plain_s), "steps": times})
    return {"models": out}

