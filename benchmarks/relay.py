"""Relay benchmark: crossroads' Unity-Relay data plane next to TURN relays.

Usage (from the repository root, after ``make install``)::

    .venv/bin/python benchmarks/relay.py [--rounds 5] [--seconds 1.5] [--payload 100]

Every target relays the same load between two UDP sockets on 127.0.0.1:

- ``direct``: no relay at all; the load generator's own ceiling and the RTT floor.
- ``crossroads relay``: ``crossroads serve --only relay`` in its own process; a host
  and a joiner allocated through the REST API, bound and connected; RELAY frames
  joiner → relay → host (and back for latency).
- ``crossroads relay DTLS``: the same, with host and joiner on the node's DTLS
  port (DTLS 1.2, PSK-AES128-GCM-SHA256, crossroads' own DTLS client with the raw
  allocation ID as identity): the node opens each record and seals it again.
  The load generator seals a fresh record per frame, which costs it time too.
- ``crossroads TURN``: crossroads' TURN service with the same load as coturn, when
  the TURN service is present in this checkout.
- ``coturn``: ``turnserver`` (long-term credentials); the client allocates, binds
  a channel to the peer socket and sends ChannelData → coturn → peer (and back).

Figures per target, each the median over ``--rounds`` rounds:

- **packets/s**: a closed loop keeps ``--window`` frames in flight and counts
  frames delivered per second for ``--seconds``. The same single-threaded Python
  load generator drives every target; the ``direct`` row shows its ceiling, so a
  relay that reaches it is limited by the generator, not by itself.
- **server CPU µs/pkt** (crossroads rows): the relay process's CPU time
  (/proc/<pid>/stat) during the throughput runs over the frames delivered.
- **added latency**: ping-pong of one frame at a time through the relay, median
  round trip minus the direct round trip, divided by two (one relay traversal).

The relay servers are pinned to CPU 0 and the load generator to CPU 1 when the
machine has two or more CPUs, so each side has one core.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from crossroads.proto.dtls.client import ClientState, PskDtlsClient  # noqa: E402
from crossroads.proto.dtls.handshake import ApplicationData  # noqa: E402
from crossroads.proto.relay import messages as m  # noqa: E402

# The figures in docs/benchmarks.md are the C plane's; run as root, `auto`
# would forward these loopback relays in the kernel (benchmarks/kernel_plane.py
# measures that plane). An older tree (--before) ignores the variable.
os.environ.setdefault("CROSSROADS_DATAPLANE", "c")

Address = tuple[str, int]
API_KEY = "benchmark-key-0123456789"
SERVER_CPU = 0
CLIENT_CPU = 1


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
    sock.bind(("127.0.0.1", 0))
    return sock


def pin_server() -> None:
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {SERVER_CPU})


@dataclass
class Path_:
    """A relayed path: A sends ``forward`` to ``forward_to``, B receives it; the
    way back is B sending ``back`` to ``back_to``, A receiving it."""

    a: socket.socket
    b: socket.socket
    forward: bytes
    forward_to: Address
    back: bytes
    back_to: Address
    #: DTLS: every record must be fresh (a replayed one is dropped), so a
    #: callable makes each frame; None sends ``forward`` / ``back`` as they are.
    fresh_forward: Callable[[], bytes] | None = None
    fresh_back: Callable[[], bytes] | None = None
    #: The relay server's process, for its CPU time per frame.
    server_pid: int | None = None


# ----------------------------------------------------------------- measurement


def drain(*socks: socket.socket) -> None:
    for sock in socks:
        sock.setblocking(False)
        while True:
            try:
                sock.recv(65535)
            except (BlockingIOError, InterruptedError):
                break


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (proc(5), fields 14 and 15)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(path: Path_, seconds: float, window: int) -> tuple[float, int]:
    """Delivered frames per second A→B with ``window`` frames in flight."""
    drain(path.a, path.b)
    sendto, frame, dest = path.a.sendto, path.forward, path.forward_to
    fresh = path.fresh_forward
    recv_into = path.b.recv_into
    buffer = bytearray(65535)
    inflight = received = stalls = 0
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        while inflight < window:
            try:
                sendto(frame if fresh is None else fresh(), dest)
            except BlockingIOError:
                break
            inflight += 1
        got = 0
        while True:
            try:
                recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                break
            got += 1
        received += got
        inflight -= got
        if not got:
            ready, _, _ = select.select([path.b], [], [], 0.02)
            if not ready:
                stalls += 1
                inflight = 0  # what is in flight is lost; start a new window
        now = time.perf_counter()
    return received / (now - start), stalls


def round_trips(path: Path_, count: int) -> list[float]:
    """Round-trip times (µs) A→B→A, one frame at a time."""
    drain(path.a, path.b)
    path.a.setblocking(True)
    path.b.setblocking(True)
    path.a.settimeout(0.5)
    path.b.settimeout(0.5)
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        try:
            forward = (
                path.forward if path.fresh_forward is None else path.fresh_forward()
            )
            back = path.back if path.fresh_back is None else path.fresh_back()
            path.a.sendto(forward, path.forward_to)
            path.b.recv(65535)
            path.b.sendto(back, path.back_to)
            path.a.recv(65535)
        except TimeoutError:
            continue
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


@dataclass
class Result:
    name: str
    pps: float
    rtt_us: float
    p99_us: float
    stalls: int
    #: Server CPU µs per delivered frame during the throughput runs (0: unknown).
    cpu_us: float = 0.0


def measure(name: str, path: Path_, args: argparse.Namespace) -> Result:
    rates, medians, p99s, stalls, cpus = [], [], [], 0, []
    throughput(path, 0.3, args.window)  # warm-up
    for _ in range(args.rounds):
        cpu_before = cpu_seconds(path.server_pid)
        rate, stalled = throughput(path, args.seconds, args.window)
        if path.server_pid is not None and rate:
            used = cpu_seconds(path.server_pid) - cpu_before
            cpus.append(used * 1e6 / (rate * args.seconds))
        rates.append(rate)
        stalls += stalled
        samples = sorted(round_trips(path, args.pings))
        medians.append(statistics.median(samples))
        p99s.append(samples[int(len(samples) * 0.99) - 1])
    return Result(
        name,
        statistics.median(rates),
        statistics.median(medians),
        statistics.median(p99s),
        stalls,
        statistics.median(cpus) if cpus else 0.0,
    )


# ------------------------------------------------------------------- targets


@contextmanager
def direct_path(payload: bytes) -> Iterator[Path_]:
    a, b = udp_socket(), udp_socket()
    try:
        yield Path_(a, b, payload, b.getsockname(), payload, a.getsockname())
    finally:
        a.close()
        b.close()


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def http_json(url: str, body: dict[str, object] | None = None) -> dict[str, object]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json",
        },
        method="POST" if body is not None else "GET",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        data = json.loads(response.read())
    assert isinstance(data, dict)
    return data


def exchange(sock: socket.socket, data: bytes, server: Address) -> bytes:
    sock.settimeout(0.5)
    for _ in range(10):
        sock.sendto(data, server)
        try:
            return sock.recv(65535)
        except TimeoutError:
            continue
    raise RuntimeError("no answer from the relay")


def connect_pair(
    base: str, host_sock: socket.socket, join_sock: socket.socket
) -> tuple[bytes, bytes, Address]:
    """Allocate a host and a joiner through crossroads' REST API at ``base``,
    BIND both sockets and CONNECT the joiner to the host: (host allocation id,
    joiner allocation id, relay server address)."""
    host = http_json(f"{base}/v1/allocate", {"maxConnections": 1})["data"]
    assert isinstance(host, dict)
    host_alloc = host["allocation"]
    code = http_json(
        f"{base}/v1/joincode", {"allocationId": host_alloc["allocationId"]}
    )
    joined = http_json(f"{base}/v1/join", {"joinCode": code["data"]["joinCode"]})  # type: ignore[index]
    join_alloc = joined["data"]["allocation"]  # type: ignore[index]
    server = (host_alloc["relayServer"]["ipV4"], host_alloc["relayServer"]["port"])
    ids = {}
    for sock, alloc in ((host_sock, host_alloc), (join_sock, join_alloc)):
        key = base64.b64decode(alloc["key"])
        data = m.pad_connection_data(base64.b64decode(alloc["connectionData"]))
        unsigned = m.Bind(nonce=0, connection_data=data, hmac=bytes(32))
        signed = unsigned.signed_bytes()
        bind = signed + hmac.new(key, signed, hashlib.sha256).digest()
        assert exchange(sock, bind, server) == m.BindReceived().encode()
        ids[id(sock)] = base64.b64decode(alloc["allocationIdBytes"])
    hid, jid = ids[id(host_sock)], ids[id(join_sock)]
    host_data = base64.b64decode(join_alloc["hostConnectionData"])
    accepted = exchange(join_sock, m.ConnectRequest(jid, host_data).encode(), server)
    assert accepted == m.Accepted(hid, jid).encode()
    return hid, jid, server


@contextmanager
def crossroads_relay_process() -> Iterator[tuple[str, int]]:
    """``crossroads serve --only relay`` pinned to the server CPU: (API base
    URL, process id). The node serves plain UDP and DTLS."""
    http_port, relay_port, dtls_port = (
        free_port(socket.SOCK_STREAM),
        free_port(),
        free_port(),
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crossroads",
            "serve",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--only",
            "relay",
            "--relay-port",
            str(relay_port),
            "--relay-dtls-port",
            str(dtls_port),
            "--api-key",
            API_KEY,
            "--relay-allow-private-peers",
            "--log-level",
            "warning",
        ],
        preexec_fn=pin_server,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: bool(http_json(f"{base}/v1/regions")), "crossroads")
        yield base, process.pid
    finally:
        process.send_signal(signal.SIGINT)  # at once: SIGTERM drains
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def crossroads_relay_path(payload: bytes) -> Iterator[Path_]:
    host_sock, join_sock = udp_socket(), udp_socket()
    try:
        with crossroads_relay_process() as (base, pid):
            hid, jid, server = connect_pair(base, host_sock, join_sock)
            yield Path_(
                join_sock,
                host_sock,
                m.Relay(jid, hid, payload).encode(),
                server,
                m.Relay(hid, jid, payload).encode(),
                server,
                server_pid=pid,
            )
    finally:
        host_sock.close()
        join_sock.close()


class DtlsSide:
    """One relay client over DTLS on a blocking socket (crossroads' sans-I/O
    DTLS client; the 16 raw allocation ID bytes as identity, as Unity sends)."""

    def __init__(self, sock: socket.socket, server: Address, alloc: dict[str, Any]):
        self.sock, self.server = sock, server
        self.core = PskDtlsClient(
            server,
            base64.b64decode(alloc["allocationIdBytes"]),
            base64.b64decode(alloc["key"]),
            os.urandom,
        )
        sock.settimeout(0.2)
        self.core.start(time.monotonic())
        deadline = time.monotonic() + 10
        while self.core.state != ClientState.ESTABLISHED:
            if time.monotonic() > deadline:
                raise RuntimeError("DTLS handshake with the relay failed")
            self._flush()
            try:
                data = sock.recv(65535)
            except TimeoutError:
                self.core.handle_timer(time.monotonic())
                continue
            self.core.receive_datagram(data, server, time.monotonic())
        self.core.pop_events()

    def _flush(self) -> None:
        for data, addr in self.core.datagrams_to_send(0.0):
            self.sock.sendto(data, addr)

    def record(self, message: bytes) -> bytes:
        """``message`` as the next DTLS record (not sent)."""
        self.core.send(message, 0.0)
        ((data, _),) = self.core.datagrams_to_send(0.0)
        return data

    def request(self, message: bytes) -> bytes:
        for _ in range(10):
            self.sock.sendto(self.record(message), self.server)
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            self.core.receive_datagram(data, self.server, time.monotonic())
            for event in self.core.pop_events():
                if isinstance(event, ApplicationData):
                    return event.data
        raise RuntimeError("no answer from the relay over DTLS")


def bind_message(alloc: dict[str, Any]) -> bytes:
    key = base64.b64decode(alloc["key"])
    data = m.pad_connection_data(base64.b64decode(alloc["connectionData"]))
    signed = m.Bind(nonce=0, connection_data=data, hmac=bytes(32)).signed_bytes()
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


@contextmanager
def crossroads_dtls_path(payload: bytes) -> Iterator[Path_]:
    """The crossroads relay with host and joiner both on DTLS: the node opens
    every record and seals it again for the other side."""
    host_sock, join_sock = udp_socket(), udp_socket()
    try:
        with crossroads_relay_process() as (base, pid):
            host_alloc = http_json(f"{base}/v1/allocate", {"maxConnections": 1})
            host = host_alloc["data"]["allocation"]  # type: ignore[index]
            code = http_json(
                f"{base}/v1/joincode", {"allocationId": host["allocationId"]}
            )
            joined = http_json(
                f"{base}/v1/join",
                {"joinCode": code["data"]["joinCode"]},  # type: ignore[index]
            )
            joiner = joined["data"]["allocation"]  # type: ignore[index]
            (dtls,) = [
                e for e in host["serverEndpoints"] if e["connectionType"] == "dtls"
            ]
            server = (dtls["host"], dtls["port"])
            host_side = DtlsSide(host_sock, server, host)
            join_side = DtlsSide(join_sock, server, joiner)
            for side, alloc in ((host_side, host), (join_side, joiner)):
                assert side.request(bind_message(alloc)) == m.BindReceived().encode()
            hid = base64.b64decode(host["allocationIdBytes"])
            jid = base64.b64decode(joiner["allocationIdBytes"])
            host_data = base64.b64decode(joiner["hostConnectionData"])
            accepted = join_side.request(m.ConnectRequest(jid, host_data).encode())
            assert accepted == m.Accepted(hid, jid).encode()
            forward = m.Relay(jid, hid, payload).encode()
            back = m.Relay(hid, jid, payload).encode()
            host_sock.settimeout(None)
            join_sock.settimeout(None)
            yield Path_(
                join_sock,
                host_sock,
                b"",
                server,
                b"",
                server,
                fresh_forward=lambda: join_side.record(forward),
                fresh_back=lambda: host_side.record(back),
                server_pid=pid,
            )
    finally:
        host_sock.close()
        join_sock.close()


# A TURN client just big enough for the benchmark (RFC 8489 / RFC 8656):
# Allocate with long-term credentials, ChannelBind, then ChannelData.
MAGIC = 0x2112A442


def _attr(kind: int, value: bytes) -> bytes:
    return struct.pack("!HH", kind, len(value)) + value + bytes(-len(value) % 4)


def _xor_address(addr: Address) -> bytes:
    host = socket.inet_aton(addr[0])
    port = addr[1] ^ (MAGIC >> 16)
    xored = bytes(b ^ c for b, c in zip(host, struct.pack("!I", MAGIC), strict=True))
    return struct.pack("!BBH", 0, 1, port) + xored


def _parse_attrs(data: bytes) -> dict[int, bytes]:
    attrs, offset = {}, 20
    while offset + 4 <= len(data):
        kind, length = struct.unpack_from("!HH", data, offset)
        attrs.setdefault(kind, data[offset + 4 : offset + 4 + length])
        offset += 4 + length + (-length % 4)
    return attrs


def _stun(method: int, attrs: bytes, key: bytes | None) -> bytes:
    tid = os.urandom(12)
    if key is None:
        return struct.pack("!HHI", method, len(attrs), MAGIC) + tid + attrs
    # MESSAGE-INTEGRITY covers the message with the length counting it (RFC 8489 §14.5).
    header = struct.pack("!HHI", method, len(attrs) + 24, MAGIC) + tid
    mac = hmac.new(key, header + attrs, hashlib.sha1).digest()
    return header + attrs + _attr(0x0008, mac)


class TurnClient:
    def __init__(
        self, sock: socket.socket, server: Address, user: str, password: str
    ) -> None:
        self.sock, self.server, self.user, self.password = sock, server, user, password
        self.key = b""
        self.auth = b""

    def allocate(self) -> Address:
        transport = _attr(0x0019, bytes([17, 0, 0, 0]))
        reply = _parse_attrs(
            exchange(self.sock, _stun(0x0003, transport, None), self.server)
        )
        realm, nonce = reply[0x0014], reply[0x0015]
        self.key = hashlib.md5(
            f"{self.user}:{realm.decode()}:{self.password}".encode()
        ).digest()
        self.auth = (
            _attr(0x0006, self.user.encode())
            + _attr(0x0014, realm)
            + _attr(0x0015, nonce)
        )
        answer = exchange(
            self.sock, _stun(0x0003, transport + self.auth, self.key), self.server
        )
        if struct.unpack_from("!H", answer)[0] != 0x0103:
            raise RuntimeError(f"TURN Allocate failed: {answer[:2].hex()}")
        relayed = _parse_attrs(answer)[0x0016]
        port = struct.unpack_from("!H", relayed, 2)[0] ^ (MAGIC >> 16)
        host = bytes(
            b ^ c for b, c in zip(relayed[4:8], struct.pack("!I", MAGIC), strict=True)
        )
        return socket.inet_ntoa(host), port

    def create_permission(self, peer: Address) -> None:
        attrs = _attr(0x0012, _xor_address(peer))
        answer = exchange(
            self.sock, _stun(0x0008, attrs + self.auth, self.key), self.server
        )
        if struct.unpack_from("!H", answer)[0] != 0x0108:
            raise RuntimeError(f"TURN CreatePermission failed: {answer[:2].hex()}")

    def channel_bind(self, channel: int, peer: Address) -> None:
        attrs = _attr(0x000C, struct.pack("!HH", channel, 0)) + _attr(
            0x0012, _xor_address(peer)
        )
        answer = exchange(
            self.sock, _stun(0x0009, attrs + self.auth, self.key), self.server
        )
        if struct.unpack_from("!H", answer)[0] != 0x0109:
            raise RuntimeError(f"TURN ChannelBind failed: {answer[:2].hex()}")


@contextmanager
def turn_path(
    payload: bytes, server: Address, user: str, password: str
) -> Iterator[Path_]:
    client_sock, peer_sock = udp_socket(), udp_socket()
    try:
        turn = TurnClient(client_sock, server, user, password)
        relayed = turn.allocate()
        turn.channel_bind(0x4000, peer_sock.getsockname())
        channel_data = struct.pack("!HH", 0x4000, len(payload)) + payload
        yield Path_(client_sock, peer_sock, channel_data, server, payload, relayed)
    finally:
        client_sock.close()
        peer_sock.close()


@contextmanager
def coturn_path(payload: bytes) -> Iterator[Path_]:
    binary = shutil.which("turnserver")
    if binary is None:
        raise RuntimeError("coturn's turnserver is not installed")
    port = free_port()
    low = 40000 + (os.getpid() % 200) * 100
    workdir = tempfile.mkdtemp(prefix="crossroads-bench-coturn-")
    process = subprocess.Popen(
        [
            binary,
            "-n",
            "--listening-ip", "127.0.0.1",
            "--listening-port", str(port),
            "--relay-ip", "127.0.0.1",
            "--min-port", str(low),
            "--max-port", str(low + 99),
            "--lt-cred-mech",
            "--user", "bench:benchpass",
            "--realm", "crossroads.bench",
            "--no-tls",
            "--no-dtls",
            "--no-cli",
            "--allow-loopback-peers",
            "--relay-threads", "1",
            "--pidfile", f"{workdir}/turnserver.pid",
            "--db", f"{workdir}/turndb",
            "--log-file", "stdout",
            "--simple-log",
        ],
        preexec_fn=pin_server,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        probe = udp_socket()
        try:
            wait_until(lambda: _stun_ping(probe, ("127.0.0.1", port)), "coturn")
        finally:
            probe.close()
        with turn_path(payload, ("127.0.0.1", port), "bench", "benchpass") as path:
            yield path
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _stun_ping(sock: socket.socket, server: Address) -> bool:
    sock.settimeout(0.2)
    sock.sendto(_stun(0x0001, b"", None), server)
    try:
        return sock.recv(2048)[:2] == b"\x01\x01"
    except TimeoutError:
        return False


def crossroads_turn_available() -> str | None:
    """Why crossroads' TURN column cannot be measured, or None when it can."""
    from crossroads.services import SERVICE_MODULES

    if "turn" not in SERVICE_MODULES:
        return "the TURN service is not in this checkout yet"
    return None


