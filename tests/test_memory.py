"""The per-stage memory model: schedule bookkeeping and sizes (no training)."""

import keras
import numpy as np
import pytest

from keras_pipe.engine import schedule
from keras_pipe.planning import backward, memory, partition
from keras_pipe.planning import resident as resident_lib


def _mlp(width=64, depth=4):
    x = keras.Input((width,))
    h = x
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def test_stage_actions_follow_the_schedule():
    # GPipe: all forward passes, then the backward passes in reverse.
    assert memory.stage_actions("gpipe", 3, 2)[0] == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    assert memory.stage_actions("1f1b", 2, 2)[1] == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # A split backward pass frees the micro-batch at its W.
    assert memory.stage_actions("zb_h1", 2, 2)[0] == [
        ("F", 0), ("F", 1), ("W", 0), ("W", 1)]


def test_in_flight_counts_micro_batches_held():
    assert memory.in_flight("gpipe", 8, 4) == [8, 8, 8, 8]
    assert memory.in_flight("1f1b", 8, 4) == [4, 3, 2, 1]
    assert memory.in_flight("1f1b", 2, 4) == [2, 2, 2, 1]


def test_a_new_schedule_plugs_in_as_a_function():
    # One micro-batch at a time through every stage: nothing else held.
    def one_at_a_time(m, k):
        ticks = []
        for i in range(m):
            ticks += [[schedule.Action("F", i, j)] for j in range(k)]
            ticks += [[schedule.Action("B", i, j)]
                      for j in reversed(range(k))]
        return ticks

    assert memory.in_flight(one_at_a_time, 5, 3) == [1, 1, 1]
    # Registered zero-bubble schedules hold a micro-batch until its W.
    assert memory.in_flight("zb_h1", 8, 2) == [3, 2]
    with pytest.raises(ValueError, match="schedule must be one of"):
        memory.in_flight("zigzag", 2, 2)


def test_block_sizes_of_a_dense_stage():
    model = _mlp(width=64, depth=4)
    part = partition.cut(model, 2, balance=[2, 3])
    block = memory.Profile(part.graph, rows=8).block(0, 2)
    assert block.weights == block.trainable == 2 * (64 * 64 + 64) * 4
    assert block.inputs == 8 * 64 * 4
    assert block.outputs == 8 * 64 * 4
    assert block.activations == 2 * 8 * 64 * 4   # relu: outputs only
    assert block.largest_variable == 64 * 64 * 4


def test_remat_and_1f1b_hold_less():
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    peaks = {(s, r): memory.predict(part, 512, 8, r, s)[0].total
             for s in ("gpipe", "1f1b") for r in ("never", "always")}
    assert peaks["gpipe", "always"] < peaks["gpipe", "never"]
    assert peaks["1f1b", "never"] < peaks["gpipe", "never"]
    # GPipe without remat keeps all 8 micro-batches' activations, and
    # through its run of backward passes also their mixing ops' output
    # gradients (bounded by the activations again) for the run's one
    # weight-gradient call: 16 x at the end of the run.
    block = memory.Profile(part.graph, 64).block(0, 3)
    never = memory.predict(part, 512, 8, "never", "gpipe")[0]
    assert never.activations == 16 * block.activations
    assert never.weights == block.weights
    assert never.optimizer_slots == 2 * block.trainable
    # With remat "except_last", only the last micro-batch keeps its
    # activations, and a run needs two backward passes without remat.
    last = memory.predict(part, 512, 8, "except_last", "gpipe")[0]
    assert last.activations < 2 * block.activations + block.recompute


def test_weight_gradient_calls_are_placed_as_the_executor_places_them():
    # 1F1B: the last stage sends every input gradient back, so each
    # backward pass without remat is split with its W right after; stage
    # 0's drain is not fed back to back (the last stage has no run), so
    # it stays whole: no deferred run (the model deferred it before), but
    # for its last backward pass, split so that its W call makes the
    # gradients one at a time (`engine.weight_calls`).
    first, last = memory.stage_actions("1f1b", 4, 2)
    assert first[-2:] == [("B", 2), ("B", 3)]
    assert first.executor_order("never", 4)[-3:] == [
        ("B", 2), ("Bi", 3), ("Wg", 3)]
    assert last.executor_order("never", 4)[:3] == [
        ("F", 0), ("Bi", 0), ("Wg", 0)]
    # GPipe: runs fed back to back: W calls at the end of the run.
    gpipe = memory.stage_actions("gpipe", 3, 2)[0]
    assert gpipe.executor_order("never", 3)[3:] == [
        ("Bi", 2), ("Bi", 1), ("Bi", 0), ("Wg", 2), ("Wg", 1), ("Wg", 0)]
    # Remat: fused, but for the stage's last backward pass. "except_last":
    # the last micro-batch is split too (on the stage that sends back).
    assert gpipe.executor_order("always", 3)[3:] == [
        ("B", 2), ("B", 1), ("Bi", 0), ("Wg", 0)]
    assert memory.stage_actions("gpipe", 3, 2)[1].executor_order(
        "except_last", 3)[3:] == [
            ("Bi", 2), ("Wg", 2), ("B", 1), ("Bi", 0), ("Wg", 0)]
    # A schedule's own W is kept as such.
    zb = memory.stage_actions("zb_h2", 4, 2)[1]
    assert {k for k, _ in zb.executor_order("never", 4)} == {"F", "W"}


