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
from crossroads.lab.matrix import (
    REMAP_DELAY,
    VIA_STEPS,
    delay_span,
    load_methods,
    pairs,
)
from crossroads.lab.topology import Lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(600)]


def test_full_matrix(lab: Lab, tmp_path: Path) -> None:
    methods = load_methods()
    out = tmp_path / "results"
    md = tmp_path / "docs" / "nat-matrix.md"
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
    results = json.loads((out / "nat-matrix.json").read_text())
    # --out holds the table too; --markdown is an extra copy of it.
    assert (out / "nat-matrix.md").read_text() == md.read_text()
    # Every pair for every method; a slow method (openttd) its default subset.
    assert len(results) == sum(len(m.pairs(KINDS, False)) for m in methods.values())
    assert len(pairs()) == 45
    wrong = []
    for row in results:
        assert set(row) == {
            "a",
            "b",
            "method",
            "connected",
            "first_attempt",
            "seconds",
            "via",
        }
        assert row["connected"] or not row["first_attempt"]
        assert row["via"] in (VIA_STEPS if row["connected"] else (None,))
        want = methods[row["method"]].expected
        if want is None:
            continue
        x, y = KINDS_BY_NAME[row["a"]], KINDS_BY_NAME[row["b"]]
        if want(x, y) != row["connected"]:
            wrong.append(row)
        first = methods[row["method"]].expected_first
        if first is not None and first(x, y) not in (None, row["first_attempt"]):
            wrong.append(row)
        via = methods[row["method"]].expected_via
        if row["connected"] and via is not None and via(x, y) not in (None, row["via"]):
            wrong.append(row)
    assert not wrong, "\n".join(map(str, wrong)) + "\n" + proc.stdout[-3000:]
    # The ladder (with its TURN relay step) connects every pair; TURN over TCP
    # connects every pair; TURN over UDP all but those with a udp-blocked side.
    by_method: dict[str, list[dict[str, object]]] = {}
    for row in results:
        by_method.setdefault(row["method"], []).append(row)
    assert all(row["connected"] for row in by_method["ladder"])
    assert all(row["connected"] for row in by_method["turn-tcp"])
    assert {
        (row["a"], row["b"]) for row in by_method["turn-udp"] if not row["connected"]
    } == {(x.name, y.name) for x, y in pairs() if "udp-blocked" in (x.name, y.name)}
    # A real OpenTTD 13 server (host A) and client (host B) join through
    # crossroads' coordinator: the direct probe for a public server, STUN hole
    # punching (TCP simultaneous open) where both NATs keep ports, TURN where a
    # NAT randomizes them, and all over TCP past the UDP-blocking firewall.
    openttd = {(row["a"], row["b"]): row for row in by_method["openttd"]}
    assert openttd[("open", "open")]["via"] == "direct"
    assert openttd[("full-cone", "port-restricted-cone")]["via"] == "punch"
    assert openttd[("symmetric-random", "symmetric-random")]["via"] == "relay"
    assert openttd[("open", "udp-blocked")]["connected"]
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


def test_remap_pairs_get_distance_by_default() -> None:
    """Without --delay only pairs with a router that remaps on a knock run with
    delay lines (20-80 ms per path); --delay sets every pair."""
    k = KINDS_BY_NAME
    remap, cone = k["port-restricted-remap"], k["port-restricted-cone"]
    assert remap in KINDS  # in the default matrix: a common home router
    assert delay_span(remap, cone, None) == REMAP_DELAY == (0.02, 0.08)
    assert delay_span(cone, remap, None) == REMAP_DELAY
    assert delay_span(cone, cone, None) is None
    assert delay_span(cone, cone, (0.005, 0.15)) == (0.005, 0.15)


def test_remapping_routers_connect_first_time_with_distance(
    lab: Lab, tmp_path: Path
) -> None:
    """`lab matrix --delay`: each attempt's paths get 30-60 ms one way (delay
    lines). Two port-restricted cones behind routers that remap on a knock
    (docs/natneg.md) then connect on natneg's first attempt, directly: the timed
    CONNECTs make the first pings cross in flight."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crossroads",
            "lab",
            "matrix",
            "--prefix",
            lab.prefix,
            "--methods",
            "natneg",
            "--kinds",
            "port-restricted-remap",
            "--delay",
            "30-60",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "matrix.md"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "nat-matrix.json").read_text())
    assert (row["a"], row["b"]) == ("port-restricted-remap", "port-restricted-remap")
    assert row["connected"] and row["first_attempt"] and row["via"] == "punch"
    assert "--delay 30-60" in (tmp_path / "matrix.md").read_text()
