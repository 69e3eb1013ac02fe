"""Forward products with kernels transposed once per step.

`keras_pipe.engine.products`: with oneDNN on, a stage's in-place `x @ w`
on micro-batches of at most 256 rows is built as `x @ transpose(w)^T`, `w`
transposed once per step and stage. oneDNN is off by default on this
machine's CPU, so the tests that want the rewrite turn the decision on
(`_compat.onednn_enabled`); the step then runs TF's own kernels, which
give the same values. Tolerances as in test_transparency: rtol 1e-5, atol
1e-6 (float32; only the order of sums changes).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import products
from tests.support import helpers, warm
from tests.test_transparency import check_one_step, compile_both

WIDTH = products.MIN_COLUMNS
BATCH, M = 256, 4  # micro-batches of 64 rows


def _stages():
    # Kernels of shapes [6, 512], [512, 512] | [512, 512], [512, 3]: three
    # wide enough to be transposed.
    return [keras.Sequential([keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(WIDTH, activation="relu")]),
            keras.Sequential([keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(helpers.NUM_CLASSES)])]


def _graph(pipe, x, y):
    return tf.function(pipe.compute_loss_and_gradients).get_concrete_function(
        tf.constant(x), tf.constant(y)).graph


def _transposed_products(graph):
    """The forward products that read a transposed kernel."""
    return [op for op in graph.get_operations() if op.type == "MatMul"
            and op.get_attr("transpose_b")
            and op.inputs[1].op.type == "Snapshot"]


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN on, and the transposed form measured the faster one (which
    form wins depends on the CPU: `products.transposed_is_faster`)."""
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    monkeypatch.setattr(products, "transposed_is_faster",
                        lambda rows, count, device=None: True)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_transposed_kernels_step_like_the_unsplit_model(devices, onednn,
                                                        schedule):
    pipe, reference = helpers.pair(_stages, devices, M, "never",
                                   schedule=schedule)
    compile_both(pipe, reference)
    x, y, _ = helpers.data(BATCH)
    assert len(_transposed_products(_graph(pipe, x, y))) == 3 * M
    check_one_step(pipe, reference, x, y)


