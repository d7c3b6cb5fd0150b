"""Run the real OpenTTD 13 binary and `crossroads serve` for the interop tests.

Recipe from reference ``openttd-coordinator.md`` section 10: headless dedicated
server (``-D``) and a null-driver client (``-v null:ticks=N -s null -m null``),
a fresh HOME and config per process, ``-x`` so nothing is saved,
``OTTD_COORDINATOR_CS`` / ``OTTD_STUN_CS`` pointing at crossroads. Each OpenTTD
process runs on one core under SCHED_BATCH (``taskset -c N chrt -b 0``), which
removes OpenTTD 13's connect race on a busy 2-core machine (same section,
"Caveats for CI"). Processes and network namespaces are always cleaned up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crossroads.proto.openttd.coordinator import (
    COORDINATOR_VERSION,
    ClientListing,
    GcListing,
    GcNewgrfLookup,
    decode_gc_packet,
    encode_peer_packet,
)
from crossroads.proto.openttd.game import CLIENT_GAME_INFO, decode_server_game_info
from crossroads.proto.openttd.gameinfo import NewGRF, VersionedGameInfo
from crossroads.proto.openttd.wire import PacketSplitter
from tests.interop.openttd_chroot import ChrootOpenTTD

OPENTTD = shutil.which("openttd") or "/usr/games/openttd"
#: An HTTP GET run inside the namespace (so its socket lives there); prints the
#: body, a newline, and the status.
_HTTP_GET = """
import sys
import urllib.error
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as response:
        body, status = response.read().decode(), response.status
except urllib.error.HTTPError as error:
    body, status = error.read().decode(), error.code
sys.stdout.write(body + "\\n" + str(status))
"""
ROOT = Path(__file__).resolve().parents[2]


def openttd_available() -> bool:
    return Path(OPENTTD).exists()


@dataclass(frozen=True)
class OpenTTDBuild:
    """One OpenTTD release: the host's binary, or the one in a chroot."""

    release: str
    chroot: ChrootOpenTTD | None = None

    @property
    def major(self) -> int:
        return int(self.release.split(".")[0])

    def argv(self, args: list[str], workdir: Path) -> list[str]:
        if self.chroot is None:
            return [OPENTTD, *args]
        return self.chroot.command(["/usr/games/openttd", *args], workdir)


#: Debian bookworm's package, installed on the host (Makefile DEBIAN_PACKAGES).
HOST_BUILD = OpenTTDBuild("13.0")


class NetNS:
    """A private network namespace with only loopback, removed on close."""

    def __init__(self) -> None:
        self.name = f"ottd-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        try:
            self.run("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def run(self, *command: str) -> str:
        done = subprocess.run(
            [*self.prefix(), *command], check=True, capture_output=True, text=True
        )
        return done.stdout

    def close(self) -> None:
        subprocess.run(
            ["ip", "netns", "delete", self.name], check=False, capture_output=True
        )


def _stop(
    process: subprocess.Popen[bytes] | None, signum: int = signal.SIGTERM
) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signum)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for(
    path: Path,
    pattern: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
) -> re.Match[str]:
    """Poll a log file until ``pattern`` matches; fail with the log on timeout."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern)
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = regex.search(text)
        if match:
            return match
        if process is not None and process.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(
        f"{pattern!r} not in {path.name} after {timeout}s:\n{text[-3000:]}"
    )


class Crossroads:
    """``crossroads serve --only openttd`` as a real process."""

    def __init__(
        self,
        workdir: Path,
        *,
        name: str = "crossroads",
        netns: NetNS | None = None,
        store: str = "memory",
        secret: str = "interop-secret",
        ports: dict[str, int] | None = None,
    ) -> None:
        self.log = workdir / f"{name}.log"
        self.netns = netns
        ports = ports or {}
        command = [
            sys.executable,
            "-m",
            "crossroads",
            "serve",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(ports.get("http", 0)),
            "--only",
            "openttd",
            "--store",
            store,
            "--openttd-secret",
            secret,
            "--openttd-coordinator-port",
            str(ports.get("coordinator", 0)),
            "--openttd-stun-port",
            str(ports.get("stun", 0)),
            "--openttd-turn-port",
            str(ports.get("turn", 0)),
            "--log-level",
            "debug",
        ]
        if netns is not None:
            command = netns.prefix() + command
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with self.log.open("wb") as out:
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )
        try:
            match = wait_for(
                self.log,
                r"openttd: tcp 127\.0\.0\.1:(\d+) \(coordinator\), tcp 127\.0\.0\.1:(\d+) \(stun\), "
                r"tcp 127\.0\.0\.1:(\d+) \(turn\)",
                30,
                self.process,
            )
            self.ports = {
                "coordinator": int(match.group(1)),
                "stun": int(match.group(2)),
                "turn": int(match.group(3)),
            }
            self.ports["http"] = int(
                wait_for(
                    self.log, r"http: tcp 127\.0\.0\.1:(\d+)", 10, self.process
                ).group(1)
            )
        except BaseException:
            self.stop()
            raise

    @property
    def env(self) -> dict[str, str]:
        return {
            "OTTD_COORDINATOR_CS": f"127.0.0.1:{self.ports['coordinator']}",
            "OTTD_STUN_CS": f"127.0.0.1:{self.ports['stun']}",
        }

    def get(self, path: str) -> tuple[int, str]:
        """HTTP GET from inside the process's network namespace."""
        url = f"http://127.0.0.1:{self.ports['http']}{path}"
        command = [sys.executable, "-c", _HTTP_GET, url]
        if self.netns is not None:
            command = self.netns.prefix() + command
        output = subprocess.run(
            command, capture_output=True, text=True, timeout=10
        ).stdout
        body, _, status = output.rpartition("\n")
        return int(status or 0), body

    def json(self, path: str) -> object:
        status, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)

    def metric(self, name: str, **labels: str) -> float:
        _, text = self.get("/metrics")
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            metric, _, rest = head.partition("{")
            if (
                metric == name
                and ",".join(sorted(rest.rstrip("}").split(","))) == wanted
            ):
                return float(value)
        return 0.0

    def stop(self) -> None:
        _stop(self.process, signal.SIGINT)  # at once: SIGTERM would drain


