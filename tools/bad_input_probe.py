"""Bad-input and fault probe: tries >= 200 wrong calls as a new user would.

Each case is a call with one bad argument (or a plain-Keras call that must
keep working). A case is classified as:

- clear:    raised TypeError/ValueError/OSError (or a keras_pipe error)
            whose message names the bad value (or the given words);
- keras:    accepted, as plain Keras accepts it (the case says so, or the
            same call on a plain Keras model is accepted), or the same
            error as plain Keras raises;
- unclear:  raised, but another type or a message without the bad value;
- silent:   a bad input accepted without an error;
- crash:    the process running the case died (signal, abort);
- hang:     no answer within the per-case timeout (the process is killed).

The cases run in a child process, one after another; the parent gives
each `--timeout` seconds and restarts the child after a crash or hang, so
the probe itself cannot hang. Prints a table of counts, then each case
that is not clear or keras.

    TF_CPP_MIN_LOG_LEVEL=3 python tools/bad_input_probe.py
    TF_CPP_MIN_LOG_LEVEL=3 python tools/bad_input_probe.py --list
"""

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTCOMES = ("clear", "keras", "unclear", "silent", "crash", "hang")


# ----------------------------------------------------------------- the cases
# Built in the child only (they import keras_pipe). Each case is
# (name, call, expect, words): expect "refuse" (a bad input) or "accept"
# (plain Keras accepts it); words: what a clear message contains (default:
# repr of the bad value given as `bad`).


