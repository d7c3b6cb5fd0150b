"""Replies that leave from the address the client sent to.

Why: a UDP socket bound to a wildcard (``0.0.0.0``, ``::``) on a host with
several addresses sends from whatever source address the route to the client
picks, not necessarily the one the client sent to. The client -- or its NAT,
or its firewall -- then sees an answer from a stranger and drops it (RFC 8489
§6.3.1.2 asks STUN for exactly this; RFC 8656 §3.1's 5-tuple and every
connectionless game protocol assume it). Linux tells a socket each datagram's
destination with ``IP_PKTINFO`` / ``IPV6_RECVPKTINFO`` (ip(7), ipv6(7)); the same
control message given to ``sendmsg`` sets the reply's source.

- :func:`enable_pktinfo` turns the option on (the batched STUN socket,
  :class:`crossroads.transport.mmsg.MmsgSocket`, uses it too).
- :func:`reply_control` turns a received control message into the one a reply
  carries.
- :class:`ReplySource` remembers, per client address, where it last sent to,
  and sends to it from there: a drop-in for ``recvfrom`` / ``sendto``.
- :class:`DatagramEndpoint` is an asyncio-style datagram transport built on it,
  for services written as ``asyncio.DatagramProtocol`` (natneg, p2p rendezvous);
  :func:`open_datagram_endpoint` picks it on a wildcard bind and asyncio's own
  transport otherwise.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from typing import Any, cast

from crossroads.proto.bounded import BoundedMap
from crossroads.types import Address, normalize_address

IP_PKTINFO: int = getattr(socket, "IP_PKTINFO", 8)
IPV6_RECVPKTINFO: int = getattr(socket, "IPV6_RECVPKTINFO", 49)
IPV6_PKTINFO: int = getattr(socket, "IPV6_PKTINFO", 50)
#: Room for one control message: in6_pktinfo is 20 bytes, in_pktinfo 12
#: (ip(7), ipv6(7)). Both options may be on for a dual-stack socket.
ANCILLARY_BYTES = socket.CMSG_SPACE(20) * 2
#: Client addresses remembered per socket; beyond it the least recently heard
#: one is forgotten (its next datagram teaches it again). 65,536 entries of ~200 bytes: ~13 MB
#: at worst, the same bound as the STUN address cache.
MAX_CLIENTS = 65_536
#: Datagrams read per readiness callback (the same amortisation as the relay
#: endpoint: enough to pay for the wake-up, few enough to keep timers on time).
BATCH = 64
#: Largest UDP payload.
MAX_DATAGRAM = 65535

Control = tuple[int, int, bytes]
_CMSGHDR = struct.Struct("=QiI")  # cmsg_len (size_t), cmsg_level, cmsg_type


def is_wildcard(host: str) -> bool:
    """``0.0.0.0`` or ``::``: the kernel picks reply sources by route."""
    return ipaddress.ip_address(host.split("%", 1)[0]).is_unspecified


def enable_pktinfo(sock: socket.socket) -> None:
    """Ask the kernel for each datagram's destination address."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)


def reply_control(ancdata: list[tuple[int, int, bytes]]) -> Control | None:
    """The ``sendmsg`` control message that makes a reply leave from the
    destination of the datagram that carried ``ancdata``; None without one."""
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= 12:
            # struct in_pktinfo {int ifindex; in_addr spec_dst; in_addr addr}:
            # the source is spec_dst; interface 0 lets the route choose it.
            return (level, kind, b"\0\0\0\0" + data[4:8] + b"\0\0\0\0")
        if level == socket.IPPROTO_IPV6 and kind == IPV6_PKTINFO and len(data) >= 20:
            # struct in6_pktinfo {in6_addr addr; int ifindex}: as received (the
            # interface matters for link-local sources).
            return (level, kind, data[:20])
    return None


def parse_control(raw: bytes) -> Control | None:
    """:func:`reply_control` of a raw control buffer (``struct cmsghdr`` + data),
    as :class:`~crossroads.transport.mmsg.MmsgSocket` receives it."""
    if len(raw) < _CMSGHDR.size:
        return None
    length, level, kind = _CMSGHDR.unpack_from(raw)
    if length < _CMSGHDR.size or length > len(raw):
        return None
    return reply_control([(level, kind, raw[_CMSGHDR.size : length])])


