"""STUN interop with coturn, both ways.

- coturn's clients (turnutils_stunclient, turnutils_natdiscovery) against a
  real `crossroads serve` process;
- crossroads' client against coturn's turnserver.

turnutils_stunclient and turnutils_natdiscovery speak UDP only, so the TCP check
uses aioice's STUN codec (a third-party implementation) over a TCP connection,
and crossroads' own TCP client against coturn.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable

import pytest
from aioice import stun as aioice_stun

from crossroads.client.stun import (
    FilteringBehavior,
    MappingBehavior,
    discover_nat,
    stun_binding,
)
from tests.conftest import free_port
from tests.interop.stun_support import (  # noqa: F401 (fixtures)
    Coturn,
    CrossroadsProcess,
    coturn_fixture,
    crossroads_serve_fixture,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

REFLEXIVE = re.compile(r"UDP reflexive addr: ([0-9.]+):(\d+)")
ORIGIN = re.compile(r"Response origin: : ([0-9.]+):(\d+)")
OTHER = re.compile(r"Other addr: : ([0-9.]+):(\d+)")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: install the Debian coturn package (make install)")
    return path


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_turnutils_stunclient_gets_reflexive_address(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    server = crossroads_serve()
    out = _run(_tool("turnutils_stunclient"), "-p", str(server.stun_port), "127.0.0.1")
    hosts = {m[0] for m in REFLEXIVE.findall(out)}
    assert hosts == {"127.0.0.1"}, out
    # Only one IP: crossroads never claims an OTHER-ADDRESS.
    assert "Other addr" not in out


def test_turnutils_stunclient_rfc5780_with_second_ip(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    server = crossroads_serve("--stun-alt-host", "127.0.0.2")
    primary = server.endpoint("udp")
    alt = server.endpoint("udp", "alt host, alt port")
    out = _run(
        _tool("turnutils_stunclient"),
        "-L",
        "127.0.0.3",
        "-p",
        str(primary[1]),
        "127.0.0.1",
    )
    assert out.count("RFC 5780 response") == 3, out
    reflexive = {(h, int(p)) for h, p in REFLEXIVE.findall(out)}
    assert {h for h, _ in reflexive} == {"127.0.0.3"}, out
    origins = {(h, int(p)) for h, p in ORIGIN.findall(out)}
    assert primary in origins and alt in origins, out  # change IP+port answered
    others = {(h, int(p)) for h, p in OTHER.findall(out)}
    assert alt in others, out


def test_turnutils_natdiscovery_against_crossroads(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    server = crossroads_serve("--stun-alt-host", "127.0.0.2")
    local_port = free_port(socket.SOCK_DGRAM, "127.0.0.4")
    out = _run(
        _tool("turnutils_natdiscovery"), "-m", "-f", "-H", "-P",
        "-L", "127.0.0.4", "-l", str(local_port),
        "-p", str(server.stun_port), "127.0.0.1",
    )  # fmt: skip
    assert "NAT with Endpoint Independent Mapping!" in out, out
    assert "NAT with Endpoint Independent Filtering!" in out, out
    assert "successful hairpinning" in out, out
    assert "No ALG: Mapped == XOR-Mapped" in out, out
    assert f"UDP reflexive addr: 127.0.0.4:{local_port}" in out, out


def test_tcp_binding_with_a_third_party_codec(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    server = crossroads_serve()
    host, port = server.endpoint("tcp")
    request = aioice_stun.Message(
        message_method=aioice_stun.Method.BINDING,
        message_class=aioice_stun.Class.REQUEST,
    )
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(bytes(request))
        header = _recv_exact(sock, 20)
        body = _recv_exact(sock, int.from_bytes(header[2:4], "big"))
        local = sock.getsockname()
    response = aioice_stun.parse_message(header + body)
    assert response.message_class == aioice_stun.Class.RESPONSE
    assert response.transaction_id == request.transaction_id
    assert response.attributes["XOR-MAPPED-ADDRESS"] == local
    assert response.attributes["SOFTWARE"].startswith("crossroads")


def _free_udp_pair(host: str) -> int:
    """A UDP port p with p + 1 free too (the RFC 3489 client binds both)."""
    for _ in range(50):
        port = free_port(socket.SOCK_DGRAM, host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free UDP port pair")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


async def test_crossroads_client_against_coturn(coturn: Callable[..., Coturn]) -> None:
    server = coturn()
    udp = await stun_binding(("127.0.0.1", server.port), local=("127.0.0.5", 0))
    assert udp.mapped == udp.local and udp.mapped[0] == "127.0.0.5"
    assert udp.response_origin == ("127.0.0.1", server.port)
    assert udp.other_address == ("127.0.0.2", server.alt_port)
    assert udp.software is not None and "Coturn" in udp.software
    tcp = await stun_binding(("127.0.0.1", server.port), transport="tcp")
    assert tcp.mapped == tcp.local
    behavior = await discover_nat(("127.0.0.1", server.port), local_host="127.0.0.1")
    assert behavior.other_address == ("127.0.0.2", server.alt_port)
    assert behavior.mapping is MappingBehavior.ENDPOINT_INDEPENDENT
    assert behavior.filtering is FilteringBehavior.ENDPOINT_INDEPENDENT
    assert behavior.hairpinning is True and not behavior.behind_nat


def test_rfc3489_client_against_crossroads(
    crossroads_serve: Callable[..., CrossroadsProcess],
) -> None:
    """The classic RFC 3489 client (Debian `stun-client`, Vovida 0.97) runs its
    NAT-type tests I-III with CHANGE-REQUEST and reads MAPPED-, SOURCE- and
    CHANGED-ADDRESS: the RFC 3489 compatibility path of the server."""
    server = crossroads_serve("--stun-alt-host", "127.0.0.2")
    primary = server.endpoint("udp")
    alt = server.endpoint("udp", "alt host, alt port")
    local_port = _free_udp_pair("127.0.0.1")
    # Its exit code is the NAT type it found (1 = open), so not checked here.
    # It binds local_port and local_port + 1.
    done = subprocess.run(
        [_tool("stun"), f"127.0.0.1:{primary[1]}", "-v", "-p", str(local_port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    out = done.stdout + done.stderr
    assert f"MappedAddress = 127.0.0.1:{local_port}" in out, out
    assert f"ChangedAddress = {alt[0]}:{alt[1]}" in out, out
    # Its tests change the IP alone (answer from A2:P1), then the port alone (A1:P2).
    for label in ("alt host", "alt port"):
        host, port = server.endpoint("udp", label)
        assert f"SourceAddress = {host}:{port}" in out, out
    for test in ("test I = 1", "test II = 1", "test III = 1"):
        assert test in out, out
    assert "Primary: Open" in out, out
