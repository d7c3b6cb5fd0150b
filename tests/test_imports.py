"""No import cycles between the modules of ``crossroads``.

A cycle makes the import order matter (a half-initialised module at run time)
and blurs the layers: proto/ below transport/ below services/ below the CLI and
the runtime. This walks every module's import statements with ``ast`` (also
imports inside functions, which only postpone a cycle; not those under ``if
TYPE_CHECKING:``, which never run) and fails on any strongly connected group of
more than one module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import crossroads

PACKAGE_ROOT = Path(crossroads.__file__).parent
PACKAGE = "crossroads"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for node in child.orelse:
                yield node
                yield from _run_time_nodes(node)
            continue
        yield child
        yield from _run_time_nodes(child)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The modules of the package that ``name`` imports at run time."""
    is_package = path.name == "__init__.py"
    for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    yield submodule
                elif source in modules:
                    yield source


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: set(imported_modules(name, path, modules)) - {name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "crossroads.cli" in graph
    assert "crossroads.config" in graph["crossroads.cli"]


def test_a_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_sdk_has_no_command_line() -> None:
    """client/ is a library; the click commands live in cli/."""
    for path in sorted((PACKAGE_ROOT / "client").rglob("*.py")):
        for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name.split(".")[0] == "click" for name in names), path


def test_no_import_cycles() -> None:
    graph = import_graph()
    described = [
        " -> ".join(group)
        + "\n    "
        + "\n    ".join(
            f"{module} imports {', '.join(sorted(graph[module] & set(group)))}"
            for module in group
        )
        for group in cycles(graph)
    ]
    assert not described, "import cycles:\n" + "\n".join(described)
