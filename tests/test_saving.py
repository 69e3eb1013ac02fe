"""Persistence: .keras round trip, stage-count independence, checkpoints,
resume, bad files."""

import io
import json
import os
import pathlib
import textwrap
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_pipe
from keras_pipe.engine import colocation
from keras_pipe.saving import files as saving
from tests.support import warm
from tests.support.data import random_data

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

IN_DIM, OUT_DIM = 6, 3


def layer_list(dropout=True):
    """The network, as a list of fresh layers (cut anywhere to make stages)."""
    layers = [keras.layers.Dense(8, activation="tanh"),
              keras.layers.BatchNormalization(),
              keras.layers.Dense(8, activation="tanh")]
    if dropout:
        layers.append(keras.layers.Dropout(0.3, seed=3))
    layers += [keras.layers.Dense(8, activation="tanh"),
               keras.layers.Dense(OUT_DIM)]
    return layers


def cut(layers, sizes):
    """Sequential stages of `sizes[j]` layers each; stage 0 has an Input."""
    stages, start = [], 0
    for j, size in enumerate(sizes):
        head = [keras.Input((IN_DIM,))] if j == 0 else []
        stages.append(keras.Sequential(head + layers[start:start + size]))
        start += size
    return stages


def pipeline(devices, sizes=(3, 3), num_micro_batches=2, dropout=True,
             compile=True):
    model = keras_pipe.PipelineModel(
        cut(layer_list(dropout), sizes), devices=devices[:len(sizes)],
        num_micro_batches=num_micro_batches, remat="always")
    model.build((None, IN_DIM))
    if compile:
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def data(n=16, seed=0):
    return random_data(n, (IN_DIM,), y_dim=OUT_DIM, seed=seed)


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def all_state(model):
    """Weights, seed states and optimizer variables, in a fixed order."""
    return values(model.variables) + values(model.optimizer.variables)


# ------------------------------------------------------------ round trip

def test_keras_round_trip_then_one_step_equals_one_more_step(devices, tmp_path):
    model = pipeline(devices)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)  # the stock Keras loader
    assert isinstance(loaded, keras_pipe.PipelineModel)
    assert (loaded.num_stages, loaded.devices, loaded.num_micro_batches,
            loaded.remat) == (2, devices[:2], 2, "always")
    assert loaded.compiled and loaded.loss == "mse"
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for v in loaded.stages[1].variables:
        assert v.value.device.endswith("CPU:1")
    assert_same(all_state(loaded), all_state(model))

    # Dropout draws a mask, BatchNormalization updates its statistics, Adam
    # uses its moments and step count: all must continue where they were.
    xb, yb = data(8, seed=1)
    model.fit(xb, yb, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(xb, yb, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_same(all_state(loaded), all_state(model))


def test_round_trip_keeps_xla_updates(devices, tmp_path):
    model = pipeline(devices)
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.xla_updates and colocation.xla_updates(loaded.optimizer)
    xb, yb = data(8, seed=1)
    model.fit(xb, yb, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(xb, yb, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_same(all_state(loaded), all_state(model))


def test_round_trip_of_stages_built_by_fit(devices, tmp_path):
    # Plain layers as stages, no Input anywhere: fit builds the pipeline.
    model = keras_pipe.PipelineModel(
        [keras.layers.Dense(5), keras.layers.Dense(OUT_DIM)],
        devices=devices[:2], num_micro_batches=2)
    model.compile("sgd", "mse")
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras_pipe.load_model(path)
    assert loaded.built
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))


def test_load_model_on_other_devices(devices, tmp_path):
    model = pipeline(devices, compile=False)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras_pipe.load_model(path, devices=devices[2:4])
    assert loaded.devices == devices[2:4]
    for stage, device in zip(loaded.stages, devices[2:4]):
        for v in stage.variables:
            assert v.value.device.endswith(device.split("/device:")[1])
    x, _ = data()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))


