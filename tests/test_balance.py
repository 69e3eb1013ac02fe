"""Tests of the block partition and of the cost models."""

import itertools
import random

import keras
import numpy as np
import pytest
from keras import layers

from keras_pipe.planning.balance import block_partition, cost
from keras_pipe.planning.graph import read_graph


def _block_sums(costs, sizes):
    sums, start = [], 0
    for size in sizes:
        sums.append(sum(costs[start:start + size]))
        start += size
    return sums


def _brute_force(costs, num_blocks):
    """The least largest block sum over every cut."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_blocks - 1):
        bounds = (0,) + cuts + (n,)
        best = min(best, max(sum(costs[a:b])
                             for a, b in zip(bounds, bounds[1:])))
    return best


def _greedy(costs, num_blocks):
    """Fills a block until it reaches the average (what we must beat)."""
    target, sizes, run, count = sum(costs) / num_blocks, [], 0, 0
    for c in costs:
        run, count = run + c, count + 1
        if run >= target and len(sizes) < num_blocks - 1:
            sizes.append(count)
            run, count = 0, 0
    return sizes + [count]


def test_known_optimum_beats_greedy():
    costs = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    sizes = block_partition(costs, 3)
    # 17 is optimal: 45 in 3 blocks with the last two items (8 + 9) or
    # 9 alone leaving 36 for two blocks, one of which exceeds 17.
    assert sizes == [5, 2, 2]
    assert _block_sums(costs, sizes) == [15, 13, 17]
    assert max(_block_sums(costs, _greedy(costs, 3))) == 21


def test_matches_brute_force_on_random_costs():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(n)]
        k = rng.randint(1, n)
        sizes = block_partition(costs, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
        assert max(_block_sums(costs, sizes)) == _brute_force(costs, k), (
            costs, k, sizes)


def test_float_costs_reach_optimum():
    rng = np.random.default_rng(0)
    costs = rng.exponential(size=12).tolist()
    sizes = block_partition(costs, 4)
    assert max(_block_sums(costs, sizes)) == pytest.approx(
        _brute_force(costs, 4), rel=1e-12)


def test_ties_go_to_even_counts():
    # [1, 5] and [3, 3] both have largest sum 5: prefer even item counts.
    assert block_partition([5, 0, 0, 0, 0, 5], 2) == [3, 3]
    assert block_partition([0] * 8, 4) == [2, 2, 2, 2]


def test_allowed_cuts_are_respected():
    costs = [1, 1, 1, 1]
    # Gap 1 (between items 1 and 2) is closed: [2, 2] is not possible.
    sizes = block_partition(costs, 2, allowed_cuts=[True, False, True])
    assert sizes in ([1, 3], [3, 1])
    assert block_partition(costs, 2, allowed_cuts=[False, False, True]) == [
        3, 1]


def test_errors():
    with pytest.raises(ValueError, match="Cannot cut 3 items into 4"):
        block_partition([1, 2, 3], 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        block_partition([1, -2, 3], 2)
    with pytest.raises(ValueError, match="only 0 of the 2 gaps"):
        block_partition([1, 2, 3], 2, allowed_cuts=[False, False])
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        block_partition([1, 2, 3], 2.0)


# ------------------------------------------------------------- cost models


def _conv_model():
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    x = layers.BatchNormalization(name="bn")(x)
    x = layers.Dropout(0.5, name="drop")(x)
    x = layers.Flatten(name="flat")(x)
    outputs = layers.Dense(5, name="dense")(x)
    return keras.Model(inputs, outputs)


def test_parameter_counts_count_shared_weights_once():
    inputs = keras.Input((4,))
    shared = layers.Dense(4, name="shared")
    x = shared(inputs)
    x = layers.Dense(4, name="middle")(x)
    x = shared(x)
    graph = read_graph(keras.Model(inputs, x))
    assert [c.name for c in graph.calls] == ["shared", "middle", "shared#2"]
    assert cost.parameter_counts(graph) == [20, 20, 0]


def test_flops_from_shapes():
    graph = read_graph(_conv_model())
    flops = dict(zip([c.name for c in graph.calls], cost.flops(graph, 2)))
    # Two FLOPs per kernel weight per output position, plus the bias adds.
    assert flops["conv"] == 2 * (2 * (3 * 3 * 3 * 4 + 4) * 64 + 256)
    assert flops["dense"] == 2 * (2 * (256 * 5 + 5) * 1 + 5)
    assert flops["bn"] == 2 * 5 * 256
    assert flops["flat"] == 2 * 256


def test_memory_counts_slots_and_kept_activations():
    graph = read_graph(_conv_model())
    names = [c.name for c in graph.calls]
    never = dict(zip(names, cost.memory(graph, 2, 4, "never", 2)))
    always = dict(zip(names, cost.memory(graph, 2, 4, "always", 0)))
    weights = (3 * 3 * 3 * 4 + 4) * 4
    outputs = 2 * 256 * 4
    assert never["conv"] == 4 * weights + 4 * outputs
    assert always["conv"] == 2 * weights + outputs
    # Moving statistics: weights only, no gradient or slots.
    assert always["bn"] == 2 * (4 * 4) * 2 + 2 * (4 * 4) + outputs
    with pytest.raises(ValueError, match="remat must be one of"):
        cost.memory(graph, remat="sometimes")


def test_time_is_measured_without_touching_state():
    model = _conv_model()
    before = [v.numpy().copy() for v in model.variables]
    graph = read_graph(model)
    times = cost.time(graph, batch_size=4, repeats=2)
    assert len(times) == len(graph.calls)
    assert all(t > 0 for t in times)
    for b, v in zip(before, model.variables):
        np.testing.assert_array_equal(b, v.numpy(), err_msg=v.path)
