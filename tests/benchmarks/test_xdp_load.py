"""The in-kernel load generator and sink of benchmarks/kernel_plane.py.

The generator (an XDP program run in live-frames mode) must put real
datagrams on the wire: each flow's own addresses, ports and payload, with
checksums the receiving stack accepts, every one it counts as sent; the
sink must count exactly what reaches it while it drops, and pass everything
otherwise. A low paced rate between two namespaces, so the test checks
correctness, not speed.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.transport.netns_support import inside, ipv4_udp_frame, mac_of, relay_lab

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Loaded from its file: benchmarks/ on sys.path would shadow packages (its
# raknet.py is not the PyPI raknet other tests import).
_spec = importlib.util.spec_from_file_location("xdp_load", BENCHMARKS / "xdp_load.py")
assert _spec is not None and _spec.loader is not None
xdp_load = importlib.util.module_from_spec(_spec)
sys.modules["xdp_load"] = xdp_load  # its dataclasses look their module up
_spec.loader.exec_module(xdp_load)

pytestmark = [
    pytest.mark.skipif(shutil.which("clang") is None, reason="needs clang"),
    pytest.mark.skipif(
        not Path("/sys/kernel/btf/vmlinux").exists(), reason="needs a BTF kernel"
    ),
]

FLOWS = 4
RATE = 5_000  # datagrams/s: the socket below holds them all


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[dict[str, str], xdp_load.Loader]]:
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, XDP)")
    with relay_lab("xg") as ns:
        loader = xdp_load.Loader.load(xdp_load.build(tmp_path))
        try:
            # The server's veth receives the generator's frames through NAPI.
            loader.attach(ns["server"], "toc", "load_sink")
            yield ns, loader
        finally:
            loader.close()


def generate(loader: xdp_load.Loader, ns: dict[str, str], frames: list[bytes]) -> int:
    """Send at RATE for a moment; how many the generator counts as sent."""
    loader.configure(round(1e9 / RATE), frames)
    before = loader.sent()
    generator = xdp_load.Generator(loader, ns["client"], "eth0", 0, frames[0])
    generator.start()
    time.sleep(0.3)
    generator.stop()
    return loader.sent() - before


def flow_frames(ns: dict[str, str], port: int) -> list[bytes]:
    client = mac_of(ns["client"], "eth0")
    server = mac_of(ns["server"], "toc")
    return [
        ipv4_udp_frame(
            client,
            server,
            ("192.0.2.2", 40000 + i),
            ("192.0.2.1", port),
            f"flow {i}".encode().ljust(100, b"."),
        )
        for i in range(FLOWS)
    ]


def receiver(ns: dict[str, str]) -> socket.socket:
    with inside(ns["server"]):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # SO_RCVBUFFORCE (root): past net.core.rmem_max, room for every datagram
    # of a run, read after it.
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)
    sock.bind(("192.0.2.1", 0))
    sock.settimeout(1.0)
    return sock


def test_the_generator_sends_each_flows_datagram_with_valid_checksums(
    lab: tuple[dict[str, str], xdp_load.Loader],
) -> None:
    ns, loader = lab
    with receiver(ns) as sock:
        sent = generate(loader, ns, flow_frames(ns, sock.getsockname()[1]))
        assert sent > 0
        got: list[tuple[bytes, int]] = []
        try:
            while len(got) < sent:
                data, source = sock.recvfrom(2048)
                got.append((data, source[1]))
        except TimeoutError:
            pass
    # Every datagram the generator counted reached the socket (a wrong
    # checksum would have been dropped by the stack), each from its flow's
    # port with its flow's payload, the flows in turn.
    assert len(got) == sent
    assert all(
        data == f"flow {port - 40000}".encode().ljust(100, b".") for data, port in got
    )
    assert [port for _, port in got[:FLOWS]] == sorted(p for _, p in got[:FLOWS])
    assert {port for _, port in got} == {40000 + i for i in range(FLOWS)}


def test_the_sink_counts_what_it_drops_and_passes_otherwise(
    lab: tuple[dict[str, str], xdp_load.Loader],
) -> None:
    ns, loader = lab
    with receiver(ns) as sock:
        frames = flow_frames(ns, sock.getsockname()[1])
        loader.sinking(True)
        before = loader.sunk()
        sent = generate(loader, ns, frames)
        deadline = time.monotonic() + 2
        while loader.sunk() - before < sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent > 0 and loader.sunk() - before == sent
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(2048)  # dropped: nothing reached the socket
        loader.sinking(False)
        generate(loader, ns, frames)
        assert sock.recv(2048).startswith(b"flow ")
