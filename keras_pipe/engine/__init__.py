"""The engine: schedules, the executor, stage runners and the step's parts.

What one training step is: the schedule's clock ticks (`schedule`), the
executor that issues them (`executor`), the stage runner with its split
backward (`stage`, `weight_grad`), micro-batches (`microbatch`), the loss
parts that seed them (`losses`), what crosses a cut (`attached`,
`tensors`), replicas, device placement, optimizer colocation and
updates in place (`in_place`).

Layering: it imports nothing from `keras_pipe.planning`,
`keras_pipe.distributed` or `keras_pipe.saving` (tests/test_structure.py).
Internal: users import from `keras_pipe` (and `keras_pipe.schedule` for
`register_schedule`), not from here.
"""
