"""keras_pipe: GPipe pipeline parallelism for Keras 3 on TensorFlow."""

import os


def _check_backend(backend):
    if backend != "tensorflow":
        raise ImportError(
            "keras_pipe needs the TensorFlow backend of Keras, but the "
            f"backend is {backend!r}. Set KERAS_BACKEND=tensorflow before "
            "importing keras.")


# Checked before importing keras too: another backend may fail to import.
_check_backend(os.environ.get("KERAS_BACKEND", "tensorflow"))

import keras  # noqa: E402

_check_backend(keras.backend.backend())

from keras_pipe import layers, schedule  # noqa: E402
from keras_pipe.callbacks import BackupAndRestore  # noqa: E402
from keras_pipe.cluster import connect  # noqa: E402
from keras_pipe.layers import DeferredBatchNormalization  # noqa: E402
from keras_pipe.local import local_workers  # noqa: E402
from keras_pipe.model import PipelineModel  # noqa: E402
from keras_pipe.placement import logical_cpu_devices  # noqa: E402
from keras_pipe.planner import plan  # noqa: E402
from keras_pipe.saving import load_model  # noqa: E402
from keras_pipe.verify import VerificationReport, verify  # noqa: E402

__all__ = ["BackupAndRestore", "DeferredBatchNormalization", "PipelineModel",
           "VerificationReport", "connect", "layers", "load_model",
           "local_workers", "logical_cpu_devices", "plan", "schedule",
           "verify"]
__version__ = "0.1.0"
