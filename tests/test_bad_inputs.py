"""Bad worker flags, connect() and plan() arguments: clear errors, nothing started.

Each case names the bad value and the fix (docs/reliability.md, "Bad inputs").
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_pipe
from keras_pipe.distributed import worker as worker_lib
from tests.support import warm
from tests.support.ports import free_port

NOT_HERE = "192.0.2.1"  # TEST-NET-1: documentation only, on no machine.


def _exit_message(argv, capsys, monkeypatch):
    """Runs the worker's main(argv); returns its exit message."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as info:
        worker_lib.main(argv)
    code = info.value.code
    return code if isinstance(code, str) else capsys.readouterr().err


def _cluster():
    return f"127.0.0.1:{free_port()}"


WORKER_CASES = [
    # (flags, expected text)
    (["--intra-op-threads", "-3"],
     "'-3' is not a thread count; pass an int >= 1"),
    (["--inter-op-threads", "0"], "'0' is not a thread count"),
    (["--intra-op-threads", "two"], "'two' is not a thread count"),
    (["--task", "-1"], "'-1' is not a task index; pass an int >= 0"),
    (["--task", "5"], "Task 5 of job 'worker' is not in the cluster"),
    (["--job", "ps", "--cluster", '{"worker": ["127.0.0.1:2222"]}'],
     "Task 0 of job 'ps' is not in the cluster"),
    (["--cluster", "{'worker': 1"], "--cluster is not valid JSON"),
    (["--cluster", "[1, 2]"], "must be host:port with a port in 1..65535"),
    (["--cluster", "127.0.0.1:99999"], "Received: '127.0.0.1:99999'"),
    (["--cluster", "127.0.0.1"], "must be host:port"),
    (["--cluster", "no-such-host.invalid:2222"], "does not resolve"),
    (["--bind", "localhost"], "not a host name. Received: bind='localhost'"),
    (["--bind", NOT_HERE], f"bind='{NOT_HERE}' is not an address of this "
                           "machine"),
    (["--bind", "127.0.0.2"], "bind='127.0.0.2' differs from this task's "
                              "cluster address"),
    (["--cpu-affinity", "x"], "'x' is not a CPU list"),
    (["--cpu-affinity", "4096"], "cpu_affinity names CPUs [4096] this "
                                 "process cannot run on"),
    ([], "--cluster is required when TF_CONFIG is unset"),
]


@pytest.mark.parametrize("flags, expected", WORKER_CASES,
                         ids=[" ".join(f) or "no-cluster"
                              for f, _ in WORKER_CASES])
def test_bad_worker_flag_is_named(flags, expected, capsys, monkeypatch):
    argv = ["--task", "0"] + flags
    if "--cluster" not in flags and flags:
        argv += ["--cluster", _cluster()]
    if "--task" in flags:
        argv = argv[2:]
    message = _exit_message(argv, capsys, monkeypatch)
    assert expected in message, message


def test_port_in_use_is_named(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = _exit_message(
            ["--task", "0", "--cluster", f"127.0.0.1:{port}"], capsys,
            monkeypatch)
    assert f"Port {port} on 127.0.0.1 is not free" in message, message


def test_negative_thread_count_exits_cleanly_not_abort():
    # Broke: TF's check aborted the process (SIGABRT) on -3 threads.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "keras_pipe.distributed.worker", "--task", "0",
         "--cluster", _cluster(), "--intra-op-threads", "-3"],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "is not a thread count; pass an int >= 1" in result.stderr


@pytest.mark.parametrize("bind, error, expected", [
    ("localhost", ValueError, "not a host name"),
    (NOT_HERE, ValueError, "is not an address of this machine"),
    (2222, TypeError, "bind must be an IP address string"),
])
def test_bad_connect_bind_is_named_before_connecting(bind, error, expected):
    with pytest.raises(error, match=expected):
        keras_pipe.connect({"worker": ["127.0.0.1:1"]}, timeout=1.0,
                           bind=bind)


def test_connect_bind_other_than_the_clients_cluster_address():
    cluster = {"worker": ["127.0.0.1:1"], "localhost": ["127.0.0.2:3"]}
    with pytest.raises(ValueError, match="bind='127.0.0.2'"):
        keras_pipe.connect(cluster, timeout=1.0)


