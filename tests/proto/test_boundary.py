"""proto/ is sans-I/O: no module under it may import I/O, clocks or randomness."""

from __future__ import annotations

import ast
from pathlib import Path

import crossroads

FORBIDDEN = {"asyncio", "socket", "selectors", "time", "random", "threading", "uvloop"}
PROTO = Path(crossroads.__file__).parent / "proto"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_proto_modules_do_no_io() -> None:
    offenders = {
        str(path.relative_to(PROTO)): sorted(imported_modules(path) & FORBIDDEN)
        for path in PROTO.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