def test_the_order_is_the_simulators_which_is_the_executors():
    # The simulator replays the executor's placement of W calls
    # (`simulator.calls`); the memory model's order must agree.
    from keras_pipe.planning import simulator
    for name, m, mode in (("gpipe", 4, "never"), ("1f1b", 4, "never"),
                          ("1f1b", 2, "never"), ("gpipe", 4, "always"),
                          ("1f1b", 4, "except_last")):
        ticks = schedule.get_schedule(name).build(m, 2, 2)
        calls, _ = simulator.calls(ticks, [0, 1], [mode] * 2, m)
        for j, stage in enumerate(memory.stage_actions(name, m, 2)):
            order = stage.executor_order(mode, m)
            weights = [i for k, i in order if k == "Wg"]
            simulated = [i for c in calls[j] if c.kind == "W"
                         for i in c.i]
            assert weights == simulated, (name, m, mode, j)


def test_1f1b_is_not_predicted_as_a_deferred_run():
    # Stage 0 of 1F1B holds no stash of its drain for a W call: its peak
    # is below GPipe's at the same M (both without remat).
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 128).block(0, 3)
    peak = memory.predict(part, 512, 4, "never", "1f1b")[0]
    # Two micro-batches in flight at most: their tape activations, and the
    # one in backward: nothing stashed for a later W call.
    assert peak.activations <= 2 * block.recompute + block.largest


def test_per_stage_remat_list_is_per_stage():
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    mixed = memory.predict(part, 512, 8, ["never", "always"])
    never = memory.predict(part, 512, 8, "never")
    always = memory.predict(part, 512, 8, "always")
    assert mixed[0].total == never[0].total
    assert mixed[1].total == always[1].total
    with pytest.raises(ValueError, match="one mode per stage"):
        memory.predict(part, 512, 8, ["never"])


def test_moments_are_linear_in_the_sizes():
    actions = memory.stage_actions("gpipe", 4, 2)[0]
    forms = memory.moments(actions, "never", 4)
    assert forms.shape[1:] == (4, len(memory.FEATURES))
    # Every size counts positively but `seeded`, a part of `mixing` and of
    # `stash` counted once: a moment is never negative.
    seeded = memory.FEATURES.index("seeded")
    others = np.delete(forms, seeded, axis=-1)
    assert np.all(others >= 0)
    parts = [memory.FEATURES.index(f) for f in ("mixing", "stash")]
    assert np.all(forms[..., seeded] + forms[..., parts].sum(-1) >= 0)


def test_cost_memory_accepts_a_remat_list():
    # Before: cost.memory refused a list ("remat must be one of ..."), so
    # balance="memory" failed with per-stage remat.
    from keras_pipe.planning.balance import cost
    from keras_pipe.planning.graph import read_graph
    graph = read_graph(_mlp(width=64, depth=4))
    assert cost.memory(graph, 8, 4, ["always", "always"]) == cost.memory(
        graph, 8, 4, "always")
    mixed = cost.memory(graph, 8, 4, ["never", "always"])
    never = cost.memory(graph, 8, 4, "never")
    always = cost.memory(graph, 8, 4, "always")
    assert mixed[0] == never[0] and mixed[-1] == always[-1]
    part = partition.cut(_mlp(width=64, depth=4), 2, balance="memory",
                         num_micro_batches=4, remat=["never", "always"],
                         batch_size=32)
    assert sum(part.sizes) == 5


def test_an_optimizer_with_slots_holds_a_buffer_per_variable_in_its_step():
    # Measured (BFC allocator peak of `optimizer.apply` in a tf.function):
    # SGD holds two products at a time, Adam about one buffer per variable
    # more (`memory.update_temporaries`).
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 1).block(0, 3)
    sizes = memory.features(block)
    assert memory.update_temporaries(0) @ sizes == 2 * block.largest_variable
    assert memory.update_temporaries(2) @ sizes == (
        block.trainable + 2 * block.largest_variable)
    # One row, one micro-batch: the updates in turn (`engine.release`) are
    # Adam's peak: one gradient applied, the temporaries of one more
    # variable (two largest) besides the mini-batch. SGD's have none: its
    # peak is the W call's two gradients. (Before the stage's last backward
    # call was split, remat made every gradient in one call and the
    # optimizer step was the peak: `update_temporaries`.)
    sgd = memory.predict(part, 1, 1, "always", optimizer_slots=0)[0]
    adam = memory.predict(part, 1, 1, "always", optimizer_slots=2)[0]
    assert adam.optimizer_slots == 2 * block.trainable
    assert adam.gradients == block.largest_variable
    assert adam.transient == block.inputs + 2 * block.largest_variable
    assert sgd.gradients == block.largest_variable + block.second_variable


def test_a_rematerialized_backward_holds_old_and_new_sums():
    # `(inputs, params, state, seeds, sums) -> (grads, new sums)`: the
    # call's inputs live until it returns. Before: trainable + one variable.
    # At M = 3, micro-batch 1's call adds to micro-batch 2's sums (the
    # last one, micro-batch 0's, is split: below).
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 1).block(0, 3)
    peak = memory.predict(part, 3, 3, "always", optimizer_slots=0)[0]
    assert peak.gradients == 2 * block.trainable


