"""Timeline of a training step: when each stage ran which micro-batch.

The `Timeline` callback re-traces the training step for the steps it
records, with a timestamp op before and after every stage call (forward,
recompute, backward) of every micro-batch, each on the stage's device. The
stamps land in a variable that the callback reads after the step and turns
into a Chrome trace (`chrome://tracing`, Perfetto) and a PNG Gantt chart,
with the measured bubble (idle) fraction next to GPipe's (K-1)/(M+K-1).
Other steps run the ordinary step function, without stamps.
"""

import json
import os
import re
import time

import keras
import numpy as np
import tensorflow as tf

from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.engine.building import device_indices

__all__ = ["Timeline", "Recorder", "bubble_of", "render_png",
           "to_chrome_trace"]

KINDS = ("forward", "recompute", "backward", "weight")
_KEY = re.compile(
    r"stage(\d+)/mb(\d+)/(forward|backward|weight)(/recompute)?$")


def _now(anchor):
    del anchor
    return np.float64(time.time())


def stamp(after, device=None):
    """The wall-clock time once the tensors `after` exist.

    Not `tf.timestamp()`: it is stateful, and `tf.function` orders all
    stateful ops in program order, which would serialize the stages. A
    stateless `numpy_function` fed from the data (so that no two stamps can
    be merged or folded) is not ordered that way.

    A `numpy_function` runs Python, so it must run in this process: with
    `device` (the client's CPU) the stamp of a stage on a remote worker is
    taken here when one element of `after` has arrived, a transfer later
    than on the worker (a fraction of a millisecond on loopback).
    """
    after = [t for t in after if t is not None]
    first = None
    tensors = [t for t in after if isinstance(t, tf.Tensor)]
    if tensors:  # not an op (the end of a device's last call)
        first = tf.reshape(tensors[0], [-1])[:1]
    with tf.device(device):
        anchor = tf.zeros((), tf.float64)
        if first is not None:
            anchor = tf.reduce_sum(tf.cast(first, tf.float64))
        with tf.control_dependencies(after):
            now = tf.numpy_function(_now, [anchor], tf.float64,
                                    stateful=False)
        return tf.reshape(now, ())


class Recorder:
    """Collects start/end timestamp tensors of stage calls while tracing."""

    def __init__(self, num_micro_batches, num_stages, buffer=None):
        self.num_micro_batches = num_micro_batches
        self.num_stages = num_stages
        self._buffer = buffer
        # Stamps run where the buffer lives: this process's CPU.
        self.device = None if buffer is None else buffer.device
        self._starts, self._ends = {}, {}

    @staticmethod
    def _key(name):
        match = _KEY.search(name)
        if not match:
            raise ValueError(f"Not a stage call name: {name!r}")
        kind = "recompute" if match.group(4) else match.group(3)
        return kind, int(match.group(2)), int(match.group(1))

    def stamp(self, after):
        """A timestamp op once `after` exist, in this process (`stamp`)."""
        return stamp(after, self.device)

    def start(self, name, after):
        """A timestamp taken once `after` (tensors) are ready."""
        start = self.stamp(after)
        self._starts[self._key(name)] = start
        return start

    def put(self, name, start, end):
        """Stamps taken elsewhere (inside a stage's backward function)."""
        self._starts[self._key(name)] = start
        self._ends[self._key(name)] = end

    def end(self, name, after):
        self._ends[self._key(name)] = self.stamp(after)

    def finish(self):
        """Writes the stamps of the traced step into the buffer variable."""
        self._buffer.assign(self.stacked())

    def stacked(self):
        """All stamps as a `[4, M, K, 2]` float64 tensor, -1 where none."""
        missing = tf.constant(-1.0, tf.float64)
        rows = []
        for kind in KINDS:
            for i in range(self.num_micro_batches):
                for j in range(self.num_stages):
                    key = (kind, i, j)
                    rows.append(tf.stack([self._starts.get(key, missing),
                                          self._ends.get(key, missing)]))
        return tf.reshape(tf.stack(rows), (len(KINDS), self.num_micro_batches,
                                           self.num_stages, 2))


