"""The modules of ``crossroads`` import only down the layer order, and never
in a cycle.

The order, bottom first (:data:`LAYERS`; docs/architecture.md "Layers"):

0. foundation: the package root (``__version__``), ``types``, ``errors``,
   ``metrics`` and ``ratelog`` (Prometheus and log helpers), ``logs``, and
   ``service_types`` (what a running service shows: the contract web/ and
   services/ both name);
1. ``proto``: sans-I/O cores and codecs;
2. ``store``, ``state``, ``config``, ``insight``: where data and settings
   live. ``config`` reads ``proto.policy`` (network lists in settings) and
   ``store.base`` (which URLs name a store);
3. ``transport``: the asyncio adapters. ``transport.localaddrs`` reads the
   configuration (which settings hold the server's own addresses) and
   ``transport.kernel_drops`` the metrics helpers: both below it;
4. ``client`` (the SDK), ``services`` and ``web`` side by side: none imports
   another. A service's HTTP API is its own router, handed to the web app
   through the registry the runtime fills (``ServiceContext.add_router``);
   what the console reads of a service the runtime hands it as callables;
5. ``runtime``, ``acme``, ``workers``, ``firstrun``, ``config_doc`` and ``lab``:
   they start and wire services (the lab reads every service's settings to write
   ``crossroads serve`` command lines in its namespaces);
6. entry points: ``cli``, ``admincli``, ``__main__``.

A module may import its own layer and the ones below. The check walks every
module's import statements with ``ast``: also imports inside functions (they
run, later) and under ``if TYPE_CHECKING:`` (a dependency all the same); the
cycle check leaves the latter out, as they never run. A cycle makes the
import order matter (a half-initialised module at run time) and blurs the
layers; it fails on any strongly connected group of more than one module.
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


def imported_modules(
    name: str, path: Path, modules: dict[str, Path], *, type_checking: bool = False
) -> Iterator[str]:
    """The modules of the package that ``name`` imports at run time (and
    under ``if TYPE_CHECKING:`` when ``type_checking``)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    nodes = ast.walk(tree) if type_checking else _run_time_nodes(tree)
    for node in nodes:
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


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: set(imported_modules(name, path, modules, type_checking=type_checking))
        - {name}
        for name, path in modules.items()
    }


#: The layer order, bottom first (module docstring): module name prefixes.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "crossroads",
        "crossroads.types",
        "crossroads.errors",
        "crossroads.metrics",
        "crossroads.ratelog",
        "crossroads.logs",
        "crossroads.service_types",
    ),
    ("crossroads.proto",),
    ("crossroads.store", "crossroads.state", "crossroads.config", "crossroads.insight"),
    ("crossroads.transport",),
    ("crossroads.client", "crossroads.services", "crossroads.web"),
    (
        "crossroads.runtime",
        # Orders certificates and serves HTTP-01 on a listener of its own: the
        # runtime's helper (transport and web below it).
        "crossroads.acme",
        "crossroads.workers",
        "crossroads.firstrun",
        "crossroads.config_doc",
        "crossroads.lab",
    ),
    ("crossroads.cli", "crossroads.admincli", "crossroads.__main__"),
)
#: Packages of one layer that stand beside each other: neither imports the other.
SIDE_BY_SIDE: tuple[str, ...] = (
    "crossroads.client",
    "crossroads.services",
    "crossroads.web",
)


def _prefix(module: str, prefixes: tuple[str, ...]) -> str | None:
    """The longest of ``prefixes`` that ``module`` is or is inside of."""
    found = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(found, key=len) if found else None


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """The index in ``layers`` of the longest prefix naming ``module``."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, prefixes in enumerate(layers):
        prefix = _prefix(module, prefixes)
        if prefix is not None and (best is None or len(prefix) > best[0]):
            best = (len(prefix), index)
    if best is None:
        raise KeyError(f"{module} has no place in the layer order (LAYERS)")
    return best[1]


def upward_imports(
    graph: dict[str, set[str]],
    layers: tuple[tuple[str, ...], ...] = LAYERS,
    side_by_side: tuple[str, ...] = SIDE_BY_SIDE,
) -> list[str]:
    """Each import that points up the order, or across side-by-side packages."""
    found = []
    for module in sorted(graph):
        here = layer_of(module, layers)
        beside = _prefix(module, side_by_side)
        for target in sorted(graph[module]):
            there = layer_of(target, layers)
            if there > here:
                found.append(
                    f"{module} (layer {here}) imports {target} (layer {there})"
                )
                continue
            other = _prefix(target, side_by_side)
            if beside is not None and other is not None and other != beside:
                found.append(
                    f"{module} imports {target}: {beside} and {other} stand side by side"
                )
    return found


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


def test_an_upward_import_is_found() -> None:
    layers = (("p.low",), ("p.mid.a", "p.mid.b"), ("p.top",))
    graph = {
        "p.low.x": {"p.mid.a.y"},  # up
        "p.mid.a.y": {"p.low.x", "p.mid.b"},  # down; across side by side
        "p.mid.b": set(),
        "p.top": {"p.mid.b", "p.low.x"},  # down
    }
    assert upward_imports(graph, layers, ("p.mid.a", "p.mid.b")) == [
        "p.low.x (layer 0) imports p.mid.a.y (layer 1)",
        "p.mid.a.y imports p.mid.b: p.mid.a and p.mid.b stand side by side",
    ]


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_imports_point_down_the_layer_order() -> None:
    found = upward_imports(import_graph(type_checking=True))
    assert not found, "imports that point up the layer order:\n" + "\n".join(found)


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
