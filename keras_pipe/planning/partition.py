"""Cutting a Sequential or Functional Keras model into pipeline stages.

The model's layer calls are listed in execution order (`keras_pipe.planning.graph`,
which opens nested Functional and Sequential models, so a KerasHub task is
cut inside its backbone) and cut into `num_stages` contiguous blocks
(`keras_pipe.planning.balance`). Each block becomes a `GraphStage`: a layer that runs
those calls of the *original* layer objects, so weights are shared with the
model, never copied. A layer with its own `call()` around other layers runs
whole; a cut that leaves a stage without weights is warned about.

A cut may fall where several tensors are alive (a skip connection, a second
model input, an early model output). Stage `j` then returns all of them as
one tuple, the *boundary*, ordered as they were made; a tensor that a later
stage needs passes through the stages in between. The first stage takes the
model's inputs as the model does; the last stage returns the model's output
structure.

A layer called in two stages (tied weights) shares its trainable variables
between them: one variable, read by both stages, whose gradients the
pipeline sums. A layer with state (BatchNormalization statistics, a dropout
seed) cannot be split that way, since each stage would update its own copy
of the state: automatic balancing never cuts between its calls and an
explicit `balance` that does is refused.
"""

import dataclasses
import warnings

import keras

from keras_pipe import _compat, _validation
from keras_pipe.engine import placement
from keras_pipe.planning import balance as balance_lib
from keras_pipe.planning import graph as graph_lib
from keras_pipe.planning.balance import shapes as shapes_lib

__all__ = ["BALANCE_MODES", "GraphStage", "Partition", "check_enough_calls", "cut",
           "split_model"]

BALANCE_MODES = ("params", "flops", "time", "memory")


class GraphStage(keras.layers.Layer):
    """A contiguous block of a model's layer calls, run as one layer.

    Created by `split_model`; holds the original layers (their variables are
    this layer's variables). Stage 0 takes the model's inputs; the last stage
    returns the model's outputs; every other input and output is a tuple of
    tensors (`input_tensors`, `output_tensors` give their KerasTensors).
    """

    def __init__(self, graph, calls, input_tensors, output_tensors, first,
                 last, **kwargs):
        super().__init__(dtype=graph.functional.dtype_policy, **kwargs)
        with _compat.no_automatic_tracking():
            self._self_setattr_tracking = False
            self._graph = graph
            self._calls = list(calls)
            self._input_tensors = list(input_tensors)
            self._output_tensors = list(output_tensors)
            self._self_setattr_tracking = True
        self._first = first
        self._last = last
        for layer in _unique_layers(self._calls):
            self._tracker.track(layer)
        # As Functional: inputs are converted per tensor, not cast at entry.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        # Masks: the layers inside read their inputs' masks and attach their
        # outputs' (`compute_mask`); Keras would otherwise warn that this
        # layer drops the masks its inputs carry (`keras_pipe.engine.attached`).
        self.supports_masking = True
        self.built = True

    @property
    def source_graph(self):
        """The `keras_pipe.planning.graph.Graph` this stage's calls come from."""
        return self._graph

    @property
    def calls(self):
        """The `keras_pipe.planning.graph.Call`s this stage runs, in order."""
        return list(self._calls)

    @property
    def input_tensors(self):
        """The KerasTensors of the input boundary (model inputs if first)."""
        return list(self._input_tensors)

    @property
    def output_tensors(self):
        """The KerasTensors of the output boundary (model outputs if last)."""
        return list(self._output_tensors)

    @property
    def inputs(self):
        """The input KerasTensors, a flat list (as `keras.Model.inputs`)."""
        return list(self._input_tensors)

    def compute_mask(self, inputs, previous_mask=None):
        """None: the outputs carry the masks the layers inside attached."""
        del inputs, previous_mask
        return None

    def call(self, inputs, training=None):
        if self._first:
            flat = self._graph.standardize_inputs(inputs)
        else:
            flat = keras.tree.flatten(inputs)
        if len(flat) != len(self._input_tensors):
            raise ValueError(
                f"{self.name} expects {len(self._input_tensors)} input "
                f"tensors, received {len(flat)}.")
        values = {id(x): t for x, t in zip(self._input_tensors, flat)}
        for call in self._calls:
            call.run(values, training=training)
        flat_out = [values[id(x)] for x in self._output_tensors]
        if self._last:
            return self._graph.pack_outputs(flat_out)
        return tuple(flat_out)

    def compute_output_spec(self, inputs, training=None):
        if self._last:
            return self._graph.output_spec()
        return tuple(keras.KerasTensor(x.shape, x.dtype)
                     for x in self._output_tensors)


def _unique_layers(calls):
    """The Keras layers the calls run, each once (ops have no weights)."""
    seen, layers = set(), []
    for call in calls:
        op = call.operation
        if isinstance(op, keras.layers.Layer) and id(op) not in seen:
            seen.add(id(op))
            layers.append(op)
    return layers