def _small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("kwargs, error, expected", [
    ({"optimizer_slots": -1}, ValueError,
     r"optimizer_slots must be >= 0. Received: optimizer_slots=-1"),
    ({"optimizer_slots": 1.5}, TypeError, r"optimizer_slots must be an int"),
    ({"flops_per_second": -1e12}, ValueError,
     r"flops_per_second must be > 0. Received: flops_per_second=-1"),
    ({"flops_per_second": 0}, ValueError, r"flops_per_second must be > 0"),
    ({"flops_per_second": float("nan")}, ValueError,
     r"flops_per_second must be a finite number"),
])
def test_bad_plan_numbers_are_named(kwargs, error, expected):
    # Broke: negative values printed negative times and memory.
    with pytest.raises(error, match=expected):
        keras_pipe.plan(_small_model(), num_stages=2, **kwargs)


# ------------------------------------------- issue 26: the probe's cases


@pytest.mark.parametrize("kwargs, error, expected", [
    # Broke: timeout=nan never returned (100% CPU).
    ({"timeout": float("nan")}, ValueError,
     r"timeout must be a finite number. Received: timeout=nan"),
    ({"timeout": float("inf")}, ValueError, r"timeout must be a finite"),
    ({"timeout": "5"}, TypeError, r"timeout must be a number"),
    # Broke: "'<' not supported between instances of 'int' and 'str'".
    ({"job_name": 5}, TypeError,
     r"job_name must be a string of letters.*Received: job_name=5"),
    ({"job_name": "a/b"}, TypeError, r"Received: job_name='a/b'"),
])
def test_bad_connect_arguments_are_named_first(kwargs, error, expected):
    with pytest.raises(error, match=expected):
        keras_pipe.connect({"worker": ["127.0.0.1:1"]}, **kwargs)


@pytest.mark.parametrize("addresses, expected", [
    # Broke: each waited the whole timeout, then said "Start the worker".
    (["127.0.0.1:abc"], r"task:0: '127.0.0.1:abc' is not host:port with a "
     r"port in 1..65535"),
    (["127.0.0.1:99999"], r"'127.0.0.1:99999' is not host:port"),
    (["127.0.0.1"], r"'127.0.0.1' is not host:port"),
    ([":2222"], r"':2222' is not host:port"),
    # Broke: "device listing did not finish within 30 s" after 0.5 s.
    (["127.0.0.1:2222", "127.0.0.1:2222"],
     r"task:1: '127.0.0.1:2222' is also the address of "
     r"/job:worker/replica:0/task:0 \(each task needs its own\)"),
])
def test_malformed_and_repeated_addresses_are_refused_before_connecting(
        addresses, expected):
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"Bad cluster addresses: .*"
                       f"{expected}.*Fix the cluster spec"):
        keras_pipe.connect({"worker": addresses}, timeout=30.0)
    # Refused at once, without waiting for the timeout (30 s).
    assert time.monotonic() - start < 15.0


def test_plan_devices_must_be_a_list():
    # Broke: devices="/GPU:0" planned 6 stages (the string's length).
    with pytest.raises(TypeError, match=r"devices must be a list of device "
                       r"strings.*Received: devices='/GPU:0'"):
        keras_pipe.plan(_small_model(), devices="/GPU:0")
    # Broke: an unknown schedule was ignored without memory_budget.
    with pytest.raises(ValueError, match=r"schedule must be one of .*"
                       r"Received: schedule='nope'"):
        keras_pipe.plan(_small_model(), num_stages=2, schedule="nope")


def _pipeline(devices):
    model = keras_pipe.PipelineModel(
        [keras.layers.Dense(4), keras.layers.Dense(2)], devices=devices[:2],
        num_micro_batches=1)
    model.build((None, 3))
    return model


def test_export_pipelined_must_be_a_bool(devices, tmp_path):
    # Broke: pipelined="no" exported the pipelined SavedModel.
    with pytest.raises(TypeError, match=r"pipelined must be True or False. "
                       r"Received: pipelined='no'"):
        _pipeline(devices).export(str(tmp_path / "m"), pipelined="no")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("args, kwargs, error, expected", [
    ((None,), {}, TypeError, r"filepath must be the path of a .keras file.*"
     r"Received: filepath=None of type NoneType"),
    ((123,), {}, TypeError, r"Received: filepath=123 of type int"),
    (("m.keras",), {"custom_objects": "x"}, TypeError,
     r"custom_objects must be a dict .*Received: custom_objects='x'"),
])
def test_load_model_arguments(args, kwargs, error, expected):
    with pytest.raises(error, match=expected):
        keras_pipe.load_model(*args, **kwargs)


