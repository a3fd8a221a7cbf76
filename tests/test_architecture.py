"""The package's shape: modules talk through contracts, not privates; no import circles.

These read the source (``ast``), so they hold for every module, imported or not.
"""

import abc
import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_dist"
# The one package whose job is to touch Keras's internals (checked at import).
KERAS_INTEGRATION = PACKAGE / "_keras"
# Private names of other libraries that we use on purpose, each with its reason.
ALLOWED_PRIVATE_READS = {
    "os._exit",
    # TF's per-thread tf.summary state, which TF's own MirroredStrategy hands to its
    # replica threads; read only where TensorFlow is already imported (_tf_summaries.py).
    "summary_ops._summary_state",
}
MAX_LINES = 500
MAX_CONTRACT_MEMBERS = 21


def _modules(root: pathlib.Path = PACKAGE) -> list:
    return sorted(root.rglob("*.py"))


def _module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


SELF = ("self", "cls")
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in SELF
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _private_accesses(path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent) -> list:
    """Every place ``path`` reaches into another object's or module's private state.

    Counted: reading, writing or deleting ``obj._name`` (also through ``getattr``
    & co.) unless ``obj`` is ``self``/``cls``/``super()``, also inside the class
    that defines ``_name`` (an ``__eq__`` reads its peer through a public
    property, as any caller would: no guessing which class owns a name); any
    ``obj.__dict__`` or ``vars(obj)`` but one's own; ``from module import _name``
    of a keras_dist module (a private submodule is a module, and fine).
    """
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        name = base = None
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
            if name == "__dict__" and not _is_self(base):
                found.append((node.lineno, f"{ast.unparse(node)} (another object's __dict__)"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            arguments = node.args
            if (
                node.func.id in ATTRIBUTE_FUNCTIONS
                and len(arguments) >= 2
                and isinstance(arguments[1], ast.Constant)
                and isinstance(arguments[1].value, str)
            ):
                name, base = arguments[1].value, arguments[0]
            elif node.func.id == "vars" and arguments and not _is_self(arguments[0]):
                found.append((node.lineno, f"{ast.unparse(node)} (another object's __dict__)"))
        if name is not None and _private(name) and not _is_self(base):
            text = f"{ast.unparse(base)}.{name}"
            if text not in ALLOWED_PRIVATE_READS:
                found.append((node.lineno, text))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "keras_dist":
            folder = PACKAGE.parent.joinpath(*node.module.split("."))
            for alias in node.names:
                is_module = (folder / f"{alias.name}.py").exists() or (folder / alias.name).is_dir()
                if _private(alias.name) and not is_module:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    where = path.relative_to(relative_to)
    return [f"{where}:{line}: {text}" for line, text in sorted(found)]


def test_no_module_reaches_into_another_objects_private_state():
    offenders = []
    for path in _modules():
        if KERAS_INTEGRATION in path.parents:
            continue  # its job: every Keras internal it touches is checked at import
        offenders += _private_accesses(path)
    assert not offenders, "private state reached from outside its owner:\n" + "\n".join(offenders)


PLANTED_VIOLATIONS = {
    "a read": (
        "def f(strategy):\n    return strategy.extended._devices\n",
        "strategy.extended._devices",
    ),
    "a write": ("def f(variable):\n    variable._value = 1\n", "variable._value"),
    "getattr": ("def f(model):\n    return getattr(model, '_steps', None)\n", "model._steps"),
    "setattr": ("def f(model):\n    setattr(model, '_steps', None)\n", "model._steps"),
    "__dict__": (
        "def f(v):\n    return v.__dict__.get('x')\n",
        "v.__dict__ (another object's __dict__)",
    ),
    "vars()": ("def f(v):\n    return vars(v)\n", "vars(v) (another object's __dict__)"),
    "a private name imported": (
        "from keras_dist._context import _state\n",
        "from keras_dist._context import _state",
    ),
    "a name the module defines, read from another object": (
        "class A:\n    def __init__(self):\n        self._x = 1\n\n"
        "def f(other):\n    return other._x\n",
        "other._x",
    ),
    "a peer's state, read in the class that defines it": (
        "class A:\n    def __init__(self):\n        self._x = 1\n\n"
        "    def __eq__(self, other):\n        return self._x == other._x\n",
        "other._x",
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTED_VIOLATIONS))
def test_the_checker_sees_each_kind_of_private_access(case, tmp_path):
    source, expected = PLANTED_VIOLATIONS[case]
    path = tmp_path / "planted.py"
    path.write_text(source)
    found = _private_accesses(path, relative_to=tmp_path)
    assert [entry.split(": ", 1)[1] for entry in found] == [expected]


def test_the_checker_lets_a_class_use_its_own_private_state(tmp_path):
    source = (
        "class A:\n    def __init__(self):\n        self._x = 1\n"
        "    def __eq__(self, other):\n        return self._x == other.x\n"
        "    @classmethod\n    def make(cls):\n        return cls._default\n"
        "    def f(self):\n        return super()._y, self.__dict__, vars(self)\n"
        "from keras_dist._engine import _compiled\n"
    )
    path = tmp_path / "fine.py"
    path.write_text(source)
    assert _private_accesses(path, relative_to=tmp_path) == []


def _top_level_imports(path: pathlib.Path, module: str, deferred: bool = False) -> set:
    """keras_dist modules imported when ``module`` is imported (``deferred``: or called).

    Every import but those in a function's body (they run when it is called):
    at the top, in a class, under ``if``/``try``/``with``; relative ones resolved.
    With ``deferred``, those in function bodies too.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if not deferred and isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            ):
                continue
            if isinstance(child, ast.Import):
                targets.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {t for t in targets if t == "keras_dist" or t.startswith("keras_dist.")}


# Deferred imports (in a function's body) count in the graph: a circle they close is
# a circle all the same, only hidden until the call. One that must stay out goes here,
# ``(module, imported module)`` -> the reason.
ALLOWED_DEFERRED_IMPORTS: dict = {}


def _import_graph(root: pathlib.Path = PACKAGE, deferred: bool = True) -> dict:
    """Module -> the modules importing it (or, ``deferred``, calling it) runs: package
    ``__init__``s included; ``ALLOWED_DEFERRED_IMPORTS`` left out."""
    modules = {_module_name(p, root): p for p in _modules(root)}
    graph = {}
    for name, path in modules.items():
        edges = set()
        at_import = _top_level_imports(path, name)
        for target in _top_level_imports(path, name, deferred):
            if target not in at_import and (name, target) in ALLOWED_DEFERRED_IMPORTS:
                continue
            # Importing a.b.c runs a.b's __init__ first, unless we are inside a.b
            # (then it is already loading; the root always is).
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                candidate = ".".join(parts[:i])
                inside = name.startswith(candidate + ".")
                if candidate in modules and candidate != name and not inside:
                    edges.add(candidate)
        graph[name] = edges
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                strongconnect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def _package_graph() -> dict:
    """The import graph without the root, which imports everything and is above it all."""
    graph = _import_graph()
    graph.pop("keras_dist")
    return graph


def test_there_are_no_import_circles():
    assert _cycles(_package_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_reader_sees_every_import_that_runs_at_import(tmp_path):
    planted = tmp_path / "mod.py"
    planted.write_text(
        "import numpy\n"
        "import keras_dist.a\n"
        "from . import b\n"
        "from ..c import d\n"
        "if TYPE_CHECKING:\n    import keras_dist.e\n"
        "try:\n    import keras_dist.f\nexcept ImportError:\n    from keras_dist import g\n"
        "class K:\n    import keras_dist.h\n"
        "def later():\n    import keras_dist.when_called\n"
        "lazy = lambda: __import__('keras_dist.when_called')\n"
    )
    assert _top_level_imports(planted, "keras_dist.pkg.mod") == {
        "keras_dist.a",
        "keras_dist.pkg",
        "keras_dist.pkg.b",
        "keras_dist.c",
        "keras_dist.c.d",
        "keras_dist.e",
        "keras_dist.f",
        "keras_dist",
        "keras_dist.g",
        "keras_dist.h",
    }


def _plant_tree(root: pathlib.Path, files: dict) -> pathlib.Path:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


def test_the_import_graph_runs_the_inits_of_the_packages_it_enters(tmp_path):
    root = _plant_tree(
        tmp_path,
        {
            "keras_dist/__init__.py": "from keras_dist import a\n",
            "keras_dist/a/__init__.py": "from keras_dist.a.x import X\n",  # inside a: no a
            "keras_dist/a/x.py": "from keras_dist.b.y import Y\n",  # runs b's __init__
            "keras_dist/b/__init__.py": "",
            "keras_dist/b/y.py": "from keras_dist.b import z\ndef f():\n    import keras_dist.a\n",
            "keras_dist/b/z.py": "",
        },
    )
    assert _import_graph(root / "keras_dist", deferred=False) == {
        "keras_dist": {"keras_dist.a"},
        "keras_dist.a": {"keras_dist.a.x"},
        "keras_dist.a.x": {"keras_dist.b", "keras_dist.b.y"},
        "keras_dist.b": set(),
        "keras_dist.b.y": {"keras_dist.b.z"},
        "keras_dist.b.z": set(),
    }


def _folder(module: str, depth: int = 1) -> str:
    """The folder ``depth`` levels under the package a module belongs to, or the module
    itself when it is no deeper (depth 1: the diagram's box)."""
    return ".".join(module.split(".")[: depth + 1])


def _folder_graph(module_graph: dict, depth: int = 1) -> dict:
    graph: dict = {}
    for module, edges in module_graph.items():
        source = _folder(module, depth)
        graph.setdefault(source, set())
        for target in edges:
            graph.setdefault(_folder(target, depth), set())
            if _folder(target, depth) != source:
                graph[source].add(_folder(target, depth))
    return graph


def test_there_are_no_circles_between_folders_at_any_depth():
    # Two modules may each import only "down", and their folders still import
    # each other (a -> b/x, b/y -> a): the diagram's boxes would then not stack,
    # nor would a folder's subfolders (parameter_server/'s rpc/, tasks/ ...).
    graph = _package_graph()
    deepest = max(len(module.split(".")) for module in graph)
    for depth in range(1, deepest):
        assert _cycles(_folder_graph(graph, depth)) == [], f"folders {depth} deep"


def test_a_deferred_import_closes_a_circle(tmp_path):
    root = _plant_tree(
        tmp_path,
        {
            "keras_dist/__init__.py": "",
            "keras_dist/a.py": "import keras_dist.b\n",
            "keras_dist/b.py": "def f():\n    # when called\n    import keras_dist.a\n",
        },
    )
    assert _cycles(_import_graph(root / "keras_dist", deferred=False)) == []
    assert _cycles(_import_graph(root / "keras_dist")) == [["keras_dist.a", "keras_dist.b"]]


def test_allowed_deferred_imports_exist_and_say_why():
    for (module, target), reason in ALLOWED_DEFERRED_IMPORTS.items():
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        assert target in _top_level_imports(path, module, deferred=True), module
        assert reason.strip(), (module, target)


def test_the_folder_graph_sees_a_circle_no_module_graph_has():
    modules = {
        "keras_dist.a.x": {"keras_dist.b.y"},
        "keras_dist.b.y": set(),
        "keras_dist.b.z": {"keras_dist.a.w"},
        "keras_dist.a.w": set(),
    }
    assert _cycles(modules) == []
    assert _cycles(_folder_graph(modules)) == [["keras_dist.a", "keras_dist.b"]]
    deeper = {  # a/p and a/q import each other; a and b do not
        "keras_dist.a.p.x": {"keras_dist.a.q.y"},
        "keras_dist.a.q.y": set(),
        "keras_dist.a.q.z": {"keras_dist.a.p.w"},
        "keras_dist.a.p.w": set(),
    }
    assert _cycles(_folder_graph(deeper)) == []
    assert _cycles(_folder_graph(deeper, depth=2)) == [["keras_dist.a.p", "keras_dist.a.q"]]


ARCHITECTURE_DOC = PACKAGE.parent / "docs" / "architecture.md"
# The doc says so under its diagram: two small leaves it leaves out.
LEFT_OUT_OF_THE_DIAGRAM = {"keras_dist._backend", "keras_dist._run_options"}


def _diagram_rows(doc: pathlib.Path) -> list:
    """The boxes of ``doc``'s first ``text`` block, row by row from the top.

    A row starts at a line with ``┌``; each box's name is the first word on the
    next line between its ``│`` (``│ strategies/   one file per ... │``).
    """
    diagram = doc.read_text().split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    return [
        [segment.split()[0] for segment in diagram[i + 1].split("│")[1::2]]
        for i, line in enumerate(diagram)
        if "┌" in line
    ]


def _diagram_problems(doc: pathlib.Path, folder_graph: dict, root: pathlib.Path = PACKAGE) -> list:
    """Where the diagram and the tree disagree: boxes that are no folder or file under
    ``root``, folders and files without a box, and imports that go within a row or up."""
    problems, row_of = [], {}
    for row, boxes in enumerate(_diagram_rows(doc)):
        for box in boxes:
            path = root.parent / box if box.startswith(f"{root.name}/") else root / box
            if not (path.is_dir() if box.endswith("/") else path.is_file()):
                problems.append(f"the box {box} is no folder or file of {root.name}/")
            row_of[_module_name(path, root)] = row
    for box in sorted(set(folder_graph) - set(row_of) - LEFT_OUT_OF_THE_DIAGRAM):
        problems.append(f"{box} has no box")
    for source, targets in sorted(folder_graph.items()):
        for target in sorted(targets):
            if source in row_of and target in row_of and row_of[target] <= row_of[source]:
                problems.append(
                    f"{source} (row {row_of[source]}) imports {target} (row {row_of[target]}): "
                    "not from a row below"
                )
    return problems


def test_the_diagram_is_the_tree_and_its_rows_import_only_down():
    problems = _diagram_problems(ARCHITECTURE_DOC, _folder_graph(_import_graph()))
    assert not problems, f"{ARCHITECTURE_DOC.name}'s diagram:\n" + "\n".join(problems)


def test_the_diagram_rule_sees_boxes_and_imports_out_of_place(tmp_path):
    root = _plant_tree(
        tmp_path,
        {
            "keras_dist/__init__.py": "",
            "keras_dist/a/__init__.py": "",
            "keras_dist/b.py": "",
            "keras_dist/c/__init__.py": "",
            "keras_dist/d.py": "",
        },
    )
    doc = tmp_path / "architecture.md"
    doc.write_text(
        "# Planted\n\n```text\n"
        "        ┌────────────────────────┐\n"
        "        │ keras_dist/__init__.py │ re-exports\n"
        "        └───────────┬────────────┘\n"
        "┌────┐ ┌──────┐\n│ a/ │ │ b.py │   top\n└────┘ └──────┘\n"
        "┌────┐ ┌───────┐\n│ c/ │ │ gone/ │\n└────┘ └───────┘\n"
        "```\n"
    )
    graph = {
        "keras_dist": {"keras_dist.a", "keras_dist.c"},
        "keras_dist.a": {"keras_dist.b", "keras_dist.c"},  # b: the same row
        "keras_dist.b": set(),
        "keras_dist.c": {"keras_dist.a"},  # up
        "keras_dist.d": set(),
    }
    assert _diagram_rows(doc) == [["keras_dist/__init__.py"], ["a/", "b.py"], ["c/", "gone/"]]
    assert _diagram_problems(doc, graph, root / "keras_dist") == [
        "the box gone/ is no folder or file of keras_dist/",
        "keras_dist.d has no box",
        "keras_dist.a (row 1) imports keras_dist.b (row 1): not from a row below",
        "keras_dist.c (row 2) imports keras_dist.a (row 1): not from a row below",
    ]


def _undocumented_function_imports(
    path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent
) -> list:
    """Imports inside a function with no comment on their line or the two above."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Import, ast.ImportFrom)):
                nearby = " ".join(lines[max(0, inner.lineno - 3) : inner.lineno])
                if "#" not in nearby:
                    where = f"{path.relative_to(relative_to)}:{inner.lineno}"
                    found.append(f"{where}: {lines[inner.lineno - 1].strip()}")
    return found


def test_imports_inside_functions_say_why():
    undocumented = [line for path in _modules() for line in _undocumented_function_imports(path)]
    assert not undocumented, "function-level imports without a comment:\n" + "\n".join(undocumented)


def test_the_import_comment_rule_sees_a_silent_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\n"
        "def f():\n    import json\n"
        "def g():\n    # keras_dist imports this module: import it when called\n"
        "    import keras_dist\n"
    )
    assert _undocumented_function_imports(planted, relative_to=tmp_path) == [
        "planted.py:3: import json"
    ]


def _contract_members(contract: type, surfaces: tuple = ()) -> set:
    """The public names ``contract`` and its bases define (less ``object``'s,
    ``abc.ABC``'s and the ``surfaces``': TF's API, which keras_dist never calls)."""
    return {
        name
        for klass in contract.__mro__
        if klass not in (object, abc.ABC, *surfaces)
        for name in vars(klass)
        if not name.startswith("_")
    }


def _stubs(path: pathlib.Path, bare_only: bool = False) -> list:
    """Lines that ``raise NotImplementedError``: a method a strategy may leave unwritten.

    ``bare_only``: only those that say nothing (a refusal that says what is not
    supported and what to do instead, as TF's, is an answer, not a stub).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise):
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            said = isinstance(node.exc, ast.Call) and (node.exc.args or node.exc.keywords)
            if isinstance(raised, ast.Name) and raised.id == "NotImplementedError":
                if not (bare_only and said):
                    found.append(node.lineno)
    return found


def test_the_core_contract_is_small_and_has_no_stubs():
    from keras_dist.strategies._extended import StrategyExtended
    from keras_dist.strategies._extended import TensorFlowSurface

    members = _contract_members(StrategyExtended, surfaces=(TensorFlowSurface,))
    assert len(members) <= MAX_CONTRACT_MEMBERS, sorted(members)
    assert _stubs(PACKAGE / "strategies" / "_extended.py") == []


def test_no_implementer_leaves_a_stub():
    # Every class that implements a contract (strategies, engines, cross-device ops,
    # partitioners...) answers each call: a real result, or a refusal that says why.
    stubs = [f"{p.relative_to(PACKAGE)}:{n}" for p in _modules() for n in _stubs(p, True)]
    assert stubs == [], "bare `raise NotImplementedError`: " + ", ".join(stubs)


def test_the_contract_rules_see_a_large_contract_and_a_stub(tmp_path):
    surface = type("Surface", (abc.ABC,), {"parameter_devices": None})
    base = type("Base", (surface,), {"reduce_to": None, "_reduce_to": None})
    planted = type("Planted", (base,), {f"member_{i}": None for i in range(21)})
    members = _contract_members(planted, surfaces=(surface,))
    assert members == {"reduce_to", *(f"member_{i}" for i in range(21))}
    assert len(members) > MAX_CONTRACT_MEMBERS
    source = tmp_path / "planted.py"
    source.write_text(
        "class A:\n"
        '    """Never raise NotImplementedError here."""\n'
        "    def e(self):\n        raise ValueError('NotImplementedError')\n"
        "    def f(self):\n        raise NotImplementedError\n"
        "    def g(self):\n        raise NotImplementedError('later')\n"
    )
    assert _stubs(source) == [6, 8]
    assert _stubs(source, bare_only=True) == [6]


# What a strategy or its extended object is called: ``strategy``, ``self._strategy``,
# ``model_strategy(model)``, ``strategy.extended``, ``extended``.
STRATEGY_LIKE = re.compile("strategy|extended", re.IGNORECASE)


def _named_like_a_strategy(node: ast.AST) -> bool:
    """Whether an object's name is a strategy's (a call's: its function's, not its arguments')."""
    return bool(
        STRATEGY_LIKE.search(ast.unparse(node.func if isinstance(node, ast.Call) else node))
    )


def _attribute_probes(path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent) -> list:
    """``hasattr``/``getattr`` on a strategy or its extended object: duck typing on the contract."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
            and _named_like_a_strategy(node.args[0])
        ):
            found.append(f"{path.relative_to(relative_to)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_abilities_are_asked_for_by_type_not_probed():
    offenders = [probe for path in _modules() for probe in _attribute_probes(path)]
    assert not offenders, "use keras_dist._capabilities with isinstance:\n" + "\n".join(offenders)


def test_the_probe_finder_sees_probes_on_a_strategy_and_its_extended_object(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(strategy, model):\n"
        "    hasattr(strategy.extended, 'programs')\n"
        "    getattr(strategy, 'extended', None)\n"
        "    hasattr(self._strategy, 'extended')\n"
        "    getattr(model, 'name', None)\n"
        "    getattr(steps_for(model, strategy), 'train_function')\n"
    )
    assert _attribute_probes(planted, relative_to=tmp_path) == [
        "planted.py:2: hasattr(strategy.extended, 'programs')",
        "planted.py:3: getattr(strategy, 'extended', None)",
        "planted.py:4: hasattr(self._strategy, 'extended')",
    ]


def _too_long(path: pathlib.Path):
    """Why ``path`` is too long to read as one concept, or ``None``."""
    lines = len(path.read_text().splitlines())
    return f"{path.name} has {lines} lines: split it by concept" if lines > MAX_LINES else None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    problem = _too_long(path)
    assert problem is None, problem


def test_the_length_rule_sees_a_long_module(tmp_path):
    planted = tmp_path / "long.py"
    planted.write_text("x = 1\n" * MAX_LINES)
    assert _too_long(planted) is None
    planted.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _too_long(planted) == f"long.py has {MAX_LINES + 1} lines: split it by concept"


def _shared_file_names(root: pathlib.Path = PACKAGE) -> dict:
    """File name -> its paths under ``root``, for each name (but ``__init__.py``) used twice."""
    names: dict = {}
    for path in _modules(root):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(root)))
    return {name: paths for name, paths in names.items() if len(paths) > 1}


def test_no_two_modules_share_a_file_name():
    # A reader who sees `_worker.py` in a traceback knows which one it is.
    assert _shared_file_names() == {}


def test_the_file_name_rule_sees_two_workers(tmp_path):
    root = _plant_tree(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/_worker.py": "",
            "b/__init__.py": "",
            "b/rpc/_worker.py": "",
            "b/_server.py": "",
        },
    )
    assert _shared_file_names(root) == {"_worker.py": ["a/_worker.py", "b/rpc/_worker.py"]}
