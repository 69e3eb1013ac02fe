"""The executor runs any registered schedule: adding one is one function.

That each steps like the unsplit model: tests/test_every_schedule.py.

Tolerances as in test_transparency: rtol 1e-5, atol 1e-6 (float32; only
the order of sums changes).
"""

import collections
import functools
import os
import subprocess
import sys

import pytest

from keras_pipe.engine import schedule
from tests.support import helpers
from tests.support.schedules import backward_in_forward_order
from tests.test_transparency import check_one_step, compile_both


def test_registered_schedule_is_followed(devices):
    ticks = backward_in_forward_order(3, 2)
    assert schedule.format_schedule(ticks) == (
        "tick     0  1  2  3  4  5  6  7\n"
        "stage 0 F0 F1 F2  .  . B0 B1 B2\n"
        "stage 1  . F0 F1 F2 B0 B1 B2  .")
    pipe, _ = helpers.pipeline_and_reference(
        2, 3, "never", devices, schedule="test_gpipe_forward_order")
    assert pipe.clock_ticks() == ticks


def test_per_stage_remat_is_exact(devices):
    pipe, reference = helpers.pipeline_and_reference(
        3, 4, ["always", "never", "except_last"], devices)
    compile_both(pipe, reference, optimizer="adam")
    x, y, _ = helpers.data(10)
    check_one_step(pipe, reference, x, y)


# Every registered schedule x every remat mode against the unsplit model:
# tests/test_every_schedule.py.


@pytest.mark.slow
@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv"])
def test_schedules_with_stages_sharing_devices_check_the_order(devices,
                                                               name):
    with pytest.raises(ValueError, match=f"schedule='{name}' needs stage j "
                       "on device"):
        helpers.pair(lambda: helpers.dense_stages(4),
                     [devices[0], devices[0], devices[1], devices[1]], 2,
                     "never", schedule=name)


@pytest.mark.slow
@pytest.mark.parametrize("name,remat", [("gpipe", "never"),
                                        ("zb_h1", "never"),
                                        ("1f1b", "always")])
