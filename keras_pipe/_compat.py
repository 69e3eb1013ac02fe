"""Keras and TensorFlow internals, behind one door.

keras_pipe needs a few things that Keras and TensorFlow do not offer as
public API. Every `keras.src` / `tensorflow.python` import and every patch
of a Keras object is here, so that a Keras or TF upgrade breaks one module,
loudly: the versions it was written for are checked at import, and
`tests/test_internals.py` has a test per hook.

Written for Keras 3.15.x and TensorFlow 2.21.x. Code copied from Keras
(gradient clipping, the loss-scale optimizer's unscaling) is Keras 3.15.0's,
with only the device placement changed, and says so where it stands.
"""

import contextlib

import keras
import tensorflow as tf

from keras_pipe import _validation

SUPPORTED = {"keras": "3.15", "tensorflow": "2.21"}


def check_versions(versions):
    """Raises ImportError unless each version is in the supported series.

    Args:
        versions: `{"keras": "3.15.0", "tensorflow": "2.21.0"}`.
    """
    bad = [f"{name} {version}" for name, version in versions.items()
           if not (version == SUPPORTED[name]
                   or version.startswith(SUPPORTED[name] + "."))]
    if bad:
        raise ImportError(
            f"keras_pipe supports Keras {SUPPORTED['keras']}.x and TensorFlow "
            f"{SUPPORTED['tensorflow']}.x; found {', '.join(bad)}. Install "
            f"'keras=={SUPPORTED['keras']}.*' and "
            f"'tensorflow=={SUPPORTED['tensorflow']}.*' (see setup.py).")


check_versions({"keras": keras.__version__, "tensorflow": tf.__version__})
# The backend Keras chose (from KERAS_BACKEND or its config file).
_validation.check_backend(keras.backend.backend())

# Imported after the check: on another version these may not exist.
from keras.src.backend import get_keras_mask, set_keras_mask  # noqa: E402
from keras.src.backend.common import global_state  # noqa: E402
from keras.src.backend.tensorflow import random as tf_random  # noqa: E402
from keras.src.losses import loss as _loss_lib  # noqa: E402
from keras.src.models.functional import (  # noqa: E402
    Functional,
    operation_fn,
    unpack_singleton,
)
from keras.src.random.seed_generator import SeedGenerator, draw_seed  # noqa: E402
from keras.src.saving import saving_lib as _saving_lib  # noqa: E402
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402
from keras.src.trainers.data_adapters import array_slicing  # noqa: E402
from keras.src.trainers.data_adapters.array_data_adapter import (  # noqa: E402
    ArrayDataAdapter,
    can_convert_arrays,
)
from keras.src.trainers.data_adapters.data_adapter import DataAdapter  # noqa: E402
from keras.src.utils import io_utils as _io_utils  # noqa: E402
from keras.src.utils import naming as _naming  # noqa: E402
from keras.src.utils import tracking as _tracking  # noqa: E402
from tensorflow.python.eager import cancellation  # noqa: E402
from tensorflow.python.eager import context as _tf_context  # noqa: E402
from tensorflow.python.eager import record as _tf_record  # noqa: E402
from tensorflow.python.framework import op_callbacks as _op_callbacks  # noqa: E402

# Keras' Functional graph: the class, how it calls one operation, and how
# it unwraps a single output (`keras_pipe.planning.graph`, `keras_pipe.saving.files`).
# `KerasSaveable`: the base of objects Keras saving walks (seed states).
# `cancellation`: TF's cancellation manager (`keras_pipe.distributed.cluster`).
# `DataAdapter`, `ArrayDataAdapter`, `can_convert_arrays`: how Keras' `fit`
# takes its data; an adapter passed as `x` is used as it is
# (`keras_pipe.placed_data`).
to_snake_case = _naming.to_snake_case
ask_to_proceed_with_overwrite = _io_utils.ask_to_proceed_with_overwrite
no_automatic_tracking = _tracking.DotNotTrackScope
get_server_def = _tf_context.get_server_def