def test_load_model_with_devices_for_a_from_model_pipeline(devices, tmp_path):
    # Broke: load_model read the stage count from a "stages" config key that
    # from_model pipelines do not have, and refused any devices ("holds a
    # 0-stage model, but 2 devices were given").
    inputs = keras.Input((IN_DIM,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    source = keras.Model(inputs, keras.layers.Dense(OUT_DIM)(
        keras.layers.Dense(8)(h)))
    pipe = keras_pipe.PipelineModel.from_model(source, 2,
                                               devices=devices[:2])
    path = str(tmp_path / "cut.keras")
    pipe.save(path)
    for chosen in (devices[:2], devices[2:4]):
        loaded = keras_pipe.load_model(path, devices=chosen)
        assert loaded.devices == chosen
        assert [len(s.calls) for s in loaded.stages] == [
            len(s.calls) for s in pipe.stages]
        for stage, device in zip(loaded.stages, chosen):
            for v in stage.variables:
                assert v.value.device.endswith(device.split("/device:")[1])
    x, _ = data()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  pipe.predict(x, verbose=0))
    with pytest.raises(ValueError, match=(
            r"holds a 2-stage model, but 3 devices were given")):
        keras_pipe.load_model(path, devices=devices[:3])


def test_load_model_rejects_bad_devices_before_building(devices, tmp_path):
    path = str(tmp_path / "m.keras")
    pipeline(devices, compile=False).save(path)
    with pytest.raises(ValueError, match=r"holds a 2-stage model, but 1 "
                                         r"devices were given"):
        keras_pipe.load_model(path, devices=devices[:1])
    with pytest.raises(TypeError, match=r"devices must be a list"):
        keras_pipe.load_model(path, devices="/device:CPU:0")
    with pytest.raises(ValueError, match=r"devices\[1\]='/device:CPU:7' "
                                         r"names no device"):
        keras_pipe.load_model(path, devices=["/device:CPU:0", "/device:CPU:7"])


FALLBACK_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    import tensorflow as tf
    import keras_pipe
    assert len(tf.config.list_logical_devices()) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras_pipe.load_model(sys.argv[1])
    x = np.load(sys.argv[2])
    np.save(sys.argv[3], model.predict(x, verbose=0))
    print(json.dumps({
        "warnings": [str(w.message) for w in caught
                     if "keras_pipe" in str(w.message)],
        "devices": model.devices,
        "variable_devices": sorted({v.value.device for v in model.variables}),
    }))
""")


def test_load_saved_on_four_devices_in_a_one_device_process(devices, tmp_path):
    model = pipeline(devices, sizes=(2, 1, 2, 1))
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "m4.keras")
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    proc = warm.run(
        ["-c", FALLBACK_SCRIPT, path, str(tmp_path / "x.npy"),
         str(tmp_path / "y.npy")], warm.env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == ["/device:CPU:0"] * 4
    assert report["variable_devices"] == [
        "/job:localhost/replica:0/task:0/device:CPU:0"]
    assert len(report["warnings"]) == 1
    assert ("the saved devices ['/device:CPU:1', '/device:CPU:2', "
            "'/device:CPU:3'] do not exist") in report["warnings"][0]
    assert "keras_pipe.load_model()" in report["warnings"][0]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"),
                               model.predict(x, verbose=0), rtol=0, atol=1e-6)


# --------------------------------------------------- stage-count independence

def weight_keys(path):
    keys = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: keys.append(name) if isinstance(
            obj, h5py.Dataset) and not name.startswith("optimizer") else None)
    return sorted(keys)


def test_weights_do_not_depend_on_the_cut(devices, tmp_path):
    x, y = data()
    two = pipeline(devices, sizes=(3, 3))
    two.fit(x, y, batch_size=8, epochs=1, verbose=0)
    expected = two.predict(x, verbose=0)
    path2 = str(tmp_path / "two.weights.h5")
    two.save_weights(path2)

    three = pipeline(devices, sizes=(1, 2, 3), num_micro_batches=3)
    path3 = str(tmp_path / "three.weights.h5")
    three.save_weights(path3)
    assert weight_keys(path2) == weight_keys(path3)
    assert "layers/dense_3/vars/1" in weight_keys(path2)

    three.load_weights(path2)  # 2 stages -> 3 stages, optimizer included
    np.testing.assert_allclose(three.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)
    assert int(three.optimizer.iterations.numpy()) == 2

    # The plain unpipelined model reads the file with stock Keras.
    plain = keras.Sequential([keras.Input((IN_DIM,))] + layer_list())
    plain.load_weights(path2, skip_mismatch=False)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)
    # ... and the other way round.
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)
    one = pipeline(devices, sizes=(6,), num_micro_batches=1, compile=False)
    one.load_weights(plain_path)
    np.testing.assert_allclose(one.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)


def test_from_model_pipeline_round_trip_and_recut(devices, tmp_path):
    inputs = keras.Input((IN_DIM,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    a, b = keras.layers.Dense(8)(h), keras.layers.Dense(8)(h)
    z = keras.layers.Dropout(0.2, seed=1)(keras.layers.Add()([a, b]))
    outputs = keras.layers.Dense(OUT_DIM)(keras.layers.Concatenate()([z, h]))
    source = keras.Model(inputs, outputs)
    x, y = data()

    pipe = keras_pipe.PipelineModel.from_model(
        source, num_stages=3, devices=devices[:3], num_micro_batches=2)
    pipe.compile("adam", "mse")
    pipe.fit(x, y, batch_size=8, epochs=1, verbose=0)
    expected = pipe.predict(x, verbose=0)
    path = str(tmp_path / "cut.keras")
    pipe.save(path)
    loaded = keras_pipe.load_model(path)
    assert [len(s.calls) for s in loaded.stages] == [
        len(s.calls) for s in pipe.stages]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)

    # Into the plain model (to_model) and into the same network cut in 2.
    plain = loaded.to_model()
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)
    weights = str(tmp_path / "cut.weights.h5")
    pipe.save_weights(weights)
    other = keras.models.clone_model(source)
    other.load_weights(weights)
    recut = keras_pipe.PipelineModel.from_model(
        other, num_stages=2, devices=devices[2:4], num_micro_batches=4)
    np.testing.assert_allclose(recut.predict(x, verbose=0), expected,
                               rtol=0, atol=1e-6)


# --------------------------------------------------------------- checkpoints

def test_model_checkpoint_weights_and_whole_model(devices, tmp_path):
    model = pipeline(devices)
    x, y = data()
    snapshots = []
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[
                  keras.callbacks.ModelCheckpoint(
                      str(tmp_path / "{epoch}.weights.h5"),
                      save_weights_only=True),
                  keras.callbacks.ModelCheckpoint(str(tmp_path / "{epoch}.keras")),
                  keras.callbacks.LambdaCallback(
                      on_epoch_end=lambda e, logs: snapshots.append(
                          all_state(model)))])
    for epoch in (1, 2):
        whole = keras_pipe.load_model(str(tmp_path / f"{epoch}.keras"))
        assert_same(all_state(whole), snapshots[epoch - 1])
        fresh = pipeline(devices, sizes=(2, 4))
        fresh.optimizer.build(fresh.trainable_variables)
        fresh.load_weights(str(tmp_path / f"{epoch}.weights.h5"))
        assert_same(all_state(fresh), snapshots[epoch - 1])


class Interrupt(keras.callbacks.Callback):
    """Raises in the middle of an epoch, as a preemption would."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("preempted")


def fit_two_epochs(devices, callbacks):
    keras.utils.set_random_seed(7)
    model = pipeline(devices)
    x, y = data(24)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model


@pytest.fixture(scope="module")
def uninterrupted():
    from tests.conftest import DEVICES
    return all_state(fit_two_epochs(list(DEVICES), []))


@pytest.mark.parametrize("backup_class,save_freq", [
    (keras_pipe.BackupAndRestore, 1),
    (keras.callbacks.BackupAndRestore, "epoch"),
])
def test_interrupted_fit_resumes_exactly(devices, tmp_path, backup_class,
                                         save_freq, uninterrupted):
    # keras_pipe's callback resumes after batch 1 of epoch 1; the stock one
    # (backups at epoch ends) runs epoch 1 again from its start.
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        fit_two_epochs(devices, [backup_class(backup_dir, save_freq=save_freq),
                                 Interrupt(epoch=1, batch=1)])
    resumed = fit_two_epochs(
        devices, [backup_class(backup_dir, save_freq=save_freq)])
    assert int(resumed.optimizer.iterations.numpy()) == 6
    assert_same(all_state(resumed), uninterrupted)
    assert not os.path.exists(backup_dir)


def test_backup_position_must_match_optimizer_state(devices, tmp_path):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="preempted"):
        fit_two_epochs(devices, [keras_pipe.BackupAndRestore(
            backup_dir, save_freq=1), Interrupt(epoch=0, batch=1)])
    weights = os.path.join(backup_dir, "latest.weights.h5")
    with h5py.File(weights, "a") as f:
        position = json.loads(f.attrs["keras_pipe_resume"])
        position["iterations"] += 5
        f.attrs["keras_pipe_resume"] = json.dumps(position)
    with pytest.raises(ValueError, match=r"after 7 optimizer steps, but its "
                                         r"optimizer state holds 2"):
        fit_two_epochs(devices, [keras_pipe.BackupAndRestore(
            backup_dir, save_freq=1)])


