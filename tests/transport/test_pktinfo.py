"""Replies from the destination address (crossroads.transport.pktinfo)."""

from __future__ import annotations

import socket
import struct

from hypothesis import given
from hypothesis import strategies as st

from crossroads.transport.pktinfo import (
    IP_PKTINFO,
    IPV6_PKTINFO,
    ReplySource,
    is_wildcard,
    parse_control,
    reply_control,
)
from crossroads.transport.sockets import make_udp_socket


@given(st.binary(max_size=80))
def test_parse_control_takes_any_bytes(raw: bytes) -> None:
    control = parse_control(raw)
    assert control is None or control[0] in (socket.IPPROTO_IP, socket.IPPROTO_IPV6)


def test_reply_control_keeps_only_the_source() -> None:
    received = struct.pack("=i4s4s", 7, socket.inet_aton("127.0.0.2"), b"\x7f\0\0\2")
    level, kind, data = reply_control([(socket.IPPROTO_IP, IP_PKTINFO, received)]) or (
        0,
        0,
        b"",
    )
    assert (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO)
    assert data == b"\0\0\0\0" + socket.inet_aton("127.0.0.2") + b"\0\0\0\0"
    v6 = socket.inet_pton(socket.AF_INET6, "::1") + struct.pack("=i", 1)
    assert reply_control([(socket.IPPROTO_IPV6, IPV6_PKTINFO, v6)]) == (
        socket.IPPROTO_IPV6,
        IPV6_PKTINFO,
        v6,
    )
    assert reply_control([(socket.SOL_SOCKET, 1, b"x" * 20)]) is None


def test_wildcards() -> None:
    assert is_wildcard("0.0.0.0") and is_wildcard("::")
    assert not is_wildcard("127.0.0.1") and not is_wildcard("::1")


def test_reply_source_answers_from_the_alias_and_forgets_the_oldest() -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client,
    ):
        server.bind(("0.0.0.0", 0))
        client.bind(("127.0.0.1", 0))
        client.settimeout(5)
        port = server.getsockname()[1]
        source = ReplySource(server, capacity=2)
        client.sendto(b"hi", ("127.0.0.2", port))
        server.settimeout(5)
        data, addr = source.recvfrom(100)
        assert data == b"hi" and addr == client.getsockname()
        source.sendto(b"back", addr)
        assert client.recvfrom(100) == (b"back", ("127.0.0.2", port))
        for n in range(3):
            source.remember(("192.0.2.1", n), (0, 0, b""))
        assert len(source) == 2  # bounded: the client was the oldest
        source.sendto(b"again", addr)  # unknown now: the route's source
        assert client.recvfrom(100) == (b"again", ("127.0.0.1", port))


def test_dual_stack_socket_answers_ipv4_clients_from_the_alias() -> None:
    """A ``::`` socket sees IPv4 clients as ::ffff:a.b.c.d; the answer still
    leaves from the IPv4 address they sent to, whichever form the caller uses."""
    server = make_udp_socket("::", 0)
    with server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        server.setblocking(True)
        server.settimeout(5)
        client.bind(("127.0.0.1", 0))
        client.settimeout(5)
        port = server.getsockname()[1]
        source = ReplySource(server)
        client.sendto(b"hi", ("127.0.0.2", port))
        _data, addr = source.recvfrom(100)
        assert addr[0] == "::ffff:127.0.0.1"
        source.sendto(b"mapped", addr)
        assert client.recvfrom(100) == (b"mapped", ("127.0.0.2", port))
        source.sendto(b"plain", ("::ffff:127.0.0.1", addr[1]))
        assert client.recvfrom(100) == (b"plain", ("127.0.0.2", port))
