"""`crossroads lab matrix` writes its results to --out (default: the state
directory's results folder), never into the checkout's docs unless asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossroads.lab.cli import default_results_dir, matrix, write_results
from crossroads.lab.matrix import Result
from crossroads.state import MATRIX_FILE


def test_defaults_point_at_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CROSSROADS_STATE_DIR", str(tmp_path / "state"))
    assert default_results_dir() == tmp_path / "state" / "results"
    options = {param.name: param for param in matrix.params}
    assert options["out"].default is None  # resolved at run time, above
    assert options["markdown"].default is None  # no docs/nat-matrix.md by default


def test_write_results(tmp_path: Path) -> None:
    results = [Result("open", "cgnat", "direct", True, 0.25, "direct")]
    out = tmp_path / "results"
    written = write_results(results, out, None, "| a | b |\n")
    assert written == [out / MATRIX_FILE, out / "nat-matrix.json"]
    assert (out / MATRIX_FILE).read_text() == "| a | b |\n"
    assert json.loads((out / "nat-matrix.json").read_text())[0]["method"] == "direct"
    docs = tmp_path / "docs" / "nat-matrix.md"
    assert write_results(results, out, docs, "t\n")[-1] == docs
    assert docs.read_text() == "t\n"
