"""Every registered schedule, under every remat mode, steps like the unsplit model.

The matrix is `schedule.schedule_names()` x `_validation.REMAT_MODES`, read
when the tests are collected: registering a schedule adds it here (the
schedule the tests register themselves included). Each schedule runs on the
device layout it asks for (`placement`, `stages_per_device`): 3 stages on 3
devices when it takes any layout, else 4 stages on 2 devices.

Tolerances as in test_transparency: rtol 1e-5, atol 1e-6 (float32; only
the order of sums changes).
"""

import pytest

from keras_pipe import _validation
from keras_pipe.engine import schedule
from tests.support import (
    helpers,
    schedules,  # noqa: F401  (registers its schedule)
)
from tests.test_transparency import check_one_step, compile_both

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`


def device_layout(name):
    """The device index of each stage that schedule `name` accepts."""
    entry = schedule.get_schedule(name)
    if entry.placement is None and entry.stages_per_device is None:
        return [0, 1, 2]
    num_devices = 2
    num_stages = num_devices * (entry.stages_per_device or 2)
    return schedule.stage_placement(num_stages, num_devices,
                                    entry.placement or "loop")


def test_the_matrix_covers_every_registered_schedule():
    assert schedules.NAME in schedule.schedule_names()
    assert {"gpipe", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b",
            "zbv"} <= set(schedule.schedule_names())


@pytest.mark.parametrize("remat", _validation.REMAT_MODES)
@pytest.mark.parametrize("name", schedule.schedule_names())
def test_schedule_steps_like_the_unsplit_model(devices, name, remat):
    layout = device_layout(name)
    pipe, reference = helpers.pair(
        lambda: helpers.dense_stages(len(layout)),
        [devices[d] for d in layout], 5, remat, schedule=name)
    compile_both(pipe, reference, optimizer="adam")
    # 11 rows: uneven micro-batches of 3, 2, 2, 2, 2; with sample weights.
    x, y, sample_weight = helpers.data(11)
    check_one_step(pipe, reference, x, y, sample_weight)
