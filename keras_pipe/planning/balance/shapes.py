"""The shapes costs are computed for: given, propagated, guesses named.

A model built for any sequence length has inputs of shape `(None, None)`, and
so has every tensor after them: costs computed from such shapes (FLOPs,
bytes) take each unknown dimension as 1 and can be off by the sequence
length, or its square for attention. `infer_shapes` takes the shapes to cost
from the user (`input_shape=` or `sample_inputs=`), propagates them through
the graph with each call's `compute_output_spec` (symbolically: nothing is
run and no variable is touched), and warns, naming the input or the calls,
where a dimension other than the batch is still unknown and is guessed as 1.
"""

import warnings

import keras

__all__ = ["infer_shapes", "check_given"]


def _is_shape(value):
    return isinstance(value, (tuple, list)) and all(
        d is None or (isinstance(d, int) and not isinstance(d, bool))
        for d in value)


def _given_shapes(graph, input_shape):
    """One shape per model input, from a shape, a list or a dict by name."""
    inputs = graph.inputs
    names = [x.name for x in inputs]
    if isinstance(input_shape, dict):
        unknown = sorted(set(input_shape) - set(names))
        if unknown:
            raise ValueError(
                f"input_shape names inputs {unknown} that "
                f"{graph.model.name!r} does not have; its inputs are "
                f"{names}. Received: input_shape={input_shape!r}")
        shapes = [input_shape.get(name) for name in names]
    elif _is_shape(input_shape) and len(inputs) == 1:
        shapes = [input_shape]
    elif isinstance(input_shape, (list, tuple)) and len(input_shape) == len(
            inputs) and all(_is_shape(s) for s in input_shape):
        shapes = list(input_shape)
    else:
        raise TypeError(
            f"input_shape must be a shape such as (None, 128) (batch axis "
            f"first) for a model with one input, or a dict of such shapes "
            f"by input name, or a list with one per input; "
            f"{graph.model.name!r} has the inputs {names}. Received: "
            f"input_shape={input_shape!r}")
    for x, shape in zip(inputs, shapes):
        if shape is None:
            continue
        if not _is_shape(shape):
            raise TypeError(
                f"input_shape for {x.name!r} must be a tuple of ints or None. "
                f"Received: {shape!r}")
        known = tuple(x.shape)
        if len(shape) != len(known) or any(
                a is not None and b is not None and a != b
                for a, b in zip(shape[1:], known[1:])):
            raise ValueError(
                f"input_shape for {x.name!r} is {tuple(shape)}, but the input "
                f"has shape {known}: give its rank ({len(known)}, batch axis "
                "first) and keep its known dimensions.")
    return shapes


def _sample_shapes(graph, sample_inputs):
    flat = graph.standardize_inputs(sample_inputs)
    return [None if t is None else tuple(t.shape) for t in flat]


def _merge(known, given):
    """`known` with its unknown non-batch dimensions taken from `given`."""
    if given is None:
        return tuple(known)
    return (None,) + tuple(k if k is not None else g
                           for k, g in zip(known[1:], given[1:]))


def _propagate(graph, shapes):
    """Runs each call's `compute_output_spec` on the shapes found so far."""
    for call in graph.calls:
        node = call.node
        local = {}
        for x in node.input_tensors:
            ref = call.tensor_for(x)
            local[id(x)] = keras.KerasTensor(
                shapes.get(id(ref), ref.shape), ref.dtype, sparse=ref.sparse)
        args, kwargs = node.arguments.fill_in(local)
        try:
            spec = call.operation.compute_output_spec(*args, **kwargs)
            flat = keras.tree.flatten(spec)
        except Exception:  # Keras raises many types; keep the graph's shapes.
            continue
        if len(flat) != len(call.outputs):
            continue
        for x, y in zip(call.outputs, flat):
            if hasattr(y, "shape") and len(y.shape) == len(x.shape):
                shapes[id(x)] = _merge(x.shape, tuple(y.shape))


def _unknown(shape):
    return [k for k, d in enumerate(shape) if k and d is None]


def _warn(graph, shapes, what):
    problems = []
    for x in graph.inputs:
        axes = _unknown(shapes.get(id(x), x.shape))
        if axes:
            problems.append(
                f"input {x.name!r} has shape {tuple(x.shape)}: dimension(s) "
                f"{axes} unknown")
    if not problems:
        calls = [c.name for c in graph.calls if any(
            _unknown(shapes.get(id(x), x.shape)) for x in c.outputs)]
        if calls:
            more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
            problems.append(
                f"the outputs of {calls[:3]}{more} have unknown dimensions "
                "(they depend on values, not shapes)")
    if problems:
        example = {x.name: (None,) + tuple(
            128 if d is None else d for d in x.shape[1:])
            for x in graph.inputs}
        if len(example) == 1:
            example = next(iter(example.values()))
        warnings.warn(
            f"keras_pipe: {what} of {graph.model.name!r} guessed each unknown "
            f"dimension other than the batch as 1: " + "; ".join(problems) +
            f". Pass the sizes to cost, e.g. input_shape={example!r}, or "
            "sample_inputs=<a batch>.", UserWarning, stacklevel=4)


def check_given(graph, input_shape=None, sample_inputs=None):
    """Checks `input_shape` / `sample_inputs` against the graph's inputs.

    Called when a model is cut, whatever the balance, so a bad
    `input_shape` is refused even where no cost uses it (`"params"`).

    Returns:
        One given shape (or None) per graph input.

    Raises:
        TypeError, ValueError: as `infer_shapes`.
    """
    if input_shape is not None and sample_inputs is not None:
        raise ValueError(
            "Pass input_shape= or sample_inputs=, not both. Received: "
            f"input_shape={input_shape!r} and sample_inputs.")
    if input_shape is not None:
        return _given_shapes(graph, input_shape)
    if sample_inputs is not None:
        return _sample_shapes(graph, sample_inputs)
    return [None] * len(graph.inputs)


def infer_shapes(graph, input_shape=None, sample_inputs=None,
                 what="the cost"):
    """Shapes (batch axis `None`) of the graph's tensors, for costing.

    Args:
        graph: a `keras_pipe.planning.graph.Graph`.
        input_shape: the model inputs' shapes, batch axis first (its size
            is ignored: costs are per micro-batch): one shape, a list with
            one per input, or a dict by input name. Defaults to `None`.
        sample_inputs: a batch of inputs, whose shapes are used instead.
            Defaults to `None`.
        what: how to name the cost in the warning. Defaults to `"the cost"`.

    Returns:
        `{id(KerasTensor): shape}` for the graph's inputs and call outputs.

    Raises:
        TypeError: if `input_shape` is not a shape, a list or a dict of
            shapes.
        ValueError: if both arguments are given, or a shape has the wrong
            rank, contradicts a known dimension or names an unknown input.
    """
    given = check_given(graph, input_shape, sample_inputs)
    shapes = {id(x): _merge(x.shape, g) for x, g in zip(graph.inputs, given)}
    if any(_unknown(tuple(x.shape)) for x in graph.inputs) or any(
            _unknown(tuple(c.outputs[0].shape)) for c in graph.calls
            if c.outputs):
        _propagate(graph, shapes)
    _warn(graph, shapes, what)
    return shapes
