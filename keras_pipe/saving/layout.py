"""Where a loaded model's stages go when it is loaded on other devices.

A file saved on 4 devices may be loaded where 2 exist. Stages spread in
contiguous blocks suit GPipe and 1F1B, but `interleaved_1f1b` needs stage
`j` on device `j % D` and `zbv` exactly two stages per device in a V: a
block layout is one these schedules refuse, and `zbv` with 8 stages cannot
run on 2 devices at all. These pure functions pick a layout the schedule
accepts, or a smaller number of stages (a model cut by
`PipelineModel.from_model` is cut again: its weights file does not depend
on the cut), or say which device counts work.
"""

from keras_pipe.engine import schedule as schedule_lib

__all__ = ["stage_devices", "device_counts", "merged_balance",
           "merged_remat", "fit"]


def stage_devices(schedule, num_stages, num_devices):
    """Device index per stage for `num_devices` devices, or None.

    Contiguous blocks for a schedule without a placement rule, else the
    schedule's own (`"loop"`, `"v"`); None if `schedule` refuses every
    layout of `num_stages` stages on exactly `num_devices` devices.
    """
    entry = schedule_lib.get_schedule(schedule)
    k, d = num_stages, num_devices
    if not 1 <= d <= k:
        return None
    if entry.placement is None:
        indices = [j * d // k for j in range(k)]
    else:
        indices = schedule_lib.stage_placement(k, d, entry.placement)
    try:
        schedule_lib.check_placement(schedule, indices)
        schedule_lib.build_ticks(schedule, 1, k, d)
    except ValueError:
        return None
    return indices


def device_counts(schedule, num_stages):
    """The device counts on which `schedule` runs `num_stages` stages."""
    return [d for d in range(1, num_stages + 1)
            if stage_devices(schedule, num_stages, d) is not None]


def fit(schedule, num_stages, num_available, can_recut):
    """`(num_stages, device indices)` for at most `num_available` devices.

    The saved number of stages on the most devices that work; else, if
    `can_recut`, the most stages (fewer than saved) that run on the most
    devices; else a ValueError naming the device counts that work.
    """
    for d in range(min(num_available, num_stages), 0, -1):
        indices = stage_devices(schedule, num_stages, d)
        if indices is not None:
            return num_stages, indices
    if can_recut:
        for d in range(min(num_available, num_stages), 0, -1):
            for k in range(num_stages - 1, 0, -1):
                indices = stage_devices(schedule, k, d)
                if indices is not None:
                    return k, indices
    counts = device_counts(schedule, num_stages)
    raise ValueError(
        f"schedule={schedule!r} runs the saved {num_stages} stages on "
        f"{counts or 'no number of'} devices, and {num_available} "
        f"exist here. Load it where {' or '.join(map(str, counts))} devices "
        "exist (on CPU: keras_pipe.logical_cpu_devices(n)), or pass "
        f"devices=[...] ({num_stages} device strings, in the order "
        f"{stage_devices(schedule, num_stages, counts[-1]) if counts else []}"
        " of device indices) to keras_pipe.load_model().")


def _groups(num_stages, new_num_stages):
    """`[(start, end)]`: saved stages merged into each new stage."""
    return [(g * num_stages // new_num_stages,
             (g + 1) * num_stages // new_num_stages)
            for g in range(new_num_stages)]


def merged_balance(balance, new_num_stages):
    """Layer-call counts per stage with neighbouring stages merged."""
    return [sum(balance[a:b]) for a, b in _groups(len(balance),
                                                  new_num_stages)]


def merged_remat(remat, num_stages, new_num_stages):
    """A remat mode per merged stage: the stages' own if they agree, else
    `"always"` (the least memory)."""
    if isinstance(remat, str):
        return remat
    merged = []
    for a, b in _groups(num_stages, new_num_stages):
        modes = set(remat[a:b])
        merged.append(modes.pop() if len(modes) == 1 else "always")
    return merged
