"""A child process that is killed (SIGKILL) during a save, for test_saving.py.

    python tests/support/save_scenarios.py PATH FORMAT POINT

saves a ~70 MB PipelineModel (weights and Adam slots all 1.0) to PATH,
prints "SAVED", sets every value to 2.0 and saves again through Keras'
`ModelCheckpoint`, killing itself with SIGKILL at POINT of that second save:
`first_write` / `middle_write` (the 1st / the middle HDF5 dataset written)
or `rename` (just before the finished file would replace PATH). FORMAT is
`keras` (whole model) or `weights` (`save_weights_only=True`).
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import h5py  # noqa: E402
import keras  # noqa: E402

import keras_pipe  # noqa: E402

WIDTH, LAYERS = 1024, 6


def make_model(devices):
    """6 x Dense(1024) in 2 stages, compiled with Adam, slots built."""
    half = LAYERS // 2
    stages = [keras.Sequential(
        ([keras.Input((WIDTH,))] if j == 0 else [])
        + [keras.layers.Dense(WIDTH) for _ in range(half)]) for j in range(2)]
    model = keras_pipe.PipelineModel(stages, devices=devices)
    model.build((None, WIDTH))
    model.compile(keras.optimizers.Adam(), "mse")
    return model


def fill(model, value):
    for v in model.variables + model.optimizer.variables:
        v.assign(keras.ops.full(v.shape, value, v.dtype))


def kill_at(point, path):
    """Installs a hook that SIGKILLs this process at `point` of a save."""
    calls = {"n": 0}
    create = h5py.Group.create_dataset
    replace = os.replace
    middle = 2 * LAYERS + 3 * LAYERS  # about half of the datasets

    def counting_create(self, *args, **kwargs):
        calls["n"] += 1
        if (point == "first_write" and calls["n"] == 1) or (
                point == "middle_write" and calls["n"] == middle):
            os.kill(os.getpid(), signal.SIGKILL)
        return create(self, *args, **kwargs)

    def killing_replace(src, dst, *args, **kwargs):
        if point == "rename" and os.path.abspath(dst) == os.path.abspath(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return replace(src, dst, *args, **kwargs)

    h5py.Group.create_dataset = counting_create
    os.replace = killing_replace


def main():
    path, fmt, point = sys.argv[1:4]
    model = make_model(["/device:CPU:0", "/device:CPU:0"])
    fill(model, 1.0)
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, save_weights_only=fmt == "weights")
    checkpoint.set_model(model)
    checkpoint.on_epoch_end(0, {})
    print("SAVED", flush=True)
    fill(model, 2.0)
    kill_at(point, path)
    checkpoint.on_epoch_end(1, {})
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    main()
