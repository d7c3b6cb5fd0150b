"""The three relay data planes as test parameters (issue 30: "routes,
counters and teardown behave the same on every plane; one test suite runs
against each")."""

from __future__ import annotations

import os

import pytest

from crossroads.transport import dataplane, planes, turnplane
from crossroads.transport.kernelplane import KernelPlane, KernelPlaneUnavailable


def _kernel_loads() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable:
        return False
    return True


def skip_unless_kernel_loads() -> None:
    """Skip the test, saying why, where the kernel plane's program does not
    load here."""
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable as exc:
        pytest.skip(f"kernel plane unavailable: {exc}")


PLANES = [
    pytest.param("python", id="python"),
    pytest.param(
        "c",
        id="c",
        marks=pytest.mark.skipif(
            not dataplane.ACCELERATED, reason="C data plane not built"
        ),
    ),
    pytest.param(
        "kernel",
        id="kernel",
        marks=pytest.mark.skipif(
            not _kernel_loads(), reason="needs root and a kernel that loads the program"
        ),
    ),
]


def keep_plane_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo, after the test, what choosing the Python plane switches for the
    whole process (planes.use_python_plane)."""
    for name in (
        "RouteType",
        "RouteTapType",
        "BudgetType",
        "PollerType",
        "ACCELERATED",
    ):
        monkeypatch.setattr(dataplane, name, getattr(dataplane, name))
    monkeypatch.setattr(turnplane, "ACCELERATED", turnplane.ACCELERATED)
    import crossroads.services.turn as turn_service
    import crossroads.transport.stunport as stunport

    monkeypatch.setattr(turn_service, "ACCELERATED", turn_service.ACCELERATED)
    monkeypatch.setattr(stunport, "ACCELERATED", stunport.ACCELERATED)
    if planes.PURE_PYTHON_ENV in os.environ:
        monkeypatch.setenv(planes.PURE_PYTHON_ENV, os.environ[planes.PURE_PYTHON_ENV])
    else:
        monkeypatch.delenv(planes.PURE_PYTHON_ENV, raising=False)