#: ``[network]`` settings that live in private.cfg from 14 (13 keeps
#: ``use_relay_service`` in openttd.cfg: reference section 9, PR #10762).
PRIVATE_SETTINGS = ("client_name", "server_name", "use_relay_service")
#: The ``ini_version`` each release writes in openttd.cfg's ``[version]`` group
#: (observed: what 13.0, 14.1 and 15.1 save on exit without ``-x``).
INI_VERSION = {13: 2, 14: 7, 15: 7}


def _config(build: OpenTTDBuild, directory: Path, network: dict[str, str]) -> Path:
    """``DIR/openttd.cfg`` (and ``DIR/private.cfg`` from 14) for ``-c``.

    13 reads everything from openttd.cfg. From 14 the files are laid out as the
    release saves them: openttd.cfg carries a ``[version]`` group and the
    private settings go to private.cfg. Without that group, 14 and 15 never
    open private.cfg (they read every setting from openttd.cfg), and with it
    they ignore private settings left in openttd.cfg: a headless client then
    has no name and never answers the relay question
    (test_private_cfg_needs_a_version_group)."""
    directory.mkdir(parents=True, exist_ok=True)
    generic = dict(network)
    private: dict[str, str] = {}
    if build.major >= 14:
        private = {k: generic.pop(k) for k in PRIVATE_SETTINGS if k in generic}
    lines = []
    if build.major >= 14:
        lines += ["[version]", f"ini_version = {INI_VERSION[build.major]}"]
    lines += ["[network]"] + [f"{k} = {v}" for k, v in generic.items()]
    # A small map, no AI: start-up in seconds (reference section 10).
    lines += [
        "[game_creation]",
        "map_x = 6",
        "map_y = 6",
        "[difficulty]",
        "max_no_competitors = 0",
    ]
    path = directory / "openttd.cfg"
    path.write_text("\n".join(lines) + "\n")
    if private:
        (directory / "private.cfg").write_text(
            "\n".join(["[network]"] + [f"{k} = {v}" for k, v in private.items()]) + "\n"
        )
    return path


