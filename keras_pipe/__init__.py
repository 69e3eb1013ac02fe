"""keras_pipe: GPipe pipeline parallelism for Keras 3 on TensorFlow."""

import importlib.abc as _abc
import os
import sys as _sys

_WORKER = "keras_pipe.distributed.worker"


def _main_module_is_worker():
    """Whether this import is Python locating `python -m` + the worker.

    A worker process (`python -m keras_pipe.distributed.worker`) runs
    TF's C++ runtime alone (`keras_pipe.distributed.runtime`): importing
    keras here, and with it TF's Python package, would make every idle
    worker hold ~270 MiB more resident memory for nothing. Python imports
    this package first while it locates the `-m` module, and only then is
    `sys.argv[0]` `"-m"`; `sys.orig_argv` names the module.
    """
    if _sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(_sys, "orig_argv", []))
    for k, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return argv[k + 1:k + 2] == [_WORKER]
        if arg.startswith("-m"):
            return arg[2:] == _WORKER
    return False


def _check_backend(backend):
    if backend != "tensorflow":
        raise ImportError(
            "keras_pipe needs the TensorFlow backend of Keras, but the "
            f"backend is {backend!r}. Set KERAS_BACKEND=tensorflow before "
            "importing keras.")


if _main_module_is_worker():
    __all__ = []
else:
    # Checked before importing keras too: another backend may fail to import.
    _check_backend(os.environ.get("KERAS_BACKEND", "tensorflow"))

    import keras  # noqa: E402

    _check_backend(keras.backend.backend())

    from keras_pipe import calibration as _calibration  # noqa: E402
    from keras_pipe import layers  # noqa: E402
    from keras_pipe.callbacks import BackupAndRestore  # noqa: E402
    from keras_pipe.distributed.cluster import connect  # noqa: E402
    from keras_pipe.distributed.local import local_workers  # noqa: E402
    from keras_pipe.engine import schedule  # noqa: E402
    from keras_pipe.engine.placement import logical_cpu_devices  # noqa: E402
    from keras_pipe.layers import DeferredBatchNormalization  # noqa: E402
    from keras_pipe.model import PipelineModel  # noqa: E402
    from keras_pipe.planning import profiling as _profiling  # noqa: E402
    from keras_pipe.planning.planner import plan  # noqa: E402
    from keras_pipe.saving.files import load_model  # noqa: E402
    from keras_pipe.verify import VerificationReport, verify  # noqa: E402

    # The planner's step costs are measured by training a tiny pipeline, which
    # only this level (above the Keras model) can build.
    _profiling.set_overhead_probe(_calibration.measure)
    _profiling.set_step_probe(_calibration.step_seconds)

    __all__ = ["BackupAndRestore", "DeferredBatchNormalization", "PipelineModel",
               "VerificationReport", "connect", "layers", "load_model",
               "local_workers", "logical_cpu_devices", "plan", "schedule",
               "verify"]
    __version__ = "0.1.0"


    # `keras_pipe.schedule` stays importable under its public name; the other
    # modules that moved into sub-packages fail with their new place.
    _sys.modules.setdefault("keras_pipe.schedule", schedule)
    _MOVED = {'attached': 'engine.attached',
     'autoplan': 'planning.autoplan',
     'balance': 'planning.balance',
     'bind': 'distributed.bind',
     'budget': 'planning.budget',
     'building': 'engine.building',
     'cluster': 'distributed.cluster',
     'colocation': 'engine.colocation',
     'diagnosis': 'distributed.diagnosis',
     'executor': 'engine.executor',
     'export': 'saving.export',
     'gradients': 'engine.gradients',
     'graph': 'planning.graph',
     'heap': 'distributed.heap',
     'internals': '_compat',
     'keyed_random': 'engine.keyed_random',
     'local': 'distributed.local',
     'losses': 'engine.losses',
     'memory': 'planning.memory',
     'microbatch': 'engine.microbatch',
     'partition': 'planning.partition',
     'placement': 'engine.placement',
     'planner': 'planning.planner',
     'profiling': 'planning.profiling',
     'replicas': 'engine.replicas',
     'saving': 'saving.files',
     'simulator': 'planning.simulator',
     'stage': 'engine.stage',
     'tensors': 'engine.tensors',
     'validation': '_validation',
     'weight_grad': 'engine.weight_grad',
     'worker': 'distributed.worker'}


    class _MovedModules(_abc.MetaPathFinder):
        """Names the new place of a module that moved into a sub-package."""

        def find_spec(self, fullname, path=None, target=None):
            del path, target
            old = fullname[len("keras_pipe."):] if fullname.startswith(
                "keras_pipe.") else None
            if old in _MOVED:
                raise ImportError(
                    f"{fullname} moved to keras_pipe.{_MOVED[old]} (keras_pipe "
                    "0.2 put its modules into sub-packages). Import the public "
                    "names from keras_pipe itself (keras_pipe.__all__), or "
                    f"import keras_pipe.{_MOVED[old]}.", name=fullname)
            return None


    _sys.meta_path.insert(0, _MovedModules())
