"""The simulator: step times of hand-computed cases, for every schedule."""

import pytest

from keras_pipe.engine import schedule
from keras_pipe.planning import simulator
from tests.support import schedules as registered


def _layout(name, num_micro_batches, num_devices=2):
    """`(ticks, stage_devices)` of a registered schedule on `num_devices`."""
    entry = schedule.get_schedule(name)
    per_device = entry.stages_per_device or (2 if entry.placement else 1)
    k = per_device * num_devices
    ticks = entry.build(num_micro_batches, k, num_devices)
    devices = schedule.stage_placement(k, num_devices,
                                       entry.placement or "loop")
    return ticks, devices


def _has_w(ticks):
    return any(a.kind == "W" for tick in ticks for a in tick)


def test_gpipe_two_stages_by_hand():
    # F0 F1 on device 0 at [0,1] [1,2], on device 1 at [1,2] [2,3]; the
    # full-batch loss seeds at 3; backward 2 each, in reverse order.
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2])
    result = simulator.simulate(schedule.gpipe(2, 2), [0, 1], costs)
    assert result.step_time == 9
    assert result.idle == pytest.approx([3 / 9, 3 / 9])
    assert [(str(c), s, e) for c, s, e in result.spans[1]][:4] == [
        ("1F0", 1, 2), ("1F1", 2, 3), ("1B1", 3, 5), ("1B0", 5, 7)]
    assert not result.seeded_by_parts


def test_one_f_one_b_by_hand():
    # Device 1: F0 [1,2], B0 [2,4], F1 waits for nothing [4,5], B1 [5,7].
    # Device 0: F0 [0,1], F1 [1,2], B0 waits for device 1's B0 (4) [4,6],
    # B1 for its B1 (7) [7,9].
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2])
    result = simulator.simulate(schedule.one_f_one_b(2, 2), [0, 1], costs)
    assert result.step_time == 9
    assert result.seeded_by_parts
    assert [(str(c), s, e) for c, s, e in result.spans[0]
            if c.kind != "W"] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)]


def test_one_f_one_b_splits_each_backward_as_the_executor_does():
    # Input gradients 1, weight gradients 1 per micro-batch, whole 2.
    # Device 1: F0 [1,2] B0 [2,3] W0 [3,4] F1 [4,5] B1 [5,6] W1 [6,7];
    # device 0 (the first stage: whole backward calls, but for the last,
    # split so that its W call releases the gradients in turn): F0 [0,1]
    # F1 [1,2], B0 waits for device 1's B0 [3,5], B1 for its B1 [6,7], W1
    # [7,8]: 8, as GPipe's (device 0's B1, B0 [4,6] and one W over both
    # [6,8]). Had device 1's calls stayed whole, its B1 would end at 8 and
    # the step at 10.
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2],
                            backward_input=[1, 1], weight=[1, 1])
    one_f_one_b = simulator.simulate(schedule.one_f_one_b(2, 2), [0, 1],
                                     costs)
    assert [(str(c), s, e) for c, s, e in one_f_one_b.spans[0]] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 3, 5), ("0B1", 6, 7),
        ("0W1", 7, 8)]
    gpipe = simulator.simulate(schedule.gpipe(2, 2), [0, 1], costs)
    assert one_f_one_b.step_time == gpipe.step_time == 8


def test_transfers_delay_the_receiver():
    # One micro-batch: F [0,1] | send 0.5 + 100 B / 100 B/s | F [2.5,3.5],
    # B [3.5,5.5] | send back 1.5 | B [7,9], then updates 0.25 and 1.
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2], latency=0.5,
                            bytes_per_second=100, output_bytes=[100, 7],
                            update=[0.25, 1])
    result = simulator.simulate(schedule.gpipe(1, 2), [0, 1], costs)
    assert result.step_time == 9.25
    assert result.busy == [3.25, 4]


def test_a_received_input_occupies_the_receiving_device():
    # receive 0.5 per input from another device. Device 0: F0 [0,1],
    # F1 [1,2]. Device 1: F0 reads stage 0's output: [1,2.5]; F1 [2.5,4];
    # the full-batch loss seeds B1 [4,6], B0 [6,8] (nothing received).
    # Device 0: B1 reads stage 1's input gradient: [6,8.5]; B0 [8.5,11].
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2], receive=0.5)
    result = simulator.simulate(schedule.gpipe(2, 2), [0, 1], costs)
    assert result.step_time == 11
    assert [(str(c), s, e) for c, s, e in result.spans[1]] == [
        ("1F0", 1, 2.5), ("1F1", 2.5, 4), ("1B1", 4, 6), ("1B0", 6, 8),
        ("1W1,0", 8, 8)]
    assert result.busy == [7, 7]