def test_a_rematerialized_stage_releases_its_last_gradients_in_turn():
    # The stage's last backward call is split and its W call chained
    # (`engine.weight_calls`, `engine.release`): besides the earlier
    # micro-batches' sums, one gradient being applied and the next being
    # made. Before: old and new sums (2 x trainable) at M = 2, every
    # gradient of the stage (trainable) at M = 1.
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 1).block(0, 3)
    two = block.largest_variable + block.second_variable
    assert two < block.trainable
    for mode in ("always", "except_last"):
        peak = memory.predict(part, 2, 2, mode, optimizer_slots=0)[0]
        assert peak.gradients == block.trainable + two, mode
    first = memory.predict(part, 1, 1, "always", optimizer_slots=0)[0]
    assert first.gradients == two    # M = 1: no sums


def test_unknown_dimensions_take_the_given_input_shape():
    # A sequence model: `(None, None, 8)` inputs. Before, the prediction
    # set every unknown dimension to 1 (a sequence of one token).
    x = keras.Input((None, 8))
    h = keras.layers.Dense(16, activation="relu")(x)
    h = keras.layers.Dense(16, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(2)(h))
    part = partition.cut(model, 2, balance=[1, 2])
    shaped = partition.cut(model, 2, balance="flops",
                           input_shape=(None, 10, 8), batch_size=4)
    assert shaped.sizes == [1, 2]
    one = memory.Profile(part.graph, 4).block(0, 1)
    ten = memory.Profile(shaped.graph, 4, shaped.shapes).block(0, 1)
    assert ten.activations == 10 * one.activations == 4 * 10 * 16 * 4
    # `predict` takes the shapes of the cut, or the ones given.
    given = memory.predict(part, 4, 2, "never", input_shape=(None, 10, 8))
    assert given == memory.predict(shaped, 4, 2, "never")
    assert given[0].total > memory.predict(part, 4, 2, "never")[0].total


def test_a_worker_peak_is_the_larger_of_its_step_and_its_build():
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 1).block(0, 3)
    step = memory.predict(part, 64, 2, "never", optimizer_slots=0)
    resident = resident_lib.predict_resident(part, 64, 2, "never",
                                       optimizer_slots=0)
    assert resident[0].build == block.weights + int(
        resident_lib.BUILD_TRANSIT * block.largest_variable)
    # The step's resident peak: at least the allocator's (small blocks'
    # high-water mark stays resident, `predict_resident`).
    steps = [memory.StageMemory.total.fget(r) for r in resident]
    assert resident[0].total == max(steps[0] + resident[0].functions,
                                    resident[0].build)
    assert all(r >= s.total for r, s in zip(steps, step))


