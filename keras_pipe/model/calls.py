"""How `PipelineModel`'s `fit`, `evaluate` and `predict` calls run.

Each call first lets the pipeline make the choices left to it from the
call's batch size (`FirstBatchChoices.see_batch`). A worker lost mid-call
ends it with an error naming the task (`cluster.run`), or costs `fit` the
steps since its last backup (`keras_pipe.distributed.recovery`); a plain
call when every stage is local. Array data of `fit`, `evaluate` and
`predict` are batched on `data_device` when one is set
(`keras_pipe.placed_data`); the error diagnosis replays the call's own
arguments.
"""

from keras_pipe import _validation, placed_data, reporting
from keras_pipe.distributed import cluster, recovery

__all__ = ["Calls"]


class Calls:
    """`PipelineModel`'s Keras entry points (a mixin before
    `keras.Model`)."""

    def fit(self, *args, **kwargs):
        _validation.check_data("fit", args, kwargs)
        # TensorBoard(write_graph=True) gets the model config as Keras
        # writes it for a Functional model (`keras_pipe.reporting`).
        self.see_batch("fit", args, kwargs)
        args, kwargs = reporting.with_config_writers_in(args, kwargs)
        # With a BackupAndRestore, a lost worker costs the steps since
        # the last backup, not the call (`recovery`).
        return recovery.fit(self, self._resolved_devices, self._placed_fit,
                            args, kwargs)

    def _placed_fit(self, *args, **kwargs):
        args, kwargs = placed_data.placed_call(
            "fit", self, self.data_device, args, kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        _validation.check_data("evaluate", args, kwargs)
        self.see_batch("evaluate", args, kwargs)
        return cluster.run(self._resolved_devices, "evaluate",
                           self._placed_evaluate, *args, **kwargs)

    def _placed_evaluate(self, *args, **kwargs):
        args, kwargs = placed_data.placed_call(
            "evaluate", self, self.data_device, args, kwargs)
        return self._inference_call(super().evaluate, *args, **kwargs)

    @property
    def data_device(self):
        """Where `fit`, `evaluate` and `predict` batch array data (numpy
        arrays,
        tensors; not datasets or generators), or None for this process.

        Defaults to None: this process, as Keras does. `"auto"` batches
        them on the first stage's device if it is on a remote worker
        (`keras_pipe.placed_data`), a device string on that device: each
        batch is then cut there instead of being sent from this process at
        every step, and the arrays are copied there once per call (that
        worker holds them while the call runs, which the memory model and
        `memory_budget` do not count: opt in only for arrays small next to
        that worker's memory). It saves this process the CPU of sending
        each batch (docs/performance.md).
        """
        chosen = getattr(self, "_data_device", None)
        if chosen != "auto":
            return chosen
        first = self._resolved_devices[0]
        return first if cluster.is_remote(first) else None

    @data_device.setter
    def data_device(self, device):
        if device is not None and not isinstance(device, str):
            raise TypeError(
                "data_device must be a device string, 'auto' or None. "
                f"Received: data_device={device!r}")
        self._data_device = device

    def train_on_batch(self, *args, **kwargs):
        self.see_batch("train_on_batch", args, kwargs)
        return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        self.see_batch("test_on_batch", args, kwargs)
        return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, *args, **kwargs):
        self.see_batch("predict_on_batch", args, kwargs)
        return super().predict_on_batch(*args, **kwargs)

    def predict(self, *args, **kwargs):
        _validation.check_data("predict", args, kwargs)
        self.see_batch("predict", args, kwargs)
        return cluster.run(self._resolved_devices, "predict",
                           self._keras_predict, *args, **kwargs)