def test_each_weight_gradient_call_pays_its_own_cost():
    # GPipe's backward runs defer one W for both micro-batches; 1F1B splits
    # the last stage's backward calls (B, then its own W: 2 W calls) and
    # fuses the first stage's (nothing waits for their input gradients)
    # but for its last (`engine.weight_calls`). A W call costs weight 0.5
    # per micro-batch + weight_call (0.25 on stage 0, 1 on stage 1) once.
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2],
                            backward_input=[1.5, 1.5], weight=[0.5, 0.5],
                            weight_call=[0.25, 1])
    gpipe = simulator.simulate(schedule.gpipe(2, 2), [0, 1], costs)
    w = [[(str(c), e - s) for c, s, e in spans if c.kind == "W"]
         for spans in gpipe.spans]
    assert w == [[("0W1,0", 1.25)], [("1W1,0", 2)]]
    one_f_one_b = simulator.simulate(schedule.one_f_one_b(2, 2), [0, 1],
                                     costs)
    w = [[(str(c), e - s) for c, s, e in spans if c.kind == "W"]
         for spans in one_f_one_b.spans]
    assert w == [[("0W1", 0.75)], [("1W0", 1.5), ("1W1", 1.5)]]


@pytest.mark.parametrize("name", schedule.schedule_names())
def test_only_inputs_from_another_device_are_received(name):
    # Each crossing stage boundary is received twice per micro-batch (its
    # outputs forward, its input gradients back): the devices' busy time
    # grows by that many receive costs, whichever placement (a V keeps the
    # middle boundary on one device).
    entry = schedule.get_schedule(name)
    m = 4
    for k, devices in ((2, [0, 1]), (4, schedule.stage_placement(
            4, 2, entry.placement or "loop"))):
        try:
            ticks = entry.build(m, k, 2)
        except ValueError:
            continue
        base = simulator.Costs(forward=[1] * k, backward=[2] * k)
        plus = simulator.Costs(forward=[1] * k, backward=[2] * k,
                               receive=0.25)
        crossing = sum(devices[j] != devices[j + 1] for j in range(k - 1))
        grown = (sum(simulator.simulate(ticks, devices, plus).busy)
                 - sum(simulator.simulate(ticks, devices, base).busy))
        assert grown == pytest.approx(0.25 * 2 * m * crossing)


def test_call_cost_remat_loss_and_step_cost():
    # Every call costs 0.1 more; remat "always" redoes the forward (1) in
    # each backward; the loss (0.5) comes after both forward calls; the
    # step's own cost (0.2) comes first. One stage: F [0.2,1.3] [1.3,2.4],
    # loss to 2.9, B (0.1 + 2 + 1) [2.9,6] [6,9.1], then the W call of the
    # stage's last backward call, split (`engine.weight_calls`): its
    # weight gradients cost 0 here, the call 0.1.
    costs = simulator.Costs(forward=[1], backward=[2], call=0.1, loss=0.5,
                            step=0.2)
    result = simulator.simulate(schedule.gpipe(2, 1), [0], costs,
                                remat="always")
    assert result.step_time == pytest.approx(9.2)
    # except_last: the last micro-batch (B1, first to run) keeps its
    # activations; a lone backward call of the first stage stays whole,
    # but for the stage's last.
    result = simulator.simulate(schedule.gpipe(2, 1), [0], costs,
                                remat="except_last")
    assert result.step_time == pytest.approx(9.2 - 1)
    assert [str(c) for c, _, _ in result.spans[0]] == [
        "0F0", "0F1", "0B1", "0B0", "0W0"]


def test_the_full_batch_loss_and_the_parts_loss():
    # GPipe seeds from the full-batch loss once (full_loss 3 after both
    # forward calls); 1F1B from each micro-batch's part (loss 0.5 each).
    # One stage, forward 1, backward 2. GPipe: F [0,1] [1,2], loss to 5, B
    # [5,7] [7,9]. 1F1B: F0 [0,1], loss to 1.5, B0 [1.5,3.5], F1 [3.5,4.5],
    # loss to 5, B1 [5,7].
    costs = simulator.Costs(forward=[1], backward=[2], loss=0.5,
                            full_loss=3)
    assert simulator.simulate(schedule.gpipe(2, 1), [0],
                              costs).step_time == pytest.approx(9)
    one_f_one_b = schedule.get_schedule("1f1b").build(2, 1, 1)
    assert simulator.simulate(one_f_one_b, [0],
                              costs).step_time == pytest.approx(7)
    # Without full_loss, the full batch's loss is `loss`, as before.
    assert simulator.Costs(forward=[1], backward=[2],
                           loss=0.5).full_loss == 0.5


