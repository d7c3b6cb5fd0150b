"""Fixtures for the STUN interop tests: `crossroads serve` and coturn's turnserver.

A module, not a conftest.py, so other areas' interop fixtures cannot collide with
these; test modules import the fixtures they use.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_udp_tcp_port


@dataclass
class CrossroadsProcess:
    """A `crossroads serve` subprocess and the STUN endpoints it logged."""

    process: subprocess.Popen[bytes]
    log: Path
    stun: list[tuple[str, str, int, str]]  # (proto, host, port, label)

    @property
    def stun_port(self) -> int:
        return self.stun[0][2]

    def endpoint(self, proto: str = "udp", label: str = "") -> tuple[str, int]:
        for p, host, port, lab in self.stun:
            if p == proto and lab == label:
                return host, port
        raise KeyError((proto, label))


_ENDPOINT = re.compile(r"(udp|tcp|tls) ([0-9.]+|\[[0-9a-f:]+\]):(\d+)(?: \(([^)]*)\))?")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(name="crossroads_serve")
def crossroads_serve_fixture() -> Iterator[Callable[..., CrossroadsProcess]]:
    """Start `crossroads serve --only stun` on 127.0.0.1 with OS-chosen ports."""
    started: list[CrossroadsProcess] = []
    directory = Path(tempfile.mkdtemp(prefix="crossroads-stun-interop-"))

    def start(*args: str) -> CrossroadsProcess:
        log = directory / f"serve-{len(started)}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")}
        command = [
            sys.executable, "-m", "crossroads", "serve", "--only", "stun",
            "--host", "127.0.0.1", "--http-port", "0",
            "--stun-port", "0", "--stun-alt-port", "0", *args,
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            line = next((ln for ln in text.splitlines() if " stun: " in ln), None)
            if line is not None:
                stun = [
                    (m[0], m[1].strip("[]"), int(m[2]), m[3] or "")
                    for m in _ENDPOINT.findall(line.split(" stun: ", 1)[1])
                ]
                proc = CrossroadsProcess(process, log, stun)
                started.append(proc)
                return proc
            if process.poll() is not None:
                break
            time.sleep(0.05)
        _stop(process)
        raise RuntimeError(f"crossroads serve did not start:\n{log.read_text()}")

    try:
        yield start
    finally:
        for proc in started:
            _stop(proc.process)
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Coturn:
    """A coturn turnserver started by a test."""

    process: subprocess.Popen[bytes]
    port: int
    alt_port: int
    log: Path
    #: TURN over TLS port, when started with a certificate (else 0).
    tls_port: int = 0


def _free_pair(hosts: list[str]) -> tuple[int, int]:
    """Two ports free for UDP and TCP on every host in ``hosts``."""
    for _ in range(50):
        port = free_udp_tcp_port(hosts[0])
        ok = True
        for host in hosts:
            for candidate in (port, port + 1):
                for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                    with socket.socket(socket.AF_INET, kind) as sock:
                        try:
                            sock.bind((host, candidate))
                        except OSError:
                            ok = False
        if ok and port < 65535:
            return port, port + 1
    raise RuntimeError("no free port pair")


@pytest.fixture(name="coturn")
def coturn_fixture() -> Iterator[Callable[..., Coturn]]:
    """Start coturn's turnserver on 127.0.0.1 + 127.0.0.2 (RFC 5780 needs two
    IPs), ephemeral ports, temp config/db/log, no CLI, no TLS."""
    binary = shutil.which("turnserver")
    if binary is None:
        pytest.fail("coturn is not installed: run `make install`")
    started: list[Coturn] = []
    directory = Path(tempfile.mkdtemp(prefix="crossroads-coturn-"))

    def start(
        *extra: str,
        hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2"),
        tls: tuple[Path, Path] | None = None,
        dtls: bool = False,
    ) -> Coturn:
        """``tls``: (certificate, key) to serve TURN over TLS with; ``dtls``:
        over DTLS too (same port number, UDP)."""
        port, alt_port = _free_pair(list(hosts))
        tls_port = 0
        tls_args = ["--no-tls"]
        if tls is not None:
            tls_port, alt_tls_port = _free_pair(list(hosts))
            tls_args = [
                "--cert", str(tls[0]), "--pkey", str(tls[1]),
                "--tls-listening-port", str(tls_port),
                "--alt-tls-listening-port", str(alt_tls_port),
            ]  # fmt: skip
        log = directory / f"turnserver-{len(started)}.log"
        command = [
            binary, "-n", "--log-file", str(log), "--simple-log",
            *[arg for host in hosts for arg in ("-L", host)],
            "-p", str(port), "--alt-listening-port", str(alt_port),
            *tls_args, *([] if dtls else ["--no-dtls"]), "--no-cli", "-r", "crossroads.test",
            "--pidfile", str(directory / f"turnserver-{len(started)}.pid"),
            "--db", str(directory / f"turndb-{len(started)}"),
            *extra,
        ]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        server = Coturn(process, port, alt_port, log, tls_port)
        started.append(server)
        # Ready when the UDP listener answers a Binding request.
        request = bytes.fromhex("000100002112a442") + os.urandom(12)
        deadline = time.monotonic() + 15
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.settimeout(0.2)
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"turnserver exited:\n{log.read_text(errors='replace')}"
                    )
                probe.sendto(request, (hosts[0], port))
                try:
                    probe.recvfrom(2048)
                    return server
                except TimeoutError:
                    continue
        raise RuntimeError("turnserver did not answer")

    try:
        yield start
    finally:
        for server in started:
            _stop(server.process)
        shutil.rmtree(directory, ignore_errors=True)
