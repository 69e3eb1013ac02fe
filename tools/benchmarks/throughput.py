"""Part (a), run: training throughput per schedule and M on two workers."""

import os
import time

from tools.benchmarks.harness import (
    BASELINE_LABEL,
    INTRA_OP_THREADS,
    Workers,
    _cpu_seconds,
    _fit_steps,
    _interleave,
    _mlp,
    _per,
    _PinnedBaseline,
    _split,
    _sum,
    _tf_env,
    _throughput_data,
    baseline_1core,
    build_then_warm,
    child,
    median,
    run_child,
)

# Schedules of part (a): K=2 stages on the 2 workers, or K=4 stages with
# these worker indices (two stages per worker, as the schedule needs).
TWO_STAGE_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_h2")


FOUR_STAGE_SCHEDULES = {"interleaved_1f1b": (0, 1, 0, 1), "zbv": (0, 1, 1, 0)}


SCHEDULES = TWO_STAGE_SCHEDULES + tuple(FOUR_STAGE_SCHEDULES)


# Part (c) runs K=4 stages on 4 devices: the one-stage-per-device schedules.
MEMORY_SCHEDULES = TWO_STAGE_SCHEDULES


def _num_stages(schedule):
    """K of a schedule's runs in part (a): 2 stages per worker for the
    schedules of FOUR_STAGE_SCHEDULES, else one."""
    return 4 if schedule in FOUR_STAGE_SCHEDULES else 2


def throughput_configs(p):
    """The runs of part (a) in one round, from its settings, as dicts.

    `kind` is `"one_worker"` (K=1 on worker 0), `"pipeline"` (a schedule on
    both workers), `"bare"` (the bare TF graph of the GPipe step),
    `"steps_per_execution"` (a schedule compiled with `steps_per_execution`)
    or `"no_xla_updates"` (a schedule compiled with `jit_compile=False`,
    when the others compile each worker's optimizer update with XLA).
    """
    configs = [{"kind": "one_worker", "schedule": "gpipe", "num_stages": 1,
                "num_micro_batches": m}
               for m in p["one_worker_micro_batches"]]
    for m in p["micro_batches"]:
        for name in p["schedules"]:
            configs.append({"kind": "pipeline", "schedule": name,
                            "num_stages": _num_stages(name),
                            "num_micro_batches": m})
        configs.append({"kind": "bare", "schedule": "gpipe", "num_stages": 2,
                        "num_micro_batches": m})
    for m in p["steps_per_execution_micro_batches"]:
        for name in p.get("steps_per_execution_schedules", ["gpipe"]):
            configs.append({"kind": "steps_per_execution", "schedule": name,
                            "num_stages": _num_stages(name),
                            "num_micro_batches": m,
                            "steps_per_execution": p["steps_per_execution"]})
    if p.get("xla_updates"):
        for m in p.get("no_xla_micro_batches", []):
            for name in p.get("no_xla_schedules", []):
                configs.append({"kind": "no_xla_updates", "schedule": name,
                                "num_stages": 2, "num_micro_batches": m,
                                "xla_updates": False})
    return configs


def config_label(config):
    """`"zbv K=4 M=8"`, `"bare K=2 M=4"`: one run of part (a)."""
    name = "bare" if config["kind"] == "bare" else config["schedule"]
    label = f"{name} K={config['num_stages']} M={config['num_micro_batches']}"
    if config.get("steps_per_execution"):
        label += f" steps_per_execution={config['steps_per_execution']}"
    if config.get("xla_updates") is False:
        label += " jit_compile=False"
    return label


