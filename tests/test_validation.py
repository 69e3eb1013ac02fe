"""Bad input gets a clear error, naming the value and the fix, early."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_pipe


def unbuilt_stages(n=2):
    return [keras.Sequential([keras.layers.Dense(4)]) for _ in range(n)]


def assert_nothing_built(stages):
    assert not any(stage.built for stage in stages)
    assert not any(stage.variables for stage in stages)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stages=[]), ValueError, r"stages must not be empty"),
    (dict(stages=keras.layers.Dense(2)), TypeError,
     r"stages must be a list of Keras layers"),
    (dict(stages=[keras.layers.Dense(2), "dense"]), TypeError,
     r"stages\[1\] must be a Keras layer or model. Received: 'dense'"),
    (dict(num_micro_batches=0), ValueError,
     r"num_micro_batches must be >= 1. Received: num_micro_batches=0"),
    (dict(num_micro_batches=2.0), TypeError,
     r"num_micro_batches must be an int. Received: num_micro_batches=2.0"),
    (dict(num_micro_batches=True), TypeError,
     r"num_micro_batches must be an int"),
    (dict(remat="sometimes"), ValueError,
     r"remat must be one of \('always', 'except_last', 'never'\). "
     r"Received: remat='sometimes'"),
    (dict(schedule="interleaved"), ValueError,
     r"schedule must be one of \('gpipe', '1f1b', 'zb_h1', .*\). "
     r"Received: schedule='interleaved'"),
    (dict(devices=["/device:CPU:0"]), ValueError,
     r"one device per stage: got 1 devices for 2 stages"),
    (dict(devices="/device:CPU:0"), TypeError,
     r"devices must be a list of device strings"),
    (dict(devices=["/device:CPU:0", "/device:CPU:9"]), ValueError,
     r"devices\[1\]='/device:CPU:9' names no device.*Available devices: "
     r"\['/device:CPU:0', '/device:CPU:1'"),
    (dict(devices=["/device:CPU:0", "/device:GPU:0"]), ValueError,
     r"devices\[1\]='/device:GPU:0' names no device"),
    (dict(devices=["/device:CPU:0", 1]), TypeError,
     r"devices\[1\] must be a device string"),
    (dict(devices=None), ValueError,
     r"devices=None needs one GPU per stage, but there are 0 GPUs for 2 "
     r"stages.*keras_pipe.logical_cpu_devices\(2\)"),
])
def test_bad_arguments(devices, kwargs, error, match):
    args = dict(stages=unbuilt_stages(), devices=devices[:2],
                num_micro_batches=2, remat="always")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        keras_pipe.PipelineModel(**args)
    if isinstance(args["stages"], list):
        assert_nothing_built([s for s in args["stages"]
                              if isinstance(s, keras.layers.Layer)])


def test_same_layer_twice(devices):
    layer = keras.layers.Dense(2)
    with pytest.raises(ValueError, match=r"stages\[0\] and stages\[1\] are "
                       r"the same layer"):
        keras_pipe.PipelineModel([layer, layer], devices=devices[:2])


def test_partial_device_names_resolve(devices):
    model = keras_pipe.PipelineModel(
        unbuilt_stages(), devices=["CPU:1", "/job:localhost/device:CPU:2"])
    assert model.devices == ["CPU:1", "/job:localhost/device:CPU:2"]
    model.build((None, 3))
    assert model.stages[0].variables[0].value.device.endswith("CPU:1")
    assert model.stages[1].variables[0].value.device.endswith("CPU:2")


def test_read_back_what_was_given(devices):
    stages = unbuilt_stages(3)
    model = keras_pipe.PipelineModel(stages, devices=devices[:3],
                                     num_micro_batches=5, remat="never",
                                     schedule="1f1b")
    assert model.stages == stages
    assert model.devices == devices[:3]
    assert model.num_micro_batches == 5
    assert model.remat == "never"
    assert model.schedule == "1f1b"
    assert model.num_stages == 3
    assert model.clock_ticks() == keras_pipe.engine.schedule.one_f_one_b(5, 3)
    model.build((None, 2))
    again = keras_pipe.PipelineModel.from_config(model.get_config())
    assert (again.num_micro_batches, again.remat, again.schedule) == (
        5, "never", "1f1b")


def test_built_stages_that_do_not_fit_together(devices):
    first = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8)],
                             name="encoder")
    second = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)],
                              name="head")
    with pytest.raises(ValueError, match=r"stages\[1\] \('head'\) cannot "
                       r"take the output of stages\[0\] \('encoder'\): "
                       r"\(\(None, 8\), 'float32'\)"):
        keras_pipe.PipelineModel([first, second], devices=devices[:2])


def test_unbuilt_stage_that_does_not_fit_fails_at_build(devices):
    second = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)],
                              name="head")
    model = keras_pipe.PipelineModel(
        [keras.layers.Dense(8, name="encoder"), second], devices=devices[:2])
    with pytest.raises(ValueError, match=r"stages\[1\] \('head'\) cannot "
                       r"take the output of stages\[0\] \('encoder'\)"):
        model.build((None, 6))


def test_jit_compile_compiles_updates_only_and_auto_is_off(devices):
    model = keras_pipe.PipelineModel(unbuilt_stages(), devices=devices[:2])
    with pytest.raises(ValueError, match=r"jit_compile='yes' is not one of "
                       r"True, False or 'auto'"):
        model.compile("sgd", "mse", jit_compile="yes")
    model.compile("sgd", "mse", jit_compile="auto")
    assert model.jit_compile is False and model.xla_updates is False
    model.fit(np.ones((4, 3)), np.ones((4, 4)), verbose=0)
    assert model.jit_compile is False
    # True: each device's optimizer update is XLA's; the step itself stays
    # un-compiled (its variables live on several devices).
    model.compile("sgd", "mse", jit_compile=True)
    assert model.jit_compile is False and model.xla_updates is True
    assert model.get_compile_config()["jit_compile"] is True
    model.fit(np.ones((4, 3)), np.ones((4, 4)), verbose=0)


def test_run_eagerly_is_refused(devices):
    model = keras_pipe.PipelineModel(unbuilt_stages(), devices=devices[:2])
    with pytest.raises(ValueError, match="run_eagerly=True is not supported"):
        model.compile("sgd", "mse", run_eagerly=True)


def test_logical_cpu_devices_after_initialization(devices):
    assert keras_pipe.logical_cpu_devices(len(devices)) == devices
    with pytest.raises(RuntimeError, match="Cannot create 2 logical CPU "
                       "devices: TensorFlow is already initialized with 4"):
        keras_pipe.logical_cpu_devices(2)
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        keras_pipe.logical_cpu_devices(0)


def test_other_keras_backend_is_refused():
    env = dict(os.environ, KERAS_BACKEND="numpy", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", "import keras_pipe"],
                          capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0
    assert "ImportError: keras_pipe needs the TensorFlow backend" in \
        proc.stderr
    assert "KERAS_BACKEND=tensorflow" in proc.stderr
