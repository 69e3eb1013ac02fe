"""The benchmarks' shared harness: child processes, workers, baseline, clocks.

Every measurement runs in a child process of its own (`--child NAME`):
logical CPU devices and thread pools are fixed when TensorFlow starts, and a
process pinned to one core must be pinned before TensorFlow is imported. A
part registers its children with `child`; `run_child` starts one and reads
the JSON object it prints as its last line. The helpers for ratios and
tables are plain Python, imported by `tests/test_benchmark.py`.
"""

import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The child processes of every part, by name (see `child`).
CHILDREN = {}


def child(name):
    """Registers a function `params -> JSON-able dict` as child `name`."""
    def register(function):
        CHILDREN[name] = function
        return function
    return register


def child_main(name, params):
    """Runs child `name` in this process; prints its JSON as the last line."""
    cpus = params.pop("cpus", None)
    if cpus is not None:  # Before TensorFlow is imported.
        os.sched_setaffinity(0, set(cpus))
    result = CHILDREN[name](params)
    print(json.dumps(result), flush=True)

# How a child process runs the benchmarks' entry point.
COMMAND = [sys.executable, "-m", "tools.benchmarks"]
# Every TF process of the benchmarks runs oneDNN's kernels (off by default
# on this AMD EPYC): TF's own products cost 2-3.5x more per row at a
# micro-batch's sizes (`keras_pipe.distributed.local.INTRA_OP_THREADS`).
# `TF_ENABLE_ONEDNN_OPTS=0` in the environment measures TF's own instead.
ONEDNN = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") == "1"
# Each pinned process's intra-op pool, keras_pipe's workers and the 1-core
# process alike, as `keras_pipe.local_workers` sizes it for those kernels.
INTRA_OP_THREADS = 1 if ONEDNN else 4


def ideal_speedup(num_micro_batches, num_stages=2):
    """GPipe's bound on speedup over one device: `K M / (M + K - 1)`.

    With `M` micro-batches on `K` equal stages, a step takes `M + K - 1`
    stage-times of one micro-batch instead of `M K`.
    """
    for name, value in (("num_micro_batches", num_micro_batches),
                        ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1. Received: "
                             f"{name}={value!r}")
    m, k = num_micro_batches, num_stages
    return k * m / (m + k - 1)


def ratio(numerator, denominator):
    """`numerator / denominator`, `None` when either is missing or zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median(values):
    """The median of the numbers in `values`, `None` if there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits=2, suffix=""):
    """A table cell: a rounded number, `-` for `None`, text as it is."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}{suffix}"
    return str(value)


def format_table(headers, rows):
    """A plain-text table, one column per header, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n and _numeric(c) else
                               c.ljust(w) for c, w in zip(row, widths))
                     .rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers, rows):
    """The same table in Markdown (for the README)."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(text):
    try:
        float(text.rstrip("x%"))
        return True
    except ValueError:
        return False


def _percentages(values):
    """`"41%/38%"` from fractions; `-` when there are none."""
    return "/".join(fmt(v * 100 if v is not None else None, 0, "%")
                    for v in values or []) or "-"


def _sum(values):
    """The sum of `values`, `None` if any is missing."""
    if not values or any(v is None for v in values):
        return None
    return sum(values)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _tf_env(threads=None, spinning=True):
    """Imports TF/Keras (after pinning) and sets the thread pools.

    `spinning=False`: the pools' idle threads sleep at once, as in a
    `keras_pipe.local_workers` worker whose threads outnumber its core
    (`keras_pipe.distributed.worker.thread_spinning`), so that a one-core
    reference runs its threads as the pipeline's workers do. TF's eager
    context has no public setter for it: its config is amended before the
    context starts.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf
    if threads:
        intra, inter = threads
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    if not spinning:
        from tensorflow.python.eager import context
        config = context.Context.config

        def without_spinning(self):
            proto = config.fget(self)
            proto.experimental.disable_thread_spinning = True
            return proto
        context.Context.config = property(without_spinning)
    import keras
    return tf, keras


def _mlp(keras, num_layers, width, name, last_linear=True):
    """`num_layers` Dense layers of `width` units, ReLU but the last."""
    layers = [keras.layers.Dense(
        width, activation=None if last_linear and n == num_layers - 1
        else "relu", name=f"{name}_dense{n}") for n in range(num_layers)]
    return keras.Sequential(layers, name=name)