def disable_thread_spinning():
    """Idle threads of TF's pools sleep at once instead of spinning.

    Sets `experimental.disable_thread_spinning` in this process's context
    config, which `tf.config.experimental_connect_to_cluster` also copies
    into the contexts it creates on the workers. Takes effect if set
    before TF starts in this process.
    """
    from tensorflow.core.protobuf import config_pb2
    context = _tf_context.context()
    if context._config is None:
        context._config = config_pb2.ConfigProto()
    context._config.experimental.disable_thread_spinning = True


def sync_executors():
    """Waits until every op this process sent to a worker has run.

    An eager op on a remote device that returns nothing (`MakeIterator`) is
    only queued there; a function run next may start before it
    (`keras_pipe.placed_data`).
    """
    _tf_context.context().sync_executors()


train_validation_split = array_slicing.train_validation_split


def runtime_started():
    """Whether this process's TF runtime has started: its devices are then
    fixed (logical devices can no longer be made)."""
    from tensorflow.python.eager import context
    return bool(context.context()._initialized)


def onednn_enabled():
    """Whether this process's TF runs oneDNN's kernels (fixed at import).

    TF reads `TF_ENABLE_ONEDNN_OPTS` once, when it is imported; its default
    depends on the CPU (on by default on some Intel CPUs, off on AMD's: the
    "oneDNN off on AMD" trap, docs/design.md). `keras_pipe.local_workers`
    passes it on to its workers.
    """
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


@contextlib.contextmanager
def op_callback(callback):
    """Within: `callback` sees every op this thread builds (TF's op
    callbacks, the hook of `tf.debugging.experimental.enable_dump_debug_info`)
    and may return replacement outputs, which later ops and the gradient
    tapes take instead (`keras_pipe.engine.products`).

    `callback(op_type, inputs, attrs, outputs, op_name=None, graph=None)`
    returns None or a list of tensors, one per output.
    """
    _op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        _op_callbacks.remove_op_callback(callback)


def stop_recording():
    """A context in which no gradient tape of this thread records ops."""
    return _tf_record.stop_recording()


def set_initial_epoch(model, epoch):
    """Makes `fit` start at `epoch` (what Keras' BackupAndRestore sets)."""
    model._initial_epoch = epoch


def save_weights_to(model, buffer):
    """Keras' `save_weights_only` into an `io.BytesIO` instead of a path.

    The same store and walk as `model.save_weights` (Keras 3.15
    `saving_lib.save_weights_only`), so the bytes are a `.weights.h5`
    file; nothing touches the disk (`keras_pipe.saving.files`).
    """
    if not model.built:
        raise ValueError(
            "You are saving a model that has not yet been built. Try "
            "building the model first by calling it on some data or by "
            "using `build()`.")
    store = _saving_lib.H5IOStore(buffer, mode="w")
    try:
        _saving_lib._save_state(model, weights_store=store, assets_store=None,
                                inner_path="", visited_saveables=set())
    finally:
        store.close()


def keras_global_state():
    """Keras' global state (scopes, seed generator) as a dict."""
    return dict(vars(global_state.GLOBAL_STATE_TRACKER))


def set_keras_global_attribute(name, value):
    """Sets one attribute of Keras' global state (in another thread)."""
    global_state.set_global_attribute(name, value)

__all__ = ["ArrayDataAdapter", "DataAdapter", "Functional", "KerasSaveable",
           "SUPPORTED", "SeedGenerator",
           "draw_seed", "tf_random",
           "ask_to_proceed_with_overwrite", "called_graph", "can_convert_arrays",
           "cancellation", "check_versions", "disable_thread_spinning",
           "eager_scope", "get_keras_mask",
           "get_server_def", "keras_global_state", "no_automatic_tracking",
           "operation_fn", "reduce_weighted_values",
           "reinitialize_variable", "replaced_losses", "save_weights_to",
           "scale_loss_for_distribution",
           "set_initial_epoch", "set_keras_global_attribute", "set_keras_mask",
           "sync_executors",
           "to_snake_case", "train_validation_split", "unpack_singleton"]

reduce_weighted_values = _loss_lib.reduce_weighted_values
scale_loss_for_distribution = _loss_lib.scale_loss_for_distribution


