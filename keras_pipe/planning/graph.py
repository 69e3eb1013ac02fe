"""The call graph of a Keras model as an ordered list of layer calls.

A Functional model (or the graph a built `keras.Sequential` keeps inside) is
a DAG of `Node`s, one per call of a layer or op. Partitioning needs it as a
*sequence*: `read_graph` lists the calls in the order in which the model
itself runs them (deepest first, the order of `Functional.call`), so a cut
anywhere in the list is a valid pipeline cut: every tensor a call needs was
made by an earlier call or is a model input. A layer called twice (shared
weights) appears twice, as two `Call`s.

Models people build nest models: a KerasHub task calls its backbone as one
layer, a transfer-learning model calls `keras.applications.*` as one layer.
`read_graph` opens a call of a nested Functional or Sequential model (at any
depth) into the calls of its own graph, so that a cut can fall inside it;
the nested model's input tensors stand for the arguments of the call, its
outputs for the call's outputs (`Call.tensors` maps a nested graph's
KerasTensors, shared by all calls of that model, to per-call ones). A layer
with its own `call()` around other layers (a subclassed layer or model)
cannot be opened: it stays one call and is listed in `Graph.opaque`.
"""

import dataclasses

import keras

from keras_pipe import _compat

__all__ = ["Call", "Graph", "read_graph"]


@dataclasses.dataclass(eq=False)
class Call:
    """One call of a layer (or a `keras.ops` operation) in a model graph.

    Attributes:
        index: position of the call in `Graph.calls`.
        name: the operation's name, with `#2`, `#3`... for later calls of an
            operation called several times, and the names of the nested
            models it was found in (`"gpt2_backbone/transformer_layer_0"`).
        operation: the `keras.Operation` (usually a `keras.layers.Layer`).
        node: the Keras `Node` recording the call's arguments.
        tensors: `{id(KerasTensor of node): KerasTensor of the graph}` for
            the node's tensors that stand for others (inside a nested
            model); other tensors stand for themselves.
        training: the `training` arguments of the calls of the nested
            models around this call, outermost first (`None` if not given).
        opaque: why a layer with sublayers runs whole (it cannot be cut
            inside), else `None`.
    """

    index: int
    name: str
    operation: object
    node: object
    tensors: dict = dataclasses.field(default_factory=dict)
    training: tuple = ()
    opaque: object = None

    def tensor_for(self, x):
        """The graph's KerasTensor for the node's KerasTensor `x`."""
        return self.tensors.get(id(x), x)

    @property
    def inputs(self):
        """The input KerasTensors, each once, in argument order."""
        return _unique([self.tensor_for(x) for x in self.node.input_tensors])

    @property
    def outputs(self):
        """The output KerasTensors, flat."""
        return [self.tensor_for(x) for x in self.node.outputs]

    def run(self, values, training=None):
        """Runs the call on `values` ({id(KerasTensor): tensor}), in place.

        As `Functional.call`, an explicit `training` wins over the one the
        calls of enclosing nested models were given.
        """
        for value in self.training:
            if training is None:
                training = value
        local = {id(x): values[id(self.tensor_for(x))]
                 for x in self.node.input_tensors}
        args, kwargs = self.node.arguments.fill_in(local)
        outputs = _compat.operation_fn(self.operation, training=training)(
            *args, **kwargs)
        for x, y in zip(self.node.outputs, keras.tree.flatten(outputs)):
            values[id(self.tensor_for(x))] = y


