"""The package's shape: modules talk through contracts, not privates; no import circles.

These read the source (``ast``), so they hold for every module, imported or not.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_dist"
# The one package whose job is to touch Keras's internals (checked at import).
KERAS_INTEGRATION = PACKAGE / "_keras"
# Private names of the standard library and JAX that we use on purpose.
ALLOWED_PRIVATE_READS = {"os._exit"}
MAX_LINES = 500


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


SELF = ("self", "cls")
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _attributes_of_class(node: ast.ClassDef) -> set:
    """Names a class owns: its methods and class attributes, and ``self.<name> = ...``."""
    names = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and isinstance(inner.ctx, ast.Store)
            and isinstance(inner.value, ast.Name)
            and inner.value.id in SELF
        ):
            names.add(inner.attr)
    return names


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in SELF
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _private_accesses(path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent) -> list:
    """Every place ``path`` reaches into another object's or module's private state.

    Counted: reading, writing or deleting ``obj._name`` (also through ``getattr``
    & co.) unless ``obj`` is ``self``/``cls``/``super()`` or the code is inside
    the class that owns ``_name`` (an ``__eq__`` reading its peer); any
    ``obj.__dict__`` or ``vars(obj)`` but one's own; ``from module import _name``
    of a keras_dist module (a private submodule is a module, and fine).
    """
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, owned):
        if isinstance(node, ast.ClassDef):
            owned = owned | _attributes_of_class(node)
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
        if name is not None and _private(name) and not _is_self(base) and name not in owned:
            text = f"{ast.unparse(base)}.{name}"
            if text not in ALLOWED_PRIVATE_READS:
                found.append((node.lineno, text))
        for child in ast.iter_child_nodes(node):
            visit(child, owned)

    visit(tree, frozenset())
    for node in ast.walk(tree):
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
        "    def __eq__(self, other):\n        return self._x == other._x\n"
        "    def f(self):\n        return super()._y, self.__dict__\n"
        "from keras_dist._engine import _compiled\n"
    )
    path = tmp_path / "fine.py"
    path.write_text(source)
    assert _private_accesses(path, relative_to=tmp_path) == []


def _top_level_imports(path: pathlib.Path, module: str) -> set:
    """keras_dist modules imported when ``module`` is imported (not inside functions)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)

    visit(tree.body)
    return {t for t in targets if t == "keras_dist" or t.startswith("keras_dist.")}


def _import_graph() -> dict:
    modules = {_module_name(p): p for p in _modules()}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in _top_level_imports(path, name):
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


def test_there_are_no_import_circles():
    graph = _import_graph()
    graph.pop("keras_dist")  # the root imports everything, and everything is below it
    for edges in graph.values():
        edges.discard("keras_dist")
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _folder(module: str) -> str:
    """The box a module belongs to: its top-level folder, or itself for a top-level file."""
    return ".".join(module.split(".")[:2])


def _folder_graph(module_graph: dict) -> dict:
    graph: dict = {}
    for module, edges in module_graph.items():
        source = _folder(module)
        graph.setdefault(source, set())
        for target in edges:
            graph.setdefault(_folder(target), set())
            if _folder(target) != source:
                graph[source].add(_folder(target))
    return graph


def test_there_are_no_circles_between_folders():
    # Two modules may each import only "down", and their folders still import
    # each other (a -> b/x, b/y -> a): the diagram's boxes would then not stack.
    graph = _import_graph()
    graph.pop("keras_dist")
    for edges in graph.values():
        edges.discard("keras_dist")
    assert _cycles(_folder_graph(graph)) == []


def test_the_folder_graph_sees_a_circle_no_module_graph_has():
    modules = {
        "keras_dist.a.x": {"keras_dist.b.y"},
        "keras_dist.b.y": set(),
        "keras_dist.b.z": {"keras_dist.a.w"},
        "keras_dist.a.w": set(),
    }
    assert _cycles(modules) == []
    assert _cycles(_folder_graph(modules)) == [["keras_dist.a", "keras_dist.b"]]


def test_imports_inside_functions_say_why():
    undocumented = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    nearby = " ".join(lines[max(0, inner.lineno - 3) : inner.lineno])
                    if "#" not in nearby:
                        where = f"{path.relative_to(PACKAGE.parent)}:{inner.lineno}"
                        undocumented.append(f"{where}: {lines[inner.lineno - 1].strip()}")
    assert not undocumented, "function-level imports without a comment:\n" + "\n".join(undocumented)


def test_the_core_contract_is_small_and_has_no_stubs():
    from keras_dist.strategies._extended import StrategyExtended
    from keras_dist.strategies._extended import TensorFlowSurface

    own = {
        name
        for klass in StrategyExtended.__mro__
        if klass.__module__.startswith("keras_dist") and klass is not TensorFlowSurface
        for name in vars(klass)
        if not name.startswith("_")
    }
    assert len(own) <= 21, sorted(own)
    source = (PACKAGE / "strategies" / "_extended.py").read_text()
    assert "NotImplementedError" not in source


def _attribute_probes(path: pathlib.Path, relative_to: pathlib.Path = PACKAGE.parent) -> list:
    """``hasattr``/``getattr`` on a strategy or its extended object: duck typing on the contract."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
            and "extended" in ast.unparse(node.args[0])
        ):
            found.append(f"{path.relative_to(relative_to)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_abilities_are_asked_for_by_type_not_probed():
    offenders = [probe for path in _modules() for probe in _attribute_probes(path)]
    assert not offenders, "use keras_dist._capabilities with isinstance:\n" + "\n".join(offenders)


def test_the_probe_finder_sees_a_probe(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(strategy):\n    return hasattr(strategy.extended, 'programs')\n")
    assert _attribute_probes(planted, relative_to=tmp_path) == [
        "planted.py:2: hasattr(strategy.extended, 'programs')"
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it by concept"


def test_no_two_modules_share_a_file_name():
    # A reader who sees `_worker.py` in a traceback knows which one it is.
    names: dict = {}
    for path in _modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
