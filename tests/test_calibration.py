"""The fixed costs of a step: solved by hand, measured with the executor;
the optimizer update's cost per stage."""

import keras
import pytest

from keras_pipe import calibration
from keras_pipe.planning import graph as graph_lib
from keras_pipe.planning import profiling


def test_solve_by_hand():
    # GPipe, 2 stages on 2 devices, calls of c seconds, no transfer cost:
    # M=1 has 5 calls on its critical path (F0 F1 B1 B0 W0: the first
    # stage's last backward call is split, `engine.weight_calls`), M=8 has
    # 19 (F0 x8, F1, B1 x8, B0, W0). 10 ms and 17 ms: c = 7 ms / 14, and
    # the step's fixed cost is 10 ms - 5 c.
    overhead = calibration.solve({1: 0.010, 8: 0.017}, [0, 1])
    assert overhead.call == pytest.approx(0.0005, rel=1e-6)
    assert overhead.step == pytest.approx(0.0075, rel=1e-6)


def test_solve_subtracts_the_transfers():
    # A transfer of 1 ms each way: M=1 is 5 c + 2 ms.
    overhead = calibration.solve({1: 0.012, 8: 0.019}, [0, 1], 0.001)
    assert overhead.call == pytest.approx(0.0005, rel=1e-6)
    assert overhead.step == pytest.approx(0.0075, rel=1e-6)


def test_solve_on_one_device_counts_every_call():
    # Both stages on one device: M=1 chains 4 calls, M=8 all 32.
    overhead = calibration.solve({1: 0.004, 8: 0.032}, [0, 0])
    assert overhead.call == pytest.approx(0.001, rel=1e-6)
    assert overhead.step == pytest.approx(0.0, abs=1e-7)


def test_solve_with_no_growth_costs_no_call():
    overhead = calibration.solve({1: 0.010, 8: 0.009}, [0, 1])
    assert overhead.call == 0.0 and overhead.step == pytest.approx(0.010)


def test_update_seconds_per_call_counts_a_shared_layer_once():
    shared = keras.layers.Dense(8)
    x = keras.Input((8,))
    y = shared(keras.layers.Dense(4)(shared(keras.layers.Dense(4)(x))))
    graph = graph_lib.read_graph(keras.Model(x, y))
    rate = profiling.UpdateRate(per_variable=1.0, per_element=0.5)
    # Dense(4) on 8 features: 2 variables of 32 + 4 elements, 2 + 18 s;
    # `shared` at its first call (4 features): 2 + (32 + 8) / 2 = 22 s;
    # its second call owns nothing.
    assert profiling.update_seconds(graph, rate) == [20.0, 22.0, 20.0, 0.0]


def test_smooth_corrects_one_wild_time_by_hand():
    # forward: 1, 2, 99, 8 at 8, 16, 32, 64 rows. Pairwise slopes: 1/8
    # three times, 98/24, 97/16, -91/32: the median is 1/8; intercepts 0,
    # 0, 95, 0: the median is 0. The line rows / 8 gives 4 at 32 rows.
    at = [profiling.CallCosts(r, [t, 0.5], [2.0 * t, 0.0], [0.0, 1.0])
          for r, t in [(8, 1.0), (16, 2.0), (32, 99.0), (64, 8.0)]]
    fitted = profiling.smooth(at)
    assert [c.rows for c in fitted] == [8, 16, 32, 64]
    assert [c.forward for c in fitted] == [[1.0, 0.5], [2.0, 0.5],
                                           [4.0, 0.5], [8.0, 0.5]]
    assert [c.backward_input[0] for c in fitted] == [2.0, 4.0, 8.0, 16.0]
    assert all(c.weight == [0.0, 1.0] for c in fitted)


def test_smooth_keeps_two_row_counts_and_flops_costs():
    two = [profiling.CallCosts(8, [1.0], [0.0], [0.0]),
           profiling.CallCosts(16, [5.0], [0.0], [0.0])]
    assert profiling.smooth(two) == two
    flops = [profiling.CallCosts(r, [float(r)], [0.0], [0.0], False)
             for r in (8, 16, 32)]
    assert profiling.smooth(flops) == flops


@pytest.mark.slow  # trains two tiny pipelines
def test_step_overhead_is_measured_once_per_devices(devices, monkeypatch,
                                                    tmp_path):
    monkeypatch.setenv("KERAS_PIPE_CACHE", str(tmp_path / "costs.json"))
    overhead = profiling.step_overhead(devices[:2])
    assert overhead.measured
    assert overhead.step >= 0 and overhead.call >= 0
    assert overhead.step + overhead.call > 0  # a step is never free

    def no_measuring(devices):
        raise AssertionError("measured again instead of read from cache")

    monkeypatch.setattr(calibration, "measure", no_measuring)
    assert profiling.step_overhead(devices[:2]) == overhead
    with pytest.raises(AssertionError, match="measured again"):
        profiling.step_overhead(devices[1:3])  # other devices


def test_a_timed_loop_reads_no_variable_inside():
    # The timed loop reads copies of the layer's weights made on the device
    # once. Before, every run read the model's variables, which live on the
    # client: on a remote worker each run timed a transfer of every weight
    # (about 1.3 ms for a Dense(256) call whatever its rows).
    import tensorflow as tf  # noqa: PLC0415

    from keras_pipe.planning.balance import cost as cost_lib  # noqa: PLC0415
    x = keras.Input((16,))
    graph = graph_lib.read_graph(keras.Model(x, keras.layers.Dense(8)(x)))
    call = graph.calls[0]
    loops, copies = profiling._loops(call, True, None)
    inputs = [cost_lib.sample_input(t, 4, None) for t in call.inputs]
    for loop in loops:
        definition = loop.get_concrete_function(
            tf.constant(2), *inputs, *copies).graph.as_graph_def()
        ops = [n.op for n in definition.node] + [
            n.op for f in definition.library.function for n in f.node_def]
        assert "While" in ops or "StatelessWhile" in ops
        assert "ReadVariableOp" not in ops


def test_a_burst_of_other_load_over_one_run_is_not_the_fixed_cost():
    quiet, burst = [0.002, 0.0021, 0.009], [0.006, 0.007, 0.0065]
    assert calibration.least_median([burst, quiet]) == 0.0021
    assert calibration.least_median([quiet]) == 0.0021