@dataclasses.dataclass(eq=False)
class Graph:
    """A model's calls in execution order, with its inputs and outputs.

    Attributes:
        model: the Keras model the graph was read from.
        functional: the `Functional` that owns the graph (the model itself,
            or the one a `keras.Sequential` keeps inside).
        calls: list of `Call`, in execution order.
        inputs: flat list of the model's input KerasTensors.
        outputs: flat list of the model's output KerasTensors.
    """

    model: object
    functional: object
    calls: list
    inputs: list
    outputs: list

    @property
    def opaque(self):
        """`(call name, class name, reason)` of each call that runs whole.

        A call is opaque when its layer holds other layers but cannot be
        opened: a subclassed layer or model with its own `call()`, or a
        nested model called in a way `read_graph` does not open.
        """
        return [(c.name, type(c.operation).__name__, c.opaque)
                for c in self.calls if c.opaque]

    def standardize_inputs(self, inputs):
        """Flattens and converts model inputs as `Functional.call` does."""
        return _compat.standardize_inputs(self.functional, inputs)

    def pack_outputs(self, flat):
        """Packs flat output tensors into the model's output structure."""
        return _compat.unpack_singleton(keras.tree.pack_sequence_as(
            _compat.outputs_struct(self.functional), list(flat)))

    def output_spec(self):
        """The model's outputs as fresh KerasTensors, in its structure."""
        return self.pack_outputs(
            [keras.KerasTensor(x.shape, x.dtype) for x in self.outputs])


def _unique(tensors):
    seen, result = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            result.append(t)
    return result


