"""Measured costs of a model's layer calls, stage calls and transfers.

Why measure: what FLOPs say is not what a device does. On a CPU the same
products cost 1.35-1.53x more per row at 8 micro-batches than at one, a
transfer between two workers costs about a millisecond whatever its size,
and a stage call has a fixed cost of its own; a planner that ranks
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
import json
import os
import pathlib
import time as time_lib
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["CallCosts", "Link", "cache_path", "call_costs", "flops_costs",
           "link", "stage_call_seconds"]

_VERSION = 1


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


def _key(*parts):
    text = json.dumps([_VERSION, tf.__version__, keras.__version__]
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


def _repeated(body, times):
    """A tf.function running `body(flat)` `times` times one after another.
    """
    @tf.function
    def run(*flat):
        out = None
        for n in range(times):
            if n:
                # Each run reads the last one's result: a data edge, so no
                # optimizer merges or reorders the identical runs.
                probe = tf.cast(tf.reshape(out[0], [-1])[0], tf.float32)
                flat = [t + tf.cast(probe * 0.0, t.dtype)
                        if t.dtype.is_floating else t for t in flat]
            out = [t for t in body(flat) if t is not None]
        return out
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


def _functions(call, training):
    """Three tf.functions: forward; forward and input gradients; forward
    and all gradients. Stateless: the model's variables do not change."""
    variables = [v for v in (getattr(call.operation, "trainable_variables",
                                     None) or [])]

    def forward(flat):
        values = {id(x): t for x, t in zip(call.inputs, flat)}
        with keras.StatelessScope():
            call.run(values, training=training)
        return [values[id(x)] for x in call.outputs]

    def loss(outputs):
        terms = [tf.reduce_sum(tf.cast(y, tf.float32)) for y in outputs
                 if y is not None and y.dtype.is_floating]
        return tf.add_n(terms) if terms else tf.constant(0.0)

    def run_forward(flat):
        return forward(flat)

    def run_input(flat):
        with tf.GradientTape() as tape:
            for t in flat:
                if t.dtype.is_floating:
                    tape.watch(t)
            y = loss(forward(flat))
        sources = [t for t in flat if t.dtype.is_floating]
        return _dense(tape.gradient(y, sources)) + [y]

    def run_all(flat):
        with tf.GradientTape() as tape:
            for t in flat:
                if t.dtype.is_floating:
                    tape.watch(t)
            y = loss(forward(flat))
        sources = [t for t in flat if t.dtype.is_floating] + [
            v.value for v in variables]
        return _dense(tape.gradient(y, sources)) + [y]

    return run_forward, run_input, run_all


def _per_run(body, inputs, repeats, times):
    """Seconds of one `body` run: `times` chained runs in one call, less
    one run, over `times - 1` (the call's own cost cancels)."""
    one = _timed(_repeated(body, 1), inputs, repeats)
    if times == 1:
        return one
    many = _timed(_repeated(body, times), inputs, repeats)
    return max(many - one, 0.0) / (times - 1)


def call_costs(graph, rows, device=None, shapes=None, training=True,
               repeats=5, times=4, cache=True):
    """Measured seconds of each layer call of `graph` for `rows` rows.

    ```python
    graph = keras_pipe.planning.graph.read_graph(model)
    costs = keras_pipe.planning.profiling.call_costs(graph, rows=32)
    sum(costs.forward), sum(costs.backward)
    ```

    Each call runs alone in three `tf.function`s on `device` (forward;
    forward and input gradients; forward and every gradient) on random
    inputs, under a `keras.StatelessScope`, each `times` times in a chain
    and once: the difference over `times - 1` (least of `repeats` warm
    runs) is one run without the function call's own cost. That gives its
    forward time, and the differences its input and weight gradient times.

    Args:
        graph: a `keras_pipe.planning.graph.Graph`.
        rows: rows per micro-batch.
        device: a TF device (logical or remote). Defaults to `None` (TF's
            default device).
        shapes: `{id(KerasTensor): shape}` (`balance.shapes.infer_shapes`).
            Defaults to `None` (the graph's shapes, unknowns as 1).
        training: the `training` flag. Defaults to `True`.
        repeats: timed runs per function. Defaults to `5`.
        times: chained runs per timed function. Defaults to `4`.
        cache: read and write the cache (`cache_path()`). Defaults to
            `True`.

    Returns:
        A `CallCosts`.
    """
    key = _key("calls", _graph_signature(graph, shapes), _device_name(device),
               rows, training, times)
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return CallCosts(**hit)
    forward, backward_input, weight = [], [], []
    with tf.device(device) if device else contextlib.nullcontext():
        for call in graph.calls:
            inputs = [cost_lib.sample_input(x, rows, shapes) for x in call.inputs]
            run_forward, run_input, run_all = _functions(call, training)
            f = _per_run(run_forward, inputs, repeats, times)
            fi = max(_per_run(run_input, inputs, repeats, times), f)
            fa = fi
            if getattr(call.operation, "trainable_variables", None):
                fa = max(_per_run(run_all, inputs, repeats, times), fi)
            forward.append(f)
            backward_input.append(fi - f)
            weight.append(fa - fi)
    result = CallCosts(rows, forward, backward_input, weight, True)
    if cache:
        _store(key, dataclasses.asdict(result))
    return result


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


def stage_call_seconds(device=None, repeats=20, cache=True):
    """The fixed cost of one stage call inside a step, on `device`.

    Times a `tf.function` chaining 32 calls of a nested `tf.function` of
    one tiny op (each call waits for the last, as the executor chains a
    device's calls) against one that chains 2; the difference per call.
    """
    key = _key("stage_call", _device_name(device))
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return hit
    with tf.device(device) if device else contextlib.nullcontext():
        @tf.function
        def inner(x):
            return x * 1.0001

        def chain(n):
            @tf.function
            def run(x):
                y = x
                for _ in range(n):
                    with tf.control_dependencies([y]):
                        y = inner(y)
                return y
            return run

        x = tf.ones([8])
        long, short = (_timed(chain(n), [x], repeats) for n in (32, 2))
    seconds = max((long - short) / 30, 0.0)
    if cache:
        _store(key, seconds)
    return seconds


def link(source=None, target=None, sizes=(2**10, 2**22), repeats=9,
         cache=True):
    """Measured transfer time from device `source` to `target`.

    Times a `tf.function` that makes a tensor on `source` and reduces it
    on `target`, for small and large `sizes` (bytes), against the same on
    `target` alone; a line through the two differences gives latency and
    bandwidth.

    Returns:
        A `Link`.
    """
    key = _key("link", _device_name(source), _device_name(target), sizes)
    if cache:
        hit = _load().get(key)
        if hit is not None:
            return Link(**hit)
    times = []
    for size in sizes:
        n = max(size // 4, 1)

        def make(where):
            @tf.function
            def run(x):
                with tf.device(where):
                    y = x + 1.0  # noqa: B023 - traced before the loop moves on
                with tf.device(target):
                    return tf.reduce_sum(y[:1])
            return run

        with tf.device(source):
            x = tf.ones([n])
        moved = _timed(make(source), [x], repeats)
        local = _timed(make(target), [x], repeats)
        times.append(max(moved - local, 0.0))
    (s0, s1), (t0, t1) = sizes, times
    slope = max((t1 - t0) / (s1 - s0), 1e-12)
    latency = max(t0 - slope * s0, 0.0)
    result = Link(latency, 1.0 / slope)
    if cache:
        _store(key, dataclasses.asdict(result))
    return result
