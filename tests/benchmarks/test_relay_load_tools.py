"""Smoke test of the C tools of benchmarks/turn_saturation.py.

The load generator (turn_load.c) and the bare forwarder (bare_forwarder.c)
check each other: the forwarder must strip and add ChannelData and Send/Data
indication headers exactly, or the generator finds no tag in what arrives and
counts it as foreign. A low rate on loopback, so the test measures correctness,
not speed.
"""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HOST = "127.0.0.1"
PAYLOAD = 100
CHANNEL = 0x4000
MAGIC = 0x2112A442

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc")


def compile_tool(name: str, directory: Path) -> Path:
    binary = directory / name
    subprocess.run(
        [
            "cc",
            "-O2",
            "-Wall",
            "-Werror",
            "-o",
            str(binary),
            str(BENCHMARKS / f"{name}.c"),
        ],
        check=True,
    )
    return binary


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(bare_forwarder, turn_load), compiled once for the module."""
    directory = tmp_path_factory.mktemp("tools")
    return compile_tool("bare_forwarder", directory), compile_tool(
        "turn_load", directory
    )


@pytest.fixture
def forwarder(tools: tuple[Path, Path]) -> Iterator[tuple[int, Path]]:
    """A running bare forwarder with 4 relay sockets: (its port, generator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((HOST, 0))
        port = int(probe.getsockname()[1])
    process = subprocess.Popen(
        [str(tools[0]), HOST, str(port), "4"], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith(b"ready")
        yield port, tools[1]
    finally:
        process.kill()
        process.wait()


def udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Room for every datagram of a run (a few thousand), so that a loaded
    # machine that pauses the generator cannot make the kernel drop any.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((HOST, 0))
    sock.settimeout(5)
    return sock


def send_indication_header(peer: tuple[str, int]) -> bytes:
    port = peer[1] ^ (MAGIC >> 16)
    address = struct.unpack("!I", socket.inet_aton(peer[0]))[0] ^ MAGIC
    attrs = struct.pack("!HHBBHI", 0x0012, 8, 0, 1, port, address)
    attrs += struct.pack("!HH", 0x0013, PAYLOAD)
    return struct.pack("!HHI", 0x0016, len(attrs) + PAYLOAD, MAGIC) + bytes(12) + attrs


def run_load(
    generator: Path,
    flows: list[tuple[socket.socket, tuple[str, int], bytes, socket.socket]],
) -> dict[str, float]:
    table = "".join(
        f"{s.fileno()} {d[0]} {d[1]} {h.hex() or '-'} {r.fileno()}\n"
        for s, d, h, r in flows
    )
    fds = sorted({sock.fileno() for flow in flows for sock in (flow[0], flow[3])})
    # 4000 datagrams/s for 0.5 s measured, 2 s to drain: a correctness run.
    result = subprocess.run(
        [str(generator), "4000", "0.1", "0.5", "2", str(PAYLOAD), "7"],
        input=table,
        capture_output=True,
        text=True,
        pass_fds=fds,
        timeout=60,
        check=True,
    )
    return {k: float(v) for k, v in (part.split("=") for part in result.stdout.split())}


def test_channel_data_and_indications_both_ways(forwarder: tuple[int, Path]) -> None:
    port, generator = forwarder
    server = (HOST, port)
    sockets = [udp() for _ in range(4)]
    try:
        flows = []
        for index, channel in enumerate((CHANNEL, 0)):
            client, peer = sockets[2 * index], sockets[2 * index + 1]
            peer_address = peer.getsockname()
            client.sendto(
                b"!" + struct.pack("!HH", index, channel) + socket.inet_aton(HOST)
                + struct.pack("!H", peer_address[1]),
                server,
            )  # fmt: skip
            answer = client.recv(64)
            assert answer[:3] == b"!ok"
            relayed = (HOST, struct.unpack_from("!H", answer, 3)[0])
            header = (
                struct.pack("!HH", CHANNEL, PAYLOAD)
                if channel
                else send_indication_header(peer_address)
            )
            flows += [(client, server, header, peer), (peer, relayed, b"", client)]
        figures = run_load(generator, flows)
    finally:
        for sock in sockets:
            sock.close()
    assert figures["sent"] > 0
    assert figures["foreign"] == 0
    assert figures["received"] == figures["sent"]


def test_pairs_forward_unchanged(forwarder: tuple[int, Path]) -> None:
    port, generator = forwarder
    server = (HOST, port)
    host, joiner = udp(), udp()
    try:
        for sock in (host, joiner):
            sock.sendto(b"&" + struct.pack("!I", 42), server)
            assert sock.recv(64) == b"&ok"
        assert host.recv(64) == b"&ok"  # told again when the pair is complete
        frame = bytes.fromhex("da7200") + bytes(33)  # any bytes: forwarded as is
        figures = run_load(
            generator, [(joiner, server, frame, host), (host, server, frame, joiner)]
        )
    finally:
        host.close()
        joiner.close()
    assert figures["sent"] > 0
    assert figures["foreign"] == 0
    assert figures["received"] == figures["sent"]