class Feedforward(keras.layers.Layer):
    """Two Dense layers behind one `call()`: an opaque call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(64, activation="gelu")
        self.down = keras.layers.Dense(16)

    def call(self, x):
        return self.down(self.up(x))


def test_an_opaque_layer_keeps_what_its_open_layers_keep():
    # The kept tensors come from each call's traced gradient graph, so a
    # subclassed layer around two Dense layers keeps what the two layers
    # keep when the graph lists them apart: the gelu's inner tensors and
    # the hidden output (the second product's gradient reads it).
    x = keras.Input((16,))
    opaque = keras.Model(x, keras.layers.Dense(3)(Feedforward()(x)))
    h = keras.layers.Dense(64, activation="gelu")(x)
    open_ = keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(16)(h)))
    rows = 8
    closed = memory.Profile(partition.cut(opaque, 2, balance=[1, 1]).graph,
                            rows).block(0, 1)
    split = memory.Profile(partition.cut(open_, 2, balance=[2, 1]).graph,
                           rows).block(0, 2)
    assert closed.recompute == split.recompute
    # At least the hidden output and the gelu's input: 2 x 8 x 64 floats.
    assert closed.recompute >= 2 * rows * 64 * 4


def test_a_conv_backward_holds_tfs_im2col_buffer():
    # TF's CPU kernels size it for a 30 MiB working set, whatever the
    # batch: ceil(30 MiB / 4 / unit) images of 32 x 32 positions x 3 x 3 x 8.
    x = keras.Input((32, 32, 8))
    h = keras.layers.Conv2D(16, 3, padding="same")(x)
    model = keras.Model(x, keras.layers.Dense(2)(
        keras.layers.GlobalAveragePooling2D()(h)))
    part = partition.cut(model, 2, balance=[1, 2])
    image, patch = 32 * 32, 3 * 3 * 8
    unit = image * patch + image * 16 + patch * 16
    shard = -(-(30 * 2**20 // 4) // unit)
    for rows in (1, 16):
        block = memory.Profile(part.graph, rows).block(0, 1)
        assert block.workspace == shard * image * patch * 4
    # It is part of the backward pass's peak, not of a forward's.
    block = memory.Profile(part.graph, 4).block(0, 1)
    none = memory.stage_memory(
        block, memory.stage_actions("gpipe", 1, 2)[0], "never", 1, 0)
    assert none.transient >= block.workspace


def _tied_cut():
    """The same Dense layer at both ends of a 3-call model, cut [2, 1]."""
    x = keras.Input((8,))
    shared = keras.layers.Dense(8)
    h = keras.layers.Dense(8)(shared(x))
    return partition.cut(keras.Model(x, shared(h)), 2, balance=[2, 1])


def test_a_tied_variable_is_counted_on_the_stage_of_its_last_call():
    # Each stage's build moves the variables of its layers to its device,
    # so the last stage keeps the shared layer's.
    part = _tied_cut()
    profile = memory.Profile(part.graph, 4)
    size = (8 * 8 + 8) * 4
    assert profile.block(0, 2).weights == size
    assert profile.block(2, 3).weights == size


def test_a_tied_variable_counts_at_build_on_every_stage_that_uses_it():
    # Stage 0's build places the shared layer's variables on its device
    # before stage 1's build moves them on: both builds hold them.
    part = _tied_cut()
    resident = resident_lib.predict_resident(part, 4, 1, "never", "gpipe", 0)
    size = (8 * 8 + 8) * 4
    transit = int(resident_lib.BUILD_TRANSIT * 8 * 8 * 4)
    assert resident[0].build == 2 * size + transit
    assert resident[1].build == size + transit


def test_a_stage_alone_holds_the_tied_variables_it_uses():
    # issue 28: `tools/memory_model.py` builds and runs a stage alone, so
    # stage 0 holds the shared layer's variables (weights, sums, slots)
    # that a pipeline keeps on the last stage (GPT-2's tied token
    # embedding: its stage 0 was under-predicted by 4-5 MiB, -20% to -33%).
    part = _tied_cut()
    profile = memory.Profile(part.graph, 4)
    size = (8 * 8 + 8) * 4
    alone = profile.block(0, 2, alone=True)
    assert alone.weights == alone.trainable == 2 * size
    assert profile.block(0, 2).trainable == size
    # The last stage holds it either way.
    assert profile.block(2, 3, alone=True).weights == size


def test_a_weight_call_of_one_micro_batch_concatenates_nothing():
    # issue 28: `weight_grad` concatenates a mixing op's stashed inputs and
    # output gradients only for a run of two or more micro-batches; a W of
    # one reads its stash as it is (the logical MLP's stage 1, SGD, M = 1:
    # +43% with two copies of the largest output counted, +20% without).
    largest = memory.FEATURES.index("largest")

    def most_largest(m):
        actions = memory.stage_actions("gpipe", m, 2)[1]
        forms = memory.moments(actions, "never", m, last=True)
        return max(form[3][largest] for form in forms)

    assert memory.stage_actions("gpipe", 1, 2)[1].executor_order(
        "never", 1) == [("F", 0), ("Bi", 0), ("Wg", 0)]
    assert most_largest(1) == 1      # the forward's output being made
    assert most_largest(2) == 2      # a run of 2: one slot's pieces and
    #                                  its concatenation


def test_a_grouped_weight_call_converts_its_stash_and_runs_one_product():
    # issue 30 item 2: a W call over a run of micro-batches concatenates
    # each mixing op's stashed slots; a concatenation frees its pieces, so
    # beyond the stash one slot is in flight (its M pieces and the result,
    # at most M largest outputs) and one product runs (one scratch buffer):
    # TF's profiler on the worker ResNet's stage 0 (Adam, M = 4, GPipe,
    # never) found one 27 MiB Conv2DBackpropFilter buffer at the W peak,
    # not two, and the stash in concatenated form; the model's two buffers
    # and two copies over-predicted the stage by 23% (187.3 / 152.7 MiB)
    # and its worker by 24-28%. A W of one micro-batch keeps two products.
    mib = 2**20
    stashed = _only(stash=10 * mib, largest=mib, workspace=5 * mib)
    for m in (2, 4):
        actions = memory.stage_actions("gpipe", m, 2)[0]
        assert [k for k, _ in actions.executor_order("never", m)][-1] == "Wg"
        peak = memory.stage_memory(stashed, actions, "never", m, 0)
        # The W call: every stash, one slot concatenating, one buffer.
        assert peak.activations == m * 10 * mib
        assert peak.transient == m * mib + 5 * mib, (m, peak)
    assert memory.weight_call_transient(1) @ memory.features(stashed) == \
        memory.CONCURRENT_KERNELS * 5 * mib


def test_a_workers_step_functions_cost_per_graph_node():
    # issue 30: a worker holds TF's graphs and executors of the step's
    # functions, 4.25 KiB per node (`tools/function_memory.py`): a
    # micro-batch run in place puts the stage's forward and backward ops
    # in the step's graph once each; remat calls two functions traced once
    # (the backward holds the forward twice and the gradient).
    part = partition.cut(_mlp(width=16, depth=4), 2, balance=[2, 3])
    block = memory.Profile(part.graph, 1).block(0, 2)
    dense = memory.call_nodes(part.graph.calls[0])
    assert 0 < dense[0] < dense[1]          # forward, forward and backward
    assert block.nodes >= 2 * dense[1]
    assert resident_lib.function_nodes(block, "never", 4) == 4 * block.nodes
    assert resident_lib.function_nodes(block, "always", 4) == \
        resident_lib.function_nodes(block, "always", 1) == \
        block.forward_nodes + 2 * block.nodes
    assert resident_lib.function_nodes(block, "except_last", 4) == \
        block.nodes + block.forward_nodes + 2 * block.nodes
    for m, mode in ((1, "never"), (4, "never"), (4, "always")):
        step = memory.predict(part, 8, m, mode, optimizer_slots=0,
                              _resident=True)[0]
        worker = resident_lib.predict_resident(part, 8, m, mode,
                                         optimizer_slots=0)[0]
        assert worker.functions == resident_lib.FUNCTION_NODE_BYTES * \
            resident_lib.function_nodes(block, mode, m) > 0
        assert worker.total == step.total + worker.functions


def test_one_taped_micro_batch_applies_each_gradient_as_it_is_made():
    # M = 1 without remat: each update reads only its own gradient, so the
    # step's function frees a gradient once applied; the optimizer step
    # holds one gradient, not all of them (measured on workers: the MLP at
    # SGD M = 1, 113 / 102 MiB, main's model 144 / 128, now 115 / 99).
    part = partition.cut(_mlp(width=64, depth=4), 2, balance=[2, 3])
    block = memory.Profile(part.graph, rows=1).block(0, 2)
    actions = memory.stage_actions("gpipe", 1, 2)[0]
    all_at_once = block.weights + block.trainable + \
        2 * block.largest_variable
    taped = memory.stage_memory(block, actions, "never", 1, 0)
    assert taped.total < all_at_once
    # With remat too: the stage's last backward call (here the only one)
    # is split, its W call chained (before: one call returning every
    # gradient, at least `all_at_once`).
    fused = memory.stage_memory(block, actions, "always", 1, 0)
    assert fused.total < all_at_once


def test_sgd_updates_in_turn_hold_two_gradients_and_no_temporaries():
    # SGD, M = 1: the last stage's gradients are applied as they are made
    # (the release chain). `lr * g` runs in the gradient's own buffer (BFC
    # peak of a traced SGD step over one 16 MiB variable: 16.0 MiB above
    # the weights), so the updates hold one gradient applied and the next
    # being made: the largest two variables' size at most. Counted 3
    # largest before (the ResNet's worker 1 at SGD M = 1: 64.8 MiB
    # predicted, 47.0 measured), then 2. Adam's update keeps temporaries
    # of one more variable.
    actions = memory.stage_actions("gpipe", 1, 2)[1]

    def most(slots, name):
        column = memory.FEATURES.index(name)
        forms = memory.moments(actions, "never", 1, last=True,
                               optimizer_slots=slots)
        return max(form[:, column].sum() for form in forms)

    assert most(0, "largest_variable") == 1
    assert most(0, "second_variable") == 1
    assert most(2, "largest_variable") == 3


def test_updates_in_turn_hold_the_largest_two_gradients():
    # One big kernel among small variables (the worker ResNet's stage 1: a
    # 16 MiB kernel; TF's profiler saw its gradient alone at the stage's
    # allocator peak, 36.7 MiB, `tools/allocation_trace.py resnet sgd 1
    # gpipe never 1`, where two of its size were counted, 48.8): the
    # updates in turn hold it and the next largest, not two of it.
    x = keras.Input((64,))
    h = keras.layers.Dense(8)(x)
    part = partition.cut(keras.Model(x, keras.layers.Dense(512)(
        keras.layers.Dense(16)(h))), 2, balance=[1, 2])
    block = memory.Profile(part.graph, 4).block(1, 3)
    assert block.largest_variable == 16 * 512 * 4
    assert block.second_variable == 512 * 4  # its bias
    actions = memory.stage_actions("gpipe", 1, 2)[1]
    taped = memory.stage_memory(block, actions, "never", 1, 0, last=True)
    assert taped.gradients == block.largest_variable + block.second_variable


def test_the_second_largest_variable_of_a_run_of_calls():
    # Per prefix: a call's own two, or the old largest it displaces.
    largest = [4, 9, 9, 2, 12]
    second = [1, 3, 9, 2, 0]
    assert list(memory.second_largest(largest, second)) == [1, 4, 9, 9, 9]
    assert list(memory.second_largest([5], [0])) == [0]


def _conv_net():
    x = keras.Input((16, 16, 8))
    h = keras.layers.Conv2D(16, 3, padding="same")(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def test_a_conv_backward_holds_two_scratch_buffers():
    # A conv's input and filter gradients run at once on TF's inter-op
    # pool, each with its im2col buffer (measured: one more 27 MiB buffer
    # with 2 inter-op threads than with 1).
    part = partition.cut(_conv_net(), 2, balance=[4, 2])
    block = memory.Profile(part.graph, 8).block(0, 4)
    assert block.workspace > 0
    peak = memory.predict(part, 8, 1, "always", optimizer_slots=0)[0]
    assert peak.transient >= memory.CONCURRENT_KERNELS * block.workspace


def test_the_stash_holds_mixing_inputs_and_output_gradients():
    # Conv: its input and its output's gradient; batch norm scales by the
    # batch statistics, its weights meet vectors only: nothing per row.
    part = partition.cut(_conv_net(), 2, balance=[4, 2])
    profile = memory.Profile(part.graph, 8)
    conv, norm = profile.block(0, 1), profile.block(1, 2)
    assert conv.stash == conv.inputs + conv.outputs
    assert norm.stash == 0
    # GPipe without remat: after its input-gradient call, a micro-batch
    # holds its stash for the run's W, not its whole tape; on the last
    # stage its output's gradient is a slice of the loss gradient.
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    block = memory.Profile(part.graph, 64).block(3, 7)
    peak = memory.predict(part, 512, 8, "never", "gpipe")[1]
    assert peak.activations == 8 * (block.stash - block.seeded)


def test_a_worker_keeps_the_peak_of_small_activations_resident():
    # Micro-batches of small hidden tensors (below glibc's mmap threshold)
    # come from arenas that stay resident: the resident prediction adds the
    # activations' own peak to the gradients' and updates' later peak.
    model = _mlp(width=256, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    allocator = memory.predict(part, 64, 4, "never", optimizer_slots=2)
    resident = resident_lib.predict_resident(part, 64, 4, "never",
                                       optimizer_slots=2)
    for a, r in zip(allocator, resident):
        assert r.total > a.total
        assert r.activations >= a.activations


def test_a_worker_gives_back_activations_of_heap_return_size():
    # A micro-batch's hidden tensors of 256 KiB (64 rows x 1024): at or
    # above heap "return"'s mmap threshold (128 KiB) they are mapped and
    # unmapped when freed, so the resident peak is the allocator's. (With
    # the threshold higher, they came from arenas whose freed chunks
    # stayed resident.)
    model = _mlp(width=1024, depth=6)
    part = partition.cut(model, 2, balance=[3, 4])
    allocator = memory.predict(part, 256, 4, "never", optimizer_slots=2)
    resident = resident_lib.predict_resident(part, 256, 4, "never",
                                       optimizer_slots=2)
    for a, r in zip(allocator, resident):
        assert memory.StageMemory.total.fget(r) == a.total


def test_a_cut_by_parameters_keeps_the_given_input_shape():
    # issue 30: `balance="params"` needs no shapes, so the cut inferred
    # none and the prediction set an unknown sequence length to 1 (GPT-2's
    # last worker: predicted 104 MiB, measured 157).
    x = keras.Input((None, 8))
    h = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(x, keras.layers.Dense(2)(h))
    by_params = partition.cut(model, 2, balance="params",
                              input_shape=(None, 10, 8))
    by_list = partition.cut(model, 2, balance=[1, 1],
                            sample_inputs=np.zeros((4, 10, 8), "float32"))
    by_flops = partition.cut(model, 2, balance="flops",
                             input_shape=(None, 10, 8))
    expected = memory.predict(by_flops, 4, 2, "never")
    assert memory.predict(by_params, 4, 2, "never") == expected
    assert memory.predict(by_list, 4, 2, "never") == expected
    assert partition.cut(model, 2, balance="params").shapes is None


def test_a_split_backward_holds_no_per_row_gradient_for_batch_norm():
    # issue 30: an input-gradient call ("Bi") holds the output gradients
    # its W will read; batch norm's W reads vectors (`_stash_bytes`), so
    # its output gradient is not held (logical ResNet stage 1, SGD, M=1:
    # +45% with it, +20% without).
    part = partition.cut(_conv_net(), 2, balance=[4, 2])
    profile = memory.Profile(part.graph, 8)
    conv, norm = profile.block(0, 1), profile.block(1, 2)
    assert conv.mixing == conv.outputs
    assert norm.mixing == 0


def test_an_input_gradient_call_holds_no_scratch_buffer():
    # issue 28 item 5: only a conv's filter gradient (Conv2DBackpropFilter)
    # allocates the im2col buffer; a call of input gradients only ("Bi")
    # holds none. TF's profiler on the logical ResNet's stage 1 (SGD, M =
    # 1, GPipe, never): at the Bi call's peak its input, the tape's and
    # stashed tensors and batch norm's gradient temporaries, 104.2 MiB for
    # a measured 104.2 (3 runs); the buffer counted there made 131.1.
    mib = 2**20
    block = _only(inputs=16 * mib, recompute=56 * mib, mixing=24 * mib,
                  largest=8 * mib, stash=48 * mib, workspace=27 * mib)
    actions = memory.stage_actions("gpipe", 1, 2)[1]
    assert actions.executor_order("never", 1) == [
        ("F", 0), ("Bi", 0), ("Wg", 0)]
    forms = memory.moments(actions, "never", 1, first=True)
    values = forms @ memory.features(block)
    bi = [v for v in values if v[1] == (56 + 24) * mib]
    assert len(bi) == 1
    assert bi[0][3] == (16 + 8) * mib    # the input and one output: no buffer
    # The W call keeps its filter gradients' buffers.
    w = [v for v in values if v[1] == 48 * mib]
    assert w and w[0][3] == (16 + 2 * 27) * mib


def _only(**sizes):
    """A `Block` with the given sizes and every other size 0."""
    fields = {name: 0 for name in ("weights", "trainable", "inputs",
                                   "outputs", "activations", "recompute",
                                   "largest", "largest_variable", "mixing")}
    return memory.Block(**{**fields, **sizes})


def test_the_last_stage_holds_its_outputs_twice_not_three_times():
    # issue 30: the forward passes of a GPipe last stage counted the merged
    # outputs and the loss gradient (2 M outputs) before either exists,
    # plus the output being made. The peak of the outputs is the merge and
    # the loss: 2 M outputs (GPT-2 small's last stage, SGD M=1: +31%).
    mib = 2**20
    for m in (1, 2, 4):
        actions = memory.stage_actions("gpipe", m, 2)[1]
        peak = memory.stage_memory(_only(outputs=mib), actions, "never", m,
                                   0, last=True)
        assert peak.total == 2 * m * mib, (m, peak)


def test_a_split_backward_stashes_the_incoming_gradient_without_a_copy():
    # issue 30: the gradient of the stage's last call's output is the one
    # arriving (or a slice of the loss gradient): the stash of a split
    # backward (`mixing`, `stash`) holds it without a copy of its own.
    part = partition.cut(_mlp(width=32, depth=2), 2, balance=[2, 1])
    block = memory.Profile(part.graph, 8).block(2, 3)
    assert block.seeded == block.outputs == 8 * 3 * 4
    mib = 2**20
    same = _only(mixing=mib, stash=mib, seeded=mib)
    for m in (1, 4):
        actions = memory.stage_actions("gpipe", m, 2)[1]
        peak = memory.stage_memory(same, actions, "never", m, 0, last=True)
        assert peak.total == 0, (m, peak)


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN on, and the transposed form measured the faster one."""
    from keras_pipe import _compat
    from keras_pipe.engine import products
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    monkeypatch.setattr(products, "transposed_is_faster",
                        lambda rows, count, device=None: True)


