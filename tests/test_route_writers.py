"""Routes are written in one place: the route table (transport/routes.py).

A relay's data plane forwards by the route dicts of its socket taps
(transport/dataplane.py); the kernel plane by its map. If a relay wrote its
tap's dict itself, its routes would exist in one plane and not the other,
and its counts would miss what the other forwarded: the reason
:class:`~crossroads.transport.routes.RouteTable` exists. This check walks
every module of ``crossroads`` with ``ast`` and fails on a statement that
changes a mapping named like a route table (a name or attribute ending in
``routes``): an item assigned or deleted, or ``pop``/``clear``/``update``/
``setdefault``/``popitem`` called on it, anywhere but in the writers below.

It is a grep with a parser: a dict written through an alias of another name
escapes it. Taps only ever get their table from ``make_tap`` and the relays'
owners, so a new writer almost always spells the name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_imports import all_modules

#: The writers, by module and function (qualified name), and why each may.
WRITERS: dict[tuple[str, str], str] = {
    ("crossroads.transport.routes", "*"): "the route table itself",
    # Not taps' tables:
    ("crossroads.proto.turn.allocation", "*"): (
        "the TURN core's channel bindings (its state; the route table writes "
        "the taps' tables for it)"
    ),
    ("crossroads.transport.kernelplane", "*"): (
        "the kernel plane's record of its map entries, changed only by "
        "install/remove, which the route table calls"
    ),
    ("crossroads.proto.relay.server", "MemoryForwarding.install"): (
        "the Unity core's in-memory forwarding port (no transport, no tap)"
    ),
    ("crossroads.client.peer", "*"): "the SDK's receivers by id, not a tap",
}

_MUTATORS = {"pop", "clear", "update", "setdefault", "popitem", "__setitem__"}


def _named_routes(node: ast.expr) -> bool:
    """Is ``node`` a name or attribute ending in ``routes``?"""
    if isinstance(node, ast.Name):
        return node.id.lower().endswith("routes")
    if isinstance(node, ast.Attribute):
        return node.attr.lower().endswith("routes")
    return False


class _Writes(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []

    def _enter(
        self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    ) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _enter
    visit_FunctionDef = _enter
    visit_AsyncFunctionDef = _enter

    def _hit(self, node: ast.AST) -> None:
        line = getattr(node, "lineno", 0)
        self.found.append((".".join(self.scope), line, ast.unparse(node)))

    def _targets(self, targets: list[ast.expr], node: ast.AST) -> None:
        for target in targets:
            if isinstance(target, ast.Subscript) and _named_routes(target.value):
                self._hit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target], node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._targets([node.target], node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node.targets, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _MUTATORS
            and _named_routes(func.value)
        ):
            self._hit(node)
        self.generic_visit(node)


def route_writes(source: str) -> list[tuple[str, int, str]]:
    """(function, line, statement) of every write to a ``*routes`` mapping."""
    visitor = _Writes()
    visitor.visit(ast.parse(source))
    return visitor.found


def _allowed(module: str, function: str) -> bool:
    return (module, "*") in WRITERS or (module, function) in WRITERS


def stray_writes(modules: dict[str, Path]) -> list[str]:
    return [
        f"{module}:{line} in {function or '<module>'}: {text}"
        for module, path in sorted(modules.items())
        for function, line, text in route_writes(path.read_text())
        if not _allowed(module, function)
    ]


def test_a_stray_write_is_found() -> None:
    found = route_writes(
        "class Side:\n"
        "    def learn(self, addr):\n"
        "        self.routes[addr] = 1\n"
        "        del peer_routes[addr]\n"
        "        self.tap_routes.pop(addr, None)\n"
        "        seen[addr] = self.routes[addr]\n"
    )
    assert [(f, n) for f, n, _ in found] == [
        ("Side.learn", 3),
        ("Side.learn", 4),
        ("Side.learn", 5),
    ]


def test_every_named_writer_exists() -> None:
    modules = all_modules()
    assert {module for module, _ in WRITERS} <= set(modules)


def test_only_the_route_table_writes_routes() -> None:
    assert stray_writes(all_modules()) == []
