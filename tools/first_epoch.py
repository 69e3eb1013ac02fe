"""Wall time of a first `fit` epoch with metrics, and its step's traces.

    PYTHONPATH=<checkout> python tools/first_epoch.py   # one JSON line

ResNet50 (no weights, 64x64x3 inputs, 10 classes) cut by
`PipelineModel.from_model` into 4 stages on 4 logical CPU devices,
`num_micro_batches=4`, SGD, sparse cross-entropy and `metrics=["accuracy"]`;
`fit` on 32 random rows in batches of 16 (2 steps), twice. Printed: how
many times `train_step` was traced and the seconds spent in it, the first
and the second epoch's wall time, the load average. Compare checkouts by
their `PYTHONPATH`, one fresh process each.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_pipe  # noqa: E402


def main():
    devices = keras_pipe.logical_cpu_devices(4)
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3),
                                        classes=10)
    pipe = keras_pipe.PipelineModel.from_model(
        model, num_stages=4, devices=devices, num_micro_batches=4)
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(),
                 metrics=["accuracy"])
    traces = []
    step = pipe.train_step

    def timed(data):
        start = time.perf_counter()
        outputs = step(data)
        traces.append(time.perf_counter() - start)
        return outputs

    pipe.train_step = timed
    rng = np.random.default_rng(0)
    x = rng.random((32, 64, 64, 3), dtype="float32")
    y = rng.integers(0, 10, 32)
    epochs = []
    for _ in range(2):
        start = time.perf_counter()
        pipe.fit(x, y, batch_size=16, epochs=1, verbose=0)
        epochs.append(round(time.perf_counter() - start, 1))
    print(json.dumps({
        "traces": len(traces), "seconds_in_train_step": round(sum(traces), 1),
        "first_epoch_s": epochs[0], "second_epoch_s": epochs[1],
        "load": [round(v, 2) for v in os.getloadavg()]}))


if __name__ == "__main__":
    main()
