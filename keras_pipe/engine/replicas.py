"""Pipeline x data parallelism: R copies of the K-stage pipeline, one optimizer step.

`model.replicate(devices)` with `R * K` devices runs replica `r` of the
pipeline on `devices[r * K:(r + 1) * K]`. A global batch is cut into
`R * M` micro-batches; replica `r` takes the `r`-th contiguous shard (`M`
micro-batches) and runs it through its own stage devices, all replicas at
once. The outputs of every replica are merged and the loss is computed once
on the whole global batch, so any reduction (mean, sum, sample weights) is
weighted exactly as on one device. Each replica's backward pass runs on its
own devices; the gradients of a variable, from every micro-batch of every
replica, are summed on the device that holds the variable, and the
optimizer steps once. Training is thus the same as training the unsplit
model on the global batch on one device (up to the order of float sums).

Why a sum in the graph rather than TF collectives or a `tf.distribute`
strategy:

* `MirroredStrategy` / `MultiWorkerMirroredStrategy` put one replica on one
  device and mirror every variable on each; a pipeline replica spans K
  devices, which no strategy models. Keras' `fit` under a strategy also
  runs `train_step` per replica, while the pipeline's step must see the
  whole batch to weight the loss exactly.
* Collectives (`CollectiveReduceV2`, NCCL) all-reduce R *copies* of each
  gradient so that R copies of each variable take R identical optimizer
  steps. That buys bandwidth on many GPUs, but costs R copies of the
  weights and of the optimizer slots, a group/instance key protocol, and
  R optimizer steps that must stay bit-identical. Here each variable exists
  once (on replica 0's stage device); the sum is an `add_n` that TF places
  on that device and feeds with transfers (over gRPC for remote workers);
  the next step's parameter reads on each replica's device are the
  broadcast. It is a reduce-to-owner plus broadcast: for 2 to 8 replicas of
  a pipeline, whose stage weights are a 1/K share of the model, that is
  the simple, exact choice. Checkpoints are unchanged by replication.

State does not join replicas: random draws are keyed by each row's place
in the global batch (so Dropout masks do not depend on the replica), and
BatchNormalization moving statistics are threaded by each replica on its
own and merged once per step as if the replicas' micro-batches had run one
after another (`keras_pipe.engine.executor`). Other state (a layer's own
non-trainable variables) is still threaded from call to call in issue
order, which makes the replicas wait for each other on that stage.
"""

from keras_pipe.engine import placement
from keras_pipe.engine.stage import Stage

__all__ = ["make_runners", "replica_of"]


def make_runners(runners, devices):
    """One list of `Stage` runners per replica; replica 0 is the model's own.

    Args:
        runners: the model's own `Stage` runners, one per stage.
        devices: `R * K` device strings (flat, replica after replica) or `R`
            lists of `K`. The first replica's devices must be the model's.

    Returns:
        `[[Stage] * K] * R`.

    Raises:
        TypeError: if `devices` is not a list of strings or of lists.
        ValueError: if the count is not a multiple of `K`, the first replica
            is not on the model's devices, or a device does not exist.
    """
    k = len(runners)
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise TypeError(
            "devices must be a list of R * K device strings (or R lists of "
            f"K). Received: devices={devices!r}")
    flat = [d for group in devices for d in (
        group if isinstance(group, (list, tuple)) else [group])]
    if not flat or len(flat) % k:
        raise ValueError(
            f"replicate() needs num_replicas * num_stages devices, a "
            f"multiple of num_stages={k}: got {len(flat)}. Received: "
            f"devices={list(devices)}")
    resolved = placement.resolve_devices(flat)
    own = [runner.device for runner in runners]
    if resolved[:k] != own:
        raise ValueError(
            f"The first replica must run on the model's devices {own}, where "
            f"its variables live. Received: {resolved[:k]}")
    replicas = [list(runners)]
    for r in range(1, len(resolved) // k):
        replicas.append([
            Stage(runner.layer, device, position=runner.position)
            for runner, device in zip(runners, resolved[r * k:(r + 1) * k])])
    return replicas


def replica_of(i, num_micro_batches, num_replicas):
    """The replica that runs micro-batch `i` of `num_micro_batches` in all.

    Contiguous shards, as even as the count allows: 8 micro-batches on 2
    replicas give 0, 0, 0, 0, 1, 1, 1, 1; 3 give 0, 0, 1.
    """
    return i * num_replicas // num_micro_batches
