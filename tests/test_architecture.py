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


def _names_defined_in(tree: ast.AST) -> set:
    """Names a module owns: its functions, classes, globals, parameters, and
    attributes it assigns (``self._x = ...``, ``obj._keras_dist_x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _private_reads(path: pathlib.Path) -> list:
    tree = ast.parse(path.read_text())
    owned = _names_defined_in(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name, base = node.attr, node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name, base = node.args[1].value, node.args[0]
        else:
            continue
        if not _private(name) or name in owned:
            continue
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        text = f"{ast.unparse(base)}.{name}"
        if text not in ALLOWED_PRIVATE_READS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text}")
    return found


def test_no_module_reads_another_modules_private_attributes():
    offenders = []
    for path in _modules():
        if KERAS_INTEGRATION in path.parents:
            continue
        offenders += _private_reads(path)
    assert not offenders, "private attributes read outside their module:\n" + "\n".join(offenders)


def test_the_checker_sees_a_private_read():
    source = "def f(strategy):\n    return strategy.extended._devices\n"
    path = PACKAGE.parent / "tests" / "_private_read_example.py"
    path.write_text(source)
    try:
        assert _private_reads(path) == [
            "tests/_private_read_example.py:2: strategy.extended._devices"
        ]
    finally:
        path.unlink()


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


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it by concept"