def _split(keras, num_layers, width, num_stages, last_linear=True):
    """The same MLP cut into `num_stages` Sequential stages."""
    per = num_layers // num_stages
    stages = []
    for j in range(num_stages):
        layers = [keras.layers.Dense(
            width, activation=None if last_linear and j * per + n ==
            num_layers - 1 else "relu") for n in range(per)]
        stages.append(keras.Sequential(layers, name=f"stage{j}"))
    return stages


class _StepClock:
    """Per-step wall times of `fit`, each taken after the step finished."""

    def __init__(self, keras):
        import numpy as np
        times = self.times = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                # Reading the loss waits for the step to end.
                np.asarray((logs or {}).get("loss", 0.0))
                times.append(time.perf_counter())

        self.callback = Clock()

    def steps(self):
        return [b - a for a, b in zip(self.times, self.times[1:])]


def _fit_steps(keras, model, x, y, batch_size):
    """Durations of the steps of one `fit` epoch (the first step excluded)."""
    clock = _StepClock(keras)
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False,
              callbacks=[clock.callback])
    return clock.steps()


def _stat_fields(pid):
    """The fields of /proc/<pid>/stat after the command name, or None."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(
            ")", 1)[1].split()
    except OSError:
        return None


def _cpu_seconds(pid):
    """User + system CPU seconds of a process, from /proc."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _system_cpu_seconds(pid):
    """System (kernel) CPU seconds of a process, from /proc (field 15)."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[12]) / os.sysconf(
        "SC_CLK_TCK")


def _run_delay_seconds(pid):
    """Seconds the threads of a process were runnable but not running.

    Summed over its threads from /proc/PID/task/*/schedstat (the second
    field): the time spent waiting for a CPU, taken by other processes or
    by the process's own threads.
    """
    total = 0.0
    try:
        tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def _throughput_data(np, steps, batch, width):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    y = rng.normal(size=(steps * batch, width)).astype("float32")
    return x, y


def _per(before, after, amount):
    """Per process, `(after - before) / amount`; `None` where a reading is
    missing (a process that ended)."""
    return [None if a is None or b is None else (b - a) / amount
            for a, b in zip(before, after)]


def build_then_warm(runs, errors):
    """Builds every run, then warms every run up: `{label: warm value}`.

    `runs` maps a label to `(build, warm)`: `build()` makes the run's model
    (seeding the random generators first), `warm(built)` runs its first
    steps and returns what the rounds call. Every build comes before any
    warm-up: `keras.utils.set_random_seed` (through `tf.random.set_seed`)
    clears TF's kernel cache, so a step function warmed before the next
    model's build is instantiated again (placement, graph optimization,
    partition, registration on the workers) at its next call, the first
    step of its first measured `fit`. That one-off costs the client 8.6 s
    of CPU for a 4-block Transformer at M=8 (docs/performance.md), which
    the client's CPU per step of a measured `fit` counted as per-step work
    (216-1521 ms on the Transformer in the 3 December run). A run that
    raises is reported in `errors` and left out.
    """
    built = {}
    for label, (build, _) in runs.items():
        try:
            built[label] = build()
        except Exception as exc:  # noqa: BLE001 - reported, others go on
            errors.append({"run": label, "error": f"{type(exc).__name__}: "
                           f"{exc}"})
    warmed = {}
    for label, value in built.items():
        try:
            warmed[label] = runs[label][1](value)
        except Exception as exc:  # noqa: BLE001 - reported, others go on
            errors.append({"run": label, "error": f"{type(exc).__name__}: "
                           f"{exc}"})
    return warmed


def _interleave(runs, rounds, pids, errors):
    """Each run of `runs` once per round, in turn: noise hits them alike.

    Adds to each run its step times and, per process of `pids`, its CPU
    use and wait (fractions of the wall time), CPU seconds per step and
    the system (kernel) part of those. A
    run that raises is reported in `errors` and dropped.
    """
    for _ in range(rounds):
        for label, r in list(runs.items()):
            cpu0 = [_cpu_seconds(pid) for pid in pids]
            sys0 = [_system_cpu_seconds(pid) for pid in pids]
            wait0 = [_run_delay_seconds(pid) for pid in pids]
            start = time.perf_counter()
            try:
                steps, count = r["run"]()
            except Exception as exc:  # noqa: BLE001 - reported, others go on
                errors.append({"run": label, "error": f"{type(exc).__name__}"
                               f": {exc}"})
                del runs[label]
                continue
            wall = time.perf_counter() - start
            cpu1 = [_cpu_seconds(pid) for pid in pids]
            r["steps"] += steps
            r["cpu"].append(_per(cpu0, cpu1, wall))
            r["cpu_per_step"].append(_per(cpu0, cpu1, count))
            r.setdefault("system_per_step", []).append(_per(
                sys0, [_system_cpu_seconds(pid) for pid in pids], count))
            r["wait"].append(_per(
                wait0, [_run_delay_seconds(pid) for pid in pids], wall))


# Part (a)'s one-core process when its rounds interleave with the pipeline's.
BASELINE_LABEL = "1 process, 1 core"


def _baseline_round(p):
    """The plain Keras model of part (a), warm: returns one round's runner.

    Each call of the runner is one `fit` epoch of `p["steps"]` steps and
    returns `(step seconds, CPU seconds per step)`; with
    `p["steps_per_execution"]`, each execution's seconds over its steps.
    """
    tf, keras = _tf_env(p.get("threads"))
    import numpy as np
    keras.utils.set_random_seed(0)
    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    model = _mlp(keras, p["layers"], p["width"], "plain")
    spe = p.get("steps_per_execution", 1)
    model.compile(keras.optimizers.Adam(1e-4), "mse",
                  jit_compile=p.get("jit_compile", False),
                  steps_per_execution=spe)
    warm = max(3, 2 * spe) * p["batch"]
    _fit_steps(keras, model, x[:warm], y[:warm], p["batch"])

    def run():
        start = time.process_time()
        steps = _fit_steps(keras, model, x, y, p["batch"])
        return ([t / spe for t in steps],
                (time.process_time() - start) / p["steps"])
    return run


@child("baseline")
def child_baseline(p):
    """Plain Keras model in this process (pinned by the parent): step time."""
    run = _baseline_round(p)
    steps, cpu = [], []
    for _ in range(p["rounds"]):
        times, seconds = run()
        steps += times
        cpu.append(seconds)
    return {"step_seconds": median(steps), "best_step_seconds": min(steps),
            "cpu_seconds_per_step": median(cpu), "steps": steps,
            "affinity": sorted(os.sched_getaffinity(0))}


@child("baseline_server")
def child_baseline_server(p):
    """`child_baseline` one round per line read from stdin, until EOF.

    The throughput child drives it (`_PinnedBaseline`) so that the 1-core
    rounds interleave with the pipeline's: host load that comes and goes
    over minutes then weighs on both sides of every ratio alike. Prints
    `READY` once warm, then `ROUND {json}` per round.
    """
    run = _baseline_round(p)
    print("READY", flush=True)
    for _ in sys.stdin:
        times, seconds = run()
        print("ROUND " + json.dumps({"steps": times,
                                     "cpu_seconds_per_step": seconds}),
              flush=True)
    return {}  # every round went out with its ROUND line


class _PinnedBaseline:
    """A `baseline_server` child pinned to `p["cpus"]`: `round()` per call."""

    def __init__(self, p):
        import tempfile
        env = _env()
        for name in ("LD_PRELOAD", "KERAS_PIPE_BIND_HOST"):  # no server
            env.pop(name, None)
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [*COMMAND, "--child", "baseline_server",
             "--params", json.dumps(p)], env=env, cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr)
        self._read("READY")

    def _read(self, prefix):
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait(timeout=60)
        self.stderr.seek(0)
        raise RuntimeError(
            f"baseline_server exited {self.proc.returncode}: "
            f"{self.stderr.read().strip().splitlines()[-1:]}")

    def round(self):
        """One round: `{"steps": [seconds], "cpu_seconds_per_step": s}`."""
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return json.loads(self._read("ROUND "))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


def baseline_1core(interleaved, before, after):
    """Part (a)'s reference: the 1-core rounds interleaved with the runs.

    Without them (a failed server), the rounds run before and after the
    pipeline runs, pooled. Those stay in the result either way: how far
    they are from the interleaved rounds is how much the host drifted.
    """
    if interleaved:
        return dict(interleaved, source="interleaved", before=before,
                    after=after)
    steps = before.get("steps", []) + after.get("steps", [])
    return {"step_seconds": median(steps),
            "cpu_seconds_per_step": median([r.get("cpu_seconds_per_step")
                                            for r in (before, after)]),
            "best_step_seconds": min(steps, default=None),
            "source": "before and after", "before": before, "after": after}


@child("probe")
def child_probe(p):
    """One-core matmul time on each core: how busy the host is.

    The machine is shared: when the host is busy, every ratio against the
    one-core process moves. A 512 x 1024 x 1024 float32 matmul, one thread,
    median of `p["repeats"]` per core (about 7.5-7.9 ms here when quiet).
    """
    tf, _ = _tf_env([1, 1])
    w = tf.random.normal([1024, 1024])
    x = tf.random.normal([512, 1024])
    product = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, w)))
    product(x)
    result = {}
    for core in sorted(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {core})
        times = []
        for _ in range(p["repeats"]):
            start = time.perf_counter()
            product(x).numpy()
            times.append(time.perf_counter() - start)
        result[str(core)] = median(times)
    return {"matmul_seconds": result}


def probe_line(env):
    """The host-speed probes of `environment`'s record, as one line."""
    parts = []
    for key, label in (("probe_start", "start"), ("probe_end", "end")):
        seconds = (env.get(key) or {}).get("matmul_seconds")
        if seconds:
            parts.append(f"{label}: " + ", ".join(
                f"core {c} {v * 1e3:.1f} ms" for c, v in sorted(
                    seconds.items())))
    if not parts:
        return None
    return ("Host speed, one-core 512 x 1024 x 1024 matmul (about 7.5-7.9 "
            "ms when the host is quiet): " + "; ".join(parts))


def _env(shim=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow",
               TF_ENABLE_ONEDNN_OPTS="1" if ONEDNN else "0",
               PYTHONPATH=os.pathsep.join(
                   p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("TF_CONFIG", None)
    if shim:  # Keeps a client's own TF gRPC port on loopback too.
        env["LD_PRELOAD"] = shim
        env["KERAS_PIPE_BIND_HOST"] = "127.0.0.1"
    return env


def run_child(name, params, timeout, shim=None, log=print, env=None):
    """Runs `--child name` in a fresh process; returns its JSON or an error.

    `env`: variables to set in the child's environment (None: unset)."""
    start = time.perf_counter()
    child_env = _env(shim)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    try:
        proc = subprocess.run(
            [*COMMAND, "--child", name, "--params",
             json.dumps(params)], env=child_env, capture_output=True,
            text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"{name}: no answer within {timeout} s"}
    seconds = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        log(f"  {name} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-2000:]}")
        return {"error": f"{name} exited {proc.returncode}: "
                         f"{proc.stderr.strip().splitlines()[-1:]}"}
    result = json.loads(lines[-1])
    result["child_seconds"] = seconds
    return result


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """`python -m keras_pipe.distributed.worker` processes, one pinned core each."""

    def __init__(self, num_tasks, logdir, inter_op_threads=2):
        self.addresses = [f"127.0.0.1:{_free_port()}"
                          for _ in range(num_tasks)]
        self.logdir = pathlib.Path(logdir)
        self.inter_op_threads = inter_op_threads
        self.procs = []

    def __enter__(self):
        try:
            self._start()
        except BaseException:  # a worker that did start must not outlive us
            self.__exit__()
            raise
        return self

    def _start(self):
        cores = sorted(os.sched_getaffinity(0))
        for task in range(len(self.addresses)):
            log = open(self.logdir / f"worker{task}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "keras_pipe.distributed.worker", "--task",
                 str(task), "--cluster", ",".join(self.addresses),
                 "--intra-op-threads", str(INTRA_OP_THREADS),
                 "--inter-op-threads",
                 str(self.inter_op_threads), "--cpu-affinity",
                 str(cores[task % len(cores)])],
                env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            log.close()
        deadline = time.monotonic() + 180
        for task, proc in enumerate(self.procs):
            path = self.logdir / f"worker{task}.log"
            while "serving" not in path.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {task} did not start:\n"
                                       f"{path.read_text()[-2000:]}")
                time.sleep(0.2)

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def __exit__(self, *exc):
        for proc in self.procs:  # all killed first, then waited for
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"worker pid {proc.pid} did not exit after SIGKILL",
                      file=sys.stderr)


def environment():
    """What the numbers were measured on."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, text=True,
                                  capture_output=True).stdout
        except OSError:
            return
    versions = {}
    for name in ("tensorflow", "keras"):
        try:
            from importlib.metadata import version
            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - reported as unknown
            versions[name] = None
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "load_average": os.getloadavg(), **versions,
            "tf_onednn": ONEDNN, "intra_op_threads": INTRA_OP_THREADS,
            "commit": git("rev-parse", "HEAD").strip(),
            "uncommitted_files": git("status", "--porcelain",
                                     "-uno").splitlines(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _m_axis(ax, ms):
    """A log2 axis of micro-batch counts labelled with the counts."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()