def test_a_dense_stage_counts_the_kernels_it_would_transpose():
    # issue 30: with oneDNN on, the forward products of small micro-batches
    # read a transposed copy of each kernel of >= 512 columns
    # (`engine.products`); a sequence's Dense multiplies rows times tokens
    # rows (Keras folds them): above 256 its kernel is not transposed.
    x = keras.Input((64,))
    h = keras.layers.Dense(512)(x)
    h = keras.layers.Dense(256)(h)
    model = keras.Model(x, keras.layers.Dense(1024)(h))
    part = partition.cut(model, 1, balance=[3])
    block = memory.Profile(part.graph, 8).block(0, 3)
    assert block.transposed == (64 * 512 + 256 * 1024) * 4
    assert memory.Profile(part.graph, 512).block(0, 3).transposed == 0
    x = keras.Input((64, 16))
    sequence = keras.Model(x, keras.layers.Dense(512)(x))
    part = partition.cut(sequence, 1, balance=[1])
    assert memory.Profile(part.graph, 8).block(0, 1).transposed == 0
    assert memory.Profile(part.graph, 4).block(0, 1).transposed == \
        16 * 512 * 4   # 4 x 64 = 256 rows


def test_transposes_follows_the_executors_rule(onednn):
    # The micro-batches run in place decide (`products.transposes`).
    assert memory.transposes("never", 512, 2)        # 256 + 256 rows
    assert not memory.transposes("never", 512, 1)    # 512 rows
    assert not memory.transposes("always", 512, 2)   # nothing in place
    assert memory.transposes("except_last", 512, 2)  # the last: 256
    assert not memory.transposes("except_last", 256, 2)  # 128: too few