# ----------------------------------------------------------------- bad files

@pytest.fixture
def saved(devices, tmp_path):
    path = str(tmp_path / "good.keras")
    pipeline(devices, sizes=(2, 2, 2)).save(path)
    return path


def rewrite_zip(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            data = edit(name, zin.read(name))
            if data is not None:
                zout.writestr(name, data)


def drop_h5_groups(data, prefixes):
    buffer = io.BytesIO(data)
    with h5py.File(buffer, "a") as f:
        for prefix in prefixes:
            del f[prefix]
    return buffer.getvalue()


def test_bad_files_name_the_file_and_the_problem(saved, tmp_path):
    raw = open(saved, "rb").read()
    cases = {}
    cases["missing.keras"] = (None, r"no such file")
    (tmp_path / "text.keras").write_text("not a model")
    cases["text.keras"] = (None, r"is not a .keras file \(a .keras file is a "
                                 r"zip archive; this one starts with b'not ")
    (tmp_path / "truncated.keras").write_bytes(raw[:len(raw) // 2])
    cases["truncated.keras"] = (None, r"the .keras zip archive is truncated")
    at = raw.find(b'"class_name"')  # .keras members are stored, not deflated
    (tmp_path / "damaged.keras").write_bytes(
        raw[:at] + b"'" + raw[at + 1:])
    cases["damaged.keras"] = (None, r"the member 'config.json' of the archive "
                                    r"is damaged \(CRC mismatch\)")
    keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]).save(
        str(tmp_path / "sequential.keras"))
    cases["sequential.keras"] = (None, r"it holds a 'Sequential' model, not a "
                                       r"keras_pipe PipelineModel")
    rewrite_zip(saved, str(tmp_path / "no_weights.keras"),
                lambda name, data: None if name.endswith(".h5") else data)
    cases["no_weights.keras"] = (None, r"the archive has no \['model.weights.h5'\]")
    # Stage 1 holds dense_1 (layers/dense_1) and dropout; drop its weights.
    rewrite_zip(saved, str(tmp_path / "no_stage.keras"),
                lambda name, data: drop_h5_groups(data, ["layers/dense_1"])
                if name.endswith(".h5") else data)
    cases["no_stage.keras"] = (None, r"the weights of stage 1 \('sequential_\d+'"
                                     r"\) are missing: no group for 'dense_\d+' "
                                     r"\(layers/dense_1\)")
    for name, (_, match) in cases.items():
        path = str(tmp_path / name)
        with pytest.raises(ValueError, match=match) as info:
            keras_pipe.load_model(path)
        assert repr(path) in str(info.value) or path in str(info.value), name


def test_failed_load_weights_leaves_the_model_unchanged(devices, tmp_path):
    model = pipeline(devices)
    model.optimizer.build(model.trainable_variables)
    before = all_state(model)
    good = str(tmp_path / "good.weights.h5")
    model.save_weights(good)
    other = pipeline(devices)
    other.optimizer.build(other.trainable_variables)
    bad = str(tmp_path / "bad.weights.h5")
    other.save_weights(bad)
    with h5py.File(bad, "a") as f:
        del f["layers/dense_3"]
    with pytest.raises(ValueError, match=r"'.*bad.weights.h5' does not fit "
                                         r"this 2-stage PipelineModel.*stage 1"):
        model.load_weights(bad)
    assert_same(all_state(model), before)

    # A late failure (inside Keras, after the layers) restores them too
    # (the file's checksum removed: it would refuse the edit first).
    with h5py.File(good, "a") as f:
        f["_seed_states/vars/1"] = np.zeros(2, "uint32")
        del f.attrs["keras_pipe_sha256"]
    other_before = all_state(other)
    with pytest.raises(ValueError, match=r"(?s)its weights are left "
                                         r"unchanged.*2 seed generator states"):
        other.load_weights(good)
    assert_same(all_state(other), other_before)
    truncated = str(tmp_path / "truncated.weights.h5")
    with open(bad, "rb") as f:
        data_ = f.read()
    with open(truncated, "wb") as f:
        f.write(data_[:len(data_) // 3])
    with pytest.raises(ValueError, match=r"truncated.weights.h5': it is not "
                                         r"a readable HDF5 weights file "
                                         r"\(truncated or damaged"):
        model.load_weights(truncated)


def test_stock_loader_reports_missing_stage(saved, tmp_path):
    path = str(tmp_path / "no_stage.keras")
    rewrite_zip(saved, path,
                lambda name, data: drop_h5_groups(data, ["layers/dense_2"])
                if name.endswith(".h5") else data)
    with pytest.raises(ValueError, match=r"the weights of stage 2"):
        keras.saving.load_model(path)


def test_flat_layers_open_nested_models():
    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(2)])
    stage = keras.Sequential([keras.Input((2,)), inner, keras.layers.Dense(1)])
    names = [p for _, _, p in saving.weight_paths([stage, keras.layers.Dense(1)])]
    assert names == ["layers/dense", "layers/dense_1", "layers/dense_2",
                     "layers/dense_3"]


# ------------------------------------------------------------ atomic saves

SAVE_SCENARIOS = str(pathlib.Path(__file__).parent / "support" / "save_scenarios.py")


def _values(model):
    return [v.numpy() for v in model.variables + model.optimizer.variables]


def test_failed_save_keeps_the_previous_file(devices, tmp_path, monkeypatch):
    # Keras writes in place: an error (or a crash) in the middle of a save
    # destroyed the previous file. Now it stays, and no temporary is left.
    model = pipeline(devices)
    paths = {"keras": str(tmp_path / "m.keras"),
             "weights": str(tmp_path / "m.weights.h5")}
    for fmt, path in paths.items():
        checkpoint = keras.callbacks.ModelCheckpoint(
            path, save_weights_only=fmt == "weights")
        checkpoint.set_model(model)
        checkpoint.on_epoch_end(0, {})
    before = all_state(model)
    for v in model.variables:
        v.assign(v + 1.0)
    create = h5py.Group.create_dataset
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return create(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", failing)
    for save, path in ((model.save, paths["keras"]),
                       (model.save_weights, paths["weights"])):
        calls.clear()
        with pytest.raises(OSError, match="disk full"):
            save(path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]
    reloaded = keras_pipe.load_model(paths["keras"], devices=devices[:2])
    for a, b in zip(all_state(reloaded), before):
        np.testing.assert_array_equal(a, b)
    fresh = pipeline(devices)
    fresh.load_weights(paths["weights"])
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a + 1.0, b)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["keras", "weights"])
def test_kill_during_checkpoint_keeps_the_previous_file(devices, tmp_path,
                                                        fmt):
    """SIGKILL a child at 3 points of a 70 MB ModelCheckpoint save."""
    from tests.support import save_scenarios
    points = ["first_write", "middle_write", "rename"]
    suffix = ".keras" if fmt == "keras" else ".weights.h5"
    # Children of the warm process (tests/support/warm.py), one at a time.
    done = {point: warm.run(
        [SAVE_SCENARIOS, str(tmp_path / f"{point}{suffix}"), fmt, point],
        warm.env(), timeout=300) for point in points}
    model = save_scenarios.make_model(devices[:2])
    for point, proc in done.items():
        out, err = proc.stdout, proc.stderr
        assert out.splitlines() == ["SAVED"], (point, out, err[-2000:])
        assert proc.returncode == -9, (point, err[-2000:])
        path = str(tmp_path / f"{point}{suffix}")
        save_scenarios.fill(model, 0.0)
        if fmt == "keras":
            loaded = keras_pipe.load_model(path, devices=devices[:2])
        else:
            model.load_weights(path)
            loaded = model
        values = _values(loaded)
        # 12 kernels and biases, their 24 Adam slots, iterations, rate.
        assert len(values) == 38, len(values)
        # The first save, intact: every value 1.0 (the second wrote 2.0).
        for value in values:
            np.testing.assert_array_equal(value, np.ones_like(value))
