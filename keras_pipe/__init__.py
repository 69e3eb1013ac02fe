"""keras_pipe: GPipe pipeline parallelism for Keras 3 on TensorFlow.

The public names are `__all__`. They load on first use (PEP 562): importing
the package imports neither Keras nor TensorFlow, so a worker process
(`python -m keras_pipe.distributed.worker`, which runs TF's C++ runtime
alone) does not hold TF's Python package. The first use of a name other
than `schedule` registers `PipelineModel` with Keras' serialization.
"""

import importlib
import os
from typing import TYPE_CHECKING

from keras_pipe import _validation

__version__ = "0.1.0"

__all__ = ["BackupAndRestore", "DeferredBatchNormalization", "PipelineModel",
           "VerificationReport", "callbacks", "connect", "layers",
           "load_model", "local_workers", "logical_cpu_devices", "plan",
           "schedule", "verify"]

# Public name -> (module, attribute); attribute None: the module itself.
_EXPORTS = {
    "BackupAndRestore": ("keras_pipe.callbacks", "BackupAndRestore"),
    "DeferredBatchNormalization": ("keras_pipe.layers",
                                   "DeferredBatchNormalization"),
    "PipelineModel": ("keras_pipe.model", "PipelineModel"),
    "VerificationReport": ("keras_pipe.verification", "VerificationReport"),
    "callbacks": ("keras_pipe.callbacks", None),
    "connect": ("keras_pipe.distributed.cluster", "connect"),
    "layers": ("keras_pipe.layers", None),
    "load_model": ("keras_pipe.saving.files", "load_model"),
    "local_workers": ("keras_pipe.distributed.local", "local_workers"),
    "logical_cpu_devices": ("keras_pipe.engine.placement",
                            "logical_cpu_devices"),
    "plan": ("keras_pipe.planning.planner", "plan"),
    "schedule": ("keras_pipe.engine.schedule", None),
    "verify": ("keras_pipe.verification", "verify"),
}


# Checked before anything imports keras: another backend may fail to import
# (`keras_pipe._compat` checks the backend Keras chose, from its config too).
_validation.check_backend(os.environ.get("KERAS_BACKEND", "tensorflow"))


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_pipe' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    if module != "keras_pipe.engine.schedule":
        # Every other name uses Keras: its first use also registers
        # `PipelineModel` with Keras' serialization, so that
        # `keras_pipe.load_model` and `keras.saving.load_model` find it.
        importlib.import_module("keras_pipe.model")
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static readers (type checkers, the API docs) see
    from keras_pipe import callbacks, layers
    from keras_pipe.callbacks import BackupAndRestore
    from keras_pipe.distributed.cluster import connect
    from keras_pipe.distributed.local import local_workers
    from keras_pipe.engine import schedule
    from keras_pipe.engine.placement import logical_cpu_devices
    from keras_pipe.layers import DeferredBatchNormalization
    from keras_pipe.model import PipelineModel
    from keras_pipe.planning.planner import plan
    from keras_pipe.saving.files import load_model
    from keras_pipe.verification import VerificationReport, verify