def test_transposed_kernels_are_held_while_forward_passes_run(onednn):
    # The copies are made by the first forward call run in place and read
    # by each: GPipe's forward passes hold them.
    mib = 2**20
    block = _only(transposed=4 * mib)
    actions = memory.stage_actions("gpipe", 2, 2)[0]
    held = memory.stage_memory(block, actions, "never", 2, 0,
                               transposed=True)
    assert memory.stage_memory(block, actions, "never", 2, 0).total == 0
    assert held.total == held.transient == 4 * mib
    # With remat "always" no forward call runs in place: nothing made.
    assert memory.stage_memory(block, actions, "always", 2, 0,
                               transposed=True).total == 0


def test_predict_counts_transposed_kernels_when_the_step_makes_them(
        monkeypatch):
    # 1F1B, M = 4: each stage's largest backward pass (old and new sums)
    # runs between two forward passes, with the copies alive.
    from keras_pipe import _compat
    from keras_pipe.engine import products
    monkeypatch.setattr(products, "transposed_is_faster",
                        lambda rows, count, device=None: True)
    part = partition.cut(_mlp(width=512, depth=4), 2, balance=[2, 3])
    peaks = {}
    for onednn in (True, False):
        monkeypatch.setattr(_compat, "onednn_enabled", lambda o=onednn: o)
        peaks[onednn] = memory.predict(part, 1024, 4, "never", "1f1b", 0)
    kernels = 2 * 512 * 512 * 4   # per stage; Dense(3) is too narrow
    assert [a.total - b.total for a, b in zip(peaks[True], peaks[False])] \
        == [kernels, kernels]


