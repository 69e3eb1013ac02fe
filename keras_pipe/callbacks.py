"""BackupAndRestore that resumes an interrupted fit at the exact batch.

`keras.callbacks.BackupAndRestore` with `save_freq=<int>` backs up in the
middle of an epoch, but on restart it only restores the epoch number: the
interrupted epoch runs again from its first batch, on top of weights that
have already seen part of it. For a pipeline trained for hours between
preemptions this both wastes work and changes the result. This subclass
records how many batches of the epoch were done, in the same file as the
weights (written to a temporary file, fsynced, then renamed:
`keras_pipe.saving.files.write_atomically`, so a crash never leaves weights and
position out of step), and on restart skips those batches: the
data they would have used is drawn and dropped, and training goes on from
the next one. With a data order that depends on the epoch only (a fixed
dataset, `shuffle=False`, or a shuffle with a fixed seed), the resumed fit
ends with the same weights as an uninterrupted one.

The position holds the running totals of the metrics too (the loss's mean,
accuracy, ...), put back after the skipped batches, so the resumed epoch's
logs are those of an uninterrupted run, not of its last batches only.
Neither depends on the cut: a backup taken with `K` stages resumes on
another number of stages or devices (weights and optimizer slots are saved
by layer, in the order of the model's variables).
"""

import json
import os
import shutil

import h5py
import keras

from keras_pipe import _compat
from keras_pipe.saving import checksums
from keras_pipe.saving import files as saving
from keras_pipe.timeline import Timeline  # noqa: F401  (re-exported)

__all__ = ["BackupAndRestore", "Timeline"]