def _cases(tmp):
    import keras
    import numpy as np

    import keras_pipe
    from keras_pipe.engine import schedule as sch

    devices = keras_pipe.logical_cpu_devices(2)
    cases = []

    def refuse(name, call, *words):
        cases.append((name, call, "refuse", words))

    def accept(name, call):
        cases.append((name, call, "accept", ()))

    def parity(name, call, plain):
        """Plain Keras' own answer decides: accepted there, or its error."""
        cases.append((name, call, "parity", (plain,)))

    def stages():
        return [keras.layers.Dense(4), keras.layers.Dense(2)]

    def pipeline(**kwargs):
        args = dict(devices=devices, num_micro_batches=2)
        args.update(kwargs)
        return keras_pipe.PipelineModel(stages(), **args)

    def built(**kwargs):
        model = pipeline(**kwargs)
        model.build((None, 3))
        return model

    def compiled(**kwargs):
        model = built(**kwargs)
        model.compile("sgd", "mse")
        return model

    def sequential():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                 keras.layers.Dense(4),
                                 keras.layers.Dense(2)])

    bad_counts = [0, -1, 1.5, "2", None, True, float("nan"), [2]]
    # PipelineModel arguments.
    for v in bad_counts:
        refuse(f"PipelineModel(num_micro_batches={v!r})",
               lambda v=v: pipeline(num_micro_batches=v), repr(v))
    for v in ["sometimes", 1, None, ["never"], ["never"] * 3, "ALWAYS"]:
        refuse(f"PipelineModel(remat={v!r})",
               lambda v=v: pipeline(remat=v), "remat")
    for v in ["nope", 1, None, "GPIPE", ""]:
        refuse(f"PipelineModel(schedule={v!r})",
               lambda v=v: pipeline(schedule=v), repr(v))
    for v in ["/CPU:0", [], [devices[0]], devices * 2, [1, 2],
              ["/GPU:7", "/GPU:8"], ["/device:FOO:0", "/CPU:0"],
              [None, None], "cpu"]:
        refuse(f"PipelineModel(devices={v!r})",
               lambda v=v: pipeline(devices=v), "devices")
    for v in [None, [], keras.layers.Dense(2), [1, 2], ["a"], "stages"]:
        refuse(f"PipelineModel(stages={v!r:.40})",
               lambda v=v: keras_pipe.PipelineModel(v, devices=devices),
               "stages")
    same = keras.layers.Dense(2)
    refuse("PipelineModel(stages=[same, same])",
           lambda: keras_pipe.PipelineModel([same, same], devices=devices),
           "same layer")
    accept("PipelineModel(schedule='interleaved_1f1b'), 1 stage/device",
           lambda: pipeline(schedule="interleaved_1f1b"))
    refuse("PipelineModel(schedule='zbv') on 2 stages/2 devs",
           lambda: pipeline(schedule="zbv"), "zbv")
    accept("PipelineModel(num_micro_batches=3) (batch not divisible later)",
           lambda: pipeline(num_micro_batches=3))
    accept("PipelineModel(name='p')", lambda: pipeline(name="p"))

    # from_model.
    for k, v in [("num_stages", 0), ("num_stages", -2), ("num_stages", 99),
                 ("num_stages", "2"), ("num_stages", 2.0),
                 ("balance", "speed"), ("balance", [1]), ("balance", [0, 3]),
                 ("balance", [1, 1, 1, 1]), ("num_micro_batches", 0),
                 ("remat", "x"), ("memory_budget", -1),
                 ("memory_budget", "1GB"), ("batch_size", 0),
                 ("input_shape", "x")]:
        refuse(f"from_model({k}={v!r})",
               lambda k=k, v=v: keras_pipe.PipelineModel.from_model(
                   sequential(), **{"devices": devices, k: v}), k)
    refuse("from_model(input_shape=(None, 5)) for a (None, 3) input",
           lambda: keras_pipe.PipelineModel.from_model(
               sequential(), devices=devices, input_shape=(None, 5)),
           "(None, 5)")
    refuse("from_model(input_shape=..., sample_inputs=...) both",
           lambda: keras_pipe.PipelineModel.from_model(
               sequential(), devices=devices, input_shape=(None, 3),
               sample_inputs=np.zeros((2, 3), "float32")), "not both")
    refuse("from_model(model=None)",
           lambda: keras_pipe.PipelineModel.from_model(None, num_stages=2),
           "model")
    refuse("from_model(model=Dense)",
           lambda: keras_pipe.PipelineModel.from_model(
               keras.layers.Dense(2), num_stages=2), "model")
    refuse("from_model(unbuilt Sequential)",
           lambda: keras_pipe.PipelineModel.from_model(
               keras.Sequential([keras.layers.Dense(2)]), devices=devices),
           "built")

    # plan.
    for k, v in [("num_stages", 0), ("num_stages", "3"),
                 ("num_micro_batches", -1), ("balance", "x"),
                 ("remat", 3), ("batch_size", -4), ("devices", "/GPU:0"),
                 ("devices", 3), ("optimizer_slots", -1),
                 ("optimizer_slots", 1.5), ("flops_per_second", 0),
                 ("flops_per_second", float("nan")),
                 ("memory_budget", 0), ("memory_budget", float("inf")),
                 ("schedule", "nope"), ("input_shape", 5)]:
        refuse(f"plan({k}={v!r})",
               lambda k=k, v=v: keras_pipe.plan(
                   sequential(), **({"num_stages": 2} | {k: v})), k)
    refuse("plan(model=None)", lambda: keras_pipe.plan(None, num_stages=2),
           "model")
    refuse("plan() without num_stages or devices",
           lambda: keras_pipe.plan(sequential()), "num_stages")
    accept("plan(num_stages=2)",
           lambda: keras_pipe.plan(sequential(), num_stages=2))

    # connect: refused before any connection (addresses, arguments).
    worker = ["127.0.0.1:1"]
    for v in ["127.0.0.1:abc", "127.0.0.1:99999", "127.0.0.1", ":2222",
              "127.0.0.1:0", "127.0.0.1:-5", "", "localhost:", "a:b:c"]:
        refuse(f"connect(address={v!r})",
               lambda v=v: keras_pipe.connect({"worker": [v]}, timeout=20),
               "Bad cluster addresses")
    refuse("connect(duplicate addresses)",
           lambda: keras_pipe.connect({"worker": ["127.0.0.1:2", "127.0.0.1:2"]},
                                      timeout=20), "also the address")
    for v in [0, -1, float("nan"), float("inf"), "5", None, True]:
        refuse(f"connect(timeout={v!r})",
               lambda v=v: keras_pipe.connect({"worker": worker}, timeout=v),
               "timeout")
    for v in [5, "", "a/b", None, "my job"]:
        refuse(f"connect(job_name={v!r})",
               lambda v=v: keras_pipe.connect({"worker": worker}, timeout=1,
                                              job_name=v), "job_name")
    for v in ["localhost", "192.0.2.1", 2222, "", "999.1.1.1"]:
        refuse(f"connect(bind={v!r})",
               lambda v=v: keras_pipe.connect({"worker": worker}, timeout=1,
                                              bind=v), repr(v))
    for v in [0, -2, 1.5, "4"]:
        refuse(f"connect(inter_op_threads={v!r})",
               lambda v=v: keras_pipe.connect({"worker": worker}, timeout=1,
                                              inter_op_threads=v),
               "inter_op_threads")
    for v in [["127.0.0.1:1"], "127.0.0.1:1", 5, {}, {"worker": []},
              '{"cluster": ']:
        refuse(f"connect(cluster={v!r})",
               lambda v=v: keras_pipe.connect(v, timeout=1), "cluster")
    refuse("connect(worker that is down, timeout=1)",
           lambda: keras_pipe.connect({"worker": ["127.0.0.1:9"]},
                                      timeout=1), "127.0.0.1:9")

    # logical_cpu_devices: after TF started.
    for v in [0, -1, "2", 2.5]:
        refuse(f"logical_cpu_devices({v!r})",
               lambda v=v: keras_pipe.logical_cpu_devices(v), repr(v))
    refuse("logical_cpu_devices(3) after TF started",
           lambda: keras_pipe.logical_cpu_devices(3), "3")

    # Schedules: registration and check_ticks.
    A = sch.Action
    good = sch.gpipe(2, 2)

    def drop(ticks, action):
        return [[a for a in t if a != action] for t in ticks]

    bad_builds = {
        "drops B": lambda m, k, d=None: drop(sch.gpipe(m, k), A("B", m - 1, 0)),
        "drops F": lambda m, k, d=None: drop(sch.gpipe(m, k), A("F", 0, k - 1)),
        "returns None": lambda m, k, d=None: None,
        "B before F": lambda m, k, d=None: [[A("B", 0, 0)]] + sch.gpipe(m, k),
        "wrong K": lambda m, k, d=None: sch.gpipe(m, k + 1),
        "index out of range": lambda m, k, d=None: sch.gpipe(m + 1, k),
        "W before B": lambda m, k, d=None: [[A("W", 0, 0)]] + sch.gpipe(m, k),
        "raises": lambda m, k, d=None: 1 / 0,
        "returns str": lambda m, k, d=None: "F0 B0",
        "duplicate F": lambda m, k, d=None: sch.gpipe(m, k) + [[A("F", 0, 0)]],
    }
    for n, (what, build) in enumerate(bad_builds.items()):
        def register(n=n, build=build):
            try:
                sch.register_schedule(f"probe_{n}", build)
            finally:
                sch._REGISTRY.pop(f"probe_{n}", None)
        refuse(f"register_schedule(build that {what})", register,
               "Schedule 'probe_")
    for k, v in [("stages_per_device", 0), ("stages_per_device", -1),
                 ("stages_per_device", 1.5), ("placement", "x"),
                 ("build", 3), ("name", 5), ("name", "gpipe")]:
        def register(k=k, v=v):
            args = {"name": "probe_x", "build": sch.gpipe} | {k: v}
            try:
                sch.register_schedule(**args)
            finally:
                sch._REGISTRY.pop("probe_x", None)
        refuse(f"register_schedule({k}={v!r})", register, k)
    for what, ticks in [("missing B", drop(good, A("B", 1, 0))),
                        ("missing F", drop(good, A("F", 1, 1))),
                        ("None", None), ("flat list", [A("F", 0, 0)]),
                        ("tuples", [[("F", 0, 0)]]),
                        ("kind X", [[A("X", 0, 0)]]),
                        ("i = -1", [[A("F", -1, 0)]]),
                        ("j = 5", [[A("F", 0, 5)]])]:
        refuse(f"check_ticks({what})",
               lambda ticks=ticks: sch.check_ticks(ticks, 2, 2, "p"),
               "Schedule 'p'")
    for v in ["gpipe", "1f1b", "zb_h1", "zb_h2"]:
        accept(f"PipelineModel(schedule={v!r})",
               lambda v=v: pipeline(schedule=v))

    # fit / evaluate / predict inputs.
    x = np.zeros((8, 3), "float32")
    y = np.zeros((8, 2), "float32")
    refuse("fit before compile", lambda: built().fit(x, y, verbose=0),
           "compile")
    def plain_compiled():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        return model

    for what, args in [("x wide", (np.zeros((8, 5), "float32"), y)),
                       ("y wrong width", (x, np.zeros((8, 7), "float32"))),
                       ("x and y lengths differ", (x, y[:5])),
                       ("x=None", (None, y)), ("x string", ("abc", y))]:
        parity(f"fit({what})",
               lambda args=args: compiled().fit(*args, verbose=0),
               lambda args=args: plain_compiled().fit(*args, verbose=0))
    for k, v in [("batch_size", 0), ("batch_size", -3), ("epochs", "2"),
                 ("batch_size", "4"), ("validation_split", 2.0),
                 ("callbacks", "x"), ("steps_per_epoch", -1)]:
        parity(f"fit({k}={v!r})",
               lambda k=k, v=v: compiled().fit(x, y, verbose=0, **{k: v}),
               lambda k=k, v=v: plain_compiled().fit(x, y, verbose=0,
                                                     **{k: v}))
    parity("evaluate(x=None)",
           lambda: compiled().evaluate(None, y, verbose=0),
           lambda: plain_compiled().evaluate(None, y, verbose=0))
    parity("predict(x=None)", lambda: compiled().predict(None, verbose=0),
           lambda: plain_compiled().predict(None, verbose=0))
    accept("fit(batch_size=3) (batch not divisible by M)",
           lambda: compiled().fit(x, y, batch_size=3, verbose=0))
    accept("fit(epochs=0)", lambda: compiled().fit(x, y, epochs=0, verbose=0))
    accept("evaluate(x, y)", lambda: compiled().evaluate(x, y, verbose=0))
    accept("predict(x)", lambda: compiled().predict(x, verbose=0))
    refuse("predict(wrong width)",
           lambda: compiled().predict(np.zeros((8, 9), "float32"), verbose=0))
    refuse("compile(optimizer='nope')",
           lambda: built().compile("nope", "mse"), "nope")
    def bad_loss():
        model = built()
        model.compile("sgd", "nope")
        model.fit(x, y, verbose=0)
    refuse("compile(loss='nope')", bad_loss, "nope")

    # Saving and loading.
    def path(name):
        return os.path.join(tmp, name)

    accept("save('m.weights.h5') (Keras: a legacy .h5 file)",
           lambda: built().save(path("m.weights.h5")))
    for name in ["m.txt", "m", "m.h5x"]:
        refuse(f"save({name!r})", lambda name=name: built().save(path(name)),
               path(name))
    for name in ["w.h5", "w.keras", "w"]:
        refuse(f"save_weights({name!r})",
               lambda name=name: built().save_weights(path(name)),
               path(name))
    for call_name, call, name in [
            ("save", lambda m, p: m.save(p), "no/dir/m.keras"),
            ("save_weights", lambda m, p: m.save_weights(p),
             "no/dir/m.weights.h5")]:
        refuse(f"{call_name}(missing folder)",
               lambda call=call, name=name: call(built(), path(name)),
               path(name))
    for v in [None, 123, 1.5, ["m.keras"], b"m.keras"]:
        refuse(f"load_model({v!r})", lambda v=v: keras_pipe.load_model(v),
               repr(v)[:10])
    for name, content in [("empty.keras", b""), ("text.keras", b"hello"),
                          ("zip.keras", b"PK\x03\x04trunc")]:
        def load(name=name, content=content):
            with open(path(name), "wb") as f:
                f.write(content)
            return keras_pipe.load_model(path(name))
        refuse(f"load_model({name} damaged)", load, path(name))
    refuse("load_model(missing file)",
           lambda: keras_pipe.load_model(path("missing.keras")),
           "missing.keras")
    refuse("load_model(a directory)", lambda: keras_pipe.load_model(tmp),
           tmp)
    refuse("load_model(custom_objects='x')",
           lambda: keras_pipe.load_model(path("missing.keras"),
                                         custom_objects="x"),
           "custom_objects")
    for v in ["/CPU:0", ["/CPU:0"], [1, 2], ["/GPU:9", "/GPU:9"]]:
        def load(v=v):
            model = built()
            model.save(path("ok.keras"))
            return keras_pipe.load_model(path("ok.keras"), devices=v)
        refuse(f"load_model(devices={v!r})", load, "devices")

    def saved_then_loaded():
        model = built()
        model.save(path("ok2.keras"))
        return keras_pipe.load_model(path("ok2.keras"))
    accept("save then load_model", saved_then_loaded)
    for v in ["no", 1, None, "True"]:
        refuse(f"export(pipelined={v!r})",
               lambda v=v: built().export(path(f"e{v}"), pipelined=v),
               "pipelined")
    refuse("export(pipelined=True, format='onnx')",
           lambda: built().export(path("e_onnx"), pipelined=True,
                                  format="onnx"), "onnx")

    def flipped_weights():
        model = built()
        model.save_weights(path("f.weights.h5"))
        import h5py
        with h5py.File(path("f.weights.h5"), "r+") as f:
            def first(group):
                for key in group:
                    item = group[key]
                    if isinstance(item, h5py.Dataset) and item.size >= 2:
                        return item
                    if isinstance(item, h5py.Group):
                        found = first(item)
                        if found is not None:
                            return found
            data = first(f)
            value = data[()]
            value.flat[0] = 5e26
            data[...] = value
        model.load_weights(path("f.weights.h5"))
    refuse("load_weights(.weights.h5 with a flipped value)", flipped_weights,
           "checksum")

    def flipped_bytes():
        model = built()
        name = path("b.weights.h5")
        model.save_weights(name)
        import h5py
        with h5py.File(name, "r") as f:
            offset = f["layers/dense/vars/0"].id.get_offset()
        with open(name, "r+b") as f:
            f.seek(offset + 4)
            data = f.read(8)
            f.seek(offset + 4)
            f.write(bytes(b ^ 0xFF for b in data))
        model.load_weights(name)
    refuse("load_weights(.weights.h5 with 8 bytes flipped in a kernel)",
           flipped_bytes, "checksum", path("b.weights.h5"))

    def unchecked_plain_file():
        plain = sequential()
        plain.save_weights(path("plain.weights.h5"))
        pipe = keras_pipe.PipelineModel.from_model(sequential(),
                                                   devices=devices)
        pipe.load_weights(path("plain.weights.h5"))
    accept("load_weights(plain Keras .weights.h5, no checksum)",
           unchecked_plain_file)

    # BackupAndRestore / callbacks.
    for v in [None, 5, ""]:
        parity(f"BackupAndRestore(backup_dir={v!r})",
               lambda v=v: keras_pipe.BackupAndRestore(v),
               lambda v=v: keras.callbacks.BackupAndRestore(v))
    for k, v in [("save_freq", 0), ("save_freq", "sometimes"),
                 ("save_freq", -1)]:
        parity(f"BackupAndRestore({k}={v!r})",
               lambda k=k, v=v: keras_pipe.BackupAndRestore(
                   path("b"), **{k: v}),
               lambda k=k, v=v: keras.callbacks.BackupAndRestore(
                   path("b"), **{k: v}))

    # Replicas.
    for v in [[], devices[:1], ["/CPU:0", "/CPU:0", "/CPU:0"], "x", [1, 2]]:
        refuse(f"replicate({v!r})", lambda v=v: built().replicate(v),
               "devices")
    # Faults: a full disk (a file-size limit, RLIMIT_FSIZE) during saves,
    # each in a process of its own that exits normally: a crash at exit
    # (libhdf5) counts as a crash.
    for name in ["full.keras", "full.weights.h5", "backup"]:
        what = ("BackupAndRestore(save_freq=1)" if name == "backup"
                else f"save({name!r})")
        shown = (os.path.join(path(name), "latest.weights.h5")
                 if name == "backup" else path(name))
        refuse(f"full disk during {what}, then exit",
               lambda name=name: _in_own_process(_FULL_DISK, path(name)),
               shown)
    for schedule in ["zbv", "interleaved_1f1b"]:
        accept(f"load_model({schedule} K=8 saved on 4 devices) on 2 devices",
               lambda schedule=schedule: _fewer_devices(schedule, tmp))
    return cases


