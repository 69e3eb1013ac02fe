"""The Timeline callback records the schedule that actually ran."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_pipe
from keras_pipe import timeline
from tests.support import tools

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


class SlowDense(keras.layers.Layer):
    """Dense whose forward also sleeps `seconds` (not differentiated)."""

    def __init__(self, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        def wait(x):
            import time

            time.sleep(self.seconds)
            return x

        slept = tf.ensure_shape(tf.numpy_function(
            wait, [inputs], tf.float32, stateful=False), inputs.shape)
        return self.dense(inputs + 0.0 * tf.stop_gradient(slept))


def _record_step_1(model, tmp_path):
    """Fits `model` two steps with a Timeline on step 1; its result."""
    model.compile("sgd", "mse")
    recorder = timeline.Timeline(str(tmp_path), steps=(1,), verbose=False)
    x = np.ones((16, 3), "float32")
    model.fit(x, x, batch_size=8, epochs=1, callbacks=[recorder], verbose=0)
    (result,) = recorder.results
    return result


def test_timeline_writes_trace_png_and_bubble(devices, tmp_path):
    k, m, t = 2, 4, 0.04
    model = keras_pipe.PipelineModel(
        [SlowDense(t) for _ in range(k)], devices=devices[:k],
        num_micro_batches=m, remat="except_last", schedule="gpipe")
    result = _record_step_1(model, tmp_path)
    events = result["events"]
    count = {kind: sum(e["kind"] == kind for e in events)
             for kind in timeline.KINDS}
    # except_last: every micro-batch but the last is recomputed; the last
    # one's backward call on stage 1, not recomputed, is split from its
    # weight gradients (its input gradient goes to stage 0's device);
    # stage 0's stays whole. Each stage's last backward call (micro-batch
    # 0's) is split too, its recompute inside B (`engine.weight_calls`).
    assert count == {"forward": m * k, "recompute": (m - 2) * k,
                     "backward": m * k, "weight": 1 + k}
    forward = sorted((e for e in events if e["kind"] == "forward"),
                     key=lambda e: (e["stage"], e["micro_batch"]))
    # Only bounds that a busy host cannot break: a stamp may run late, never
    # early, and a sleep never ends early. (b's start and a's end stamps
    # wait for the same tensor and race, so they are not compared.)
    for e in forward:
        assert e["end"] - e["start"] >= 0.9 * t  # the stage's sleep
    for a, b in zip(forward, forward[1:]):
        if a["stage"] == b["stage"]:  # micro-batches in order on a stage
            # b's start stamp waits for a's call, which waits for a's
            # start stamp and sleeps t.
            assert b["start"] >= a["start"] + 0.9 * t
    span = max(e["end"] for e in forward) - min(e["start"] for e in forward)
    assert span >= (m + k - 1) * t * 0.9
    # Pipelined, not serialized: stage 0 starts micro-batch i + 1 before
    # stage 1 has finished micro-batch i (run one after the other, as
    # stateful ops in program order would, it never does). Both start when
    # micro-batch i leaves stage 0; stage 1 then sleeps t = 40 ms.
    by_key = {(e["stage"], e["micro_batch"]): e for e in forward}
    assert any(by_key[(0, i + 1)]["start"] < by_key[(1, i)]["end"]
               for i in range(m - 1)), forward
    assert 0.0 < result["measured_bubble"] < 1.0
    assert result["theoretical_bubble"] == pytest.approx((k - 1) / (m + k - 1))

    trace = json.loads((tmp_path / "step1.trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(n for n in names if n.startswith("F")) == sorted(
        f"F{i}" for i in range(m) for _ in range(k))
    assert os.path.getsize(tmp_path / "step1.png") > 1000
    # Steps that are not recorded run the ordinary step function.
    assert model.step_observer is None


def test_timeline_records_split_weight_gradients(devices, tmp_path):
    # zb_h2 defers every W; consecutive W of a stage run as one call, which
    # the timeline shows once, at its first micro-batch.
    k, m = 2, 4
    model = keras_pipe.PipelineModel(
        [SlowDense(0.01) for _ in range(k)], devices=devices[:k],
        num_micro_batches=m, schedule="zb_h2")
    events = _record_step_1(model, tmp_path)["events"]
    weights = [e for e in events if e["kind"] == "weight"]
    backward = {(e["stage"], e["micro_batch"]): e for e in events
                if e["kind"] == "backward"}
    assert len(backward) == m * k
    assert 1 <= len(weights) < m * k  # grouped
    for w in weights:  # after the B of its micro-batch (5 ms of slack)
        assert w["start"] >= backward[(w["stage"], w["micro_batch"])][
            "end"] - 0.005


def test_timeline_bubble_joins_the_stages_of_a_device(devices, tmp_path):
    # zbv's V: stages 0 and 3 on one device, 1 and 2 on the other. A device
    # busy with one of its stages is not idle while the other waits.
    k, m = 4, 2
    model = keras_pipe.PipelineModel(
        [SlowDense(0.01) for _ in range(k)],
        devices=[devices[0], devices[1], devices[1], devices[0]],
        num_micro_batches=m, schedule="zbv")
    result = _record_step_1(model, tmp_path)
    events = result["events"]
    assert {e["stage"] for e in events} == set(range(k))
    assert result["measured_bubble"] == pytest.approx(
        timeline.bubble_of(events, k, [0, 1, 1, 0]))
    assert result["measured_bubble"] < timeline.bubble_of(events, k)
    assert os.path.getsize(tmp_path / "step1.png") > 1000


def test_timeline_rejects_bad_steps():
    with pytest.raises(ValueError, match=r"steps must be non-empty step "
                       r"indices >= 0. Received: steps=\(-1,\)"):
        timeline.Timeline("/tmp/x", steps=(-1,))


def test_bubble_of_counts_idle_time():
    events = [dict(stage=0, start=0.0, end=1.0), dict(stage=1, start=1.0,
                                                      end=2.0)]
    assert timeline.bubble_of(events, 2) == pytest.approx(0.5)
    # Two stages on one device: that device was never idle.
    assert timeline.bubble_of(events, 2, [0, 0]) == pytest.approx(0.0)
    # zbv's V on 2 devices: stages 0 and 3 share device 0, which is idle
    # from 1 to 3 of the 4 units; device 1 (stages 1 and 2) from 0 to 1.
    events = [dict(stage=0, start=0.0, end=1.0),
              dict(stage=1, start=1.0, end=2.0),
              dict(stage=2, start=2.0, end=3.0),
              dict(stage=3, start=3.0, end=4.0)]
    assert timeline.bubble_of(events, 4, [0, 1, 1, 0]) == pytest.approx(
        1 - (2 + 2) / 2 / 4)
    assert timeline.bubble_of(events, 4) == pytest.approx(0.75)
    with pytest.raises(ValueError, match=r"one device index per stage "
                       r"\(4\). Received: stage_devices=\[0, 1\]"):
        timeline.bubble_of(events, 4, [0, 1])


def test_consecutive_recorded_steps_share_one_traced_function(devices,
                                                              tmp_path):
    # The first run of a traced function carries one-time costs; the
    # second recorded step reuses the function, so it shows a warm step.
    model = keras_pipe.PipelineModel(
        [keras.Sequential([keras.layers.Dense(3)]) for _ in range(2)],
        devices=devices[:2], num_micro_batches=2, remat="always",
        schedule="gpipe")
    model.compile("sgd", "mse")
    rebuilt = []
    make = model.make_train_function

    def counted(force=False):
        rebuilt.append(force)
        return make(force=force)

    model.make_train_function = counted
    recorder = timeline.Timeline(str(tmp_path), steps=(1, 2), verbose=False)
    x = np.ones((32, 3), "float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    assert [r["step"] for r in recorder.results] == [1, 2]
    # Forced rebuilds: to the recording function before step 1, back to the
    # plain one after step 2; none between steps 1 and 2.
    assert rebuilt.count(True) == 2, rebuilt
    for result in recorder.results:
        # Each stage's last backward call is split (`engine.weight_calls`).
        assert {e["kind"] for e in result["events"]} == {
            "forward", "recompute", "backward", "weight"}
    assert model.step_observer is None


def test_timeline_tool_places_a_v_schedule_on_half_the_devices(
        tmp_path, capsys):
    # zbv's 4 stages on the first 2 of this process's devices in a V, a
    # warm step drawn.
    tools.load("timeline").main(
        ["--schedule", "zbv", "--num-micro-batches", "2", "--batch-size",
         "64", "--out", str(tmp_path), "--name", "v"])
    done = capsys.readouterr()
    assert "measured bubble" in done.out
    trace = json.loads((tmp_path / "v.trace.json").read_text())
    rows = sorted(e["args"]["name"] for e in trace["traceEvents"]
                  if e["ph"] == "M")
    # Stage j and stage 3 - j share a device.
    device = {int(r.split()[1]): r.split("(")[1] for r in rows}
    assert device[0] == device[3] != device[1] == device[2]
    assert os.path.getsize(tmp_path / "v.png") > 1000
