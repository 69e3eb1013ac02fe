"""The rules for the choices a user leaves to the pipeline.

A pipeline has four choices besides its devices: `num_micro_batches`,
`schedule`, `remat` and (for a cut model) `balance`. Each left as `None` is
made by these rules (`resolve`):

* With none of them given (and no `memory_budget`), all four are planned
  together (`schedule="auto"`: `keras_pipe.planning.autoplan`) for a batch
  size, costed from measurements when the devices run in processes of
  their own or are GPUs (`measured`), and from FLOPs on logical devices of
  this process, which share one thread pool and so cannot give the speed
  a measurement would predict.
* Otherwise each choice left `None` takes its fixed default:
  `default_micro_batches` (two per stage, no more than the batch's rows),
  `default_schedule` (the fastest exact schedule the placement allows),
  remat `"except_last"`, balance `"params"`.

`keras_pipe.plan` and `PipelineModel.from_model` both resolve their
arguments here, so the same call chooses the same configuration (measured
costs are cached: `keras_pipe.planning.profiling`). When a pipeline makes
its choices (the first batch it sees) is `keras_pipe.model.first_batch`'s.
"""

import dataclasses
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_pipe import _compat
from keras_pipe.engine import building, placement
from keras_pipe.engine import schedule as schedule_lib

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_OPTIMIZER_SLOTS", "DEFAULT_REMAT",
           "DEFAULT_BALANCE", "optimizer_slots",
           "Resolved", "batch_size_of", "default_micro_batches",
           "default_schedule", "leaves_all", "measured", "outputs_masked",
           "resolve"]

# Keras' own default batch size for array data (`Model.fit`).
DEFAULT_BATCH_SIZE = 32
DEFAULT_REMAT = "except_last"
DEFAULT_BALANCE = "params"

# Fastest first: the zero-bubble schedules run the weight gradients in the
# bubbles GPipe and 1F1B leave idle; every schedule gives the same
# gradients. The first whose placement the stages' devices allow is taken.
_FASTEST_EXACT = ("zb_h2", "zbv", "interleaved_1f1b", "gpipe")


def leaves_all(num_micro_batches, schedule, remat, balance):
    """Whether the caller left every choice to the planner."""
    return (num_micro_batches is None and schedule is None and remat is None
            and balance is None)


def default_micro_batches(batch_size, num_stages):
    """`M` for a pipeline of `num_stages` stages that nobody chose: two
    micro-batches per stage (GPipe's bubble `(K-1)/(M+K-1)` then idles at
    most a third of a step), no more than the batch's rows."""
    m = 2 * num_stages
    if batch_size is not None:
        m = max(1, min(m, int(batch_size)))
    return m


def default_schedule(stage_devices, masked=False):
    """The fastest exact schedule the stages' placement allows (per stage,
    its device's index); GPipe for a model whose outputs carry a Keras
    mask, whose loss is divided by the whole batch's unmasked positions,
    known only once every micro-batch has run forward."""
    for name in ("gpipe",) if masked else _FASTEST_EXACT:
        try:
            schedule_lib.check_placement(name, stage_devices)
        except ValueError:
            continue
        return name
    return "gpipe"


def outputs_masked(model):
    """Whether a built Keras model's outputs carry a Keras mask (an
    `Embedding(mask_zero=True)` upstream, say)."""
    return any(_compat.get_keras_mask(t) is not None
               for t in keras.tree.flatten(getattr(model, "outputs", None)
                                           or []))


def measured(devices):
    """Whether a plan for `devices` is costed from measurements: some device
    is a GPU or belongs to a cluster job (a worker process). Logical CPU
    devices of this process share its thread pool: their plan is costed
    from FLOPs."""
    for device in devices or ():
        spec = tf.DeviceSpec.from_string(device)
        if (spec.device_type or "").upper() == "GPU" or (
                placement.process_of(device) is not None):
            return True
    return False


# What a plan assumes when no optimizer is compiled yet (Adam's).
DEFAULT_OPTIMIZER_SLOTS = 2


def optimizer_slots(optimizer):
    """The variables `optimizer` keeps per trained weight (SGD 0, SGD with
    momentum 1, Adam 2, ...): a fresh copy of it built for one and for two
    weights, counted."""
    counts = []
    for n in (1, 2):
        fresh = type(optimizer).from_config(optimizer.get_config())
        fresh.build([keras.Variable(np.zeros((1,), "float32"))
                     for _ in range(n)])
        counts.append(len(fresh.variables))
    return counts[1] - counts[0]


