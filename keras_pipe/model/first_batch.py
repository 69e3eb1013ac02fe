"""The choices a pipeline makes when it first sees a batch.

`PipelineModel.from_model(model, devices=...)` with every choice left to
the planner keeps its arguments (`Deferred`) and is planned by the first
`fit`, `evaluate`, `predict` or `*_on_batch` call, for that call's batch
size, the compiled loss and the optimizer's slots; a pipeline whose
`num_micro_batches` was not given takes it from that batch size. The rules
of each choice are in `keras_pipe.planning.choices`.
"""

from keras_pipe import _validation
from keras_pipe.engine import placement
from keras_pipe.planning import graph as graph_lib
from keras_pipe.planning import partition as partition_lib
from keras_pipe.planning import planner
from keras_pipe.planning.balance import shapes
from keras_pipe.planning.choices import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_OPTIMIZER_SLOTS,
    batch_size_of,
    default_micro_batches,
    optimizer_slots,
)

__all__ = ["Deferred", "FirstBatchChoices"]


class Deferred:
    """`from_model`'s arguments, kept until the batch size is known;
    checked now, before anything is built."""

    def __init__(self, model, devices, options):
        num_stages = options.get("num_stages")
        if num_stages is None and not devices:
            raise ValueError(
                "from_model needs num_stages, or devices (one per "
                "stage). Received: num_stages=None, devices=None")
        if num_stages is not None:
            _validation.check_positive_int("num_stages", num_stages)
        if devices is not None:
            _validation.check_device_list(devices)
            placement.resolve_devices(devices)
        # A built Sequential or Functional, with sizes that fit it and
        # enough layer calls for its stages.
        graph = graph_lib.read_graph(model)
        shapes.check_given(graph, options.get("input_shape"),
                           options.get("sample_inputs"))
        partition_lib.check_enough_calls(graph, num_stages or len(devices))
        self.model = model
        self.devices = devices
        self.options = options  # `planner.stages_from_model` keywords

    def stages_for(self, batch_size, compiled_loss, optimizer_slots):
        """`(stages, PipelineModel arguments, plan)` for `batch_size`, the
        compiled loss (unless `from_model` was given one) and the
        optimizer's slots."""
        return planner.stages_from_model(
            self.model, devices=self.devices, batch_size=batch_size,
            optimizer_slots=optimizer_slots, **dict(
                self.options, loss=self.options["loss"] or compiled_loss))


# What a pipeline built from a `Deferred` has only once it is planned.
_PLANNED_STATE = frozenset({
    "_stage_layers", "_given_devices", "_resolved_devices",
    "_num_micro_batches", "_remat", "_remat_modes", "_schedule", "_runners",
    "_executor", "plan"})


class FirstBatchChoices:
    """`PipelineModel`'s choices made when it first sees a batch.

    A mixin before `keras.Model`: `fit`, `evaluate` and `predict` call
    `see_batch` first. A pipeline from `from_model` with every choice left
    to the planner is planned then (anything that needs its stages
    earlier, such as `summary`, plans it for `DEFAULT_BATCH_SIZE`); a
    pipeline whose `num_micro_batches` was not given gets
    `default_micro_batches` of that batch size.
    """

    def __getattr__(self, name):
        # Reached only for attributes not set: a pipeline still to plan.
        if name in _PLANNED_STATE and \
                self.__dict__.get("_deferred") is not None:
            self._plan_for(None)
            return getattr(self, name)
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}")

    def see_batch(self, method, args, kwargs):
        """Records the batch size of a `fit` / `evaluate` / `predict` call
        (`batch_size_of`) if none was seen, and plans with it."""
        if self.__dict__.get("_batch_size_seen") is None and (
                self.__dict__.get("_deferred") is not None
                or self.__dict__.get("_num_micro_batches") is None):
            self._batch_size_seen = batch_size_of(method, args, kwargs)
        if self.__dict__.get("_deferred") is not None:
            self._plan_for(self._batch_size_seen)

    def _plan_for(self, batch_size):
        """Plans the deferred pipeline for `batch_size` (None: the one seen,
        else `DEFAULT_BATCH_SIZE`) and sets its stages."""
        deferred = self.__dict__["_deferred"]
        batch_size = (batch_size or self.__dict__.get("_batch_size_seen")
                      or DEFAULT_BATCH_SIZE)
        # Compiled by now, usually: the plan costs that loss head and
        # those optimizer slots.
        optimizer = getattr(self, "optimizer", None)
        stages, arguments, chosen = deferred.stages_for(
            batch_size, getattr(self, "loss", None),
            DEFAULT_OPTIMIZER_SLOTS if optimizer is None
            else optimizer_slots(optimizer))
        self._deferred = None
        self._set_stages(stages, **arguments)
        self.plan = chosen

    def chosen_micro_batches(self):
        """`M`: as given, else `default_micro_batches` of the batch size
        first seen (fixed from then on)."""
        if self._num_micro_batches is None:
            self._num_micro_batches = default_micro_batches(
                self.__dict__.get("_batch_size_seen") or DEFAULT_BATCH_SIZE,
                len(self._stage_layers))
        return self._num_micro_batches