@pytest.mark.parametrize("method, name, error, expected", [
    # Broke: each named a temporary file (".85993cfc.tmp.m.txt").
    ("save", "m.txt", ValueError, r"Invalid filepath extension.*Received: "
     r"filepath={path}"),
    ("save_weights", "w.h5", ValueError, r"must end in `.weights.h5`. "
     r"Received: filepath={path}"),
    ("save", "missing/m.keras", FileNotFoundError,
     r"Cannot save '{path}': the folder '.*missing' does not exist"),
    ("save_weights", "missing/m.weights.h5", FileNotFoundError,
     r"Cannot save '{path}': the folder"),
])
def test_save_errors_name_the_users_path(devices, tmp_path, method, name,
                                         error, expected):
    path = str(tmp_path / name)
    with pytest.raises(error, match=expected.format(path=re.escape(path))) \
            as info:
        getattr(_pipeline(devices), method)(path)
    assert ".tmp." not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------- issue 26: what the probe still found


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_no_input_data_is_named(devices, method):
    # Broke: fit(None, y) raised AttributeError: 'NoneType' object has no
    # attribute 'shape' (plain Keras: ValueError, the input is not optional).
    model = _pipeline(devices)
    model.compile("sgd", "mse")
    y = np.zeros((4, 2), "float32")
    args = (None,) if method == "predict" else (None, y)
    with pytest.raises(ValueError, match=rf"{method}\(\) needs input data: "
                       r"x is None.*Received: x=None"):
        getattr(model, method)(*args, verbose=0)
    with pytest.raises(ValueError, match=r"x is None"):
        getattr(model, method)(x=None, verbose=0)


@pytest.mark.parametrize("input_shape, error, expected", [
    ("x", TypeError, r"input_shape must be a shape such as \(None, 128\).*"
     r"Received: input_shape='x'"),
    ((None, 5), ValueError, r"input_shape for .* is \(None, 5\), but the "
     r"input has shape \(None, 4\)"),
])
def test_from_model_input_shape_checked_for_any_balance(
        devices, input_shape, error, expected):
    # Broke: balance="params" (the default) never read input_shape, so a
    # string was silently accepted.
    with pytest.raises(error, match=expected):
        keras_pipe.PipelineModel.from_model(
            _small_model(), num_stages=2, devices=devices[:2],
            input_shape=input_shape)


