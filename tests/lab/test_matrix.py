"""The full connection-success matrix, once, through the CLI: every pair of NAT
kinds for every registered method; each outcome must match the method's
prediction from the kinds' RFC 4787 behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from crossroads.lab.kinds import KINDS, KINDS_BY_NAME
from crossroads.lab.matrix import VIA_STEPS, load_methods, pairs
from crossroads.lab.topology import Lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(600)]


def test_full_matrix(lab: Lab, tmp_path: Path) -> None:
    methods = load_methods()
    out = tmp_path / "matrix.json"
    md = tmp_path / "nat-matrix.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crossroads",
            "lab",
            "matrix",
            "--prefix",
            lab.prefix,
            "--out",
            str(out),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    results = json.loads(out.read_text())
    assert len(results) == len(methods) * len(pairs()) == len(methods) * 36
    wrong = []
    for row in results:
        assert set(row) == {"a", "b", "method", "connected", "seconds", "via"}
        assert row["via"] in (VIA_STEPS if row["connected"] else (None,))
        want = methods[row["method"]].expected
        if want is None:
            continue
        if want(KINDS_BY_NAME[row["a"]], KINDS_BY_NAME[row["b"]]) != row["connected"]:
            wrong.append(row)
    assert not wrong, "\n".join(map(str, wrong)) + "\n" + proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stderr
    # Progress lines, and the table has a row per kind for every method.
    assert proc.stdout.count(" <-> ") == len(results)
    text = md.read_text()
    for name in methods:
        assert f"## `{name}`" in text
    for kind in KINDS:
        assert f"| **{kind.name}** |" in text


def test_known_outcomes() -> None:
    """A few textbook cells, spelled out (independent of the prediction code)."""
    methods = load_methods()
    k = KINDS_BY_NAME
    punch = methods["punch"].expected
    direct = methods["direct"].expected
    assert punch is not None and direct is not None
    assert punch(k["port-restricted-cone"], k["port-restricted-cone"])
    assert punch(k["symmetric-random"], k["restricted-cone"])
    assert not punch(k["symmetric-random"], k["port-restricted-cone"])
    assert not punch(k["symmetric-sequential"], k["symmetric-random"])
    assert not punch(k["udp-blocked"], k["open"])
    assert direct(k["open"], k["symmetric-random"])
    assert not direct(k["full-cone"], k["full-cone"])