@contextlib.contextmanager
def eager_scope():
    """Leaves Keras' symbolic/stateless scopes and any FuncGraph.

    Keras builds a model inside `backend.compute_output_spec`, where new
    variables are deferred and later created outside any `tf.device` scope.
    Stages must be built eagerly under their device instead.
    """
    names = ("stateless_scope", "symbolic_scope")
    saved = {n: global_state.get_global_attribute(n) for n in names}
    for n in names:
        global_state.set_global_attribute(n, None)
    try:
        with tf.init_scope():
            yield
    finally:
        for n, value in saved.items():
            global_state.set_global_attribute(n, value)


def reinitialize_variable(variable, value):
    """Re-creates the tf.Variable behind a Keras variable, in the device scope.

    `_initialize` is the one place where Keras' TF backend creates the
    underlying `tf.Variable`; the Keras variable, its name and path stay.
    """
    variable._initialize(value)


def rekey_optimizer(optimizer, keys):
    """Points the optimizer's tables at re-created variables.

    Keras keys a variable's place in its optimizer by the id of the
    `tf.Variable` behind it (`_var_key`); `reinitialize_variable` makes a
    new one. `keys` maps each old key to the new one.
    """
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        rekey_optimizer(inner, keys)
    optimizer._trainable_variables_indices = {
        keys.get(key, key): index for key, index in
        optimizer._trainable_variables_indices.items()}
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded:
        optimizer._exclude_from_weight_decay = {keys.get(k, k)
                                                for k in excluded}
    optimizer._exclude_from_weight_decay_cache = {}


def variable_key(optimizer, variable):
    """The key of `variable` in `optimizer`'s tables (`rekey_optimizer`)."""
    return optimizer._var_key(variable)


@contextlib.contextmanager
def replaced_losses(compile_loss, make):
    """Replaces each loss of a `CompileLoss` by `make(n, loss)` meanwhile.

    Keras still matches outputs, targets, per-output sample weights and
    loss weights; the losses it calls are ours for the length of the block.
    """
    originals = compile_loss._flat_losses
    compile_loss._flat_losses = [
        entry._replace(loss=make(n, entry.loss))
        for n, entry in enumerate(originals)]
    try:
        yield len(originals)
    finally:
        compile_loss._flat_losses = originals


@contextlib.contextmanager
def _swapped(obj, name, value):
    """`obj.name = value` while the block runs, bypassing Keras tracking."""
    saved = obj.__dict__[name]
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        object.__setattr__(obj, name, saved)


# ------------------------------------------- private attributes, by name
# Every read or write of a private attribute of a Keras object goes through
# one of these (`tests/test_structure.py` checks it).


def flatten_layers(layer, include_self=True, recursive=True):
    """`layer` and its sub-layers, as Keras walks them."""
    return layer._flatten_layers(include_self=include_self,
                                 recursive=recursive)


def keras_logits(tensor):
    """The logits Keras keeps beside a softmax/sigmoid output, or None."""
    return getattr(tensor, "_keras_logits", None)


def set_keras_logits(tensor, logits):
    """Attaches `logits` to `tensor` as Keras' activations do."""
    tensor._keras_logits = logits


def sequential_graph(model):
    """The Functional graph behind a Sequential model (None without Input)."""
    return model._functional


def run_through_graph(functional, inputs, operation_fn):
    """Runs a Functional graph, calling `operation_fn(op)` for each op."""
    return functional._run_through_graph(inputs, operation_fn=operation_fn)


def standardize_inputs(functional, inputs):
    """Flattens and converts model inputs as `Functional.call` does."""
    return functional._standardize_inputs(inputs)


def inputs_struct(functional):
    """The nested structure of a Functional model's inputs."""
    return functional._inputs_struct


def outputs_struct(functional):
    """The nested structure of a Functional model's outputs."""
    return functional._outputs_struct


def nodes_by_depth(functional):
    """`{depth: [Node]}` of a Functional graph."""
    return functional._nodes_by_depth


def build_shapes(layer):
    """The shapes `layer.build` was called with, as Keras records them."""
    return layer._build_shapes_dict


def object_type(layer):
    """Keras' saving name of `layer`'s kind ("Functional", "Sequential")."""
    return layer._obj_type()


def seed_generators(layer):
    """The `SeedGenerator`s `layer` itself tracks."""
    return layer._seed_generators


def own_variables(layer):
    """The variables `layer` tracks itself, trainable first."""
    return layer._trainable_variables + layer._non_trainable_variables