def test_transfers_leave_through_an_identity_on_the_sender(devices, name,
                                                           remat):
    # TF's executor queues a finished op's `_Send` behind the next call on
    # the same device (its control successor); through an Identity that
    # runs in line, the transfer leaves at once (`executor._handed_over`).
    # Every tensor that crosses to another stage's device must come from an
    # Identity on the sender's device.
    import tensorflow as tf
    pipe, _ = helpers.pair(lambda: helpers.dense_stages(3), devices[:3], 3,
                           remat, schedule=name)
    pipe.compile("sgd", "sparse_categorical_crossentropy")
    x, y, _ = helpers.data(9)
    graph = tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y)).graph
    spec = tf.DeviceSpec.from_string
    crossing = []
    for op in graph.get_operations():
        for t in op.inputs:
            if (op.device and t.op.device and spec(op.device) !=
                    spec(t.op.device) and "/mb" in op.name):
                crossing.append((t.op.type, t.op.name, op.name))
    assert crossing, "no tensor crossed devices"
    assert all(kind == "Identity" for kind, _, _ in crossing), [
        c for c in crossing if c[0] != "Identity"][:5]


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["never", "always"])
def test_gpipe_weight_gradients_are_one_product_per_kernel(devices, remat):
    # Without remat, each stage's run of backward calls leaves its weight
    # gradients to one call after the run: one MatMul per Dense kernel over
    # the concatenated micro-batches, no running sum. With remat, each
    # backward call computes them (the stash would hold the activations
    # that remat frees), but for each stage's last: its W call runs in
    # place (`engine.weight_calls`), one MatMul per kernel of one
    # micro-batch, added to the running sums.
    import tensorflow as tf
    pipe, _ = helpers.pair(lambda: helpers.dense_stages(2), devices[:2], 3,
                           remat)
    pipe.compile("sgd", "sparse_categorical_crossentropy")
    x, y, _ = helpers.data(9)
    graph = tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y)).graph
    weight_ops = [op for op in graph.get_operations() if "/weight" in op.name]
    # Function calls (remat) hold their ops in function bodies.
    calls = [op for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    # W replays each mixing op on its stash under a tape; the replayed
    # forward product feeds nothing and is pruned at run time.
    matmuls = [op.name for op in weight_ops if op.type == "MatMul"
               and op.name.startswith("gradient_tape/")]
    kernels = [v for v in pipe.trainable_variables if len(v.shape) == 2]
    assert len(matmuls) == len(kernels) == 3, matmuls
    concats = [op for op in weight_ops if op.type == "ConcatV2"]
    if remat == "always":
        assert calls and not concats
        return
    assert concats
    adds = [op.name for op in graph.get_operations()
            if op.type in ("AddV2", "AddN") and "backward" in op.name
            and "gradient_tape" not in op.name]
    assert not adds, adds


_COUNT_PRODUCTS = """
import sys
import keras, numpy as np, keras_pipe
devices = keras_pipe.logical_cpu_devices(2)
for name in sys.argv[1:]:
    stages = [keras.Sequential([keras.layers.Dense(64, activation="relu")
                                for _ in range(2)]) for _ in range(2)]
    pipe = keras_pipe.PipelineModel(stages, devices=devices,
                                    num_micro_batches=4, remat="never",
                                    schedule=name)
    pipe.build((None, 64))
    pipe.compile("sgd", "mse")
    x = np.random.rand(64, 64).astype("float32")
    pipe.fit(x[:32], x[:32], batch_size=32, verbose=0)  # traced, warm
    print(f"=====STEPS {name}=====", flush=True)
    pipe.fit(x, x, batch_size=32, verbose=0, shuffle=False)  # two steps
    print("=====END=====", flush=True)
"""
# The schedules `test_each_product_runs_once_per_step` counts, in one child.
COUNTED = ("gpipe", "zb_h2")


@functools.cache
def _products_per_step():
    """`{schedule: oneDNN's executed matmuls in one training step, by kind
    and shape}` for the `COUNTED` schedules.

    From `ONEDNN_VERBOSE=1` in a child process: every product TF ran, after
    the function runtime pruned what feeds nothing (the graph alone cannot
    say which products run).
    """
    env = dict(os.environ, ONEDNN_VERBOSE="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _COUNT_PRODUCTS, *COUNTED],
                          capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = {}
    for name in COUNTED:
        steps = proc.stdout.split(f"=====STEPS {name}=====")[1].split(
            "=====END=====")[0]
        counts = collections.Counter()
        for line in steps.splitlines():
            fields = line.split(",")
            if line.startswith("onednn_verbose") and "exec" in fields[2:4]:
                counts[fields[5], fields[-2]] += 1
        assert counts, "no oneDNN product ran: is oneDNN off in this TF build?"
        result[name] = {key: n / 2 for key, n in counts.items()}
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name, weight_products", [
    # GPipe: each stage's 4 backward calls form one run; one product per
    # kernel over the 32 rows of the batch.
    ("gpipe", {"64x32:32x64": 4}),
    # ZB-H2 (see `schedule.zb_h2(4, 2)`): stage 0 runs W0 and W1 alone in
    # bubbles and W2 W3 as one call; stage 1 its trailing W0-W3 as one.
    ("zb_h2", {"64x8:8x64": 4, "64x16:16x64": 2, "64x32:32x64": 2}),
])
def test_each_product_runs_once_per_step(name, weight_products):
    # 2 stages of 2 Dense(64) layers, batch 32, M=4 (8 rows each). Forward:
    # 4 layers x 4 micro-batches; input gradients: 3 layers (the model's
    # input needs none) x 4; nothing replayed or computed twice.
    counts = _products_per_step()[name]
    micro = {"inner_product": 0, "gemm_api": 0}
    weight = {}
    for (kind, shape), n in counts.items():
        if shape in ("mb8ic64oc64", "8x64:64x64"):
            micro[kind] += n
        else:
            weight[shape] = weight.get(shape, 0) + n
    assert sum(micro.values()) == 4 * 4 + 3 * 4, counts
    assert weight == weight_products, counts


@pytest.mark.slow
def test_a_stage_that_runs_fused_adds_its_weight_gradients_at_once(devices):
    # An LSTM stage cannot split (its While loop): B stashes its whole
    # weight gradients, so they are added at each backward call rather
    # than held for the run's W (one copy of the weights per micro-batch).
    import keras
    import tensorflow as tf

    def stages():
        return [keras.Sequential([keras.layers.Reshape((3, 2)),
                                  keras.layers.LSTM(4)], name="recurrent"),
                keras.Sequential([keras.layers.Dense(helpers.NUM_CLASSES)],
                                 name="head")]

    pipe, reference = helpers.pair(stages, devices[:2], 3, "never")
    compile_both(pipe, reference, optimizer="adam")
    x, y, _ = helpers.data(8)  # uneven: 3, 3, 2
    check_one_step(pipe, reference, x, y)
    graph = tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y)).graph
    calls = {op.name.split("/")[1] for op in graph.get_operations()
             if op.name.startswith("stage0/") and "/weight/" in op.name}
    # GPipe runs B2, B1, B0; B2's gradients start the sums (no op), B1's
    # and B0's are added at once (one W over the run would be "mb2").
    assert calls == {"mb0", "mb1"}
    calls = {op.name.split("/")[1] for op in graph.get_operations()
             if op.name.startswith("stage1/") and "/weight/" in op.name}
    assert calls == {"mb2"}  # the Dense head: one W after its run


def _ancestors(ops):
    seen, todo = set(), list(ops)
    while todo:
        op = todo.pop()
        for p in [t.op for t in op.inputs] + list(op.control_inputs):
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name,num_stages", [("1f1b", 2),
                                             ("interleaved_1f1b", 4)])
