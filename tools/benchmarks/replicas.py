"""Part (f): 2 replicas x 2 stages against 1 replica on 4 workers."""


from tools.benchmarks.harness import (
    _fit_steps,
    _tf_env,
    _throughput_data,
    child,
    fmt,
    median,
    ratio,
)


@child("replicas")
def child_replicas(p):
    """Client of 4 workers: R=1 vs R=2 replicas of a 2-stage BN+Dropout MLP."""
    tf, keras = _tf_env()
    del tf
    import numpy as np

    import keras_pipe
    devices = keras_pipe.connect({"worker": p["cluster"]}, timeout=60.0)
    remote = [names[0] for _, names in sorted(devices.items())]

    def stages():
        per = p["layers"] // 2
        return [keras.Sequential(
            [layer for _ in range(per) for layer in (
                keras.layers.Dense(p["width"], activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.1))], name=f"stage{j}")
            for j in range(2)]

    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    models = {}
    for r in (1, 2):
        keras.utils.set_random_seed(0)
        model = keras_pipe.PipelineModel(stages(), devices=remote[:2],
                                         num_micro_batches=p["M"])
        model.build((None, p["width"]))
        if r == 2:
            model.replicate(remote[:4])
        model.compile(keras.optimizers.Adam(1e-4), "mse")
        _fit_steps(keras, model, x[:3 * p["batch"]], y[:3 * p["batch"]],
                   p["batch"])
        models[r] = model
    steps = {r: [] for r in models}
    for _ in range(p["rounds"]):
        for r, model in models.items():
            steps[r] += _fit_steps(keras, model, x, y, p["batch"])
    return {f"R{r}": {"step_seconds": median(steps[r]),
                      "best_step_seconds": min(steps[r]), "steps": steps[r]}
            for r in models}


def replicas_table(result):
    """Table (f): step time of R=2 replicas x K=2 stages vs R=1, same model.

    Pure, for `tests/test_benchmark.py`.
    """
    one, two = result["R1"], result["R2"]
    return ((
        "(f) Replicas with BatchNormalization + Dropout on 4 worker "
        f"processes (2 per core), {result['model']}, M={result['M']} per "
        "replica, same global batch: step time of 2 replicas x 2 stages "
        "over 1 replica x 2 stages (medians of interleaved rounds)"),
        ["run", "ms/step", "fastest ms/step", "ratio to R=1"],
        [["R=1, K=2", fmt(one["step_seconds"] * 1e3, 0),
          fmt(one["best_step_seconds"] * 1e3, 0), "1.00x"],
         ["R=2, K=2", fmt(two["step_seconds"] * 1e3, 0),
          fmt(two["best_step_seconds"] * 1e3, 0),
          fmt(ratio(two["step_seconds"], one["step_seconds"]),
              suffix="x")]])

