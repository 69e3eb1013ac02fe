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
# glibc's arenas). Measured by `tools/function_memory.py` (two workers,
# one-row micro-batches, resident size after two steps minus the idle
# worker, the weights and the slots, against the nodes placed on the
# worker; `--fit docs/benchmarks/function_memory.json`): 25 stages of the
# ResNet, the Transformer and GPT-2, 87-6445 nodes: 4.25 KiB per node
# (least squares; 15.9 MiB at 0 nodes, not counted: residual 5.2 MiB).
FUNCTION_NODE_BYTES = 4352

# A worker's build holds its weights and, of the initial values the client
# sends, about this many times the largest variable in transit (gRPC's
# receive buffers, the received tensor). Measured where the build is a
# worker's peak (`tools/memory_model.py --workers`, heap "return", which
# trims the arenas when the worker idles between the client's layers,
# median of 3 runs): GPT-2's worker 0 (a 15.6 MiB token table, weights
# 0.1 MiB besides) 1.55-1.76, the ResNet's worker 1 (a 16 MiB kernel) 1.47
# above its weights; one 16 MiB variable placed on a fresh worker (6
# runs): 1.35-1.93. Without the trim about 2 (GPT-2's worker 0: 1.95-2.3).
BUILD_TRANSIT = 1.5


def function_nodes(block, mode, num_micro_batches):
    """Graph nodes of a stage's step functions on its worker.

    A micro-batch run in place (no remat) puts the stage's forward and
    backward ops in the step's graph once per micro-batch
    (`Stage.forward`); rematerialized micro-batches call two functions
    traced once: the forward (`forward_nodes`) and the backward, which
    holds the forward twice (TF's forward with its side outputs, and the
    recompute's) and the gradient ops. Measured node counts (ResNet stage
    0: 669 at M = 1 without remat, 3097 at M = 4, 1736 with remat "always";
    predicted 750, 3000, 1746)."""
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
    base a memory budget for a worker is net of: TF's own share (~650 MiB
    here: kernels, thread pools, gRPC) is in it. The step's peak is the
    allocator peak of `predict`: with freed blocks of 128 KiB or more
    given back to the OS (`keras_pipe.distributed.heap`, `"return"`),
    resident memory follows the allocator's bytes in use; to it come the
    step's functions, TF's graphs and executors on the worker
    (`functions`: `FUNCTION_NODE_BYTES` per node of `function_nodes`).
    Not counted: the kernels' code paged in (8 MiB on the Transformer
    worker of `tools/memory_model.py --workers`, Adam, M = 4). The build
    can peak on its own (before the functions are made): the weights and
    the initial values the client sends, `BUILD_TRANSIT` times the largest
    variable in transit (`build`); a tied variable counts at build on every stage
    that uses it, since each stage's build places it on its device before
    the last one keeps it.
    Measured by `tools/memory_model.py --workers`. Arguments as in
    `predict`.

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