def _functional_of(model):
    """The Functional that holds `model`'s graph, or raises saying why not."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "model must be a keras.Sequential or a Functional keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}")
    if isinstance(model, keras.Sequential):
        if not model.built:
            raise ValueError(
                f"The Sequential model {model.name!r} is not built, so its "
                "layers have no weights and no shapes to cut by. Start it "
                "with keras.Input(shape=...) or call "
                "model.build(input_shape) first.")
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise ValueError(
                f"The Sequential model {model.name!r} is built but has no "
                "graph: one of its layers cannot compute its output shape "
                "symbolically. Start it with keras.Input(shape=...) or pass "
                "stages to PipelineModel by hand.")
        return functional
    if not isinstance(model, _compat.Functional):
        raise TypeError(
            f"Cannot read the layer graph of {model.name!r}: it is a "
            f"subclassed keras.Model ({type(model).__name__}), whose call() "
            "is Python code. Rebuild it with the Functional API "
            "(keras.Input ... keras.Model(inputs, outputs)) or as a "
            "keras.Sequential, or pass stages to PipelineModel by hand.")
    if type(model).call is not _compat.Functional.call:
        raise TypeError(
            f"Cannot partition {model.name!r}: {type(model).__name__} "
            "overrides call(), so its layer graph may not be what it "
            "computes. Pass stages to PipelineModel by hand.")
    return model


def _check_order(functional, calls):
    """Checks that each call only needs tensors made before it."""
    known = {id(x) for x in functional.inputs}
    for call in calls:
        missing = [x.name for x in call.inputs if id(x) not in known]
        if missing:
            raise ValueError(
                f"Cannot order the layers of {functional.name!r}: "
                f"{call.name!r} needs {missing}, which no earlier layer "
                "makes. Pass stages to PipelineModel by hand.")
        known.update(id(x) for x in call.outputs)


def _sublayers(op):
    if not isinstance(op, keras.layers.Layer):
        return []
    return _compat.flatten_layers(op, include_self=False, recursive=False)


def _inner_graph(op):
    """The Functional run by a call of `op`, or `(None, why not)`."""
    if isinstance(op, keras.Sequential):
        if type(op).call is not keras.Sequential.call:
            return None, f"{type(op).__name__} overrides call()"
        if getattr(op, "_functional", None) is None:
            return None, "a Sequential model without a graph (no Input)"
        return _compat.sequential_graph(op), None
    if isinstance(op, _compat.Functional):
        if type(op).call is not _compat.Functional.call:
            return None, f"{type(op).__name__} overrides call()"
        return op, None
    if isinstance(op, keras.Model):
        return None, "a subclassed model: its call() is Python code"
    if _sublayers(op):
        return None, (f"a layer with its own call() around "
                      f"{len(_sublayers(op))} sublayer(s)")
    return None, None


def _flat_arguments(inner, node):
    """The KerasTensors a nested call feeds `inner`'s inputs, or a reason.

    Mirrors the structure matching of `Functional._standardize_inputs`; a
    call that would need conversion (dtype, rank) or extra arguments (masks)
    is not opened.
    """
    args, kwargs = node.arguments.args, node.arguments.kwargs
    extra = sorted(k for k in kwargs if k not in ("training", "mask"))
    if len(args) != 1 or extra:
        return None, "called with other arguments than its inputs"
    if any(m is not None for m in keras.tree.flatten(kwargs.get("mask"))):
        return None, "called with an explicit mask"
    training = kwargs.get("training")
    if training is not None and not isinstance(training, bool):
        return None, "called with a tensor as `training`"
    struct, arg = _compat.inputs_struct(inner), args[0]
    if isinstance(arg, keras.KerasTensor):
        flat = [arg]
    elif isinstance(arg, dict) and not isinstance(struct, dict):
        names = [x.name for x in inner.inputs]
        if not set(names) <= set(arg):
            return None, "called with a dict that does not name its inputs"
        flat = [arg[n] for n in names]
    else:
        if isinstance(arg, dict) and set(arg) != set(struct):
            return None, "called with a dict of other keys than its inputs"
        flat = keras.tree.flatten(arg)
    if len(flat) != len(inner.inputs):
        return None, "called with another number of tensors than its inputs"
    for outer, x in zip(flat, inner.inputs):
        if not isinstance(outer, keras.KerasTensor) or (
                outer.dtype != x.dtype or len(outer.shape) != len(x.shape)
                or outer.sparse != x.sparse):
            return None, "its inputs would be converted (dtype or rank)"
    return flat, None


class _Reader:
    """Lists the calls of a Functional, opening nested models."""

    def __init__(self):
        self.calls, self.counts, self.alias = [], {}, {}
        self.num_scopes = 0

    def ref(self, scope, x):
        """The graph's KerasTensor for `x` of the nested graph `scope`."""
        key = (scope, id(x))
        if key not in self.alias:
            self.alias[key] = x if scope == 0 else keras.KerasTensor(
                x.shape, x.dtype, sparse=x.sparse, record_history=False,
                name=x.name)
        return self.alias[key]

    def read(self, functional, scope=0, training=(), prefix=""):
        by_depth = _compat.nodes_by_depth(functional)
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                op = node.operation
                inner, why = _inner_graph(op)
                if inner is not None:
                    flat, why = _flat_arguments(inner, node)
                    if flat is not None:
                        self.num_scopes += 1
                        sub = self.num_scopes
                        for x, outer in zip(inner.inputs, flat):
                            self.alias[(sub, id(x))] = self.ref(scope, outer)
                        self.read(inner, sub, training + (
                            node.arguments.kwargs.get("training"),),
                            f"{prefix}{op.name}/")
                        for x, y in zip(node.outputs, inner.outputs):
                            self.alias[(scope, id(x))] = self.ref(sub, y)
                        continue
                self.counts[id(op)] = self.counts.get(id(op), 0) + 1
                count = self.counts[id(op)]
                name = f"{prefix}{op.name}"
                if count > 1:
                    name = f"{name}#{count}"
                tensors = {id(x): self.ref(scope, x)
                           for x in node.input_tensors + node.outputs}
                self.calls.append(Call(len(self.calls), name, op, node,
                                       tensors, training, why))


def read_graph(model):
    """Reads the calls of a built Sequential or Functional model.

    Nested Functional and Sequential models are opened, at any depth; a
    layer with its own `call()` around other layers stays one call (see
    `Graph.opaque`).

    ```python
    graph = read_graph(keras.applications.MobileNetV2(weights=None))
    [c.name for c in graph.calls[:3]]  # ['Conv1', 'bn_Conv1', 'Conv1_relu']
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.

    Returns:
        A `Graph`.

    Raises:
        TypeError: if `model` is not a Keras model, or is a subclassed model
            (its graph is Python code).
        ValueError: if `model` is a Sequential model that is not built.
    """
    functional = _functional_of(model)
    reader = _Reader()
    reader.read(functional)
    _check_order(functional, reader.calls)
    return Graph(model, functional, reader.calls, list(functional.inputs),
                 [reader.ref(0, x) for x in functional.outputs])