_ARGUMENT = {"fit": 2, "evaluate": 2, "predict": 1}


def batch_size_of(method, args, kwargs):
    """The batch size a `fit` / `evaluate` / `predict` (or `*_on_batch`)
    call runs with.

    Its `batch_size` argument (an `*_on_batch` call: its rows); else a
    dataset's or `PyDataset`'s batch (from its spec, else its first
    batch); else Keras' default for array data, no more than their rows.
    A Python generator cannot be looked into without consuming it:
    `DEFAULT_BATCH_SIZE`, with a warning.
    """
    x = kwargs.get("x", args[0] if args else None)
    if method.endswith("_on_batch"):  # the whole of x is the batch
        return _leading(x) or DEFAULT_BATCH_SIZE
    position = _ARGUMENT[method]
    given = kwargs.get("batch_size", args[position]
                       if len(args) > position else None)
    if given is not None:
        return int(given)
    if isinstance(x, tf.data.Dataset):
        return _leading(x.element_spec) or _leading(next(iter(x.take(1))))
    if isinstance(x, keras.utils.PyDataset):
        return _leading(x[0])
    rows = _leading(x)
    if rows is not None:
        return min(rows, DEFAULT_BATCH_SIZE)
    warnings.warn(
        f"keras_pipe cannot see the batch size of {method}'s data "
        f"({type(x).__name__}) without consuming it; the pipeline's choices "
        f"are made for batch_size={DEFAULT_BATCH_SIZE}. Pass batch_size= "
        "to from_model to plan for the real one.", stacklevel=3)
    return DEFAULT_BATCH_SIZE


def _leading(structure):
    """The size of the first axis of the first array or spec in
    `structure`, or None if it has none or it is unknown."""
    if isinstance(structure, tuple) and len(structure) in (2, 3) and \
            not hasattr(structure, "_fields"):
        structure = structure[0]  # (x, y[, sample_weight]): x's rows
    leaves = keras.tree.flatten(structure)
    if not leaves:
        return None
    shape = getattr(leaves[0], "shape", None)
    if shape is None:  # a Python list of numbers
        shape = np.shape(structure) if isinstance(structure, list) else ()
    if len(shape) == 0 or shape[0] is None:
        return None
    return int(shape[0])


@dataclasses.dataclass
class Resolved:
    """A call's choices, each given or made (`resolve`).

    Attributes:
        implicit: True when the caller gave no choice (planned by
            `schedule="auto"`).
        schedule: the schedule's name, or `"auto"`.
        num_micro_batches: `M`, or None (auto, or chosen from the first
            batch when no batch size is known).
        remat, balance: as given or their defaults (None under auto).
        measure: whether auto measures costs (None: not planning).
        batch_size: as given; Keras' default when planning without one.
    """

    implicit: bool
    schedule: str
    num_micro_batches: object
    remat: object
    balance: object
    measure: object
    batch_size: object


def resolve(num_micro_batches, schedule, remat, balance, memory_budget,
            devices, num_stages, batch_size, measure=None,
            batch_size_known=True, masked=False):
    """Makes the choices left `None`, by this module's rules.

    `batch_size_known=False` (`from_model` before any batch) leaves `M`
    None for the pipeline to choose from its first batch; `plan` costs
    Keras' default batch instead. `masked`: the model's outputs carry a
    Keras mask (`outputs_masked`).
    """
    # Planning places stages on devices: without devices there is nothing
    # to measure or simulate, and the fixed defaults apply.
    implicit = memory_budget is None and devices is not None and leaves_all(
        num_micro_batches, schedule, remat, balance)
    if implicit or schedule == "auto":
        if batch_size is None and implicit:
            batch_size = DEFAULT_BATCH_SIZE
        return Resolved(
            implicit=implicit, schedule="auto", num_micro_batches=None,
            remat=None, balance=None, batch_size=batch_size,
            measure=(measured(devices) if implicit else True)
            if measure is None else measure)
    if schedule is None:
        schedule = "gpipe" if memory_budget is not None else \
            default_schedule(building.device_indices(devices) if devices
                             else list(range(num_stages or 1)), masked)
    if num_micro_batches is None and (batch_size is not None
                                      or batch_size_known):
        num_micro_batches = default_micro_batches(
            batch_size, num_stages or len(devices or [None]))
    return Resolved(
        implicit=False, schedule=schedule,
        num_micro_batches=num_micro_batches,
        remat=DEFAULT_REMAT if remat is None else remat,
        balance=DEFAULT_BALANCE if balance is None else balance,
        measure=True if measure is None else measure, batch_size=batch_size)