@contextmanager
def crossroads_turn_path(payload: bytes) -> Iterator[Path_]:
    """``crossroads serve --only turn``, driven exactly as coturn is."""
    port = free_port()
    low = 45000 + (os.getpid() % 50) * 100
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crossroads",
            "serve",
            "--only", "turn",
            "--host", "127.0.0.1",
            "--http-port", "0",
            "--stun-port", str(port),
            "--stun-alt-port", "0",
            "--turn-user", "bench:benchpass",
            "--turn-realm", "crossroads.bench",
            "--allow-loopback-peers",
            "--relay-ports", f"{low}-{low + 99}",
            "--log-level", "warning",
        ],
        preexec_fn=pin_server,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        probe = udp_socket()
        try:
            wait_until(
                lambda: _stun_ping(probe, ("127.0.0.1", port)), "crossroads TURN"
            )
        finally:
            probe.close()
        with turn_path(payload, ("127.0.0.1", port), "bench", "benchpass") as path:
            yield path
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ----------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument(
        "--payload", type=int, default=100, help="bytes of game data per frame"
    )
    parser.add_argument("--window", type=int, default=128, help="frames in flight")
    parser.add_argument("--pings", type=int, default=1000, help="round trips per round")
    args = parser.parse_args()
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {CLIENT_CPU})
    payload = os.urandom(args.payload)
    results: list[Result] = []
    targets: list[tuple[str, Callable[[bytes], object]]] = [
        ("direct (no relay)", direct_path),
        ("crossroads relay", crossroads_relay_path),
        ("crossroads relay DTLS", crossroads_dtls_path),
        ("coturn", coturn_path),
    ]
    turn_missing = crossroads_turn_available()
    if turn_missing is None:
        targets.insert(2, ("crossroads TURN", crossroads_turn_path))
    for name, factory in targets:
        with factory(payload) as path:  # type: ignore[attr-defined]
            results.append(measure(name, path, args))
        print(f"  measured {name}", file=sys.stderr)
    direct = results[0]
    print(
        f"payload {args.payload} B, window {args.window}, {args.rounds} rounds x "
        f"{args.seconds}s, {args.pings} pings/round; median of rounds"
    )
    print(
        f"{'target':<24}{'packets/s':>12}{'RTT µs':>10}{'added µs/hop':>14}"
        f"{'p99 RTT µs':>12}{'server CPU µs/pkt':>19}"
    )
    for r in results:
        added = (r.rtt_us - direct.rtt_us) / 2 if r is not direct else 0.0
        cpu = f"{r.cpu_us:>19.1f}" if r.cpu_us else f"{'':>19}"
        print(
            f"{r.name:<24}{r.pps:>12,.0f}{r.rtt_us:>10.1f}{added:>14.1f}"
            f"{r.p99_us:>12.1f}{cpu}"
        )
    if turn_missing:
        print(f"{'crossroads TURN':<22}{'n/a':>12}  ({turn_missing})")
    by_name = {r.name: r for r in results}
    coturn = by_name["coturn"]
    for name in ("crossroads relay", "crossroads TURN"):
        if name in by_name:
            ours = by_name[name]
            added = (ours.rtt_us - direct.rtt_us) / max(
                1e-9, coturn.rtt_us - direct.rtt_us
            )
            print(
                f"ratio {name} / coturn: packets/s {ours.pps / coturn.pps:.2f}, "
                f"added latency {added:.2f}"
            )
    plain, dtls = by_name.get("crossroads relay"), by_name.get("crossroads relay DTLS")
    if plain is not None and dtls is not None:
        print(
            f"ratio crossroads relay DTLS / plain: packets/s {dtls.pps / plain.pps:.2f}, "
            f"server CPU per packet {dtls.cpu_us / max(1e-9, plain.cpu_us):.2f}"
        )
    stalls = {r.name: r.stalls for r in results if r.stalls}
    if stalls:
        print(f"windows lost to drops (restarted): {stalls}")


if __name__ == "__main__":
    main()
