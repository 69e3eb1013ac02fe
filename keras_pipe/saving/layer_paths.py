"""The unpipelined model's layers and their weight paths, whatever the cut.

Stock Keras saving walks a model's attributes, so a pipeline's weights would
be filed under its stages (`layers/sequential_1/layers/dense/...`) and a file
written with 2 stages would not load into the same network cut into 3. Here
`PipelineModel.layers` is the flat list of the unpipelined model's layers
(nested Sequential and Functional stages opened), so the weights file has the
layout of the plain model, `layers/<layer class>[_k]/vars/<i>`, whatever the
cut; the plain model loads it with `keras.Model.load_weights` as well.

The states of seed generators (Dropout masks), which stock saving loses, are
written under `_seed_states/vars` in layer order (`SeedStates`; plain Keras
models ignore that group): training after a save and load draws the masks
training straight on would.
"""


import keras

from keras_pipe import _compat

__all__ = ["SeedStates", "flat_layers", "graph_of", "is_container",
           "weight_paths"]


def is_container(layer):
    """Sequential and plain Functional models are opened; other layers are not."""
    return type(layer) in (keras.Sequential, _compat.Functional)


def graph_of(stages):
    """The `keras_pipe.planning.graph.Graph` the stages were cut from, else None.

    Stages made by `PipelineModel.from_model` (`partition.GraphStage`) run
    calls of one original model.
    """
    graphs = {id(getattr(s, "source_graph", None)) for s in stages}
    if len(graphs) != 1 or not all(
            hasattr(s, "calls") and hasattr(s, "source_graph")
            for s in stages):
        return None
    return stages[0].source_graph


def _stage_layers(stage):
    """The layers of one stage, nested Sequential/Functional models opened."""
    if isinstance(stage, keras.layers.InputLayer):
        return []
    if hasattr(stage, "calls") and hasattr(stage, "source_graph"):
        ops = [c.operation for c in stage.calls]
        return [leaf for op in ops if isinstance(op, keras.layers.Layer)
                for leaf in _stage_layers(op)]
    if not is_container(stage):
        return [stage]
    return [leaf for layer in stage.layers for leaf in _stage_layers(layer)]


def _source_layers(graph):
    """The layers of the model a pipeline was cut from, without Inputs."""
    return [layer for layer in graph.model.layers
            if not isinstance(layer, keras.layers.InputLayer)]


def flat_layers(stages):
    """The layers of the unpipelined model, stage after stage.

    For stages cut by `PipelineModel.from_model`, the layers of the model
    they were cut from, as that model lists them (`model.layers`: a nested
    model is one entry), so that weight files have that model's layout.
    Otherwise Sequential and Functional stages (and models nested in them)
    are opened up; any other layer, a subclassed model included, is one
    entry. Input layers are left out.
    """
    graph = graph_of(stages)
    if graph is not None:
        return _source_layers(graph)
    seen, result = set(), []
    for stage in stages:
        for layer in _stage_layers(stage):
            if id(layer) not in seen:
                seen.add(id(layer))
                result.append(layer)
    return result


def _snake_names(layers):
    """Keras' names for list entries (`_save_container_state`)."""
    used, names = {}, []
    for layer in layers:
        name = _compat.to_snake_case(type(layer).__name__)
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        names.append(name)
    return names


def _nested_paths(layers, prefix, stage_of, seen, result):
    """Paths of `layers` as Keras saves them: nested models under `layers/`."""
    for layer, name in zip(layers, _snake_names(layers)):
        if id(layer) in seen:
            continue  # Keras saves a layer where it first meets it.
        seen.add(id(layer))
        path = f"{prefix}/{name}"
        if _compat.object_type(layer) in ("Functional", "Sequential"):
            _nested_paths(layer.layers, f"{path}/layers", stage_of, seen,
                          result)
        elif not isinstance(layer, keras.layers.InputLayer):
            result.append((stage_of.get(id(layer), 0), layer, path))


def weight_paths(stages):
    """`[(stage index, layer, path in the weights file)]`, in file order.

    Mirrors Keras' naming of list entries (`_save_container_state`): the
    snake-case class name, `_1`, `_2`... for repeats. It depends on the
    order of the layers, never on where the stages are cut. Stages cut by
    `from_model` have the layout of the model they were cut from, nested
    models included (`layers/functional/layers/dense`).
    """
    graph = graph_of(stages)
    if graph is not None:
        stage_of = {}
        for j, stage in enumerate(stages):
            for call in stage.calls:
                stage_of.setdefault(id(call.operation), j)
        result = []
        _nested_paths(_source_layers(graph), "layers", stage_of, set(),
                      result)
        return result
    owned, seen = [], set()
    for j, stage in enumerate(stages):
        layers = [l for l in _stage_layers(stage) if id(l) not in seen]
        seen.update(id(l) for l in layers)
        owned += [(j, layer) for layer in layers]
    names = _snake_names([layer for _, layer in owned])
    return [(j, layer, f"layers/{name}")
            for (j, layer), name in zip(owned, names)]


class SeedStates(_compat.KerasSaveable):
    """The seed generator states of some layers, as one saveable object.

    Keras saves a layer's own variables only; the state of a
    `keras.random.SeedGenerator` held by a layer (Dropout) is not saved, so
    training after a round trip would draw different masks.
    """

    def __init__(self, layers):
        self._generators = [g for layer in layers
                            for sub in _compat.flatten_layers(layer)
                            for g in _compat.seed_generators(sub)]

    def _obj_type(self):
        return "Operation"

    def save_own_variables(self, store):
        for i, generator in enumerate(self._generators):
            store[str(i)] = generator.state.numpy()

    def load_own_variables(self, store):
        if not len(store.keys()):
            return  # A file of a plain Keras model: keep the current states.
        if len(store.keys()) != len(self._generators):
            raise ValueError(
                f"The file holds {len(store.keys())} seed generator states "
                f"but the model has {len(self._generators)} seed generators: "
                "the file was saved from a different network.")
        for i, generator in enumerate(self._generators):
            generator.state.assign(store[str(i)])
