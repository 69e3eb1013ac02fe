"""Predicted resident memory of a worker process in training.

A worker's resident memory is the allocator's bytes in use when the heap
gives freed blocks back (`keras_pipe.distributed.heap`, "return"): the
peak of `memory.predict` (with `resident=True`), plus TF's graphs and
executors of the step's functions, plus a build that can peak on its own.
"""

import dataclasses

from keras_pipe.engine import schedule as schedule_lib
from keras_pipe.planning import memory as memory_lib
from keras_pipe.planning.balance import cost as cost_lib

__all__ = ["BUILD_TRANSIT", "FUNCTION_NODE_BYTES", "ResidentMemory",
           "function_nodes", "predict_resident"]


# Resident bytes per graph node of the step's functions on a worker: TF's
# graphs and executors (node definitions, kernels, their small blocks in
# glibc's arenas). A least-squares fit of resident size against the nodes
# placed on the worker, by `tools/function_memory.py --fit` (docs/capacity.md,
# "The memory model's constants").
FUNCTION_NODE_BYTES = 4352

# A worker's build holds its weights and, of the initial values the client
# sends, about this many times the largest variable in transit (gRPC's
# receive buffers, the received tensor), with heap "return" trimming the
# arenas while the worker idles between the client's layers. Fitted where
# the build is a worker's peak (`tools/memory_model.py --workers`;
# docs/capacity.md, "The memory model's constants").
BUILD_TRANSIT = 1.5


def function_nodes(block, mode, num_micro_batches):
    """Graph nodes of a stage's step functions on its worker.

    A micro-batch run in place (no remat) puts the stage's forward and
    backward ops in the step's graph once per micro-batch
    (`Stage.forward`); rematerialized micro-batches call two functions
    traced once: the forward (`forward_nodes`) and the backward, which
    holds the forward twice (TF's forward with its side outputs, and the
    recompute's) and the gradient ops."""
    m = num_micro_batches
    in_place = sum(not schedule_lib.is_remat(mode, i, m) for i in range(m))
    nodes = in_place * block.nodes
    if in_place < m:
        nodes += block.forward_nodes + 2 * block.nodes
    return nodes


@dataclasses.dataclass
class ResidentMemory(memory_lib.StageMemory):
    """Predicted resident peak of a stage's worker process (bytes), net of
    the idle worker: the larger of the training step's peak (the fields of
    `StageMemory`) with the step's functions (`functions`) and the build's
    (`build`), which comes before the functions are made.
    """

    build: int = 0   # weights + initial values in transit at build
    functions: int = 0   # TF's graphs and executors of the step's functions

    @property
    def total(self):
        return max(super().total + self.functions, self.build)


def predict_resident(partition, batch_size, num_micro_batches,
                     remat="except_last", schedule="gpipe",
                     optimizer_slots=2, input_shape=None):
    """Predicted resident peak of each stage's worker process in training.

    Net of an idle worker (after a client connected and ran one op), the
    base a memory budget for a worker is net of: TF's own share (kernels,
    thread pools, gRPC) is in it. The step's peak is the allocator peak of
    `predict`: with freed blocks of `heap.RETURN_THRESHOLD` or more given
    back to the OS (`keras_pipe.distributed.heap`, `"return"`),
    resident memory follows the allocator's bytes in use; to it come the
    step's functions, TF's graphs and executors on the worker
    (`functions`: `FUNCTION_NODE_BYTES` per node of `function_nodes`).
    Not counted: the kernels' code paged in. The build
    can peak on its own (before the functions are made): the weights and
    the initial values the client sends, `BUILD_TRANSIT` times the largest
    variable in transit (`build`); a tied variable counts at build on
    every stage that uses it, since each stage's build places it on its
    device before the last one keeps it. Checked against measurement by
    `tools/memory_model.py --workers`. Arguments as in `predict`.

    Returns:
        A list of `ResidentMemory`, one per stage.
    """
    result, start = [], 0
    calls = partition.graph.calls
    peaks, blocks, modes, m = memory_lib.predict_stages(
        partition, batch_size, num_micro_batches, remat, schedule,
        optimizer_slots, input_shape, True)
    for size, peak, block, mode in zip(partition.sizes, peaks, blocks,
                                       modes):
        # At build each stage places every variable its layers use on its
        # device, tied ones too (a later stage moves them on).
        used = {id(v): cost_lib.variable_bytes(v) for call in calls[start:start + size]
                for v in getattr(call.operation, "weights", None) or []}
        start += size
        result.append(ResidentMemory(
            **vars(peak),
            build=sum(used.values()) + int(
                BUILD_TRANSIT * max(used.values(), default=0)),
            functions=FUNCTION_NODE_BYTES * function_nodes(block, mode, m)))
    return result