def test_remat_except_last_transposes_for_the_last_micro_batch(devices,
                                                               onednn):
    # Only the last micro-batch's forward runs in place; its 256 rows pay
    # for the transposes on their own.
    pipe, reference = helpers.pair(_stages, devices, M, "except_last",
                                   schedule="1f1b")
    compile_both(pipe, reference)
    x, y, _ = helpers.data(4 * BATCH)
    assert len(_transposed_products(_graph(pipe, x, y))) == 3
    check_one_step(pipe, reference, x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_each_kernel_is_transposed_once_per_step(devices, onednn, schedule):
    # One Transpose per wide kernel, whatever M; every forward product on
    # such a kernel reads it, and no product on an untransposed kernel
    # feeds anything (the original ops stay in the graph for the tapes,
    # unused: TF prunes them). W replays the original product: no
    # Transpose of a weight gradient.
    pipe, _ = helpers.pair(_stages, devices, M, "never", schedule=schedule)
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y, _ = helpers.data(BATCH)
    graph = _graph(pipe, x, y)
    transposes = [op for op in graph.get_operations()
                  if op.type == "Transpose"]
    assert len(transposes) == 3, [op.name for op in transposes]
    assert all("/forward" in op.name for op in transposes)
    assert len(_transposed_products(graph)) == 3 * M
    kernels = [v for v in pipe.trainable_variables
               if len(v.shape) == 2 and v.shape[1] >= WIDTH]
    assert len(kernels) == 3
    consumers = {}
    for op in graph.get_operations():
        for t in op.inputs:
            consumers.setdefault(t.ref(), []).append(op)
    used_plain = [op.name for op in graph.get_operations()
                  if op.type == "MatMul" and "/forward" in op.name
                  and "gradient_tape" not in op.name
                  and not op.get_attr("transpose_b")
                  and op.inputs[1].shape[-1] >= WIDTH
                  and consumers.get(op.outputs[0].ref())]
    assert not used_plain, used_plain


def test_off_with_tf_own_kernels(devices):
    # oneDNN off (this CPU's default): TF's own kernels run the transposed
    # form slower, nothing is rewritten.
    if _compat.onednn_enabled():
        pytest.skip("oneDNN is on in this process")
    pipe, _ = helpers.pair(_stages, devices, M, "never")
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y, _ = helpers.data(BATCH)
    assert not _transposed_products(_graph(pipe, x, y))


@pytest.mark.parametrize("batch,m,remat", [(2048, 4, "never"),
                                           (64, 4, "never"),
                                           (BATCH, M, "always")])
def test_off_where_it_does_not_pay(devices, onednn, batch, m, remat):
    # Micro-batches of 512 rows (both forms cost the same), a batch too
    # small to pay for the transposes, or remat (the forward runs as a
    # traced function per micro-batch: one transpose per call).
    pipe, _ = helpers.pair(_stages, devices, m, remat)
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y, _ = helpers.data(batch)
    assert not _transposed_products(_graph(pipe, x, y))


def test_worth_it_rule(onednn):
    assert products.worth_it(128, 512)
    assert products.worth_it(256, 256)
    assert not products.worth_it(512, 1024)
    assert not products.worth_it(64, 128)
    assert not products.worth_it(tf.constant(64), 512)


def test_the_device_decides_which_form_is_faster(devices, monkeypatch):
    # oneDNN on, small micro-batches, but the transposed form measured
    # slower on the device (as on some CPUs): nothing is rewritten.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    asked = []
    monkeypatch.setattr(products, "transposed_is_faster",
                        lambda rows, count, device=None:
                        asked.append((rows, count)) or False)
    assert not products.worth_it(128, 512)
    pipe, _ = helpers.pair(_stages, devices, M, "never")
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y, _ = helpers.data(BATCH)
    assert not _transposed_products(_graph(pipe, x, y))
    assert (BATCH // M, M) in asked, asked


def test_the_probe_times_both_forms_once_per_process_and_size(monkeypatch):
    monkeypatch.setattr(products, "_FASTER", {})
    first = products.transposed_is_faster(64, 4)
    assert isinstance(first, bool)

    def again(rows, count):
        raise AssertionError("timed again")

    monkeypatch.setattr(products, "_probe", again)
    # Kept for this process, and for another logical device of it.
    assert products.transposed_is_faster(64, 4) is first
    assert products.transposed_is_faster(64, 4, "/device:CPU:1") is first
    # Another size, or another process's device, is timed.
    for rows, count, device in ((32, 8, None),
                                (64, 4, "/job:worker/task:1/device:CPU:0")):
        with pytest.raises(AssertionError, match="timed again"):
            products.transposed_is_faster(rows, count, device)


def test_before_the_runtime_starts_nothing_is_timed():
    # A memory prediction made before any op ran must not start TF's
    # runtime (logical devices could no longer be made): the probe answers
    # True untimed, and the devices are still free to configure.
    code = (
        "from tensorflow.python.eager import context\n"
        "from keras_pipe.engine import products\n"
        "assert products.transposed_is_faster(64, 4) is True\n"
        "assert not context.context()._initialized\n"
        "import keras_pipe\n"
        "print(len(keras_pipe.logical_cpu_devices(2)))\n")
    result = warm.run(["-c", code], warm.env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2"]


def test_replacement_is_exact_alone():
    # The product itself: x @ transpose(wt)^T is x @ w.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype("float32")
    w = rng.normal(size=(32, WIDTH)).astype("float32")
    stand_ins = {}

    @tf.function
    def both(x, w):
        plain = tf.matmul(x, w)
        with products.TransposedKernels([w]).rewriting(stand_ins):
            transposed = tf.matmul(x, w)
        return plain, transposed

    plain, transposed = both(tf.constant(x), tf.constant(w))
    assert [(new.type, old.type) for new, old in stand_ins.items()] == [
        ("MatMul", "MatMul")]
    np.testing.assert_allclose(transposed, plain, rtol=1e-5, atol=1e-6)


def test_grappler_keeps_the_transposed_form(devices, onednn, tmp_path):
    # What runs, not what is traced: Grappler folds a Transpose that feeds
    # a MatMul back into `x @ w` (FoldTransposeIntoMatMul); through the
    # Snapshot it stays. TF's profiler names each op that ran.
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    pipe, _ = helpers.pair(_stages, devices, M, "never", schedule="zb_h1")
    pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y, _ = helpers.data(BATCH)
    pipe.train_on_batch(x, y)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        pipe.train_on_batch(x, y)
    finally:
        tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    space.ParseFromString(next(tmp_path.rglob("*.xplane.pb")).read_bytes())
    ran = [plane.event_metadata[e.metadata_id].name
           for plane in space.planes for line in plane.lines
           for e in line.events]
    snapshots = [n for n in ran if "transposed_kernel:Snapshot" in n]
    folded = [n for n in ran if "FoldTransposeIntoMatMul" in n]
    assert not folded, folded
    assert len(snapshots) == 3, snapshots


def test_a_worker_device_follows_the_workers_kernels(monkeypatch):
    """Workers set their kernels themselves (oneDNN on by default): the
    client decides the transposed form by the device's kernels, not by its
    own (an AMD client runs TF's own kernels by default)."""
    monkeypatch.setattr(products._compat, "onednn_enabled", lambda: False)
    monkeypatch.setattr(products, "transposed_is_faster",
                        lambda rows, count, device=None: True)
    worker = "/job:worker/replica:0/task:1/device:CPU:0"
    try:
        for workers in (True, False):
            products.set_workers_onednn(workers)
            assert products.onednn(worker) is workers
            assert products.worth_it(128, 512, worker) is workers
            assert not products.worth_it(128, 512, "/device:CPU:0")
            assert not products.transposes([128] * 4)
    finally:
        products.set_workers_onednn(True)
