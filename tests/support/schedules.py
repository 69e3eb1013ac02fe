"""A schedule the tests register, as a user would: one function, one call."""

from keras_pipe.engine import schedule

NAME = "test_gpipe_forward_order"


def backward_in_forward_order(num_micro_batches, num_stages,
                              num_devices=None):
    """GPipe, but each stage runs its backward passes in forward order."""
    m, k = num_micro_batches, num_stages
    return schedule.ticks_from_orders(
        [[schedule.Action("F", i, j) for i in range(m)] +
         [schedule.Action("B", i, j) for i in range(m)] for j in range(k)], k)


if NAME not in schedule.schedule_names():
    schedule.register_schedule(NAME, backward_in_forward_order)