@dataclasses.dataclass(eq=False)
class Partition:
    """Where a model is cut, without any stage layer built.

    Attributes:
        graph: the `keras_pipe.planning.graph.Graph` of the model.
        sizes: number of calls per stage.
        costs: the per-call costs the cut balanced (`None` for an explicit
            balance).
        boundaries: `boundaries[j]`, the KerasTensors stage `j` hands to
            stage `j + 1`, for `j < num_stages - 1`.
        tied: `(layer_name, stages)` for each layer whose trainable
            variables are used by several stages.
        shapes: `{id(KerasTensor): shape}` the costs were computed with
            (`keras_pipe.planning.balance.shapes.infer_shapes`), also
            inferred when `input_shape` or `sample_inputs` was given to a
            cut that needs no shapes (`balance="params"`, a list), or
            `None` when neither was given and the cut needed none.
    """

    graph: object
    sizes: list
    costs: list
    boundaries: list
    tied: list
    shapes: object = None

    @property
    def num_stages(self):
        return len(self.sizes)

    def stage_calls(self, j):
        """The calls of stage `j`."""
        start = sum(self.sizes[:j])
        return self.graph.calls[start:start + self.sizes[j]]

    def stage_inputs(self, j):
        """The KerasTensors stage `j` takes (the model inputs for stage 0)."""
        return list(self.graph.inputs) if j == 0 else self.boundaries[j - 1]

    def stage_outputs(self, j):
        """The KerasTensors stage `j` returns (the model outputs if last)."""
        if j == self.num_stages - 1:
            return list(self.graph.outputs)
        return self.boundaries[j]


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int. Received: {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1. Received: {name}={value}")


def _stage_of_calls(sizes):
    stage = []
    for j, size in enumerate(sizes):
        stage += [j] * size
    return stage


def _variable_users(graph):
    """`[(is_state, call indices)]`, one entry per variable of the model.

    A state variable is one the pipeline threads through micro-batches
    rather than differentiates: `layer.non_trainable_variables`.
    """
    users = {}
    for call in graph.calls:
        op = call.operation
        if not isinstance(op, keras.layers.Layer):
            continue
        state = {id(v) for v in op.non_trainable_variables}
        for v in op.variables:
            entry = users.setdefault(id(v), (id(v) in state, []))
            if call.index not in entry[1]:
                entry[1].append(call.index)
    return list(users.values())


def _owner(graph, indices):
    """Names the layers of the calls at `indices`, each once."""
    names = []
    for i in indices:
        name = graph.calls[i].operation.name
        if name not in names:
            names.append(name)
    return " and ".join(repr(n) for n in names)


def _state_spans(graph):
    """(first call, last call, layer names) of each state variable's users."""
    spans = []
    for is_state, indices in _variable_users(graph):
        if is_state and len(indices) > 1:
            spans.append((min(indices), max(indices), _owner(graph, indices)))
    return spans


def allowed_cuts(graph):
    """Flags per gap between calls: False inside a span of shared state."""
    allowed = [True] * (len(graph.calls) - 1)
    for first, last, _ in _state_spans(graph):
        for gap in range(first, last):
            allowed[gap] = False
    return allowed


def _check_state_not_split(graph, sizes):
    stage = _stage_of_calls(sizes)
    problems = []
    for first, last, owner in _state_spans(graph):
        if stage[first] != stage[last]:
            problems.append(
                f"{owner} (calls {graph.calls[first].name!r} in stage "
                f"{stage[first]} and {graph.calls[last].name!r} in stage "
                f"{stage[last]})")
    if problems:
        raise ValueError(
            "balance puts calls of a layer with state (non-trainable "
            "variables such as BatchNormalization statistics or a dropout "
            "seed) in two stages, where each stage would update its own "
            "copy: " + "; ".join(sorted(set(problems))) + ". Change balance "
            "so that these calls share a stage, or use an automatic balance "
            "('params', 'flops', 'time', 'memory'), which never cuts there.")


def _tied(graph, sizes):
    """(layer names, stages) for trainable variables used in several stages."""
    stage = _stage_of_calls(sizes)
    result = []
    for is_state, indices in _variable_users(graph):
        stages = sorted({stage[i] for i in indices})
        if not is_state and len(stages) > 1:
            entry = (_owner(graph, indices), stages)
            if entry not in result:
                result.append(entry)
    return result


def _boundaries(graph, sizes):
    """The tensors alive across each cut, in the order they were made."""
    stage = _stage_of_calls(sizes)
    num_stages = len(sizes)
    made, needed, order = {}, {}, []
    for x in graph.inputs:
        made[id(x)] = 0
        order.append(x)
    for call in graph.calls:
        for x in call.inputs:
            needed[id(x)] = max(needed.get(id(x), 0), stage[call.index])
        for x in call.outputs:
            made[id(x)] = stage[call.index]
            order.append(x)
    for x in graph.outputs:
        needed[id(x)] = num_stages
    return [[x for x in order
             if made[id(x)] <= j < needed.get(id(x), -1)]
            for j in range(num_stages - 1)]


def _resolve_sizes(graph, num_stages, balance, costs_of):
    """Stage sizes from an explicit list, or the optimal cut of costs."""
    n = len(graph.calls)
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(
                f"balance must be one of {BALANCE_MODES} or a list of layer "
                f"counts, one per stage. Received: balance={balance!r}")
        allowed = allowed_cuts(graph)
        if sum(allowed) < num_stages - 1:
            owners = sorted({owner for _, _, owner in _state_spans(graph)})
            raise ValueError(
                f"Cannot cut {graph.model.name!r} into {num_stages} stages: "
                f"only {sum(allowed) + 1} stages are possible, because the "
                "calls of a layer with state (non-trainable variables such as "
                "BatchNormalization statistics) must share a stage, and "
                f"{', '.join(owners)} span most of the model. Use "
                f"num_stages <= {sum(allowed) + 1}.")
        costs = costs_of(balance)
        sizes = balance_lib.block_partition(costs, num_stages,
                                            allowed_cuts=allowed)
        return sizes, costs
    if not isinstance(balance, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in balance):
        raise TypeError(
            f"balance must be one of {BALANCE_MODES} or a list of ints (layer "
            f"counts per stage). Received: balance={balance!r}")
    even = [n // num_stages + (1 if j < n % num_stages else 0)
            for j in range(num_stages)]
    if len(balance) != num_stages or any(s < 1 for s in balance) or sum(
            balance) != n:
        raise ValueError(
            f"balance={list(balance)} must hold {num_stages} counts (one per "
            f"stage), each >= 1, summing to the number of layer calls of "
            f"{graph.model.name!r}, {n}; it holds {len(balance)} counts "
            f"summing to {sum(balance)}. For example balance={even}, or an "
            f"automatic balance {BALANCE_MODES}.")
    _check_state_not_split(graph, balance)
    return list(balance), None


def _opaque_note(graph):
    """A sentence naming the calls that run whole, or ''."""
    opaque = graph.opaque
    if not opaque:
        return ""
    names = ", ".join(f"{name!r} ({cls}: {why})"
                      for name, cls, why in opaque[:4])
    more = f" and {len(opaque) - 4} more" if len(opaque) > 4 else ""
    return (f" These calls run whole and cannot be cut inside: {names}{more}."
            " A nested Functional or Sequential model is opened; rebuild a "
            "layer with its own call() that way to cut inside it.")


def check_enough_calls(graph, num_stages):
    n = len(graph.calls)
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} is larger than the number of layer "
            f"calls of {graph.model.name!r} ({n}): every stage needs at "
            f"least one layer.{_opaque_note(graph)} Use num_stages <= {n}.")


