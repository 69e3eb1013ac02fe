"""Where variables, forward, backward, recompute and optimizer ops run.

Placement is read back from TF itself (variables' devices and the placer
log), not from what the code asked for.
"""

import json
import re

import keras
import pytest
import tensorflow as tf

from tests.support import helpers, warm

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

PLACER_LINE = re.compile(r"placer\.cc:\d+\] (\S+): \((\w+)\): (\S+)$")


def run_placement_script(remat, *policy):
    # Children of one warm process that logs TF's placement (level 0).
    proc = warm.run(
        ["-m", "tests.support.placement_script", remat, *policy],
        dict(warm.env(), TF_CPP_MIN_LOG_LEVEL="0"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    ops = [m.groups() for m in map(PLACER_LINE.search,
                                   proc.stderr.splitlines()) if m]
    assert len(ops) > 100, proc.stderr[-3000:]
    return result, ops


@pytest.fixture(scope="module", params=["always", "never"])
def placement(request):
    return request.param, *run_placement_script(request.param)


def cpu(index):
    return f"/job:localhost/replica:0/task:0/device:CPU:{index}"


def test_stage_variables_live_on_their_device(placement):
    _, result, _ = placement
    for j, paths in enumerate(result["stage_devices"]):
        for path in paths:
            assert result["variables"][path] == cpu(j), path


def test_optimizer_slots_live_with_their_variable(placement):
    _, result, _ = placement
    checked = 0
    for path, device in result["variables"].items():
        for slot in ("momentum", "velocity"):
            slot_path = "adam/" + path.replace("/", "_") + "_" + slot
            if slot_path in result["slots"]:
                assert result["slots"][slot_path] == device, slot_path
                checked += 1
    assert checked == 2 * 8  # 8 trainable variables, 2 Adam slots each


def test_forward_backward_and_recompute_ops_run_on_the_stage_device(
        placement):
    remat, _, ops = placement
    # Ops of the step's graph: stage{j}/mb{i}/forward|backward[/recompute].
    calls = {"forward": 0, "backward": 0, "recompute": 0}
    for name, op_type, device in ops:
        match = re.match(r"stage(\d+)/mb\d+/(forward|backward)", name)
        if not match:
            continue
        assert device == cpu(int(match.group(1))), (name, op_type, device)
        kind = "recompute" if "/recompute/" in name else match.group(2)
        calls[kind] += 1
    assert calls["forward"] > 0 and calls["backward"] > 0
    # With remat, each backward call is one function that recomputes its
    # stage first (op names "recompute/s{j}_..." inside it).
    calls["recompute"] += sum(
        1 for name, _, _ in ops
        if re.match(r"recompute/s\d_\w+/", name))
    assert (calls["recompute"] > 0) == (remat == "always")
    # Ops inside the traced stage functions and their gradient functions,
    # named after the stage's layers ("s{j}_..."): forward and backward math.
    inside = {"forward": 0, "backward": 0}
    for name, op_type, device in ops:
        match = re.search(r"(?:^|/)s(\d)_(?:dense|norm|dropout|logits)\w*/",
                          name)
        if not match or op_type == "NoOp":
            continue
        assert device == cpu(int(match.group(1))), (name, op_type, device)
        backward = "gradients/" in name or "gradient_tape/" in name
        inside["backward" if backward else "forward"] += 1
    assert inside["forward"] > 10 and inside["backward"] > 10, inside


def test_optimizer_update_math_runs_on_each_variables_device(placement):
    _, _, ops = placement
    per_device = {cpu(0): 0, cpu(1): 0}
    for name, op_type, device in ops:
        match = re.search(r"update_on_(\S+?CPU_(\d))(_\d+)?/", name)
        if not match or op_type == "ReadVariableOp":
            continue  # reads of the shared iteration counter live on CPU:0
        assert device == cpu(int(match.group(2))), (name, op_type, device)
        per_device[device] += 1
    assert all(count > 10 for count in per_device.values()), per_device


def _device_index(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


@pytest.mark.parametrize("clip", [{}, {"clipnorm": 1.0},
                                  {"global_clipnorm": 1.0},
                                  {"clipvalue": 0.1}])
@pytest.mark.parametrize("remat", ["always", "never"])
def test_weight_gradients_stay_on_their_device_in_the_optimizer(
        devices, clip, remat):
    # Keras' default-strategy "all-reduce" joins every gradient in one
    # IdentityN op and its clipping ops have no device: TF then moves all
    # gradients to one device and back each step (on worker processes,
    # over gRPC). Every consumer of a stage's weight gradients must run on
    # that stage's device.
    pipe = helpers.compiled_pipeline(devices, 2, 3, remat)
    pipe.compile(keras.optimizers.Adam(1e-3, **clip),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    graph = tf.function(pipe.train_step).get_concrete_function(
        (tf.TensorSpec((9, helpers.IN_DIM)), tf.TensorSpec((9,), tf.int32)),
    ).graph
    # Weight gradients come from backward calls (fused) or, without remat,
    # from one weight call after each stage's backward calls.
    scope = r"(gradient_tape/)?stage\d/mb\d/(backward|weight)/"
    backward = [op for op in graph.get_operations() if re.match(
        scope, op.name) and op.outputs]
    assert backward
    checked = 0
    for op in backward:
        for out in op.outputs:
            for consumer in out.consumers():
                assert consumer.device, (op.name, consumer.name)
                if re.match(scope, consumer.name):
                    continue  # gradients for the previous stage, or sums
                assert _device_index(consumer.device) == _device_index(
                    op.device), (op.name, consumer.name, consumer.device)
                checked += 1
    assert checked >= 4  # 2 stages x (kernel, bias) reach the optimizer


def test_mixed_precision_loss_scaling_runs_on_each_gradients_device():
    # LossScaleOptimizer checks every gradient for inf/NaN and divides it by
    # the loss scale under no device scope: TF put those ops (and moved the
    # gradients) on one device. One check and one division per gradient,
    # on its stage's device.
    result, ops = run_placement_script("always", "mixed_float16")
    expected = {cpu(j): n for j, n in enumerate(result["gradients_per_stage"])}
    checks, divisions = {}, {}
    for name, op_type, device in ops:
        if op_type == "IsFinite":
            checks[device] = checks.get(device, 0) + 1
        elif op_type == "RealDiv" and re.fullmatch(
                r"cond/then/_\d+/cond/truediv(_\d+)?", name):
            divisions[device] = divisions.get(device, 0) + 1
    assert checks == expected, (checks, expected)
    assert divisions == expected, (divisions, expected)


def test_big_variables_are_placed_one_at_a_time(devices, monkeypatch):
    # Each move of a variable of IN_TURN_BYTES or more waits until it is on
    # its device (on a worker an eager op is only queued: without the wait
    # every transfer of a stage was queued at once and arrived during the
    # first step); small ones do not wait.
    from keras_pipe.engine import placement as placement_lib

    waits = []
    monkeypatch.setattr(placement_lib._compat, "sync_executors",
                        lambda: waits.append(len(waits)))
    model = keras.Sequential([keras.Input((512,)),
                              keras.layers.Dense(512),   # 1 MiB kernel
                              keras.layers.Dense(600),   # 1.17 MiB kernel
                              keras.layers.Dense(8)])    # small
    big = [v for v in model.variables
           if v.value.shape.num_elements() * 4 >= placement_lib.IN_TURN_BYTES]
    assert len(big) == 2
    moved = placement_lib.place_variables(model, devices[1])
    assert moved == len(model.variables) == 6
    assert len(waits) == len(big)
    assert all(placement_lib.device_of(v).endswith("CPU:1")
               for v in model.variables)
