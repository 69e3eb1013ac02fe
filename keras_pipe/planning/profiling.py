"""Measured costs of a model's layer calls, stage calls and transfers.

Why measure: what FLOPs say is not what a device does. On a CPU the same
products cost more per row on small micro-batches than on large ones, a
transfer between two workers has a latency whatever its size, and a stage
call has a fixed cost of its own; a planner that ranks
schedules and micro-batch counts by FLOPs ranks them wrongly. So each
layer call is timed on the target device, for each micro-batch size the
planner considers: its forward pass, its input gradient, its weight
gradient (and a recompute, which is a forward pass). A stage call's fixed
cost and a transfer's latency and bandwidth between two devices are timed
too. Results are cached in a JSON file (`~/.cache/keras_pipe/costs.json`,
or `$KERAS_PIPE_CACHE`), keyed by the model's calls and shapes, the device
and the rows, so a model is measured once per device. Devices may be
logical or remote (`keras_pipe.connect`): the timed functions run there.

Where nothing can be measured (`measure=False`), costs come from FLOPs at
`flops_per_second`, with a warning saying so.
"""

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import pathlib
import time as time_lib
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["CallCosts", "Link", "Overhead", "UpdateRate", "cache_path",
           "call_costs", "call_costs_at", "cached", "flops_costs",
           "flops_update_rate", "has_step_probe", "link", "loss_seconds",
           "loss_target", "release_loops", "model_step_seconds", "smooth",
           "step_overhead", "update_rate", "update_seconds"]

_VERSION = 3  # 3: a link timed per hop of a chain (was: moved vs moved)
_MAX_RUNS = 4096  # runs per timed loop at most


@dataclasses.dataclass
class CallCosts:
    """Seconds per layer call for micro-batches of `rows` rows.

    Attributes:
        rows: rows per micro-batch.
        forward: per call, its forward pass.
        backward_input: per call, the gradient of its inputs.
        weight: per call, the gradient of its weights.
        measured: `True` when timed, `False` when from FLOPs.
    """

    rows: int
    forward: list
    backward_input: list
    weight: list
    measured: bool = True

    @property
    def backward(self):
        """Per call, input and weight gradients together."""
        return [b + w for b, w in zip(self.backward_input, self.weight)]


@dataclasses.dataclass
class Link:
    """A transfer between two devices: `latency + bytes / bytes_per_second`.
    """

    latency: float
    bytes_per_second: float

    def seconds(self, num_bytes):
        return self.latency + num_bytes / self.bytes_per_second


@dataclasses.dataclass
class Overhead:
    """The fixed costs of a training step, apart from its layers' work.

    Attributes:
        step: seconds of a step that computes nothing: `fit`'s own loop on
            the client, the batch sent in, the step function's dispatch to
            each device, the results back.
        call: seconds each stage call adds inside a step.
        measured: `True` when timed on the devices.
    """

    step: float
    call: float
    measured: bool = True


@dataclasses.dataclass
class UpdateRate:
    """An optimizer update: `per_variable + per_element * size` seconds a
    variable."""

    per_variable: float
    per_element: float

    def seconds(self, sizes):
        """Seconds to update variables of `sizes` elements."""
        return sum(self.per_variable + self.per_element * n for n in sizes)


def cache_path():
    """The JSON file measured costs are kept in."""
    root = os.environ.get("KERAS_PIPE_CACHE")
    if root:
        return pathlib.Path(root)
    return pathlib.Path.home() / ".cache" / "keras_pipe" / "costs.json"


def _load():
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(key, value):
    path = cache_path()
    data = _load()
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)  # never a half-written cache
    except OSError as exc:
        warnings.warn(f"keras_pipe could not write its cost cache {path}: "
                      f"{exc}. Costs will be measured again next time.",
                      stacklevel=3)


def cached(parts, compute, cache=True):
    """`compute()`, kept in the cache under `parts` (JSON values)."""
    key = _key(*parts)
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return hit
    value = compute()
    if cache:
        _store(key, value)
    return value


