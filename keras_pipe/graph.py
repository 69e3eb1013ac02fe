"""The call graph of a Keras model as an ordered list of layer calls.

A Functional model (or the graph a built `keras.Sequential` keeps inside) is
a DAG of `Node`s, one per call of a layer or op. Partitioning needs it as a
*sequence*: `read_graph` lists the calls in the order in which the model
itself runs them (deepest first, the order of `Functional.call`), so a cut
anywhere in the list is a valid pipeline cut: every tensor a call needs was
made by an earlier call or is a model input. A layer called twice (shared
weights) appears twice, as two `Call`s.
"""

import dataclasses

import keras
from keras.src.models.functional import Functional
from keras.src.models.functional import operation_fn
from keras.src.models.functional import unpack_singleton

__all__ = ["Call", "Graph", "read_graph"]


@dataclasses.dataclass(eq=False)
class Call:
    """One call of a layer (or a `keras.ops` operation) in a model graph.

    Attributes:
        index: position of the call in `Graph.calls`.
        name: the operation's name, with `#2`, `#3`... for later calls of an
            operation called several times.
        operation: the `keras.Operation` (usually a `keras.layers.Layer`).
        node: the Keras `Node` recording the call's arguments.
    """

    index: int
    name: str
    operation: object
    node: object

    @property
    def inputs(self):
        """The input KerasTensors, each once, in argument order."""
        return _unique(self.node.input_tensors)

    @property
    def outputs(self):
        """The output KerasTensors, flat."""
        return list(self.node.outputs)

    def run(self, values, training=None):
        """Runs the call on `values` ({id(KerasTensor): tensor}), in place."""
        args, kwargs = self.node.arguments.fill_in(values)
        outputs = operation_fn(self.operation, training=training)(
            *args, **kwargs)
        for x, y in zip(self.node.outputs, keras.tree.flatten(outputs)):
            values[id(x)] = y


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

    def standardize_inputs(self, inputs):
        """Flattens and converts model inputs as `Functional.call` does."""
        return self.functional._standardize_inputs(inputs)

    def pack_outputs(self, flat):
        """Packs flat output tensors into the model's output structure."""
        return unpack_singleton(keras.tree.pack_sequence_as(
            self.functional._outputs_struct, list(flat)))

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
    if not isinstance(model, Functional):
        raise TypeError(
            f"Cannot read the layer graph of {model.name!r}: it is a "
            f"subclassed keras.Model ({type(model).__name__}), whose call() "
            "is Python code. Rebuild it with the Functional API "
            "(keras.Input ... keras.Model(inputs, outputs)) or as a "
            "keras.Sequential, or pass stages to PipelineModel by hand.")
    if type(model).call is not Functional.call:
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


def read_graph(model):
    """Reads the calls of a built Sequential or Functional model.

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
    by_depth = functional._nodes_by_depth
    calls, seen = [], {}
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.operation is None or node.is_input:
                continue
            op = node.operation
            seen[id(op)] = seen.get(id(op), 0) + 1
            count = seen[id(op)]
            name = op.name if count == 1 else f"{op.name}#{count}"
            calls.append(Call(len(calls), name, op, node))
    _check_order(functional, calls)
    return Graph(model, functional, calls, list(functional.inputs),
                 list(functional.outputs))
