"""The host's own addresses and the ports this process listens on.

The relay policy (:mod:`crossroads.proto.policy`) takes the server's own
addresses as data; this module finds them:

- :func:`interface_addresses`: every address of every local interface, from a
  netlink ``RTM_GETADDR`` dump (rtnetlink(7)) -- the stdlib route, no ``ip``
  binary, no psutil. Secondary addresses and IPv6 addresses included, which
  ``SIOCGIFCONF`` would miss. Falls back to loopback when netlink is missing.
- :func:`configured_hosts`: every address the configuration names (bind and
  advertised addresses of every section: ``--public-host``,
  ``--turn-external-ip``, ``--relay-public-host``, ...).
- :func:`own_addresses`: both.

The ports the services listen on are in :func:`crossroads.transport.sockets.listening_ports`.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any

from crossroads.config import Config, iter_settings
from crossroads.proto.policy import IPAddress, parse_ip

#: rtnetlink constants (linux/rtnetlink.h, linux/netlink.h, linux/if_addr.h).
_RTM_GETADDR = 22
_RTM_NEWADDR = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3
_NLMSG_ERROR = 2
_IFA_ADDRESS = 1
_IFA_LOCAL = 2
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTATTR = struct.Struct("=HH")  # len, type
#: A dump of a few hundred addresses fits; recv is repeated until NLMSG_DONE.
_RECV_BYTES = 65536

_FALLBACK: tuple[IPAddress, ...] = (
    ipaddress.IPv4Address("127.0.0.1"),
    ipaddress.IPv6Address("::1"),
)


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_addr_dump(data: bytes) -> tuple[list[IPAddress], bool]:
    """Addresses in a chunk of an RTM_GETADDR dump, and whether it ended."""
    found: list[IPAddress] = []
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG_HEADER.unpack_from(data, offset)
        if length < _NLMSG_HEADER.size or offset + length > len(data):
            return found, True
        if kind in (_NLMSG_DONE, _NLMSG_ERROR):
            return found, True
        if kind == _RTM_NEWADDR:
            body = offset + _NLMSG_HEADER.size
            family = data[body]
            at = body + _IFADDRMSG.size
            end = offset + length
            while at + _RTATTR.size <= end:
                attr_len, attr_type = _RTATTR.unpack_from(data, at)
                if attr_len < _RTATTR.size:
                    break
                value = data[at + _RTATTR.size : at + attr_len]
                if attr_type in (_IFA_ADDRESS, _IFA_LOCAL):
                    if family == socket.AF_INET and len(value) == 4:
                        found.append(ipaddress.IPv4Address(value))
                    elif family == socket.AF_INET6 and len(value) == 16:
                        found.append(ipaddress.IPv6Address(value))
                at += _align(attr_len)
        offset += _align(length)
    return found, False


def interface_addresses() -> frozenset[IPAddress]:
    """Every address of every interface in this network namespace."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    except (OSError, AttributeError):
        return frozenset(_FALLBACK)
    found: list[IPAddress] = []
    try:
        sock.settimeout(2.0)
        sock.bind((0, 0))
        request = _NLMSG_HEADER.pack(
            _NLMSG_HEADER.size + _IFADDRMSG.size,
            _RTM_GETADDR,
            _NLM_F_REQUEST | _NLM_F_DUMP,
            1,
            0,
        ) + _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(request)
        while True:
            chunk = sock.recv(_RECV_BYTES)
            if not chunk:
                break
            addresses, done = parse_addr_dump(chunk)
            found.extend(addresses)
            if done:
                break
    except OSError:
        return frozenset((*found, *_FALLBACK))
    finally:
        sock.close()
    return frozenset((*found, *_FALLBACK))


def configured_hosts(config: Config) -> frozenset[IPAddress]:
    """Every address named by a ``host`` setting of any section (bind and
    advertised addresses); wildcards and empty values are skipped."""
    hosts: set[IPAddress] = set()
    sections: dict[str, Any] = {"core": config.core, **config.sections}
    for name, field, info in iter_settings():
        if info.kind != "host" or name not in sections:
            continue
        value = getattr(sections[name], field.name, "")
        address = parse_ip(value) if isinstance(value, str) and value else None
        if address is not None and not address.is_unspecified:
            hosts.add(address)
    return frozenset(hosts)


def own_addresses(config: Config) -> frozenset[IPAddress]:
    """Interface and configured addresses (the service context enumerates them
    once per runtime: :meth:`crossroads.services.base.ServiceContext.own_addresses`)."""
    return interface_addresses() | configured_hosts(config)