_ATTRIBUTE = "keras_pipe_resume"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with an exact mid-epoch resume.

    Works with any Keras model; a `PipelineModel` saves its seed generator
    states too, so Dropout draws the same masks after the restart. With
    stages on remote workers and `save_freq` a number of batches, a worker
    lost during `fit` costs the batches since the last backup, not the
    call: once the worker is back at its address (`local_workers(...,
    restart=True)`, or its host's supervisor), the same `fit` call restores
    the backup and goes on (`keras_pipe.distributed.recovery`).

    ```python
    backup = keras_pipe.BackupAndRestore("/ckpt/backup", save_freq=100)
    model.fit(dataset, epochs=10, callbacks=[backup])   # preempted
    # in the new process, same model code, same call:
    model.fit(dataset, epochs=10, callbacks=[backup])   # goes on from there
    ```

    Args:
        backup_dir: directory of the backup.
        save_freq: `"epoch"` or a number of batches between backups.
            Defaults to `"epoch"`.
        double_checkpoint: keep the previous backup too. Defaults to `False`.
        delete_checkpoint: delete the backup when training ends. Defaults
            to `True`.

    Raises:
        ValueError: if `save_freq` is neither `"epoch"` nor an int, or (at
            restore) the backup's position does not match its optimizer
            step count.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False,
                 delete_checkpoint=True):
        super().__init__(backup_dir, save_freq=save_freq,
                         double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._steps_done = 0
        self._skip = 0
        self._resume_steps = 0
        self._train_function = None
        self.saves = 0  # backups written by this callback object
        self.saved_iterations = None  # optimizer steps of the last one
        self._metrics_to_restore = None

    @property
    def weights_path(self):
        """The backup's weights file (`<backup_dir>/latest.weights.h5`)."""
        return self._weights_path

    @property
    def resumed_steps(self):
        """Batches of the current epoch that the restore skipped."""
        return self._resume_steps

    def save_if_missing(self):
        """Writes a backup now if none exists (the start of a run)."""
        if not os.path.exists(self._weights_path):
            self._save_model()

    # ------------------------------------------------------------- restore

    def _load_model(self):
        if os.path.exists(self._weights_path):
            # A PipelineModel's load_weights checks too; any model here.
            with h5py.File(self._weights_path, "r") as f:
                checksums.verify(f, repr(self._weights_path))
        super()._load_model()
        self._skip = 0
        self._batches_seen_since_last_saving = 0
        self._metrics_to_restore = None
        if not os.path.exists(self._weights_path):
            return
        with h5py.File(self._weights_path, "r") as f:
            position = f.attrs.get(_ATTRIBUTE)
        if position is None:
            return
        position = json.loads(position)
        optimizer = self.model.optimizer
        if optimizer is not None and int(optimizer.iterations.numpy()) != \
                position["iterations"]:
            raise ValueError(
                f"The backup {self._weights_path!r} says it was written after "
                f"{position['iterations']} optimizer steps, but its optimizer "
                f"state holds {int(optimizer.iterations.numpy())}. Delete "
                f"{self.backup_dir!r} to train from the start.")
        epoch, steps = position["epoch"], position["steps"]
        if steps and steps == (self.params or {}).get("steps"):
            epoch, steps = epoch + 1, 0  # Saved after the epoch's last batch.
        _compat.set_initial_epoch(self.model, epoch)
        self._current_epoch = epoch
        self._skip = steps
        if steps:
            self._metrics_to_restore = position.get("metrics")

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._steps_done = self._resume_steps = self._skip
        if self._skip:
            self._wrap_train_function()

    def _wrap_train_function(self):
        original = self.model.train_function
        self._train_function = original
        steps = self.model.steps_per_execution or 1

        def skipping(iterator):
            # Draw and drop the data of batches done before the interruption.
            for _ in range(min(steps, self._skip)):
                next(iterator)
            self._skip -= min(steps, self._skip)
            if not self._skip:
                self.model.train_function = original
                self._restore_metrics(iterator)
            return {}  # The metrics hold these batches only if restored.

        self.model.train_function = skipping

    def _restore_metrics(self, iterator):
        """Puts the metrics' running totals of the backup back."""
        saved, self._metrics_to_restore = self._metrics_to_restore, None
        # A PipelineModel builds its compiled metrics at its first step,
        # which has not run in a new process: built here from the data's
        # spec, as that step would.
        build = getattr(self.model, "_build_from_data_spec", None)
        spec = getattr(iterator, "element_spec", None)
        if build is not None and spec is not None:
            build(spec)
        variables = self.model.metrics_variables
        if saved is None or len(saved) != len(variables):
            return
        for variable, value in zip(variables, saved):
            variable.assign(value)

    def on_train_end(self, logs=None):
        if self._train_function is not None:
            self.model.train_function = self._train_function
            self._train_function = None
        # Keras leaves the resumed epoch on the model; a later fit would
        # start there.
        _compat.set_initial_epoch(self.model, None)
        super().on_train_end(logs)

    # ---------------------------------------------------------------- save

    def on_train_batch_end(self, batch, logs=None):
        self._steps_done = batch + 1
        if batch < self._resume_steps:
            # A skipped batch: the weights are those of the backup already.
            self._last_batch_seen = batch
            return
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._steps_done = 0
        self._resume_steps = 0
        super().on_epoch_end(epoch, logs)

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        if self.double_checkpoint and os.path.exists(self._weights_path):
            shutil.copyfile(self._weights_path, self._prev_weights_path)
        optimizer = self.model.optimizer
        position = {
            "epoch": self._current_epoch,
            "steps": self._steps_done,
            "iterations": (int(optimizer.iterations.numpy())
                           if optimizer is not None else None),
            "metrics": [v.numpy().tolist()
                        for v in self.model.metrics_variables],
        }

        # Made in memory, with checksums: a full disk is a clean OSError.
        saving.write_weights_file(self._weights_path, self.model,
                                  {_ATTRIBUTE: json.dumps(position)})
        # Keras' own metadata file, read by the stock restore.
        if self.double_checkpoint and os.path.exists(
                self._training_metadata_path):
            shutil.copyfile(self._training_metadata_path,
                            self._prev_training_metadata_path)

        def write_metadata(path):
            with open(path, "w") as f:
                json.dump({"epoch": self._current_epoch,
                           "batch": self._last_batch_seen}, f)

        saving.write_atomically(self._training_metadata_path, write_metadata)
        self.saves += 1
        self.saved_iterations = position["iterations"]