class _BarePipeline:
    """A bare TF graph of the GPipe training step of `_split`'s K=2 model.

    The same 8 x Dense weights as `tf.Variable`s, half on each worker; x
    already on worker 0 and y on worker 1; one `tf.function` per step:
    forward per micro-batch and stage under the stage's device, the mse on
    the last stage, backward per stage under its device with its own
    `tf.GradientTape` (one tape over the step would put every gradient op
    on one device), gradients summed over micro-batches on each variable's
    device, and `keras.optimizers.Adam` colocated by keras_pipe (each
    worker's update one XLA function with `xla_updates`, as keras_pipe's
    runs then do).
    """

    def __init__(self, tf, keras, devices, p, x, y, xla_updates=False):
        import numpy as np

        from keras_pipe.engine import placement
        self.tf, self.devices = tf, devices
        rng = np.random.default_rng(0)
        width, per = p["width"], p["layers"] // 2
        limit = (6 / (2 * width)) ** 0.5  # glorot_uniform, as Dense
        self.stages = [[], []]
        for n in range(p["layers"]):
            with tf.device(devices[n // per]):
                self.stages[n // per].append((
                    tf.Variable(rng.uniform(-limit, limit, (width, width))
                                .astype("float32"), name=f"kernel{n}"),
                    tf.Variable(np.zeros(width, "float32"), name=f"bias{n}")))
        self.variables = [v for stage in self.stages for layer in stage
                          for v in layer]
        self.optimizer = placement.colocate_optimizer(
            keras.optimizers.Adam(1e-4), xla_updates=xla_updates)
        self.optimizer.build(self.variables)
        batch = p["batch"]
        with tf.device(devices[0]):
            self.x = tf.identity(tf.constant(x[:batch]))
        with tf.device(devices[1]):
            self.y = tf.identity(tf.constant(y[:batch]))
        self.step_functions = {}

    def slot_devices(self):
        """Devices of the optimizer's variables (slots, iterations)."""
        return sorted({v.value.device for v in self.optimizer.variables})

    def _step(self, x, y, num_micro_batches):
        tf, devices, m = self.tf, self.devices, num_micro_batches
        with tf.device(devices[0]):
            xs = tf.split(x, m)
        with tf.device(devices[1]):
            ys = tf.split(y, m)
        last = len(self.stages) - 1
        tapes, inputs, outputs, losses = {}, {}, {}, []
        for i in range(m):  # forward, micro-batch by micro-batch
            h = xs[i]
            for j, stage in enumerate(self.stages):
                with tf.device(devices[j]):
                    h = tf.identity(h)  # the transfer, on the receiver
                    with tf.GradientTape() as tape:
                        tape.watch(h)
                        inputs[i, j] = h
                        for n, (kernel, bias) in enumerate(stage):
                            h = tf.matmul(h, kernel) + bias
                            if j < last or n < len(stage) - 1:
                                h = tf.nn.relu(h)
                        if j == last:  # the full batch's mse, in M parts
                            h = tf.reduce_mean(tf.square(h - ys[i])) / m
                            losses.append(h)
                    tapes[i, j], outputs[i, j] = tape, h
        parts = {v.ref(): [] for v in self.variables}
        for i in reversed(range(m)):  # backward, as GPipe: last first
            upstream = None
            for j in reversed(range(len(self.stages))):
                with tf.device(devices[j]):
                    own = [v for layer in self.stages[j] for v in layer]
                    # No input gradient for the first stage: x is data.
                    sources = own + ([inputs[i, j]] if j else [])
                    grads = tapes[i, j].gradient(
                        outputs[i, j], sources, output_gradients=upstream)
                upstream = grads[-1] if j else None
                for v, g in zip(own, grads):
                    parts[v.ref()].append(g)
        sums = []
        for v in self.variables:
            with tf.device(v.device):
                sums.append(tf.add_n(parts[v.ref()]))
        self.optimizer.apply_gradients(zip(sums, self.variables))
        with tf.device(devices[-1]):
            return tf.add_n(losses)

    def steps(self, num_micro_batches, num_steps):
        """Seconds of each of `num_steps` steps (traced once per M)."""
        tf = self.tf
        if num_micro_batches not in self.step_functions:
            self.step_functions[num_micro_batches] = tf.function(
                lambda x, y: self._step(x, y, num_micro_batches))
        step = self.step_functions[num_micro_batches]
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            step(self.x, self.y).numpy()  # waits for the step to end
            times.append(time.perf_counter() - start)
        return times


def _transfer_costs(tf, remote, pids, batch, micro_batches, width, hops,
                    repeats):
    """What one hop of a micro-batch between the two workers costs.

    Per M, at `batch / M` rows: a chain of `hops` element-wise ops on
    `rows x width` floats, alternating between the workers (each op reads
    the previous one's output: one transfer per hop) against the same chain
    on one worker. Chains interleaved over `repeats`, so that host noise
    hits both alike. Per hop: the median seconds of each, and the CPU
    seconds the two workers (`pids[:2]`) spent, summed over all repeats of
    each chain.
    """
    costs = {}
    for m in micro_batches:
        rows, chains = batch // m, {}
        for kind, cross in (("cross", True), ("local", False)):
            def chain(rows=rows, cross=cross):
                with tf.device(remote[0]):
                    h = tf.random.normal([rows, width])
                last = 0
                for hop in range(hops):
                    last = (hop + 1) % 2 if cross else 0
                    with tf.device(remote[last]):
                        h = h * 1.0001
                with tf.device(remote[last]):  # only a scalar leaves
                    return tf.reduce_sum(h)
            run = tf.function(chain)
            run().numpy()  # traced and warm
            chains[kind] = (run, [], [])
        for _ in range(repeats):
            for run, times, cpu in chains.values():
                cpu0 = [_cpu_seconds(pid) for pid in pids[:2]]
                start = time.perf_counter()
                run().numpy()
                times.append(time.perf_counter() - start)
                cpu.append(_sum(_per(
                    cpu0, [_cpu_seconds(pid) for pid in pids[:2]], 1)))
        entry = {"M": m, "rows": rows, "width": width, "hops": hops,
                 "repeats": repeats}
        for kind, (_, times, cpu) in chains.items():
            entry[f"{kind}_seconds"] = median(times) / hops
            entry[f"{kind}_cpu_seconds"] = (
                None if None in cpu else sum(cpu) / (repeats * hops))
        costs[str(m)] = entry
    return costs


@child("throughput")
def child_throughput(p):
    """Client of 2 workers: every schedule for each M, the bare graph, K=1.

    K=1 on one worker with M=1 isolates the cost of remote execution, and
    with M>1 the cost of micro-batching without any transfer between stages.
    Runs that fail (to build or to step) are reported, and the others go on.
    """
    tf, keras = _tf_env()
    import numpy as np

    import keras_pipe
    devices = keras_pipe.connect({"worker": p["cluster"]}, timeout=60.0)
    remote = [names[0] for _, names in sorted(devices.items())]
    x, y = _throughput_data(np, p["steps"], p["batch"], p["width"])
    warm = (x[:3 * p["batch"]], y[:3 * p["batch"]])
    runs, errors, bare = {}, [], None
    baseline, baseline_cpu = None, []
    if p.get("baseline"):  # one of the runs of each round
        try:
            baseline = _PinnedBaseline(p["baseline"])
        except (OSError, RuntimeError) as exc:  # the parent's rounds remain
            errors.append({"run": BASELINE_LABEL, "error": str(exc)})
    if baseline is not None:
        def run_baseline():
            r = baseline.round()
            baseline_cpu.append(r["cpu_seconds_per_step"])
            return r["steps"], p["baseline"]["steps"]
        runs[BASELINE_LABEL] = {"run": run_baseline, "steps": [], "cpu": [],
                                "wait": [], "cpu_per_step": []}

    def build(config):
        k, m = config["num_stages"], config["num_micro_batches"]
        if config["kind"] == "bare":
            nonlocal bare
            if bare is None:
                bare = _BarePipeline(tf, keras, remote, p, x, y,
                                     p.get("xla_updates", False))
            return bare
        keras.utils.set_random_seed(0)
        if k == 1:
            stages = [_mlp(keras, p["layers"], p["width"], "whole")]
        else:
            stages = _split(keras, p["layers"], p["width"], k)
        order = FOUR_STAGE_SCHEDULES.get(config["schedule"], (0, 1))
        model = keras_pipe.PipelineModel(
            stages, devices=[remote[w] for w in order[:k]],
            num_micro_batches=m, remat=p["remat"],
            schedule=config["schedule"])
        model.build((None, p["width"]))
        model.compile(keras.optimizers.Adam(1e-4), "mse",
                      steps_per_execution=config.get("steps_per_execution", 1),
                      jit_compile=config.get(
                          "xla_updates", p.get("xla_updates", False)))
        return model

    def warm_up(config, built):
        """The first steps (traced, instantiated); returns the round's run
        and the seconds they took."""
        m = config["num_micro_batches"]
        start = time.perf_counter()
        if config["kind"] == "bare":
            built.steps(m, 3)  # trace and warm up
            return ((lambda: (built.steps(m, p["steps"]), p["steps"])),
                    time.perf_counter() - start)
        spe = config.get("steps_per_execution", 1)
        _fit_steps(keras, built, *(
            warm if spe == 1 else (x[:2 * spe * p["batch"]],
                                   y[:2 * spe * p["batch"]])),
            p["batch"])
        # With steps_per_execution, the clock ticks once per
        # execution of `spe` steps.
        n = p["steps"] // spe * spe
        rows = n * p["batch"]
        return ((lambda: ([t / spe for t in _fit_steps(
            keras, built, x[:rows], y[:rows], p["batch"])], n)),
            time.perf_counter() - start)

    configs = {config_label(c): c for c in throughput_configs(p)}
    warmed = build_then_warm(
        {label: ((lambda c=c: build(c)),
                 (lambda built, c=c: warm_up(c, built)))
         for label, c in configs.items()}, errors)
    for label, (run, seconds) in warmed.items():
        runs[label] = {"config": configs[label], "run": run, "steps": [],
                       "cpu": [], "wait": [], "cpu_per_step": [],
                       "first_fit_seconds": seconds}
    pids = p["worker_pids"] + [os.getpid()]  # the workers, then the client
    try:
        _interleave(runs, p["rounds"], pids, errors)
    finally:
        if baseline is not None:
            baseline.close()
    transfers = {}
    try:
        transfers = _transfer_costs(
            tf, remote, pids, p["batch"], sorted({8, *p["micro_batches"]}),
            p["width"], p["transfer_hops"], p["transfer_repeats"])
    except Exception as exc:  # noqa: BLE001 - reported, the runs stand
        errors.append({"run": "transfers", "error": f"{type(exc).__name__}"
                       f": {exc}"})
    xla = p.get("xla_updates", False)
    result = {"pipeline": [], "one_worker_runs": [], "bare": [],
              "steps_per_execution": [], "no_xla_updates": [],
              "errors": errors, "devices": remote, "xla_updates": xla,
              "bare_optimizer": "keras.optimizers.Adam, colocated by "
              "keras_pipe.engine.placement.colocate_optimizer" + (
                  ", each worker's update one XLA function" if xla else ""),
              "steps_per_execution_setting": p["steps_per_execution"],
              "transfers": transfers}
    if bare is not None:
        result["bare_optimizer_devices"] = bare.slot_devices()
    kinds = {"pipeline": "pipeline", "one_worker": "one_worker_runs",
             "bare": "bare", "steps_per_execution": "steps_per_execution",
             "no_xla_updates": "no_xla_updates"}
    baseline_run = runs.pop(BASELINE_LABEL, None)
    if baseline_run and baseline_run["steps"]:
        result["baseline_interleaved"] = {
            "step_seconds": median(baseline_run["steps"]),
            "best_step_seconds": min(baseline_run["steps"]),
            "cpu_seconds_per_step": median(baseline_cpu),
            "steps": baseline_run["steps"]}
    for label, r in runs.items():
        if not r["steps"]:
            continue

        def per_process(key, r=r):
            return [median([row[w] for row in r[key]])
                    for w in range(len(pids))]

        use, delay = per_process("cpu"), per_process("wait")
        per_step = per_process("cpu_per_step")
        config = r["config"]
        entry = {"run": label, "schedule": config["schedule"],
                 "num_stages": config["num_stages"],
                 "steps_per_execution": config.get("steps_per_execution", 1),
                 "num_micro_batches": config["num_micro_batches"],
                 "step_seconds": median(r["steps"]),
                 "best_step_seconds": min(r["steps"]),
                 "steps": r["steps"], "first_fit_seconds":
                 r["first_fit_seconds"],
                 "worker_cpu_utilisation": use[:-1],
                 "worker_cpu_wait": delay[:-1],
                 "worker_cpu_seconds_per_step": per_step[:-1],
                 "client_cpu_seconds_per_step": per_step[-1],
                 "client_cpu_utilisation": use[-1],
                 "client_cpu_wait": delay[-1]}
        result[kinds[config["kind"]]].append(entry)
        if config["kind"] == "one_worker" and entry["num_micro_batches"] == 1:
            result["one_worker"] = entry
    return result


@child("kernel")
def child_kernel(p):
    """One-core cost of the model's products at each micro-batch size.

    A micro-batch of `batch / M` rows runs each stage's forward (matmul,
    bias, ReLU) and input-gradient (`dY W^T`) products on fewer rows; on
    this CPU oneDNN's sgemm costs more per row below 128 rows. Here, one
    thread, median seconds per M (repetitions interleaved over M, so that
    host noise hits every M alike):

    * `seconds`: the whole batch through both products of one
      `width x width` layer, cut into M parts;
    * `xla_seconds`: the same compiled by XLA (`jit_compile=True`, which a
      stage on one device could use);
    * `chain_seconds` (with `layers`): the products of the model's
      `layers` layers as a stage runs them, micro-batch by micro-batch:
      each part's forward through every layer, then its input gradients
      back through every layer but the first (whose input is data). Each
      part streams every layer's weights through the caches again, which
      one layer alone does not show.
    """
    tf, _ = _tf_env(p.get("threads"))
    batch, width = p["batch"], p["width"]
    depth = p.get("layers") or 1
    kernels = [tf.random.normal([width, width]) * width ** -0.5
               for _ in range(depth)]
    biases = [tf.random.normal([width]) for _ in range(depth)]
    x = tf.random.normal([batch, width])

    def products(parts):
        total = tf.constant(0.0)
        for part in parts:
            forward = tf.nn.relu(tf.matmul(part, kernels[0]) + biases[0])
            grad = tf.matmul(part, kernels[0], transpose_b=True)
            total += tf.reduce_sum(forward) + tf.reduce_sum(grad)
        return total

    def chain(parts):
        total = tf.constant(0.0)
        for part in parts:
            h, masks = part, []
            for kernel, bias in zip(kernels, biases):
                h = tf.nn.relu(tf.matmul(h, kernel) + bias)
                masks.append(h > 0)
            grad = h
            for n in reversed(range(depth)):
                grad = tf.where(masks[n], grad, 0.0)
                if n:
                    grad = tf.matmul(grad, kernels[n], transpose_b=True)
            total += tf.reduce_sum(grad)
        return total

    kinds = {"seconds": (products, False), "xla_seconds": (products, True)}
    if p.get("layers"):
        kinds["chain_seconds"] = (chain, False)
    runs = {}
    for m in sorted({1, *p["micro_batches"]}):
        if batch % m:
            continue
        parts = tf.split(x, m)
        for key, (function, xla) in kinds.items():
            run = tf.function(function, jit_compile=xla)
            run(parts)  # traced and warm
            runs[m, key] = (run, parts, [])
    for _ in range(p["repeats"]):
        for run, parts, times in runs.values():
            start = time.perf_counter()
            run(parts).numpy()
            times.append(time.perf_counter() - start)
    result = {"batch": batch, "width": width, "layers": p.get("layers")}
    for key in kinds:
        result[key] = {str(m): median(times)
                       for (m, kind), (_, _, times) in runs.items()
                       if kind == key}
    return result


def run_throughput(p, outdir, log):
    """Part (a): 1-core baseline, 2 pinned workers + client, baseline again."""
    from keras_pipe.distributed.worker import bind_shim_path  # imports TF, here only
    shim = bind_shim_path()
    core = sorted(os.sched_getaffinity(0))[0]
    base = {k: p[k] for k in ("layers", "width", "batch", "steps", "rounds")}
    one_core = dict(base, cpus=[core], threads=[INTRA_OP_THREADS, 2])
    log("  1 process pinned to 1 core ...")
    before = run_child("baseline", dict(one_core), 900, log=log)
    log("  2 worker processes, 1 core each; client drives fit; its rounds "
        "interleave with the 1-core process's ...")
    with Workers(2, outdir) as workers:
        result = run_child(
            "throughput", dict(p, cluster=workers.addresses,
                               worker_pids=workers.pids, baseline=one_core),
            3600, shim=shim, log=log)
    if "error" in result:
        return result
    log("  1 process pinned to 1 core, again; 1 process on 2 cores ...")
    after = run_child("baseline", dict(one_core), 900, log=log)
    two = run_child("baseline", dict(base), 900, log=log)
    log("  1 process pinned to 1 core, plain Keras with jit_compile=True, "
        f"then with steps_per_execution={p['steps_per_execution']} ...")
    xla = run_child("baseline", dict(one_core, jit_compile=True), 900,
                    log=log)
    spe = run_child("baseline", dict(
        one_core, steps_per_execution=p["steps_per_execution"]), 900, log=log)
    log("  the model's products per micro-batch size, 1 core ...")
    kernel = run_child("kernel", dict(  # M=8 always: the CPU goal's M
        base, micro_batches=sorted({8, *p["micro_batches"]}),
        repeats=p["kernel_repeats"],
        cpus=[core], threads=[INTRA_OP_THREADS, 2]), 900, log=log)
    result["kernel"] = kernel  # or its error, logged by run_child
    result["baseline_1core"] = baseline_1core(
        result.get("baseline_interleaved"), before, after)
    for key, other in (("baseline_2cores", two), ("baseline_1core_xla", xla),
                       ("baseline_1core_spe", spe)):
        if "error" not in other:  # else logged by run_child
            result[key] = other
    result["model"] = (f"{p['layers']} x Dense({p['width']}), batch "
                       f"{p['batch']}")
    result["remat"] = p["remat"]
    return result