def _warn_weightless_stages(graph, sizes):
    """Warns about stages without weights: they only pass activations on."""
    if len(sizes) < 2:
        return
    start = 0
    for j, size in enumerate(sizes):
        calls = graph.calls[start:start + size]
        start += size
        if any(getattr(c.operation, "weights", None) for c in calls):
            continue
        warnings.warn(
            f"keras_pipe: stage {j} of {graph.model.name!r} "
            f"({calls[0].name}..{calls[-1].name}, {size} call(s)) has no "
            "weights: it holds none of the model and only passes activations "
            "to the next device, so it adds a transfer and a pipeline step "
            f"for little work. Use fewer stages (num_stages={len(sizes) - 1})"
            " or an explicit balance=[...] that gives it a layer with "
            f"weights.{_opaque_note(graph)}", UserWarning, stacklevel=3)


def cut(model, num_stages, balance="params", devices=None,
        num_micro_batches=1, remat="except_last", batch_size=None,
        input_shape=None, sample_inputs=None):
    """Decides where to cut `model` into `num_stages` stages.

    Builds nothing and moves no variable; `split_model` turns the result
    into stage layers and `keras_pipe.plan` describes it. Arguments are as
    in `split_model`.

    Returns:
        A `Partition`.
    """
    _check_count("num_stages", num_stages)
    _check_count("num_micro_batches", num_micro_batches)
    if batch_size is not None:
        _check_count("batch_size", batch_size)
    _validation.check_remat(remat, num_stages)
    graph = graph_lib.read_graph(model)
    check_enough_calls(graph, num_stages)
    # Checked even where no cost reads them (balance="params").
    shapes_lib.check_given(graph, input_shape, sample_inputs)
    micro = micro_batch_size(batch_size, num_micro_batches)
    shapes = None

    def costs_of(mode):
        nonlocal shapes
        if mode == "params":
            return balance_lib.cost.parameter_counts(graph)
        shapes = shapes_lib.infer_shapes(graph, input_shape, sample_inputs,
                                         what=f"balance={mode!r}")
        if mode == "flops":
            return balance_lib.cost.flops(graph, micro, shapes)
        if mode == "memory":
            return balance_lib.cost.memory(graph, micro, num_micro_batches,
                                           remat, shapes=shapes)
        device = None
        if devices:
            device = placement.resolve_devices(list(devices)[:1])[0]
        return balance_lib.cost.time(graph, device, micro, shapes=shapes)

    sizes, costs = _resolve_sizes(graph, num_stages, balance, costs_of)
    if shapes is None and (input_shape is not None
                           or sample_inputs is not None):
        # A cut by parameters or by a list needs no shapes, but the memory
        # model (`keras_pipe.planning.memory.predict`) reads them from the
        # partition: without, a dimension the model leaves unknown (a
        # sequence length) counts as 1.
        shapes = shapes_lib.infer_shapes(graph, input_shape, sample_inputs,
                                         what="the memory prediction")
    _warn_weightless_stages(graph, sizes)
    return Partition(graph, sizes, costs, _boundaries(graph, sizes),
                     _tied(graph, sizes), shapes)