class OpenTTDServer:
    """``openttd -D`` registered with a coordinator."""

    def __init__(
        self,
        workdir: Path,
        crossroads: Crossroads,
        *,
        name: str,
        bind: str,
        port: int,
        game_type: str,
        netns: NetNS | None = None,
        cpu: int = 0,
        build: OpenTTDBuild = HOST_BUILD,
    ) -> None:
        self.name = name
        self.port = port
        self.log = workdir / f"{name}.log"
        home = Path(tempfile.mkdtemp(prefix="home-", dir=workdir))
        config = _config(
            build,
            workdir / name,
            {
                "server_game_type": game_type,
                "server_port": str(port),
                "server_name": name,
                "client_name": "srv",
            },
        )
        command = [
            "taskset", "-c", str(cpu), "chrt", "-b", "0",
            *build.argv(
                ["-D", f"{bind}:{port}", "-c", str(config), "-x", "-d", "net=3"],
                workdir,
            ),
        ]  # fmt: skip
        if netns is not None:
            command = netns.prefix() + command
        env = {**os.environ, "HOME": str(home), **crossroads.env}
        with self.log.open("wb") as out:
            # The open stdin keeps the dedicated server's console alive.
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def registration(self, timeout: float = 60, after: int = 0) -> dict[str, str]:
        """The block OpenTTD prints on GC_REGISTER_ACK (``after`` skips earlier ones)."""
        pattern = (
            r"Game type: +(?P<game_type>[^\n]+?)\s*\n.*?Connection type: +(?P<connection_type>[^\n]+?)"
            r"\s*\n.*?Invite code: +(?P<code>\+[A-Za-z0-9]+)"
        )
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            found = list(re.finditer(pattern, text, re.S))
            if len(found) > after:
                return found[after].groupdict()
            if time.monotonic() > deadline or (
                self.process and self.process.poll() is not None
            ):
                raise AssertionError(f"{self.name} did not register:\n{text[-3000:]}")
            time.sleep(0.2)

    def joined(self, client_name: str, timeout: float) -> str:
        return wait_for(
            self.log,
            rf"{re.escape(client_name)} has joined the game[^\n]*",
            timeout,
            self.process,
        ).group(0)

    def stop(self) -> None:
        _stop(self.process)


class OpenTTDClient:
    """A headless client joining by invite code (null drivers)."""

    def __init__(
        self,
        workdir: Path,
        crossroads: Crossroads,
        *,
        name: str,
        code: str,
        netns: NetNS | None = None,
        cpu: int = 1,
        build: OpenTTDBuild = HOST_BUILD,
    ) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        home = Path(tempfile.mkdtemp(prefix="home-", dir=workdir))
        config = _config(
            build,
            workdir / name,
            # "allow" answers the relay question a GUI would ask.
            {"client_name": name, "use_relay_service": "allow"},
        )
        command = [
            "taskset", "-c", str(cpu), "chrt", "-b", "0",
            *build.argv(
                [
                    "-c", str(config), "-x", "-n", code, "-v", "null:ticks=100000000",
                    "-s", "null", "-m", "null", "-d", "net=5",
                ],
                workdir,
            ),
        ]  # fmt: skip
        if netns is not None:
            command = netns.prefix() + command
        env = {**os.environ, "HOME": str(home), **crossroads.env}
        with self.log.open("wb") as out:
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def used(self) -> list[str]:
        """Every peer the client's TCP connects reached (``- using IP:PORT``)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return re.findall(r"- using (\S+) \(IPv", text)

    def stop(self) -> None:
        _stop(self.process)


#: Run inside a network namespace: every IPv4 TCP frame on ``lo`` to or from
#: port argv[2], appended to argv[1] as (u32 length, frame). AF_PACKET sees a
#: loopback frame twice (sent and received): the sent copy is skipped.
_CAPTURE = """
import socket
import struct
import sys

port = int(sys.argv[2])
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
sock.bind(("lo", 0))
with open(sys.argv[1], "wb", buffering=0) as out:
    print("ready", flush=True)
    while True:
        frame, address = sock.recvfrom(1 << 18)
        if address[2] == socket.PACKET_OUTGOING or frame[12:14] != b"\\x08\\x00":
            continue
        ip = frame[14:]
        if ip[9] != 6:
            continue
        tcp = ip[(ip[0] & 15) * 4 :]
        if port in struct.unpack("!HH", tcp[:4]):
            out.write(struct.pack("!I", len(frame)) + frame)