class TiedOutput(keras.layers.Layer):
    """`x @ transpose(table)`, as a tied output layer reads its table
    (`ReversibleEmbedding(reverse=True)`); `scaled`: the transposed copy
    is also scaled, a read no matrix product absorbs."""

    def __init__(self, scaled=False, **kwargs):
        super().__init__(**kwargs)
        self.scaled = scaled

    def build(self, input_shape):
        self.table = self.add_weight(shape=(256, input_shape[-1]))

    def call(self, x):
        table = keras.ops.transpose(self.table)
        if self.scaled:
            table = table * 2.0
        return keras.ops.matmul(x, table)


def test_a_transposed_weight_only_products_read_is_not_held():
    # issue 30 item 2: grappler folds a 2-D transpose that only MatMuls
    # read into them (transpose_b): the step holds no transposed table
    # (TF's profiler, the worker GPT-2's stage 1, Adam M = 4 never), where
    # the model counted one per micro-batch held (+19-20% on its worker).
    # A transposed copy another op reads is still counted, once per call.
    table = 256 * 32 * 4
    inner = {}
    for scaled in (False, True):
        x = keras.Input((32,))
        h = keras.layers.Dense(32)(x)
        part = partition.cut(keras.Model(x, TiedOutput(scaled)(h)), 2,
                             balance=[1, 1])
        call = part.graph.calls[1]
        inner[scaled] = backward.kept_inside(call, part.shapes)
    assert inner[False] == (0, 0)
    assert inner[True][1] >= table


