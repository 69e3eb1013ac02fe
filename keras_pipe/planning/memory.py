"""Predicted peak memory of a training step, per stage (per device).

Why a model and not a measurement: the planner (`keras_pipe.planning.budget`)
compares thousands of cuts, micro-batch counts and remat modes before
anything is built. The model follows what the executor holds, in parts:

* `stage_order`: each stage's passes in the order the executor runs them,
  from the schedule's clock ticks (so a new schedule needs no formula);
* `stage_sizes`: per call and per run of calls (`Block`), the sizes that
  matter: weights, boundary tensors, what the tape keeps, stashes;
* `backward`: what one call's gradient keeps, from its traced gradient
  graph, and its kernels' scratch buffers;
* `allocation`: per pass, what is alive, as linear forms of a `Block`'s
  sizes (`moments`); the stage's peak is the largest (`stage_memory`);
* `resident`: a worker process's resident memory on top of that.

Validated per stage against TF's allocator peak by `tools/memory_model.py`
(docs/capacity.md).
"""

import dataclasses

import numpy as np

from keras_pipe import _validation
from keras_pipe.distributed import heap
from keras_pipe.planning.allocation import (
    CATEGORIES,
    moments,
    update_temporaries,
    weight_call_transient,
)
from keras_pipe.planning.backward import CONCURRENT_KERNELS, call_nodes
from keras_pipe.planning.balance import shapes as shapes_lib
from keras_pipe.planning.stage_order import StageActions, in_flight, stage_actions
from keras_pipe.planning.stage_sizes import (
    FEATURES,
    Block,
    Profile,
    features,
    second_largest,
    transposes,
)

# The memory model's parts, importable from here.
__all__ = ["CONCURRENT_KERNELS", "Block", "FEATURES",
           "Profile", "StageActions", "StageMemory", "call_nodes",
           "features", "in_flight", "moments", "predict", "predict_stages",
           "second_largest", "stage_actions", "stage_memory", "transposes",
           "update_temporaries", "weight_call_transient"]


@dataclasses.dataclass
class StageMemory:
    """Predicted peak of one stage's device during a training step (bytes).

    `total` is the peak; the other fields say what it is made of at that
    moment.
    """

    weights: int
    optimizer_slots: int
    gradients: int
    boundary: int      # held boundary inputs of micro-batches in flight
    activations: int   # held tape activations, and a recompute's
    transient: int     # gradients passing through, mini-batch, loss head

    @property
    def total(self):
        return (self.weights + self.optimizer_slots + self.gradients
                + self.boundary + self.activations + self.transient)


def stage_memory(block, actions, mode, num_micro_batches, optimizer_slots=2,
                 first=False, last=False, resident=False, transposed=False):
    """The predicted peak of one stage running `actions` under remat `mode`.

    Args:
        block: the stage's `Block` (sizes for one micro-batch).
        actions: the stage's passes in order (`stage_actions(...)[j]`).
        mode: `"always"`, `"except_last"` or `"never"`.
        num_micro_batches: `M`.
        optimizer_slots: optimizer variables per trainable weight (Adam 2,
            SGD 0). Defaults to `2`.
        first: the stage takes the mini-batch (stage 0). Defaults to
            `False`.
        last: the stage holds the merged outputs, targets and loss
            gradient (the last stage). Defaults to `False`.
        resident: the peak of a worker's resident memory (heap
            "return"), not of the allocator. Defaults to `False`.
        transposed: the stage's forward products read transposed kernels
            (`transposes`). Defaults to `False`.

    Returns:
        A `StageMemory`.
    """
    forms = moments(actions, mode, num_micro_batches, first, last,
                    optimizer_slots, transposed)
    values = forms @ features(block)          # (moments, categories)
    peak = values[int(np.argmax(values.sum(axis=1)))]
    hidden = block.outputs if first else block.inputs
    if resident and hidden < heap.RETURN_THRESHOLD:
        # A worker's resident memory (`keras_pipe.distributed.heap`,
        # "return"): blocks below the mmap threshold come from glibc's
        # arenas, which keep their high-water mark resident; when a
        # micro-batch's hidden tensors (at the stage's boundary) are that
        # small, the activations' own peak
        # stays resident under the later peak of gradients and updates.
        small = values[:, :2].sum(axis=1)
        big = values[:, 2:].sum(axis=1)
        peak = np.concatenate([values[int(np.argmax(small)), :2],
                               values[int(np.argmax(big)), 2:]])
    return StageMemory(
        weights=block.weights,
        optimizer_slots=optimizer_slots * block.trainable,
        **{name: int(v) for name, v in zip(CATEGORIES, peak)})


def predict(partition, batch_size, num_micro_batches, remat="except_last",
            schedule="gpipe", optimizer_slots=2, input_shape=None,
            _resident=False):
    """Predicted peak memory of each stage of a `Partition` in training.

    ```python
    part = keras_pipe.planning.partition.cut(model, 4, balance="flops")
    peaks = keras_pipe.planning.memory.predict(part, batch_size=256,
                                      num_micro_batches=8, remat="always",
                                      schedule="1f1b")
    [p.total for p in peaks]
    ```

    Args:
        partition: a `keras_pipe.planning.partition.Partition`.
        batch_size: rows per mini-batch.
        num_micro_batches: `M`.
        remat: a remat mode or a list of one mode per stage. Defaults to
            `"except_last"`.
        schedule: `"gpipe"`, `"1f1b"`, or a function
            `(num_micro_batches, num_stages) -> clock ticks`. Defaults to
            `"gpipe"`.
        optimizer_slots: optimizer variables per trainable weight (2 for
            Adam, 1 for SGD with momentum, 0 for SGD). Defaults to `2`.
        input_shape: the model inputs' shapes, for dimensions the model
            leaves unknown (a sequence length); as in `partition.cut`.
            Defaults to `None`: the shapes the partition was cut with, or
            1 for an unknown dimension.

    Returns:
        A list of `StageMemory`, one per stage.

    Raises:
        TypeError, ValueError: for a bad count, remat mode or schedule.
    """
    return predict_stages(partition, batch_size, num_micro_batches, remat,
                          schedule, optimizer_slots, input_shape,
                          _resident)[0]


def predict_stages(partition, batch_size, num_micro_batches, remat,
                   schedule, optimizer_slots, input_shape, resident):
    """`predict`'s stages, with what `predict_resident` adds to them: per
    stage its `Block` and remat mode, and the `M` the step runs."""
    _validation.check_positive_int("batch_size", batch_size)
    _validation.check_positive_int("num_micro_batches", num_micro_batches)
    k = partition.num_stages
    modes = _validation.check_remat(remat, k)
    rows = -(-batch_size // num_micro_batches)
    m = min(num_micro_batches, batch_size)
    shapes = partition.shapes
    if input_shape is not None:
        shapes = shapes_lib.infer_shapes(partition.graph, input_shape,
                                         what="the memory prediction")
    profile = Profile(partition.graph, rows, shapes)
    actions = stage_actions(schedule, m, k)
    result, blocks, start = [], [], 0
    for j, size in enumerate(partition.sizes):
        blocks.append(profile.block(start, start + size))
        start += size
        result.append(stage_memory(
            blocks[-1], actions[j], modes[j], m, optimizer_slots,
            first=j == 0, last=j == k - 1, resident=resident,
            transposed=transposes(modes[j], batch_size, m)))
    return result, blocks, modes, m


