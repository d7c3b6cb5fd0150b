"""--dataplane: which relay data plane runs, the log line and the info metric."""

from __future__ import annotations

import logging
import os
import socket

import pytest
from prometheus_client import CollectorRegistry

from crossroads.transport import dataplane, planes, turnplane
from crossroads.transport.kernelplane import KernelPlane, KernelPlaneUnavailable
from tests.transport.plane_support import keep_plane_globals


def kernel_loads() -> bool:
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable:
        return False
    return True


def test_auto_takes_the_kernel_when_the_program_loads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 30: ``auto`` is the kernel plane where the program loads, else
    the C plane (else Python); one log line says which and why."""
    registry = CollectorRegistry()
    choice = planes.select("auto")
    with caplog.at_level(logging.INFO, logger="crossroads.dataplane"):
        planes.announce(choice, registry)
    try:
        if kernel_loads():
            expected = "kernel"
            assert choice.kernel is not None
            assert "dataplane: kernel (eBPF program loaded" in caplog.text
        else:
            expected = "c" if dataplane.ACCELERATED else "python"
            assert choice.kernel is None
            assert f"dataplane: {expected} (eBPF program not loaded" in caplog.text
        assert choice.kind == expected
        for kind in ("kernel", "c", "python"):
            assert registry.get_sample_value(
                "crossroads_dataplane_info", {"kind": kind}
            ) == (1 if kind == expected else 0)
    finally:
        choice.close()


@pytest.mark.skipif(not kernel_loads(), reason="eBPF program does not load here")
def test_kernel_when_asked_or_auto() -> None:
    choice = planes.select("kernel")
    assert choice.kind == "kernel" and choice.kernel is not None
    choice.close()
    assert choice.kernel is None
    auto = planes.select("auto")
    assert auto.kind == "kernel" and "eBPF program loaded" in auto.reason
    auto.close()


def test_kernel_that_cannot_load_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(cls: object, path: object = None) -> KernelPlane:
        raise KernelPlaneUnavailable(
            "the kernel refused the program: Operation not permitted"
        )

    monkeypatch.setattr(KernelPlane, "load", classmethod(refuse))
    with pytest.raises(
        planes.DataplaneError, match="--dataplane kernel: the kernel refused"
    ):
        planes.select("kernel")
    choice = planes.select("auto")
    assert choice.kind in ("c", "python") and "eBPF program not loaded" in choice.reason


def test_python_switches_every_new_route_to_the_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import crossroads.services.turn as turn_service
    import crossroads.transport.stunport as stunport

    keep_plane_globals(monkeypatch)
    choice = planes.select("python")
    assert choice.kind == "python"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        route = dataplane.make_route(sock, ("127.0.0.1", 9))
        assert isinstance(route, dataplane.PyRoute)
        assert isinstance(dataplane.make_budget(0), dataplane.PyBudget)
    finally:
        sock.close()
    assert turnplane.ACCELERATED is False and turn_service.ACCELERATED is False
    assert stunport.ACCELERATED is False
    assert os.environ[planes.PURE_PYTHON_ENV] == "1"  # for the workers


def test_unknown_plane_is_refused() -> None:
    with pytest.raises(planes.DataplaneError):
        planes.select("dpdk")