class ProbeCrash(Exception):
    """The case's own process died (a signal)."""


_FULL_DISK = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
import keras, keras_pipe
devices = keras_pipe.logical_cpu_devices(2)
model = keras_pipe.PipelineModel(
    [keras.layers.Dense(64), keras.layers.Dense(2)], devices=devices)
model.build((None, 3))
path = sys.argv[1]
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
try:
    if path.endswith("backup"):
        import numpy as np
        model.compile("sgd", "mse")
        model.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0,
                  callbacks=[keras_pipe.BackupAndRestore(path, save_freq=1)])
    else:
        (model.save_weights if path.endswith(".weights.h5")
         else model.save)(path)
except Exception as exc:
    print("ERROR", type(exc).__name__, str(exc).splitlines()[0], flush=True)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
"""


_SAVE_ON_FOUR = """
import sys, keras, keras_pipe
d = keras_pipe.logical_cpu_devices(4)
devices = {"zbv": d + d[::-1], "interleaved_1f1b": d * 2}[sys.argv[2]]
model = keras_pipe.PipelineModel.from_model(
    keras.Sequential([keras.Input((3,))] + [keras.layers.Dense(4)
                                            for _ in range(8)]),
    num_stages=8, devices=devices, schedule=sys.argv[2])
model.save(sys.argv[1])
"""
_LOAD_ON_TWO = """
import sys, numpy as np, keras_pipe
keras_pipe.logical_cpu_devices(2)
model = keras_pipe.load_model(sys.argv[1])
model.predict(np.zeros((4, 3), "float32"), verbose=0)
"""


def _fewer_devices(schedule, tmp):
    """Saves an 8-stage `schedule` model on 4 devices, loads it on 2."""
    name = os.path.join(tmp, f"k8_{schedule}.keras")
    _in_own_process(_SAVE_ON_FOUR, name, schedule)
    _in_own_process(_LOAD_ON_TWO, name)


def _in_own_process(script, *args):
    """Runs `script`; re-raises the error it printed, or ProbeCrash."""
    result = subprocess.run([sys.executable, "-c", script, *args],
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    printed = [line for line in result.stdout.splitlines()
               if line.startswith("ERROR ")]
    if result.returncode > 0 and not printed:  # An uncaught error.
        last = (result.stderr.strip().splitlines() or [""])[-1]
        kind, _, message = last.partition(": ")
        printed = [f"ERROR {kind.rsplit('.', 1)[-1] or 'RuntimeError'} "
                   f"{message}"]
    if result.returncode < 0:
        raise ProbeCrash(f"signal {-result.returncode} "
                         f"({printed[0] if printed else 'no error printed'})")
    if printed:
        _, kind, message = printed[0].split(" ", 2)
        error = {"OSError": OSError, "ValueError": ValueError,
                 "TypeError": TypeError}.get(kind, RuntimeError)
        raise error(f"{kind}: {message}")


# -------------------------------------------------------------- child side


CLEAR_TYPES = (TypeError, ValueError, OSError, KeyError, RuntimeError)


def _classify(expect, words, call):
    """(outcome, detail) of one case, run in this process."""
    plain_error = None
    if expect == "parity":
        try:
            words[0]()
        except Exception as exc:  # Plain Keras refuses it: so must we.
            plain_error = exc
        expect, words = ("refuse", ()) if plain_error else ("accept", ())
    try:
        call()
    except ProbeCrash as exc:
        return "crash", str(exc)
    except Exception as exc:  # The probe classifies every error.
        message = f"{type(exc).__name__}: {exc}"
        if plain_error is not None and type(exc) is type(plain_error):
            return "keras", message + " (plain Keras raises the same)"
        clear_type = isinstance(exc, CLEAR_TYPES)
        named = all(w in str(exc) for w in words)
        return ("clear" if clear_type and named else "unclear"), message
    if expect == "accept":
        return "keras", ""
    return "silent", (f"plain Keras raises {type(plain_error).__name__}: "
                      f"{plain_error}" if plain_error is not None else "")


def child(start):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    tmp = tempfile.mkdtemp(prefix="probe")
    cases = _cases(tmp)
    print(json.dumps({"total": len(cases)}), flush=True)
    for n, (name, call, expect, words) in enumerate(cases):
        if n < start:
            continue
        print(json.dumps({"start": n, "name": name}), flush=True)
        outcome, detail = _classify(expect, words, call)
        print(json.dumps({"done": n, "name": name, "outcome": outcome,
                          "detail": detail.splitlines()[0][:300]
                          if detail else ""}), flush=True)
    print(json.dumps({"end": True}), flush=True)
    os._exit(0)


# ------------------------------------------------------------- parent side


def _read_line(proc, deadline):
    """The next stdout line of `proc`, or None at `deadline` / its end."""
    import selectors
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not selector.select(left):
            return None
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith("{"):
            return json.loads(line)


def parent(timeout, startup):
    results, total, start = {}, None, 0
    while total is None or start < total:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child",
             str(start)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, cwd=ROOT,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        current = None
        deadline = time.monotonic() + startup
        while True:
            line = _read_line(proc, deadline)
            if line is None:
                break
            if "total" in line:
                total = line["total"]
            elif "start" in line:
                current = (line["start"], line["name"])
                deadline = time.monotonic() + timeout
            elif "done" in line:
                results[line["done"]] = line
                start, current = line["done"] + 1, None
            elif "end" in line:
                start = total
                break
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        if current is not None:
            n, name = current
            outcome = "crash" if code not in (0, -9) else "hang"
            results[n] = {"done": n, "name": name, "outcome": outcome,
                          "detail": f"exit code {code}" if outcome == "crash"
                          else f"no answer within {timeout:g} s"}
            start = n + 1
        elif total is None:
            raise SystemExit(f"the probe's child failed to start (exit {code})")
    return [results[n] for n in sorted(results)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per case (default 60)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout must be > 0. Received: {args.timeout}")
    if args.child is not None:
        return child(args.child)
    results = parent(args.timeout, startup=max(120.0, args.timeout))
    counts = collections.Counter(r["outcome"] for r in results)
    print(f"{len(results)} cases")
    print("| outcome | cases |\n|---|---|")
    for outcome in OUTCOMES:
        print(f"| {outcome} | {counts.get(outcome, 0)} |")
    print()
    for r in results:
        if r["outcome"] not in ("clear", "keras"):
            print(f"{r['outcome']:8s} {r['name']}: {r['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