def test_split_backward_by_hand():
    # zb_h1, one micro-batch, 2 stages: device 1 F [1,2], B [2,3], W
    # [3,6]; device 0 F [0,1], B waits for device 1's B [3,4], W [4,7].
    costs = simulator.Costs(forward=[1, 1], backward=[4, 4],
                            backward_input=[1, 1], weight=[3, 3])
    result = simulator.simulate(schedule.zb_h1(1, 2), [0, 1], costs)
    assert result.step_time == 7
    assert [(str(c), s, e) for c, s, e in result.spans[1]] == [
        ("1F0", 1, 2), ("1B0", 2, 3), ("1W0", 3, 6)]


def test_a_run_of_backward_calls_defers_its_weight_gradients():
    # GPipe without remat: the executor runs B (input gradients) of each
    # micro-batch, then one W call over the run (2 x 0.5 + the call cost).
    costs = simulator.Costs(forward=[1], backward=[3], backward_input=[2],
                            weight=[0.5], call=0.1)
    result = simulator.simulate(schedule.gpipe(2, 1), [0], costs)
    assert [str(c) for c, _, _ in result.spans[0]] == [
        "0F0", "0F1", "0B1", "0B0", "0W1,0"]
    assert result.step_time == pytest.approx(2.2 + 2 * 2.1 + 1.1)


@pytest.mark.parametrize("name", schedule.schedule_names())
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_unit_costs_take_one_tick_per_action(name, m):
    # With every call one unit long and nothing else, each device's calls
    # fall on the schedule's ticks: the step lasts as many ticks.
    ticks, devices = _layout(name, m)
    k = len(devices)
    costs = simulator.Costs(forward=[1] * k, backward=[1] * k,
                            weight=[1] * k if _has_w(ticks) else None,
                            recompute=[0] * k)
    # remat="always": no deferred runs, so no W calls the ticks lack.
    result = simulator.simulate(ticks, devices, costs, remat="always")
    assert result.step_time == len(ticks)
    busy = sum(len(tick) for tick in ticks)
    assert sum(result.busy) == busy
    assert sum(result.idle) == pytest.approx(
        len(result.idle) * schedule.idle_fraction(ticks, devices))


@pytest.mark.parametrize("name", schedule.schedule_names())
def test_a_slow_stage_bounds_every_schedule(name):
    # Stage 0 ten times slower than the rest: no schedule beats M times its
    # own work, none may overlap two calls of one device.
    ticks, devices = _layout(name, 4)
    k = len(devices)
    forward = [10.0] + [1.0] * (k - 1)
    costs = simulator.Costs(forward=forward, backward=[2 * f for f in
                                                       forward])
    result = simulator.simulate(ticks, devices, costs)
    assert result.step_time >= 4 * 30
    for spans in result.spans:
        for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
            assert start >= end


def test_a_registered_schedule_is_simulated_like_the_built_in_ones():
    # Registered as a user would, by tests/support/schedules.py.
    name = registered.NAME
    ticks, devices = _layout(name, 2)
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2])
    # Device 1: F0 [1,2] F1 [2,3], loss; B0 [3,5] B1 [5,7]. Device 0: B0
    # waits for device 1's B0 (5) [5,7], B1 [7,9].
    assert simulator.simulate(ticks, devices, costs).step_time == 9


def test_bad_inputs_name_the_values():
    costs = simulator.Costs(forward=[1, 1], backward=[2, 2])
    with pytest.raises(ValueError, match="one device per stage"):
        simulator.simulate(schedule.gpipe(2, 2), [0], costs)
    with pytest.raises(ValueError, match="one backward time per stage"):
        simulator.Costs(forward=[1, 1], backward=[2])
    with pytest.raises(ValueError, match="weight needs one value"):
        simulator.Costs(forward=[1, 1], backward=[2, 2], weight=[1])
    with pytest.raises(ValueError, match=r"stages \[0, 1\] are not"):
        simulator.simulate(schedule.gpipe(2, 2), [0, 1, 2],
                           simulator.Costs([1] * 3, [1] * 3))
