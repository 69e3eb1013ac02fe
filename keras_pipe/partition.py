"""Cutting a Sequential or Functional Keras model into pipeline stages.

The model's layer calls are listed in execution order (`keras_pipe.graph`)
and cut into `num_stages` contiguous blocks (`keras_pipe.balance`). Each
block becomes a `GraphStage`: a layer that runs those calls of the *original*
layer objects, so weights are shared with the model, never copied.

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

import keras
from keras.src.utils import tracking

from keras_pipe import balance as balance_lib
from keras_pipe import graph as graph_lib
from keras_pipe import placement
from keras_pipe import validation

__all__ = ["BALANCE_MODES", "GraphStage", "Partition", "cut", "split_model"]

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
        with tracking.DotNotTrackScope():
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
        self.built = True

    @property
    def calls(self):
        """The `keras_pipe.graph.Call`s this stage runs, in order."""
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
        graph: the `keras_pipe.graph.Graph` of the model.
        sizes: number of calls per stage.
        costs: the per-call costs the cut balanced (`None` for an explicit
            balance).
        boundaries: `boundaries[j]`, the KerasTensors stage `j` hands to
            stage `j + 1`, for `j < num_stages - 1`.
        tied: `(layer_name, stages)` for each layer whose trainable
            variables are used by several stages.
    """

    graph: object
    sizes: list
    costs: list
    boundaries: list
    tied: list

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
        costs = costs_of(balance)
        sizes = balance_lib.block_partition(
            costs, num_stages, allowed_cuts=allowed_cuts(graph))
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


def cut(model, num_stages, balance="params", devices=None,
        num_micro_batches=1, remat="except_last", batch_size=None):
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
    validation.check_remat(remat, num_stages)
    graph = graph_lib.read_graph(model)
    n = len(graph.calls)
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} is larger than the number of layer "
            f"calls of {model.name!r} ({n}): every stage needs at least one "
            f"layer. Use num_stages <= {n}.")
    micro = micro_batch_size(batch_size, num_micro_batches)

    def costs_of(mode):
        if mode == "params":
            return balance_lib.cost.parameter_counts(graph)
        if mode == "flops":
            return balance_lib.cost.flops(graph, micro)
        if mode == "memory":
            return balance_lib.cost.memory(graph, micro, num_micro_batches,
                                           remat)
        device = None
        if devices:
            device = placement.resolve_devices(list(devices)[:1])[0]
        return balance_lib.cost.time(graph, device, micro)

    sizes, costs = _resolve_sizes(graph, num_stages, balance, costs_of)
    return Partition(graph, sizes, costs, _boundaries(graph, sizes),
                     _tied(graph, sizes))


def micro_batch_size(batch_size, num_micro_batches):
    """Rows of the largest micro-batch; 1 when `batch_size` is `None`."""
    if batch_size is None:
        return 1
    return -(-batch_size // num_micro_batches)


def split_model(model, num_stages, balance="params", devices=None,
                num_micro_batches=1, remat="except_last", batch_size=None):
    """Cuts a built Sequential or Functional model into stage layers.

    The stages reuse the model's layer objects: training the pipeline trains
    `model`. Feed the result to `keras_pipe.PipelineModel` (which
    `PipelineModel.from_model` does).

    ```python
    model = keras.applications.MobileNetV2(weights=None)
    stages = keras_pipe.partition.split_model(model, 4, balance="flops")
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
            `keras_pipe.graph.read_graph(model).calls`). Defaults to
            `"params"`.
        devices: the stage devices; `"time"` measures on the first one.
            Defaults to `None` (TF's default device).
        num_micro_batches: `M`, for the `"memory"` cost. Defaults to `1`.
        remat: the pipeline's remat mode, for the `"memory"` cost. Defaults
            to `"except_last"`.
        batch_size: mini-batch size, for the `"memory"`, `"flops"` and
            `"time"` costs. Defaults to `None` (micro-batches of one row).

    Returns:
        A list of `num_stages` `GraphStage` layers.

    Raises:
        TypeError: if `model` is not a Sequential or Functional model, a
            count is not an int, or `balance` is neither a mode nor a list
            of ints.
        ValueError: if the model is not built, `num_stages` exceeds the
            number of layer calls, an explicit `balance` does not hold
            `num_stages` positive counts summing to the number of layer
            calls or splits a layer with state, or a mode is unknown.
    """
    partition = cut(model, num_stages, balance, devices, num_micro_batches,
                    remat, batch_size)
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