def events_of(stamps):
    """Turns a `[4, M, K, 2]` array of stamps into a list of event dicts."""
    stamps = np.asarray(stamps)
    t0 = stamps[stamps >= 0].min()
    events = []
    for k, kind in enumerate(KINDS):
        for i in range(stamps.shape[1]):
            for j in range(stamps.shape[2]):
                start, end = stamps[k, i, j]
                if start >= 0 and end >= 0:
                    events.append(dict(kind=kind, micro_batch=i, stage=j,
                                       start=float(start - t0),
                                       end=float(end - t0)))
    return events


def _busy(intervals):
    total, last = 0.0, -np.inf
    for start, end in sorted(intervals):
        start = max(start, last)
        if end > start:
            total += end - start
            last = end
    return total


def bubble_of(events, num_stages, stage_devices=None):
    """Measured idle fraction: 1 - mean over devices of busy time / span.

    `stage_devices` (per stage, the index of its device) joins the stages
    that share a device: a device running one of its stages is not idle
    while its other stage waits. Defaults to one device per stage.

    Raises:
        ValueError: if `stage_devices` does not give one index per stage.
    """
    stage_devices = (list(range(num_stages)) if stage_devices is None
                     else list(stage_devices))
    if len(stage_devices) != num_stages:
        raise ValueError(
            f"stage_devices must give one device index per stage "
            f"({num_stages}). Received: stage_devices={stage_devices!r}")
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = [_busy([(e["start"], e["end"]) for e in events
                   if stage_devices[e["stage"]] == d])
            for d in sorted(set(stage_devices))]
    return 1.0 - float(np.mean(busy)) / span