class ReplySource:
    """``recvfrom`` / ``sendto`` for one socket, replies from the address each
    client sent to (see the module docstring). Call on a wildcard-bound socket;
    :func:`enable_pktinfo` is done here."""

    __slots__ = ("sock", "_known", "capacity")

    def __init__(self, sock: socket.socket, capacity: int = MAX_CLIENTS) -> None:
        enable_pktinfo(sock)
        self.sock = sock
        self.capacity = capacity
        self._known: BoundedMap[Address, Control] = BoundedMap(capacity)

    def __len__(self) -> int:
        return len(self._known)

    def remember(self, addr: Any, control: Control) -> None:
        """Reply to ``addr`` with ``control`` from now on."""
        known = self._known
        key: Address = (addr[0], addr[1])
        if known.get(key) == control:
            return
        known.put(key, control)
        short = normalize_address(addr)
        if short != key:
            # A dual-stack socket sees ::ffff:a.b.c.d; callers often send to
            # the normalised a.b.c.d form.
            known.put(short, control)

    def learn(self, addr: Any, ancdata: list[tuple[int, int, bytes]]) -> None:
        """Reply to ``addr`` from where its datagram (carrying ``ancdata``, as
        ``recvmsg`` gives it) was sent to."""
        control = reply_control(ancdata)
        if control is not None:
            self.remember(addr, control)

    def control_for(self, addr: Any) -> Control | None:
        """The control message a datagram to ``addr`` leaves with (None: the
        kernel picks the source)."""
        return self._known.peek((addr[0], addr[1]))

    def recvfrom(self, bufsize: int) -> tuple[bytes, Any]:
        """Like ``socket.recvfrom``, learning where the datagram was sent to."""
        data, ancdata, _flags, addr = self.sock.recvmsg(bufsize, ANCILLARY_BYTES)
        self.learn(addr, ancdata)
        return data, addr

    def sendto(self, data: bytes, addr: Any) -> int:
        """Like ``socket.sendto``, from the address ``addr`` last sent to."""
        control = self._known.peek((addr[0], addr[1]))
        if control is None:
            return self.sock.sendto(data, addr)
        return self.sock.sendmsg([data], [control], 0, addr)


class DatagramEndpoint:
    """The part of ``asyncio.DatagramTransport`` the services use, reading
    with ``loop.add_reader`` and replying through a :class:`ReplySource`."""

    def __init__(self, sock: socket.socket, protocol: asyncio.DatagramProtocol) -> None:
        self.sock = sock
        self.protocol = protocol
        self.source = ReplySource(sock)
        self._loop = asyncio.get_running_loop()
        self._closing = False
        self._loop.add_reader(sock.fileno(), self._readable)
        protocol.connection_made(cast(asyncio.DatagramTransport, self))

    def _readable(self) -> None:
        recvfrom = self.source.recvfrom
        for _ in range(BATCH):
            if self._closing:
                return
            try:
                data, addr = recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # ICMP errors from earlier sends surface here on Linux.
                self.protocol.error_received(exc)
                continue
            # Looked up each time: set_protocol may hand the socket over.
            self.protocol.datagram_received(data, addr)

    def sendto(self, data: bytes, addr: Any = None) -> None:
        if self._closing or addr is None:
            return
        try:
            self.source.sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            pass  # a full socket buffer drops the datagram, as asyncio's would not
        except OSError as exc:
            self.protocol.error_received(exc)

    def is_closing(self) -> bool:
        return self._closing

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the datagrams to another protocol (the TURN listener tap)."""
        self.protocol = cast(asyncio.DatagramProtocol, protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sockname":
            return self.sock.getsockname()
        if name == "socket":
            return self.sock
        return default

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self._loop.call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()


async def open_datagram_endpoint(
    protocol: asyncio.DatagramProtocol, sock: socket.socket
) -> asyncio.DatagramTransport:
    """Run ``protocol`` on a bound UDP socket: replies from each client's
    destination address on a wildcard bind, asyncio's own transport otherwise."""
    if is_wildcard(sock.getsockname()[0]):
        return cast(asyncio.DatagramTransport, DatagramEndpoint(sock, protocol))
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
    return transport