def _flip_bytes_inside(path, dataset_path, count=8):
    """Flips `count` bytes in the stored values of one dataset of an h5 file."""
    with h5py.File(path, "r") as f:
        offset = f[dataset_path].id.get_offset()
        size = f[dataset_path].id.get_storage_size()
    assert offset is not None and size >= count
    with open(path, "r+b") as f:
        f.seek(offset + (size - count) // 2)
        data = f.read(count)
        f.seek(offset + (size - count) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def test_weights_file_with_flipped_bytes_is_refused(devices, tmp_path):
    # Broke: 8 flipped bytes inside a kernel loaded silently (as in plain
    # Keras): a value off by 5e26.
    model = _pipeline(devices)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    _flip_bytes_inside(path, "layers/dense/vars/0")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=(
            rf"Cannot load {re.escape(repr(path))}: the values of "
            r"\['layers/dense/vars/0'\] do not match the SHA-256 checksums.*"
            r"Use an intact copy of the file, or save the weights again")):
        model.load_weights(path)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_weights_files_without_checksums_still_load(devices, tmp_path):
    # A plain Keras file (no checksum) loads into the pipeline, and plain
    # Keras loads the pipeline's file (it ignores the checksums).
    plain = _small_model()
    plain_path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(plain_path)
    with h5py.File(plain_path, "r") as f:
        assert "keras_pipe_sha256" not in f.attrs
    pipe = keras_pipe.PipelineModel.from_model(
        _small_model(), num_stages=2, devices=devices[:2])
    pipe.load_weights(plain_path)
    for a, b in zip(pipe.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    pipe_path = str(tmp_path / "pipe.weights.h5")
    for v in pipe.variables:
        v.assign(v + 1.0)
    pipe.save_weights(pipe_path)
    plain.load_weights(pipe_path)
    for a, b in zip(pipe.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_weights_added_to_a_checksummed_file_are_refused(devices, tmp_path):
    model = _pipeline(devices)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r+") as f:
        del f["layers/dense_1/vars/1"].attrs["keras_pipe_sha256"]
    with pytest.raises(ValueError, match=r"its list of weights does not "
                       r"match the checksum.*'layers/dense_1/vars/1'"):
        model.load_weights(path)


def test_keras_file_with_flipped_bytes_in_its_weights_is_refused(
        devices, tmp_path):
    # Keras writes the weights inside a .keras file; the zip's CRC-32 of
    # each member is checked on loading (this passed before issue 26 too).
    model = _pipeline(devices)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(f.read(4), "<u2")
        start = info.header_offset + 30 + name_len + extra_len
        f.seek(start + info.compress_size // 2)
        data = f.read(8)
        f.seek(start + info.compress_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    for load in (lambda: keras_pipe.load_model(path),
                 lambda: model.load_weights(path)):
        with pytest.raises(ValueError, match=rf"Cannot load "
                           rf"{re.escape(repr(path))}: .*damaged"):
            load()


_FULL_DISK = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() gets EFBIG
import keras, numpy as np, keras_pipe
devices = keras_pipe.logical_cpu_devices(2)
model = keras_pipe.PipelineModel(
    [keras.layers.Dense(64), keras.layers.Dense(2)], devices=devices)
model.build((None, 3))
model.compile("sgd", "mse")
folder = sys.argv[1]
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
for name, save in [
        ("full.weights.h5", lambda p: model.save_weights(p)),
        ("backup", lambda p: model.fit(
            np.zeros((4, 3)), np.zeros((4, 2)), verbose=0,
            callbacks=[keras_pipe.BackupAndRestore(p, save_freq=1)]))]:
    try:
        save(os.path.join(folder, name))
    except OSError as exc:
        print("ERROR", str(exc).splitlines()[0], flush=True)
print("DONE", flush=True)
"""


@pytest.mark.slow
def test_full_disk_during_weights_saves_names_the_path_and_exits_cleanly(
        tmp_path):
    # Broke: libhdf5 failed a write (EFBIG), the save raised, and the
    # process segfaulted at exit (return code -11), leaving a temporary
    # file. Now the h5 file is made in memory and written by Python.
    result = warm.run(["-c", _FULL_DISK, str(tmp_path)], warm.env(),
                      timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    lines = [l for l in result.stdout.splitlines() if l.startswith("ERROR")]
    weights = str(tmp_path / "full.weights.h5")
    backup = str(tmp_path / "backup" / "latest.weights.h5")
    assert lines == [
        f"ERROR [Errno 27] Cannot save {weights!r}: File too large: "
        f"{weights!r}",
        f"ERROR [Errno 27] Cannot save {backup!r}: File too large: "
        f"{backup!r}"], result.stdout
    assert "DONE" in result.stdout
    assert os.listdir(tmp_path) == ["backup"]
    assert os.listdir(tmp_path / "backup") == []


# ------------------------- issue 26: V and interleaved files on fewer devices


@pytest.mark.parametrize("schedule, k, available, can_recut, expected", [
    ("interleaved_1f1b", 8, 2, False, (8, [0, 1] * 4)),
    ("interleaved_1f1b", 8, 3, False, (8, [0, 1] * 4)),
    ("zbv", 8, 4, False, (8, [0, 1, 2, 3, 3, 2, 1, 0])),
    ("zbv", 8, 2, True, (4, [0, 1, 1, 0])),
    ("zbv", 8, 3, True, (6, [0, 1, 2, 2, 1, 0])),
    ("gpipe", 4, 2, False, (4, [0, 0, 1, 1])),
])
def test_fallback_layout_is_one_the_schedule_accepts(
        schedule, k, available, can_recut, expected):
    from keras_pipe.engine import schedule as schedule_lib
    from keras_pipe.saving import layout
    num_stages, indices = layout.fit(schedule, k, available, can_recut)
    assert (num_stages, indices) == expected
    schedule_lib.check_placement(schedule, indices)


def test_zbv_that_cannot_be_recut_names_the_device_counts_that_work():
    from keras_pipe.saving import layout
    with pytest.raises(ValueError, match=(
            r"schedule='zbv' runs the saved 8 stages on \[4\] devices, and 2 "
            r"exist here. Load it where 4 devices exist.*pass devices=\[...\]"
            r" \(8 device strings, in the order \[0, 1, 2, 3, 3, 2, 1, 0\]")):
        layout.fit("zbv", 8, 2, can_recut=False)


def test_load_model_with_devices_the_schedule_refuses(devices, tmp_path):
    # Broke: the refusal named the model's schedule rule only; now it says
    # which device counts work for the saved stages.
    model = keras_pipe.PipelineModel.from_model(
        _eight_layers(), num_stages=8, devices=_v(devices), schedule="zbv")
    path = str(tmp_path / "zbv.keras")
    model.save(path)
    with pytest.raises(ValueError, match=(
            rf"Cannot load {re.escape(repr(path))} on devices=.*runs 2 "
            r"stages per device.*"
            r"With 8 stages, schedule='zbv' runs on \[4\] devices \(device "
            r"indices in the order \[0, 1, 2, 3, 3, 2, 1, 0\]\)")):
        keras_pipe.load_model(path, devices=devices[:2] * 4)


def _eight_layers():
    return keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(4) for _ in range(7)] + [keras.layers.Dense(2)])


def _v(devices):
    return devices[:4] + devices[:4][::-1]


_FEWER_DEVICES = """
import json, sys, warnings
import numpy as np, keras_pipe
keras_pipe.logical_cpu_devices(2)
x = np.load(sys.argv[1])
out = {}
for name in sys.argv[2:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras_pipe.load_model(name)
    out[name] = {"num_stages": model.num_stages, "devices": model.devices,
                 "schedule": model.schedule,
                 "warnings": [str(w.message) for w in caught
                              if "keras_pipe" in str(w.message)]}
    model.compile("sgd", "mse")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    model.load_weights(name)
    np.save(name + ".npy", model.predict(x, verbose=0))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_v_and_interleaved_files_load_on_two_devices(devices, tmp_path):
    # Broke: saved on 4 devices and loaded where 2 exist, an
    # interleaved_1f1b file got a block layout its schedule refused, and a
    # zbv file with 8 stages could not load at all.
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    names, expected = [], {}
    for schedule, stage_devices in [("zbv", _v(devices)),
                                    ("interleaved_1f1b", devices[:4] * 2)]:
        model = keras_pipe.PipelineModel.from_model(
            _eight_layers(), num_stages=8, devices=stage_devices,
            schedule=schedule, num_micro_batches=2)
        model.compile("sgd", "mse")
        name = str(tmp_path / f"{schedule}.keras")
        model.save(name)
        names.append(name)
        expected[name] = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    result = warm.run(["-c", _FEWER_DEVICES, str(tmp_path / "x.npy"),
                       *names], warm.env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    zbv, inter = report[names[0]], report[names[1]]
    cpu = "/device:CPU:{}".format
    assert zbv["num_stages"] == 4 and zbv["schedule"] == "zbv"
    assert zbv["devices"] == [cpu(0), cpu(1), cpu(1), cpu(0)]
    assert "cut again into 4 stages (balance=[2, 2, 2, 2]" in \
        zbv["warnings"][0]
    assert inter["num_stages"] == 8
    assert inter["devices"] == [cpu(0), cpu(1)] * 4
    for name in names:
        np.testing.assert_allclose(np.load(name + ".npy"), expected[name],
                                   rtol=0, atol=1e-6)


# --------------------------------------- issue 26: a worker out of memory


def test_exit_of_a_started_process_is_explained(tmp_path):
    from keras_pipe.distributed import exits
    log = tmp_path / "w.log"
    cases = {
        "killed": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                   r"killed by SIGKILL, the signal the kernel's out-of-memory "
                   r"killer \(or a memory limit\) sends: it most likely ran "
                   r"out of memory"),
        "bad_alloc": ("import os; print(\"terminate called after throwing an "
                      "instance of 'std::bad_alloc'\", flush=True); "
                      "os.abort()",
                      r"ran out of memory and exited with code -6: its log "
                      r"says \"terminate called .*std::bad_alloc'\""),
        "other": ("print('bye'); raise SystemExit(3)",
                  r"exited with code 3; its log ends: 'bye'"),
    }
    for name, (code, expected) in cases.items():
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=out,
                                    stderr=subprocess.STDOUT)
        task = f"/job:test/replica:0/task:{name}"
        exits.started(task, proc, log)
        try:
            assert re.search(expected, exits.why_ended(task, wait=30)), name
        finally:
            exits.stopped(task)
    assert exits.why_ended("/job:test/replica:0/task:none") is None


_OUT_OF_MEMORY = """
import os, signal, sys, threading, time
import numpy as np, keras, keras_pipe


def worker_pid(task):
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (parent == os.getpid() and b"keras_pipe.distributed.worker" in argv
                and argv[argv.index(b"--task") + 1] == str(task).encode()):
            return int(pid)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def cap(pid, limit_mb, stop):
    # A memory limit as the kernel enforces one: SIGKILL above it.
    while not stop.is_set():
        try:
            if rss_mb(pid) > limit_mb:
                os.kill(pid, signal.SIGKILL)
                return
        except (OSError, TypeError):
            return
        time.sleep(0.02)


when = sys.argv[1]
with keras_pipe.local_workers(num_workers=2) as devices:
    pid = worker_pid(1)
    width = 2048 if when == "build" else 1024
    stages = [keras.Sequential([keras.layers.Dense(8)]),
              keras.Sequential([keras.layers.Dense(width)
                                for _ in range(4 if when == "build" else 3)])]
    model = keras_pipe.PipelineModel(stages, devices=devices)
    stop = threading.Event()
    try:
        if when == "fit":
            model.build((None, 8))
            model.compile("sgd", "mse")
            model.fit(np.zeros((8, 8), "float32"),
                      np.zeros((8, width), "float32"), verbose=0)
        limit = rss_mb(pid) + (40 if when == "build" else 100)
        threading.Thread(target=cap, args=(pid, limit, stop),
                         daemon=True).start()
        if when == "build":
            model.build((None, 8))  # stage 1: 4 x 2048 x 2048 floats, 64 MB
        else:  # stage 1's activations: 80 MB each
            model.fit(np.zeros((20000, 8), "float32"),
                      np.zeros((20000, width), "float32"),
                      batch_size=20000, epochs=3, verbose=0)
        print("NO ERROR", flush=True)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc).replace("\\n", " "),
              flush=True)
    finally:
        stop.set()
    print("PID", pid, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["build", "fit"])
def test_worker_out_of_memory_is_named(when):
    # Broke: at build a ValueError "stages[1] cannot take the output of
    # stages[0] ... Connection reset by peer"; during fit a
    # WorkerUnavailableError naming the task but no stage and no memory.
    result = warm.run(["-c", _OUT_OF_MEMORY, when], warm.env(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    error = [l for l in result.stdout.splitlines() if l.startswith("ERROR")]
    pid = [l.split()[1] for l in result.stdout.splitlines()
           if l.startswith("PID")]
    assert error and pid, result.stdout
    assert re.search(
        r"ERROR WorkerUnavailableError Lost /job:worker/replica:0/task:1 at "
        rf"127.0.0.1:\d+, which held stage 1 \(its process \(pid {pid[0]}\) "
        r"was killed by SIGKILL.*it most likely ran out of memory.*\) "
        rf"during {when}\. Restart the worker", error[0]), error[0]


def test_damaged_backup_is_refused_at_restore(tmp_path):
    # BackupAndRestore writes checksums for any Keras model and checks them
    # before restoring (a plain model's load_weights would not).
    model = _small_model()
    model.compile("sgd", "mse")
    x, y = np.zeros((4, 4), "float32"), np.zeros((4, 2), "float32")
    backup_dir = str(tmp_path / "backup")
    model.fit(x, y, verbose=0, callbacks=[keras_pipe.BackupAndRestore(
        backup_dir, save_freq=1, delete_checkpoint=False)])
    path = os.path.join(backup_dir, "latest.weights.h5")
    _flip_bytes_inside(path, "layers/dense/vars/0")
    with pytest.raises(ValueError, match=(
            rf"Cannot load {re.escape(repr(path))}: the values of "
            r"\['layers/dense/vars/0'\] do not match the SHA-256")):
        model.fit(x, y, verbose=0,
                  callbacks=[keras_pipe.BackupAndRestore(backup_dir)])