def _key(*parts):
    # The kernels TF runs change every cost (oneDNN's small products are
    # several times TF's own): a cache measured with one does not serve
    # the other.
    text = json.dumps([_VERSION, tf.__version__, keras.__version__,
                       _compat.onednn_enabled()]
                      + [str(p) for p in parts])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _graph_signature(graph, shapes):
    """The calls, their classes, configs and shapes: what the costs depend
    on (not the weights' values)."""
    rows = []
    for call in graph.calls:
        op = call.operation
        try:
            config = op.get_config()
        except (NotImplementedError, TypeError, AttributeError):
            config = None
        rows.append([call.name, type(op).__name__, config,
                     [list(cost_lib.shape_of(x, shapes)) for x in call.inputs],
                     [str(x.dtype) for x in call.inputs]])
    return json.dumps(rows, sort_keys=True, default=str)


def _device_name(device):
    return device or "default"


def _timed(function, args, repeats):
    """Least seconds of `function(*args)` over `repeats` warm calls (the
    least is the one a busy machine disturbed least)."""
    _fetch(function(*args))
    samples = []
    for _ in range(repeats):
        start = time_lib.perf_counter()
        _fetch(function(*args))
        samples.append(time_lib.perf_counter() - start)
    return float(np.min(samples))


def _probe(outputs):
    """A finite scalar that needs every element-producing output: the sum
    of their first elements, clipped (a NaN or inf fed back would change
    what the next run computes)."""
    firsts = [tf.cast(tf.reshape(t, [-1])[0], tf.float32) for t in outputs
              if t is not None and t.shape.num_elements() != 0]
    if not firsts:
        return tf.constant(0.0)
    total = tf.add_n(firsts)
    total = tf.where(tf.math.is_finite(total), total, 0.0)
    return tf.clip_by_value(total, -1.0, 1.0)


def _loop(body, device=None, moved=None):
    """A tf.function running `body(flat)` `n` times in a `tf.while_loop`,
    every op of it on `device`.

    Each run reads the last one's outputs (a data edge through `_probe`),
    so no optimizer merges, hoists or prunes the identical runs, and the
    loop runs on the device without a call per run: one call's own cost
    (a remote call's round trip) is paid once however large `n` is. The
    whole loop is pinned to `device`: a loop counter left on the client
    would make every run a round trip to a remote device. Only the first
    `moved` tensors of `flat` (all by default) take the edge; the rest
    (a layer's weights) are read as given, as a stage reads its variables.
    """
    @tf.function(reduce_retracing=True)  # one trace for most row counts
    def run(n, *flat):
        limit = len(flat) if moved is None else moved
        with tf.device(device) if device else contextlib.nullcontext():
            def step(count, probe):
                edge = [t + tf.cast(probe * 0.0, t.dtype)
                        if k < limit and t.dtype.is_floating else t
                        for k, t in enumerate(flat)]
                return count + 1, _probe(body(edge))

            _, probe = tf.while_loop(lambda count, _: count < n, step,
                                     [tf.constant(0), tf.constant(0.0)])
            return tf.identity(probe)
    return run


def _fetch(outputs):
    for t in tf.nest.flatten(outputs):
        if t is not None and hasattr(t, "shape") and t.shape.num_elements():
            tf.reshape(t, [-1])[:1].numpy()
            return