def to_chrome_trace(events, devices):
    """Chrome trace JSON (one row per stage) for chrome://tracing."""
    trace = [dict(ph="M", name="thread_name", pid=1, tid=j,
                  args=dict(name=f"stage {j} ({device})"))
             for j, device in enumerate(devices)]
    letter = {"forward": "F", "recompute": "R", "backward": "B",
              "weight": "W"}
    for e in events:
        trace.append(dict(
            ph="X", pid=1, tid=e["stage"], cat=e["kind"],
            name=f"{letter[e['kind']]}{e['micro_batch']}",
            ts=e["start"] * 1e6, dur=(e["end"] - e["start"]) * 1e6,
            args=dict(micro_batch=e["micro_batch"], kind=e["kind"])))
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def render_png(events, num_stages, path, title="", stage_devices=None):
    """A Gantt chart: stages as rows, micro-batches as coloured boxes.

    With `stage_devices` (per stage, the index of its device), each row
    also names its device.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20").colors
    hatch = {"forward": None, "recompute": "..", "backward": "//",
             "weight": "xx"}
    fig, ax = plt.subplots(figsize=(10, 0.6 * num_stages + 1.4), dpi=90)
    for e in events:
        ax.broken_barh([(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)],
                       (e["stage"] - 0.4, 0.8),
                       facecolors=colors[e["micro_batch"] % len(colors)],
                       edgecolor="black", linewidth=0.3,
                       hatch=hatch[e["kind"]])
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {j}" + (
        "" if stage_devices is None else f" (device {stage_devices[j]})")
        for j in range(num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (plain: forward, dots: recompute, hatched: backward,"
                  " crossed: weight gradients; colour: micro-batch)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Timeline(keras.callbacks.Callback):
    """Records when each stage ran each micro-batch, for chosen steps.

    ```python
    timeline = keras_pipe.timeline.Timeline("logs/timeline", steps=(2,))
    model.fit(dataset, epochs=1, callbacks=[timeline])
    print(timeline.results[-1]["measured_bubble"])
    ```

    For each recorded step it writes `step{n}.trace.json` (open in
    chrome://tracing or https://ui.perfetto.dev) and `step{n}.png`, and
    appends to `results` a dict with the events, the measured bubble
    fraction and the theoretical `(K - 1) / (M + K - 1)`.

    Args:
        logdir: the directory to write to (created if missing).
        steps: the global training step indices (from 0) to record. The
            first step also traces the step function, so record a later
            one. Defaults to `(2,)`.
        verbose: print one line per recorded step. Defaults to `True`.

    Raises:
        TypeError: if the model is not a `keras_pipe.PipelineModel`.
        ValueError: if `steps` holds a negative or non-int value, or the
            model runs several steps per execution.
    """

    def __init__(self, logdir, steps=(2,), verbose=True):
        super().__init__()
        steps = tuple(steps)
        bad = [s for s in steps if isinstance(s, bool)
               or not isinstance(s, int) or s < 0]
        if bad or not steps:
            raise ValueError(
                "steps must be non-empty step indices >= 0. Received: "
                f"steps={steps!r}")
        self.logdir, self.steps, self.verbose = logdir, set(steps), verbose
        self.results = []
        self._step = 0
        self._buffer = None

    def on_train_begin(self, logs=None):
        from keras_pipe.model import PipelineModel

        if not isinstance(self.model, PipelineModel):
            raise TypeError(
                "Timeline records a keras_pipe.PipelineModel. Received: "
                f"{type(self.model).__name__}")
        if getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "Timeline needs steps_per_execution=1 to record one step. "
                f"Received: {self.model.steps_per_execution}")
        os.makedirs(self.logdir, exist_ok=True)
        m, k = self.model.num_micro_batches, self.model.num_stages
        with tf.device("/device:CPU:0"):
            self._buffer = tf.Variable(
                tf.fill((len(KINDS), m, k, 2), tf.constant(-1.0, tf.float64)),
                trainable=False, name="keras_pipe_timeline")

    def _switch(self, buffer):
        # The model calls the factory once per traced step and stamps each
        # stage call with the observer it returns.
        self.model.observe_steps(None if buffer is None else (
            lambda: Recorder(buffer.shape[1], buffer.shape[2], buffer)))

    def on_train_batch_begin(self, batch, logs=None):
        if self._step in self.steps:
            self._buffer.assign(tf.fill(self._buffer.shape,
                                        tf.constant(-1.0, tf.float64)))
            # Consecutive recorded steps share one traced function: from
            # the second on, no first-run costs are in the picture.
            if self._step - 1 not in self.steps:
                self._switch(self._buffer)

    def on_train_batch_end(self, batch, logs=None):
        step, self._step = self._step, self._step + 1
        if step not in self.steps:
            return
        if step + 1 not in self.steps:
            self._switch(None)
        events = events_of(self._buffer.numpy())
        k = self.model.num_stages
        m = 1 + max(e["micro_batch"] for e in events)
        on = device_indices(self.model.devices)
        result = dict(step=step, events=events, num_micro_batches=m,
                      num_stages=k,
                      measured_bubble=bubble_of(events, k, on),
                      theoretical_bubble=schedule_lib.bubble_fraction(m, k))
        self.results.append(result)
        base = os.path.join(self.logdir, f"step{step}")
        with open(base + ".trace.json", "w", encoding="utf-8") as f:
            json.dump(to_chrome_trace(events, self.model.devices), f)
        shared = len(set(on)) < k  # several stages per device
        render_png(events, k, base + ".png", stage_devices=(
            on if shared else None), title=(
            f"step {step}: K={k} stages, M={m} micro-batches, "
            f"remat={self.model.remat!r}; bubble measured "
            f"{result['measured_bubble']:.0%}, GPipe "
            f"{result['theoretical_bubble']:.0%}"))
        if self.verbose:
            print(
                f"Timeline step {step}: measured bubble "
                f"{result['measured_bubble']:.1%} (GPipe (K-1)/(M+K-1) = "
                f"{result['theoretical_bubble']:.1%}); wrote {base}.png")
