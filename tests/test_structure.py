"""The package's shape: no import cycle, no private name across modules.

Read from the source with `ast`, so the test needs no TF session.
"""

import ast
import functools
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                       "keras_pipe")


def _modules():
    """`{dotted name: ast tree}` for every module of the package."""
    return dict(_parsed())


@functools.cache
def _parsed():
    """The package's modules, parsed once (the tests only read the trees)."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3]
            dotted = rel.replace(os.sep, ".")
            if dotted.endswith(".__init__"):
                dotted = dotted[:-len(".__init__")]
            with open(path, encoding="utf-8") as f:
                found[dotted] = ast.parse(f.read(), path)
    return found


def _imports(tree, modules):
    """`(module, names)` pairs that `tree` imports from within the package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("keras_pipe"):
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("keras_pipe")):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:  # `from keras_pipe import schedule`
                    yield full, []
                else:
                    yield node.module, [alias.name]


def _graph():
    modules = _modules()
    return {name: {target for target, _ in _imports(tree, modules)
                   if target != name and target in modules}
            for name, tree in modules.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt == "keras_pipe":  # the package's own re-exports
                continue
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found[found.index(found[-1]):]
    return None


def test_no_import_cycle_among_modules():
    graph = _graph()
    assert "keras_pipe.engine.executor" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_one():
    # The check above can fail: a planted cycle is found.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c",
                                                            "a"]


def _module_aliases(tree, modules):
    """Local names bound to package modules (`from keras_pipe import x`)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("keras_pipe")):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = alias.name
    return aliases


def _private_uses(modules):
    bad = [f"{name} imports {target}.{n}"
           for name, tree in modules.items()
           for target, names in _imports(tree, modules)
           for n in names if n.startswith("_") and not n.startswith("__")]
    for name, tree in modules.items():
        aliases = _module_aliases(tree, modules)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{name} uses {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_imported_across_modules():
    bad = _private_uses(_modules())
    assert not bad, bad


def test_private_use_finder_finds_one():
    tree = ast.parse("from keras_pipe import saving\nsaving._graph_of(1)\n")
    assert _private_uses({"keras_pipe.x": tree,
                          "keras_pipe.saving": ast.parse("")}) == [
        "keras_pipe.x uses saving._graph_of"]


@pytest.mark.parametrize("core", ["keras_pipe.engine.executor",
                                  "keras_pipe.engine.stage",
                                  "keras_pipe.engine.schedule",
                                  "keras_pipe.model.pipeline"])
def test_core_does_not_import_the_timeline(core):
    assert "keras_pipe.timeline" not in _graph()[core]


def test_internals_are_imported_in_one_module_only():
    # Every keras.src / tensorflow.python import lives in _compat.py, which
    # checks the Keras and TF versions it was written for.
    bad = []
    for name, tree in _modules().items():
        if name == "keras_pipe._compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            bad += [f"{name} imports {m}" for m in modules
                    if m.startswith(("keras.src", "tensorflow.python"))]
    assert not bad, bad


def _foreign_private_attributes(modules):
    """Private attributes read or written on anything but `self`, `cls` or
    `super()`, outside `keras_pipe._compat`."""
    bad = []
    for name, tree in modules.items():
        if name == "keras_pipe._compat":
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"):
                continue
            bad.append(f"{name}:{node.lineno} .{node.attr}")
    return bad


def test_private_attributes_are_reached_through_internals_only():
    # Every private attribute of a Keras or TF object (and of another
    # module's object) is read or written through keras_pipe._compat.
    bad = _foreign_private_attributes(_modules())
    assert not bad, bad


def test_foreign_private_attribute_finder_finds_one():
    tree = ast.parse("def f(layer, self):\n    self._a = layer._b\n"
                     "    super()._c()\n")
    assert _foreign_private_attributes({"keras_pipe.x": tree}) == [
        "keras_pipe.x:2 ._b"]


# Which sub-packages each part of the package may import (besides the
# private top-level modules `_compat` and `_validation`).
ALLOWED = {
    "keras_pipe.engine": {"keras_pipe.engine"},
    # The resident memory model predicts under the worker heap's settings:
    # planning reads them from their one home (heap imports no keras_pipe).
    "keras_pipe.planning": {"keras_pipe.engine", "keras_pipe.planning",
                            "keras_pipe.distributed.heap"},
    "keras_pipe.distributed": {"keras_pipe.engine", "keras_pipe.distributed"},
    # saving rebuilds cut models: it reads the partition's stages
    "keras_pipe.saving": {"keras_pipe.engine", "keras_pipe.planning",
                          "keras_pipe.saving"},
}
SHARED = {"keras_pipe._compat", "keras_pipe._validation"}


def _layering_violations(graph):
    bad = []
    for module, targets in graph.items():
        part = next((p for p in ALLOWED if module == p
                     or module.startswith(p + ".")), None)
        if part is None:
            continue
        for target in sorted(targets):
            if target in SHARED:
                continue
            if not any(target == p or target.startswith(p + ".")
                       for p in ALLOWED[part]):
                bad.append(f"{module} imports {target}")
    return bad


def test_layering_of_the_sub_packages():
    # The engine imports nothing from planning, the distributed runtime or
    # saving; those import the engine, never each other or the Keras glue.
    graph = _graph()
    assert "keras_pipe.engine.executor" in graph
    bad = _layering_violations(graph)
    assert not bad, bad


def test_layering_check_finds_an_engine_module_importing_planning():
    graph = dict(_graph())
    graph["keras_pipe.engine.executor"] = set(
        graph["keras_pipe.engine.executor"]) | {"keras_pipe.planning.planner"}
    assert _layering_violations(graph) == [
        "keras_pipe.engine.executor imports keras_pipe.planning.planner"]


def test_at_most_twelve_modules_at_the_top_level():
    # Modules, not sub-packages; `__init__.py` counts as one.
    top = [name for name in os.listdir(PACKAGE) if name.endswith(".py")]
    assert len(top) <= 12, sorted(top)
    assert {"engine", "planning", "distributed", "saving"} <= {
        name for name in os.listdir(PACKAGE)
        if os.path.isfile(os.path.join(PACKAGE, name, "__init__.py"))}