def _dense(gradients):
    """The gradients that exist, an embedding's (IndexedSlices) as its
    rows, which is what its backward pass makes."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g
            for g in gradients if g is not None]


def _functions(call, training, device=None):
    """Three tf.functions: forward; forward and input gradients; forward
    and all gradients, each of `flat`, the call's inputs followed by the
    values of its variables; and those values. Stateless: the model's
    variables do not change.

    The layer reads copies of its variables made on `device` once (a
    `keras.StatelessScope` mapping), as a stage reads the variables placed
    with it: the model's own variables live on the client, and reading
    them from a remote device would time a transfer of every weight at
    every run. The copies are arguments of the functions, not captured by
    their graphs: whoever holds the copies holds the device memory, and
    it is freed when they let go, without a garbage collection of the
    traced functions' reference cycles.
    """
    operation = call.operation
    variables = list(getattr(operation, "variables", None) or [])
    trainable = {id(v) for v in (getattr(operation, "trainable_variables",
                                         None) or [])}
    with tf.device(device) if device else contextlib.nullcontext():
        copies = [tf.identity(v.value) for v in variables]
    count = len(call.inputs)

    def forward(flat, values):
        tensors = {id(x): t for x, t in zip(call.inputs, flat)}
        with keras.StatelessScope(state_mapping=list(zip(variables,
                                                         values))):
            call.run(tensors, training=training)
        return [tensors[id(x)] for x in call.outputs]

    def loss(outputs):
        terms = [tf.reduce_sum(tf.cast(y, tf.float32)) for y in outputs
                 if y is not None and y.dtype.is_floating]
        return tf.add_n(terms) if terms else tf.constant(0.0)

    def run_forward(flat):
        return forward(flat[:count], flat[count:])

    def gradients(flat, weights):
        inputs, values = list(flat[:count]), list(flat[count:])
        with tf.GradientTape() as tape:
            for t in inputs:
                if t.dtype.is_floating:
                    tape.watch(t)
            sources = [t for t in inputs if t.dtype.is_floating]
            if weights:
                values = [tf.identity(t) for t in values]
                for v, t in zip(variables, values):
                    if id(v) in trainable:
                        tape.watch(t)
                        sources.append(t)
            y = loss(forward(inputs, values))
        return _dense(tape.gradient(y, sources)) + [y]

    def run_input(flat):
        return gradients(flat, False)

    def run_all(flat):
        return gradients(flat, True)

    return (run_forward, run_input, run_all), copies


_LOOPS = {}  # (id(call), training, device) -> (call, its loops, copies)


def _loops(call, training, device):
    """The `_loop`s of `_functions(call, ...)` and the weight copies they
    read, made once per call and device and kept until released
    (`_release_loops_of`, `release_loops`): a search measures each call at
    several row counts, and tracing dominates measuring."""
    key = (id(call), training, device)
    if key not in _LOOPS or _LOOPS[key][0] is not call:
        if len(_LOOPS) > 1024:  # another model's: let them go
            _LOOPS.clear()
        functions, copies = _functions(call, training, device)
        _LOOPS[key] = (call, [_loop(f, device, len(call.inputs))
                              for f in functions], copies)
    return _LOOPS[key][1], _LOOPS[key][2]


def _release_loops_of(call, training, device):
    """Lets one call's `_loops` go (`call_costs_at`), with its weight
    copies on the device: nothing else holds them."""
    _LOOPS.pop((id(call), training, device), None)


def release_loops():
    """Lets the `_loops` made so far go, with the copies of the layers'
    weights they read on the devices they time (a search makes them
    once, for every row count, and releases them when it is done)."""
    _LOOPS.clear()


def _per_run(run, inputs, repeats, target, device=None):
    """Seconds of one run of a `_loop` `run` on a shared machine.

    Runs `n` in one loop on the device, `n` grown (from single timings)
    until the loop takes `target` seconds more than one run does; the
    difference over `n - 1` (least of `repeats` warm calls each, at that
    `n` and at 1) is one run without the call's own cost. Timing one run
    of tens of microseconds against a remote call's millisecond round trip
    is noise; a loop of `target` seconds shrinks the round trip's share of
    it `n` times.
    """
    def least(n, times):
        with tf.device(device) if device else contextlib.nullcontext():
            count = tf.constant(n)
        return _timed(run, [count] + list(inputs), times)

    one, n = least(1, repeats), 4
    many = least(n, 2)  # a first guess of `n`, then `repeats` at that `n`
    while True:
        if many - one >= target or n >= _MAX_RUNS:
            many = min(many, least(n, repeats))
            if many - one >= target / 2 or n >= _MAX_RUNS:
                return max(many - one, 0.0) / (n - 1)
        per = (many - one) / (n - 1)
        grow = target / per + 1 if per > 0 else 4 * n
        n = int(min(_MAX_RUNS, max(2 * n, grow)))
        many = least(n, 1)


def call_costs(graph, rows, device=None, shapes=None, training=True,
               repeats=5, target=0.005, cache=True):
    """Measured seconds of each layer call of `graph` for `rows` rows.

    ```python
    graph = keras_pipe.planning.graph.read_graph(model)
    costs = keras_pipe.planning.profiling.call_costs(graph, rows=32)
    sum(costs.forward), sum(costs.backward)
    ```

    Each call runs alone in three `tf.function`s on `device` (forward;
    forward and input gradients; forward and every gradient) on random
    inputs, under a `keras.StatelessScope`, each `n` times in a loop on the
    device and once: the difference over `n - 1` (least of `repeats` warm
    calls, `n` grown until the loop lasts `target` seconds) is one run
    without the call's own cost. That gives its forward time, and the
    differences its input and weight gradient times.

    Args:
        graph: a `keras_pipe.planning.graph.Graph`.
        rows: rows per micro-batch.
        device: a TF device (logical or remote). Defaults to `None` (TF's
            default device).
        shapes: `{id(KerasTensor): shape}` (`balance.shapes.infer_shapes`).
            Defaults to `None` (the graph's shapes, unknowns as 1).
        training: the `training` flag. Defaults to `True`.
        repeats: timed calls per loop length. Defaults to `5`.
        target: seconds a timed loop lasts at least (more runs per loop
            average out more of a shared machine's noise). Defaults to
            `0.005`.
        cache: read and write the cache (`cache_path()`). Defaults to
            `True`.

    Returns:
        A `CallCosts`.
    """
    return call_costs_at(graph, [rows], device, shapes, training, repeats,
                         target, cache)[0]


def call_costs_at(graph, all_rows, device=None, shapes=None, training=True,
                  repeats=5, target=0.005, cache=True):
    """`call_costs` at each of `all_rows`, one layer call at a time.

    Each call is measured at every row count not in the cache, then its
    timing loops, with their copies of its weights on `device`, are let go
    before the next call's are made: the device holds one call's weights
    and gradients at a time, not the model's.

    Returns:
        A list of `CallCosts`, one per entry of `all_rows`.
    """
    keys = {rows: _key("calls", _graph_signature(graph, shapes),
                       _device_name(device), rows, training, target)
            for rows in all_rows}
    found = {}
    if cache:
        stored = _load()
        for rows, key in keys.items():
            if stored.get(key) is not None:
                found[rows] = CallCosts(**stored[key])
    missing = [rows for rows in dict.fromkeys(all_rows) if rows not in found]
    times = {rows: ([], [], []) for rows in missing}
    with tf.device(device) if device else contextlib.nullcontext():
        for call in graph.calls if missing else []:
            (run_forward, run_input, run_all), copies = _loops(
                call, training, device)
            for rows in missing:
                inputs = [cost_lib.sample_input(x, rows, shapes)
                          for x in call.inputs] + copies
                f = _per_run(run_forward, inputs, repeats, target, device)
                fi = max(_per_run(run_input, inputs, repeats, target,
                                  device), f)
                fa = fi
                if getattr(call.operation, "trainable_variables", None):
                    fa = max(_per_run(run_all, inputs, repeats, target,
                                      device), fi)
                forward, backward_input, weight = times[rows]
                forward.append(f)
                backward_input.append(fi - f)
                weight.append(fa - fi)
            del run_forward, run_input, run_all, copies, inputs
            _release_loops_of(call, training, device)
    for rows in missing:
        found[rows] = CallCosts(rows, *times[rows], True)
        if cache:
            _store(keys[rows], dataclasses.asdict(found[rows]))
    return [found[rows] for rows in all_rows]


def _loss_functions(loss, num_outputs):
    """One Keras loss function per output, or None where `loss` is not one
    `keras.losses.get` reads (a dict by output name is not costed)."""
    if isinstance(loss, (list, tuple)):
        if len(loss) != num_outputs:
            return None
        return [keras.losses.get(x) for x in loss]
    if isinstance(loss, dict):
        return None
    return [keras.losses.get(loss)] * num_outputs


def loss_target(function, y_pred):
    """A target the loss takes for `y_pred`: zeros of its shape, or integer
    class indices (a sparse cross-entropy's) of its shape without the last
    axis."""
    dense = tf.zeros_like(y_pred)
    try:
        function(dense, y_pred)
        return dense
    except (ValueError, tf.errors.InvalidArgumentError):
        return tf.zeros(tf.shape(y_pred)[:-1], tf.int32)


def loss_seconds(loss, outputs, rows, device=None, shapes=None, repeats=5,
                 target=0.005, cache=True):
    """Measured seconds of the loss head for `rows` rows: the loss of
    outputs like `outputs` (the model's output KerasTensors) and its
    gradient with respect to them, timed in a loop on `device` as
    `call_costs` times a layer call. 0.0 where `loss` cannot be read per
    output (a dict of losses).

    ```python
    graph = keras_pipe.planning.graph.read_graph(model)
    keras_pipe.planning.profiling.loss_seconds(
        "sparse_categorical_crossentropy", graph.outputs, rows=32)
    ```
    """
    functions = _loss_functions(loss, len(outputs))
    if functions is None:
        warnings.warn(
            f"keras_pipe costs no loss head for loss={loss!r}: give one loss, "
            f"or a list of {len(outputs)} (one per output), to time it.",
            stacklevel=2)
        return 0.0
    key = _key("loss", [keras.saving.serialize_keras_object(f)
                        for f in functions],
               [list(cost_lib.shape_of(x, shapes)) for x in outputs],
               _device_name(device), rows, target)
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return hit
    with tf.device(device) if device else contextlib.nullcontext():
        y_preds = [tf.cast(cost_lib.sample_input(x, rows, shapes), "float32")
                   for x in outputs]
        y_trues = [loss_target(f, y) for f, y in zip(functions, y_preds)]

    def head(flat):
        with tf.GradientTape() as tape:
            tape.watch(flat)
            total = tf.add_n([tf.reduce_mean(f(t, y)) for f, t, y in
                              zip(functions, y_trues, flat)])
        return tape.gradient(total, flat) + [total]

    seconds = _per_run(_loop(head, device), y_preds, repeats, target, device)
    if cache:
        _store(key, seconds)
    return seconds


def _theil_sen(xs, ys):
    """The line through `(xs, ys)` with the median pairwise slope and the
    median intercept: one wild point of several moves it little."""
    slopes = [(ys[b] - ys[a]) / (xs[b] - xs[a])
              for a in range(len(xs)) for b in range(a + 1, len(xs))
              if xs[b] != xs[a]]
    slope = float(np.median(slopes)) if slopes else 0.0
    return slope, float(np.median([y - slope * x for x, y in zip(xs, ys)]))


def smooth(costs):
    """`CallCosts` at several row counts, each time replaced by a line in
    the rows fitted through all of them (`a + b * rows`, Theil-Sen).

    A time measured on a shared machine is sometimes far off (a loop that
    another process interrupted at every call); a call's time is close to
    a fixed cost plus a cost per row, and a line through four row counts
    that ignores its worst point corrects the one that is off. Times stay
    at least zero; costs from FLOPs are returned as they are.

    ```python
    at = {r: CallCosts(r, [t], [0.0], [0.0]) for r, t in
          [(8, 1.0), (16, 2.0), (32, 99.0), (64, 8.0)]}
    smooth(list(at.values()))[2].forward  # [4.0]: the line 0 + rows / 8
    ```
    """
    if len(costs) < 3 or not all(c.measured for c in costs):
        return list(costs)
    rows = [c.rows for c in costs]
    fitted = {}
    for kind in ("forward", "backward_input", "weight"):
        columns = list(zip(*[getattr(c, kind) for c in costs]))
        lines = [_theil_sen(rows, list(times)) for times in columns]
        fitted[kind] = [[max(a + b * r, 0.0) for b, a in lines]
                        for r in rows]
    return [CallCosts(r, fitted["forward"][n], fitted["backward_input"][n],
                      fitted["weight"][n], True)
            for n, r in enumerate(rows)]


def flops_costs(graph, rows, flops_per_second=2e10, shapes=None):
    """Costs from FLOPs: the fallback when nothing can be measured.

    The forward pass takes its FLOPs at `flops_per_second`; the input and
    the weight gradients as long each (two products of the same size where
    a layer has weights; the input gradient alone where it has none).
    Warns that the costs are not measured.
    """
    warnings.warn(
        "keras_pipe is costing the model from FLOPs, not measured times: "
        "its step time predictions may be far off (a CPU does not run at "
        "one FLOP rate). Pass measure=True with the devices to measure on.",
        stacklevel=2)
    forward = [f / flops_per_second
               for f in cost_lib.flops(graph, rows, shapes)]
    weighted = [bool(getattr(c.operation, "trainable_weights", None))
                for c in graph.calls]
    return CallCosts(rows, forward, list(forward),
                     [f if w else 0.0 for f, w in zip(forward, weighted)],
                     False)


def _hop_chain(devices, num_bytes):
    """`(function, input)`: `num_bytes` of float32 passed along `devices`
    (one `+ 1` on each), then reduced on the last; its input lives on the
    first. Consecutive devices that differ move the tensor once each."""

    @tf.function
    def run(x):
        y = x
        for device in devices[1:]:
            with tf.device(device):
                y = y + 1.0
        with tf.device(devices[-1]):
            return tf.reduce_sum(y[:1])

    with tf.device(devices[0]):
        x = tf.ones([max(num_bytes // 4, 1)])
    return run, x


def link(source=None, target=None, sizes=(2**10, 2**22), repeats=9,
         hops=16, cache=True):
    """Measured transfer time between devices `source` and `target`.

    Times one `tf.function` passing a tensor back and forth `hops` times
    against one passing it twice, both against the same chains on
    `target` alone (the same ops, nothing moved): the difference per hop is
    one transfer inside a step, without the step's own costs (a function
    spanning two workers dispatches to both: about a millisecond on
    loopback, which the step's fixed cost holds, not each transfer). Small
    and large `sizes` (bytes) give latency and bandwidth.

    Returns:
        A `Link`.
    """
    key = _key("link", _device_name(source), _device_name(target), sizes,
               hops)
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return Link(**hit)

    def chain(pair, n, size):  # n hops alternating between `pair`
        function, x = _hop_chain([pair[h % 2] for h in range(n + 1)], size)
        return _timed(function, [x], repeats)

    def per_hop(pair, size):
        return (chain(pair, hops, size) - chain(pair, 2, size)) / (hops - 2)

    times = [max(per_hop((source, target), size)
                 - per_hop((target, target), size), 0.0) for size in sizes]
    (s0, s1), (t0, t1) = sizes, times
    slope = max((t1 - t0) / (s1 - s0), 1e-12)
    latency = max(t0 - slope * s0, 0.0)
    result = Link(latency, 1.0 / slope)
    if cache:
        _store(key, dataclasses.asdict(result))
    return result


def update_rate(device=None, optimizer_slots=2, repeats=3, target=0.005,
                cache=True):
    """Measured seconds of an Adam-like update, per variable and element.

    Times, on `device`, the update of one variable of 256 and one of 2**16
    elements (a layer's size, cache-resident as most are) with
    `optimizer_slots` moment slots, in a loop (`_per_run`); a line through
    the two gives the cost a variable has whatever its size and the cost
    an element adds.
    """
    def compute():
        sizes = (256, 2**16)
        seconds = []
        with tf.device(device) if device else contextlib.nullcontext():
            for size in sizes:
                state = [tf.ones([size]) for _ in range(1 + optimizer_slots)]
                seconds.append(_per_run(_loop(_update_body(state), device),
                                        [tf.ones([size])], repeats, target,
                                        device))
        slope = max((seconds[1] - seconds[0]) / (sizes[1] - sizes[0]), 0.0)
        return {"per_variable": max(seconds[0] - slope * sizes[0], 0.0),
                "per_element": slope}

    return UpdateRate(**cached(("update", _device_name(device),
                                optimizer_slots, target), compute, cache))


def _update_body(state):
    """One update of the weight `state[0]` from a gradient and the moment
    slots `state[1:]` (the loop feeds the gradient only: the one input it
    perturbs)."""
    def body(flat):
        gradient, weight, slots = flat[0], state[0], state[1:]
        new = []
        for n, slot in enumerate(slots):
            term = gradient if n == 0 else gradient * gradient
            new.append(slot * 0.9 + term * 0.1)
        if len(new) >= 2:
            step = new[0] / (tf.sqrt(new[1]) + 1e-7)
        else:
            step = new[0] if new else gradient
        return [weight - 1e-3 * step] + new
    return body


def flops_update_rate(optimizer_slots=2, flops_per_second=2e10):
    """An `UpdateRate` from FLOPs, the fallback: `3 + 3 * optimizer_slots`
    operations an element."""
    return UpdateRate(0.0, (3 + 3 * optimizer_slots) / flops_per_second)


def update_seconds(graph, rate):
    """Per layer call, seconds to update the weights it owns (a layer
    called twice owns its weights at its first call)."""
    seen, result = set(), []
    for call in graph.calls:
        sizes = []
        for v in getattr(call.operation, "trainable_variables", None) or []:
            if id(v) not in seen:
                seen.add(id(v))
                sizes.append(int(np.prod(v.shape)))
        result.append(rate.seconds(sizes))
    return result


# The probes train a pipeline, which only the level above the Keras model
# can build: they live in `keras_pipe.calibration` (which imports this
# module) and are looked up by name when first needed, so planning imports
# nothing above it.
_PROBES = "keras_pipe.calibration"


def _step_probe(name):
    """The function `name` of the probes' module (`_PROBES`)."""
    return getattr(importlib.import_module(_PROBES), name)


def step_overhead(devices, cache=True):
    """The fixed costs of a step on `devices` (an `Overhead`), measured
    once per devices by training a pipeline that computes next to nothing
    (`keras_pipe.calibration.measure`), and cached."""
    probe = _step_probe("measure")
    return Overhead(**cached(
        ("overhead", [_device_name(d) for d in devices or [None]]),
        lambda: dataclasses.asdict(probe(list(devices or []))), cache))


def has_step_probe():
    """Whether the measured training step of a pipeline is available
    (`keras_pipe.calibration.step_seconds`, `model_step_seconds`)."""
    return importlib.util.find_spec(_PROBES) is not None


def model_step_seconds(model, graph, shapes, devices, sizes,
                       num_micro_batches, remat, batch_size,
                       input_shape=None, sample_inputs=None, loss=None,
                       optimizer_slots=2, schedule="gpipe", cache=True):
    """The measured training step of a pipeline of `model` (seconds,
    `keras_pipe.calibration.step_seconds`), cached: keyed by the
    model's calls and shapes, the schedule, the devices of the stages, the
    cut, `M`, the remat modes, the batch, the loss and the optimizer's
    slots."""
    probe = _step_probe("step_seconds")
    remat = [remat] * len(sizes) if isinstance(remat, str) else list(remat)
    loss_key = (keras.saving.serialize_keras_object(keras.losses.get(loss))
                if isinstance(loss, str) or callable(loss) else None)
    return cached(
        ("model_step", _graph_signature(graph, shapes), schedule,
         [_device_name(d) for d in devices], list(sizes), num_micro_batches,
         remat, batch_size, loss_key, optimizer_slots),
        lambda: probe(model, devices, sizes, num_micro_batches, remat,
                      batch_size, shapes, input_shape, sample_inputs, loss,
                      optimizer_slots, schedule), cache)
