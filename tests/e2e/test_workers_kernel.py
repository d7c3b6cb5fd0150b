"""``crossroads serve --workers 2 --dataplane kernel``: both workers forward
in the kernel on the same devices (issue 30).

Each worker loads its own eBPF program with its own route maps and attaches
it to the server's devices; a datagram one worker's program does not route
goes on to the other's, then to the sockets. The server runs in the server
namespace of client (192.0.2.2) -- [toc] server [top] -- peer (198.51.100.2)
(tests/transport/netns_support.py); TURN clients from many source ports land
on both workers (SO_REUSEPORT), bind a channel to a peer and cross both ways;
each worker's own route map counts what its program forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossroads.client.turn import TurnClient
from crossroads.transport.kernelplane import KernelPlane, KernelPlaneUnavailable
from tests.transport.netns_support import inside, relay_lab
from tests.transport.plane_support import wire_like

pytestmark = pytest.mark.timeout(90)

CLIENT_IP, PEER_IP = "192.0.2.2", "198.51.100.2"
LISTEN_IP, RELAY_IP = "192.0.2.1", "198.51.100.1"
STUN_PORT = 3478
USER, PASSWORD = "alice", "secret123"
STARTED = re.compile(r"worker (\d+)/2 started \(pid (\d+)\)")
#: route_val.packets in relay.bpf.c (after addresses, ports, channel, kind,
#: ifindex and padding).
PACKETS_AT = 48


@pytest.fixture(params=["tc", "xdp"])
def server(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[dict[str, str], Path, str]]:
    """``--kernel-hook tc`` on relay_lab, or ``xdp`` on it made wire-like
    (full checksums, NAPI on the far ends, forwarding on: XDP can finish
    every datagram)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for namespaces and eBPF")
    try:
        KernelPlane.load().close()
    except KernelPlaneUnavailable as exc:
        pytest.skip(f"kernel plane unavailable: {exc}")
    hook = request.param
    with (
        relay_lab("ks") as names,
        wire_like(names) if hook == "xdp" else contextlib.nullcontext(),
    ):
        log = tmp_path / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
        env["XDG_STATE_HOME"] = str(tmp_path / "state")
        with log.open("wb") as output:
            process = subprocess.Popen(
                [
                    "ip", "netns", "exec", names["server"],
                    sys.executable, "-m", "crossroads", "serve", "--workers", "2",
                    "--dataplane", "kernel", "--kernel-hook", hook, "--host", LISTEN_IP,
                    "--only", "stun,turn", "--http-port", "8080",
                    "--stun-port", str(STUN_PORT), "--stun-alt-port", "3479",
                    "--turn-user", f"{USER}:{PASSWORD}",
                    "--turn-relay-ip", RELAY_IP,
                    "--turn-allowed-peers", "198.51.100.0/24",
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 45
            while log.read_text().count(f"stun: udp {LISTEN_IP}:{STUN_PORT}") < 2:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(log.read_text())
                time.sleep(0.1)
            yield names, log, hook
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def maps_of(pid: int) -> Iterator[dict[str, str]]:
    """The fdinfo fields of each BPF map process ``pid`` holds."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) != "anon_inode:bpf-map":
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
        except OSError:
            continue
        yield {
            key: value.strip()
            for key, value in (
                line.split(":\t", 1) for line in info.splitlines() if ":\t" in line
            )
        }


def dump(fields: dict[str, str]) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["bpftool", "-j", "map", "dump", "id", fields["map_id"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    entries: list[dict[str, Any]] = json.loads(out)
    return entries


def forwarded_by(pid: int) -> int:
    """Packets the programs of process ``pid`` forwarded on its live TURN
    routes (its own ``routes`` map: a hash keyed by 40 bytes)."""
    total = 0
    for fields in maps_of(pid):
        if fields.get("map_type") != "1" or fields.get("key_size") != "40":
            continue
        for entry in dump(fields):
            raw = bytes(int(b, 16) for b in entry["value"])
            total += int.from_bytes(raw[PACKETS_AT : PACKETS_AT + 8], "little")
    return total


def xdp_forwarded_by(pid: int) -> int:
    """Datagrams the XDP program of process ``pid`` forwarded itself (its
    ``xdp_stats`` map, per CPU, 5 slots: [0] is XDP_FORWARDED)."""
    total = 0
    for fields in maps_of(pid):
        if fields.get("map_type") != "6" or fields.get("max_entries") != "5":
            continue
        for entry in dump(fields):
            if entry["formatted"]["key"] == 0:
                total += sum(cpu["value"] for cpu in entry["formatted"]["values"])
    return total


async def one_client(names: dict[str, str], n: int) -> tuple[TurnClient, socket.socket]:
    """A client with a channel to its own peer, crossed once each way."""
    with inside(names["client"]):
        csock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    csock.bind((CLIENT_IP, 0))
    csock.connect((LISTEN_IP, STUN_PORT))
    csock.setblocking(False)
    with inside(names["peer"]):
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind((PEER_IP, 0))
    peer.setblocking(False)
    client = await TurnClient.on_socket(
        csock, (LISTEN_IP, STUN_PORT), USER, PASSWORD, timeout=10
    )
    relayed = await client.allocate()
    await client.bind_channel(peer.getsockname())
    loop = asyncio.get_running_loop()
    for attempt in range(3):  # a first datagram may race the route's install
        await client.send(b"up %d" % n, peer.getsockname())
        try:
            async with asyncio.timeout(2):
                assert await loop.sock_recvfrom(peer, 2048) == (b"up %d" % n, relayed)
            break
        except TimeoutError:
            assert attempt < 2, "ChannelData never reached the peer"
    peer.sendto(b"down %d" % n, relayed)
    assert await client.receive(2) == (b"down %d" % n, peer.getsockname())
    return client, peer


async def test_both_workers_forward_in_the_kernel(
    server: tuple[dict[str, str], Path, str],
) -> None:
    names, log, hook = server
    pids = {int(i): int(pid) for i, pid in STARTED.findall(log.read_text())}
    assert sorted(pids) == [0, 1], log.read_text()
    assert log.read_text().count("dataplane: kernel") >= 2, log.read_text()
    # 16 source ports hashed over 2 sockets: both get some (all on one: 2^-15).
    clients = [await one_client(names, n) for n in range(16)]
    try:
        for client, peer in clients:
            for n in range(3):
                await client.send(b"more %d" % n, peer.getsockname())
        await asyncio.sleep(0.5)
        counts = {index: forwarded_by(pid) for index, pid in pids.items()}
        # Each worker's own program forwarded its own clients' channels.
        assert counts[0] > 0 and counts[1] > 0, counts
        assert sum(counts.values()) >= 16 * 4 + 16, counts
        if hook == "xdp":
            # One XDP program per device: the first worker's holds it, the
            # other's routes go by its tc program behind it, and say so.
            text = log.read_text()
            for device in ("toc", "top"):
                assert text.count(f"device {device}: xdp (driver mode") == 1, text
                held = f"device {device}: tc (another XDP program"
                assert text.count(held) == 1, text
            by_xdp = {index: xdp_forwarded_by(pid) for index, pid in pids.items()}
            holder = max(by_xdp, key=lambda index: by_xdp[index])
            # The holder's channels went by XDP (their first datagrams may
            # find no neighbour yet and go by tc); the other's XDP holds
            # no device and forwarded nothing.
            assert 0 < by_xdp[holder] <= counts[holder], (by_xdp, counts)
            assert by_xdp[1 - holder] == 0, by_xdp
    finally:
        for client, peer in clients:
            await client.close()
            peer.close()