def compute_loss(model, **kwargs):
    """Keras' `Trainer._compute_loss` (the compiled loss, loss metrics)."""
    return model._compute_loss(**kwargs)


def eval_epoch_iterator(model):
    """The epoch iterator `fit` keeps for its validation data, or None."""
    return getattr(model, "_eval_epoch_iterator", None)


def build_cache(task, token_ids):
    """A KerasHub causal LM's `(hidden states, cache)` for `token_ids`:
    the empty cache its `generate` starts from."""
    return task._build_cache(token_ids)


def compiled_state(model):
    """Keras' `CompileLoss` and `CompileMetrics` of a compiled model, each
    None when it was compiled without (variables made on `build(y,
    y_pred)`)."""
    return [getattr(model, "_compile_loss", None),
            getattr(model, "_compile_metrics", None)]


def optimizer_hook(optimizer, name):
    """One of the per-step hooks of a Keras optimizer, by private name."""
    return getattr(optimizer, name)


def set_optimizer_hooks(optimizer, **hooks):
    """Replaces per-step hooks of `optimizer` (on the object, not its class)."""
    for name, hook in hooks.items():
        setattr(optimizer, name, hook)


def optimizer_iterations(optimizer):
    """The optimizer's step counter variable."""
    return optimizer._iterations


def swapped_iterations(optimizer, value):
    """The optimizer reads `value` as its step counter meanwhile."""
    return _swapped(optimizer, "_iterations", value)


def optimizer_variables(optimizer):
    """The trainable variables the optimizer was built for."""
    return optimizer._trainable_variables


def overwrites_with_gradient(optimizer, variable):
    """Whether `variable` is overwritten with its gradient (not updated)."""
    return optimizer._overwrite_variable_with_gradient(variable)


def clip_by_norm(optimizer, gradient):
    """Keras' clip of one gradient to the optimizer's `clipnorm`."""
    return optimizer._clip_by_norm(gradient)


def add_control_inputs(op, inputs):
    """Makes graph op `op` wait for `inputs` (ops), after it was built."""
    op._add_control_inputs(list(inputs))


def cast_seed(seed):
    """A drawn seed as Keras' TF random backend casts it."""
    return tf_random._cast_seed(seed)


def concrete_noise_shape(inputs, noise_shape):
    """Dropout's noise shape with None entries filled from `inputs`."""
    return tf_random._get_concrete_noise_shape(inputs, noise_shape)


def called_graph(op):
    """The `FuncGraph` a function-call op runs (`PartitionedCall`,
    `StatefulPartitionedCall`), or None (another op, or a function known
    only by its FunctionDef). Looked up in the op's graph, then in the
    graphs it is nested in (`keras_pipe.engine.gradients` walks it)."""
    try:
        name = op.get_attr("f").name
    except (ValueError, TypeError):
        return None
    graph = op.graph
    while graph is not None:
        function = graph._get_function(name)
        if function is not None:
            return getattr(function, "graph", None)
        graph = getattr(graph, "outer_graph", None)
    return None


def release_graphs_capturing(variables):
    """Lets go of the variables' buffers held by traced graphs.

    A `tf.function` graph that captured a variable holds its resource
    handle, and with it the variable's buffer on its device, for as long
    as the graph lives; a Keras train function's graph is never freed
    (its cycle runs through TF's C++ graph, which Python's collector does
    not see, and TF's gradient registry can hold it too). For every live
    `FuncGraph` that captured a handle of `variables`, this empties the
    graph and its captures: those graphs can no longer run, so call it
    only on variables that are being thrown away with every function that
    used them. Returns how many graphs it released.
    """
    import gc

    from tensorflow.python.framework import func_graph as _func_graph

    handles = set()
    for variable in variables:
        value = getattr(variable, "value", variable)
        handle = getattr(value, "handle", None)
        if handle is not None:
            handles.add(id(handle))
    released = 0
    for graph in [o for o in gc.get_objects()
                  if isinstance(o, _func_graph.FuncGraph)]:
        if not any(id(t) in handles for t in graph.external_captures):
            continue
        captures = graph._function_captures
        _func_graph.dismantle_func_graph(graph)
        for container in vars(captures).values():
            if hasattr(container, "clear"):
                container.clear()
        released += 1
    return released