def test_no_weight_call_waits_for_a_later_micro_batch(devices, name,
                                                      num_stages):
    # 1F1B's B calls on a stage wait for the next stage micro-batch by
    # micro-batch. A W call held to the end of a run of them would wait for
    # the input gradients of every later micro-batch (the other device's
    # B): the device idles in the gaps and computes the weight gradients
    # in the step's tail. Each W call of micro-batch i on stage j must
    # depend on no input gradient of a micro-batch after i.
    import tensorflow as tf
    stage_devices = [devices[j % 2] for j in range(num_stages)]
    pipe, _ = helpers.pair(lambda: helpers.dense_stages(num_stages),
                           stage_devices, 4, "never", schedule=name)
    pipe.compile("sgd", "sparse_categorical_crossentropy")
    x, y, _ = helpers.data(16)
    graph = tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y)).graph
    calls = collections.defaultdict(list)
    for op in graph.get_operations():
        parts = op.name.split("/")
        if len(parts) > 3 and parts[2] == "weight" and parts[0].startswith(
                "stage"):
            calls[int(parts[0][5:]), int(parts[1][2:])].append(op)
    assert calls, "no W call in the step"
    # The first stage sends no input gradient: its B calls stay whole, but
    # for its last (its W call releases the gradients in turn,
    # `engine.weight_calls`).
    assert len([i for j, i in calls if j == 0]) == 1, sorted(calls)
    if num_stages > 2:
        assert any(j < num_stages - 1 for j, _ in calls)
    for (j, i), ops in calls.items():
        if j == num_stages - 1:
            continue  # its B waits for the loss, not for another stage
        waited = {int(op.name.split("/")[1][2:]) for op in _ancestors(ops)
                  if op.name.startswith(f"stage{j + 1}/mb")
                  and op.name.split("/")[2] == "send_back"}
        assert waited and max(waited) == i, (j, i, sorted(waited))


_COMPUTE = ("MatMul", "PartitionedCall", "StatefulPartitionedCall")


def _record_calls(monkeypatch):
    """Records each stage call (and loss head) as it is issued:
    `(device, ops it created, its outputs)`, in issue order."""
    import tensorflow as tf

    from keras_pipe.engine import executor as executor_lib
    from keras_pipe.engine import stage as stage_lib

    calls = []

    def ops():
        return tf.compat.v1.get_default_graph().get_operations()

    def spy(owner, method, device_of, outputs_of):
        original = getattr(owner, method)

        def wrapped(self, *args, **kwargs):
            first = len(ops())
            result = original(self, *args, **kwargs)
            made = ops()[first:]
            outputs = [t for t in outputs_of(self, args, result)
                       if isinstance(t, tf.Tensor) and t.op in set(made)]
            if made:
                calls.append((device_of(self, args), made, outputs))
            return result

        monkeypatch.setattr(owner, method, wrapped)

    def on_stage(self, args):
        return self.device

    spy(stage_lib.Stage, "forward", on_stage, lambda s, a, r: (
        __import__("keras").tree.flatten(r[0].outputs) + list(r[0].losses)
        + list(r[1])))
    spy(stage_lib.Stage, "backward", on_stage,
        lambda s, a, r: list(r[0]) + list(r[1]))
    spy(stage_lib.Stage, "backward_input", on_stage,
        lambda s, a, r: list(r[0]) + list(r[1]))
    spy(stage_lib.Stage, "backward_weight", on_stage,
        lambda s, a, r: list(r))
    # The loss head of micro-batch i (args: step, head, i): its outputs
    # are the seeds of the last stage's backward call.
    spy(executor_lib.Executor, "_maybe_seed_part",
        lambda self, a: self.runner(a[0], a[2], self.num_stages - 1).device,
        lambda self, a, r: list(a[0].cells[a[2]][-1].output_grads or []))
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["never", "except_last"])
@pytest.mark.parametrize("name", schedule.schedule_names())
def test_a_device_waits_for_every_output_of_its_last_call(devices,
                                                          monkeypatch, name,
                                                          remat):
    # The calls of a device run one after another (what the memory model
    # assumes): the work of each call (its products, or its one function
    # op) waits for EVERY output of the previous call on the device (a
    # backward call's weight gradients and sums, a W call's total per
    # variable, a forward call's outputs, the loss head's seeds), not only
    # for one of them: TF inlines the calls that run in place, and the
    # rest of the previous call would still run, holding its activations.
    import tensorflow as tf

    from tests.test_every_schedule import device_layout
    layout = device_layout(name)
    pipe, _ = helpers.pair(lambda: helpers.dense_stages(len(layout)),
                           [devices[d] for d in layout], 4, remat,
                           schedule=name)
    pipe.compile("sgd", "sparse_categorical_crossentropy")
    x, y, _ = helpers.data(16)
    calls = _record_calls(monkeypatch)
    tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y))
    by_device = collections.defaultdict(list)
    for device, made, outputs in calls:
        by_device[device].append((made, outputs))
    assert len(by_device) == len(set(layout))
    checked = 0
    for device, chain in by_device.items():
        for (_, outputs), (made, _) in zip(chain, chain[1:]):
            for op in (op for op in made if op.type in _COMPUTE):
                waited = _ancestors([op])
                missing = [t.name for t in outputs if t.op not in waited]
                assert not missing, (device, op.name, missing)
                checked += 1
    assert checked