def micro_batch_size(batch_size, num_micro_batches):
    """Rows of the largest micro-batch; 1 when `batch_size` is `None`."""
    if batch_size is None:
        return 1
    return -(-batch_size // num_micro_batches)


def split_model(model, num_stages, balance="params", devices=None,
                num_micro_batches=1, remat="except_last", batch_size=None,
                input_shape=None, sample_inputs=None):
    """Cuts a built Sequential or Functional model into stage layers.

    The stages reuse the model's layer objects: training the pipeline trains
    `model`. Feed the result to `keras_pipe.PipelineModel` (which
    `PipelineModel.from_model` does).

    ```python
    model = keras.applications.MobileNetV2(weights=None)
    stages = keras_pipe.planning.partition.split_model(model, 4, balance="flops")
    pipe = keras_pipe.PipelineModel(stages, devices=devices)
    ```

    Args:
        model: a built `keras.Sequential` or Functional `keras.Model`.
        num_stages: number of stages, between 1 and the number of layer
            calls.
        balance: how to cut: `"params"` (parameter count), `"flops"`
            (estimated from shapes), `"time"` (measured per layer on the
            first device), `"memory"` (training bytes under `remat`), or a
            list of layer-call counts per stage (in the order of
            `keras_pipe.planning.graph.read_graph(model).calls`). Defaults to
            `"params"`.
        devices: the stage devices; `"time"` measures on the first one.
            Defaults to `None` (TF's default device).
        num_micro_batches: `M`, for the `"memory"` cost. Defaults to `1`.
        remat: the pipeline's remat mode, for the `"memory"` cost. Defaults
            to `"except_last"`.
        batch_size: mini-batch size, for the `"memory"`, `"flops"` and
            `"time"` costs. Defaults to `None` (micro-batches of one row).
        input_shape: the input shapes to cost (batch axis first, its size
            ignored), for inputs with unknown dimensions such as
            `(None, None)` token ids: one shape, a list with one per input,
            or a dict by input name. Dimensions left unknown are costed as
            1, with a warning naming the input. Defaults to `None`.
        sample_inputs: a batch of inputs whose shapes to cost, instead of
            `input_shape`. Defaults to `None`.

    Returns:
        A list of `num_stages` `GraphStage` layers.

    Nested Functional and Sequential models are opened and may be cut
    inside (`keras_pipe.planning.graph`); a layer with its own `call()` around other
    layers runs whole, in one stage. A stage without weights gets a
    warning: it only passes activations on.

    Raises:
        TypeError: if `model` is not a Sequential or Functional model, a
            count is not an int, `balance` is neither a mode nor a list
            of ints, or `input_shape` is not a shape, list or dict.
        ValueError: if the model is not built, `num_stages` exceeds the
            number of layer calls (the message names the layers that run
            whole), an explicit `balance` does not hold `num_stages`
            positive counts summing to the number of layer calls or splits
            a layer with state, a mode is unknown, or `input_shape` does
            not fit the inputs.
    """
    partition = cut(model, num_stages, balance, devices, num_micro_batches,
                    remat, batch_size, input_shape, sample_inputs)
    return build_stages(partition)


def build_stages(partition):
    """The `GraphStage` layers of a `Partition`."""
    k = partition.num_stages
    name = partition.graph.model.name
    return [GraphStage(partition.graph, partition.stage_calls(j),
                       partition.stage_inputs(j), partition.stage_outputs(j),
                       first=j == 0, last=j == k - 1,
                       name=f"{name}_stage{j}")
            for j in range(k)]