"""


class LoopbackCapture:
    """The TCP byte streams to and from one port in a network namespace, as a
    packet capture sees them (the kernel's copy, not the programs')."""

    def __init__(self, path: Path, netns: NetNS, port: int) -> None:
        self.path = path
        self.port = port
        self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [*netns.prefix(), sys.executable, "-c", _CAPTURE, str(path), str(port)],
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            self.stop()
            raise RuntimeError("the loopback capture did not start")

    def streams(self) -> dict[tuple[str, str], bytes]:
        """Each direction's payload in sequence order, keyed by
        ("ip:port", "ip:port") from sender to receiver."""
        data = self.path.read_bytes()
        segments: dict[tuple[str, str], dict[int, bytes]] = {}
        start: dict[tuple[str, str], int] = {}
        offset = 0
        while offset + 4 <= len(data):
            (length,) = struct.unpack_from("!I", data, offset)
            ip = data[offset + 18 : offset + 4 + length]
            offset += 4 + length
            header = (ip[0] & 15) * 4
            total = struct.unpack_from("!H", ip, 2)[0]
            tcp = ip[header:total]
            sport, dport, seq = struct.unpack_from("!HHI", tcp)
            flags = tcp[13]
            src = f"{socket.inet_ntoa(ip[12:16])}:{sport}"
            dst = f"{socket.inet_ntoa(ip[16:20])}:{dport}"
            key = (src, dst)
            if flags & 0x02:  # SYN: the stream starts after it
                start[key] = (seq + 1) & 0xFFFFFFFF
            payload = tcp[(tcp[12] >> 4) * 4 :]
            if payload:
                segments.setdefault(key, {})[seq] = payload
        result: dict[tuple[str, str], bytes] = {}
        for key, by_seq in segments.items():
            base = start[key]
            stream = bytearray()
            for seq, payload in sorted(
                by_seq.items(), key=lambda item: (item[0] - base) & 0xFFFFFFFF
            ):
                at = (seq - base) & 0xFFFFFFFF
                if at > len(stream):
                    raise AssertionError(
                        f"capture lost bytes of {key} at {len(stream)}"
                    )
                stream[at : at + len(payload)] = payload
            result[key] = bytes(stream)
        return result

    def stop(self) -> None:
        _stop(self.process)


def _packets(
    sock: socket.socket, until: Callable[[int, bytes], bool]
) -> list[tuple[int, bytes]]:
    """OpenTTD packets read from ``sock`` up to the one ``until`` accepts."""
    splitter = PacketSplitter()
    received: list[tuple[int, bytes]] = []
    while True:
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"connection closed after {received!r}")
        for packet_type, payload in splitter.feed(data):
            received.append((packet_type, payload))
            if until(packet_type, payload):
                return received


def listing_as_client(
    crossroads: Crossroads, revision: str, game_info_version: int
) -> list[tuple[str, VersionedGameInfo]]:
    """CLIENT_LISTING as a client of ``revision`` sends it (coordinator protocol
    6, cursor 0), and the servers of the answer as that client decodes them."""
    request = ClientListing(COORDINATOR_VERSION, game_info_version, revision, 0)
    lookup: dict[int, NewGRF] = {}
    servers: list[tuple[str, VersionedGameInfo]] = []
    address = ("127.0.0.1", crossroads.ports["coordinator"])
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(encode_peer_packet(request))

        def end(packet_type: int, payload: bytes) -> bool:
            message = decode_gc_packet(packet_type, payload, lookup=lookup)
            if isinstance(message, GcNewgrfLookup):
                lookup.update(message.entries)
                return False
            assert isinstance(message, GcListing), message
            for entry in message.entries:
                servers.append(
                    (
                        entry.connection_string,
                        VersionedGameInfo(
                            message.game_info_version, message.serialization, entry.info
                        ),
                    )
                )
            return not message.entries

        _packets(sock, end)
    return servers


def game_info_from_server(host: str, port: int) -> VersionedGameInfo:
    """The server's own answer to CLIENT_GAME_INFO on its game port."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(CLIENT_GAME_INFO)
        packet_type, payload = _packets(sock, lambda _t, _p: True)[0]
    return decode_server_game_info(packet_type, payload)


def saved_network_settings(
    build: OpenTTDBuild, directory: Path, files: dict[str, str]
) -> dict[str, dict[str, str]]:
    """Start a null-driver OpenTTD on ``-c DIR/openttd.cfg`` with ``files``
    written in DIR, let it run ten ticks and save its configuration on exit
    (no ``-x``), and return the ``[network]`` group of each file it wrote: what
    it saves is what it had read."""
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    command = build.argv(
        ["-c", str(directory / "openttd.cfg"), "-v", "null:ticks=10",
         "-s", "null", "-m", "null"],
        directory,
    )  # fmt: skip
    subprocess.run(
        command,
        env={**os.environ, "HOME": str(directory)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=True,
    )
    saved: dict[str, dict[str, str]] = {}
    for name in ("openttd.cfg", "private.cfg"):
        group: dict[str, str] = {}
        section = ""
        path = directory / name
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("["):
                section = line.strip()
            elif section == "[network]" and " = " in line:
                key, _, value = line.partition(" = ")
                group[key] = value
        saved[name] = group
    return saved