def test_one_taped_sgd_micro_batch_holds_two_gradients_while_it_runs():
    # SGD, M = 1, no remat: the release chain applies each gradient as it
    # is made, so the backward pass holds about two (the one applied, the
    # next being made), not all of the stage's. TF's profiler (logical MLP
    # stage 0: two of its three 1 MiB kernel gradients at the peak; all
    # three counted made 18.0 MiB for a measured 14.0).
    part = partition.cut(_mlp(width=64, depth=4), 2, balance=[4, 1])
    block = memory.Profile(part.graph, rows=8).block(0, 4)
    assert block.trainable > 2 * block.largest_variable
    actions = memory.stage_actions("gpipe", 1, 2)[0]
    taped = memory.stage_memory(block, actions, "never", 1, 0, first=True)
    assert taped.gradients <= 2 * block.largest_variable
    # Adam and remat too: the stage's last backward call is split and its
    # W call chained (before, both kept every gradient).
    adam = memory.stage_memory(block, actions, "never", 1, 2, first=True)
    fused = memory.stage_memory(block, actions, "always", 1, 0, first=True)
    assert adam.gradients <= 2 * block.largest_variable
    assert fused.gradients <= 2 * block.largest_variable


def _attention_net(dim=32, tokens=8):
    x = keras.Input((tokens, dim))
    h = keras.layers.MultiHeadAttention(2, dim // 2)(x, x)
    h = keras.layers.Dense(dim, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def test_a_broadcast_kernels_gradient_is_held_per_row():
    # `MultiHeadAttention`'s projections multiply a 3-D input by a 2-D
    # kernel: TF's gradient makes the kernel's gradient per row, then sums
    # it (TF's profiler, the worker Transformer's stage 0, SGD M = 1: two
    # [16, 512, 512] gradients, 16 MiB each, at the allocator peak; the
    # worker's 129.9 MiB was predicted 119.4 only because every gradient of
    # the stage was counted at once; with two, 109.4). Two run at once
    # (`CONCURRENT_KERNELS`); a `Dense` (2-D products) holds none.
    dim, rows = 32, 8
    part = partition.cut(_attention_net(dim), 2, balance=[1, 3])
    profile = memory.Profile(part.graph, rows)
    attention, dense = profile.block(0, 1), profile.block(1, 2)
    kernel = dim * dim * 4   # query: (dim, heads, dim // heads), float32
    assert attention.broadcast == rows * memory.CONCURRENT_KERNELS * kernel
    assert dense.broadcast == 0
    actions = memory.stage_actions("gpipe", 1, 2)[0]
    peak = memory.stage_memory(attention, actions, "never", 1, 0, first=True)
    assert peak.transient >= attention.broadcast
    # The tape's tensors of the calls after it are freed by then, and its
    # own after its first projection (scores, softmax).
    both = profile.block(0, 2)
    assert both.after_broadcast == dense.recompute + \
        attention.after_broadcast
    assert dense.recompute > 0 and attention.after_broadcast > 0


class _Decoder(keras.layers.Layer):
    """An opaque layer: attention, then a feed-forward part."""

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, dim // 2)
        self.up = keras.layers.Dense(4 * dim, activation="gelu")
        self.down = keras.layers.Dense(dim)

    def call(self, x):
        return self.down(self.up(x + self.attention(x, x)))


def test_an_opaque_layer_frees_what_follows_its_attention_first():
    # Inside an opaque layer (KerasHub's `TransformerDecoder`), the tensors
    # its feed-forward part keeps are freed by the backward pass before it
    # reaches the attention's kernel gradients (logical GPT-2's stage 1 at
    # SGD M = 4 always: +26% -> +24% with them freed).
    dim, rows = 32, 8
    x = keras.Input((8, dim))
    h = _Decoder(dim, name="decoder")(x)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(x, keras.layers.Dense(3)(h))
    part = partition.cut(model, 2, balance=[1, 2])
    block = memory.Profile(part.graph, rows).block(0, 1)
    assert block.broadcast > 0
    # At least the GELU's input, kept for its gradient (4 * dim per token).
    assert block.after_broadcast >= rows * 8 * 4 * dim * 4
    assert block.after_broadcast <= block.recompute
