"""One address policy for every relay: which peers it may reach, which clients it serves.

Theory of operation
-------------------
A relay sends datagrams where an anonymous client tells it to (TURN Send,
ChannelBind, Connect) or serves whoever sends it a BIND (Unity relay) or an INIT
(natneg relay). Pointed at an internal address, it becomes a proxy into the
network it runs in: coturn CVE-2020-26262 reached loopback services through
``0.0.0.0`` and ``::``; the same class of bug reaches a cloud metadata service at
169.254.169.254, or the relay's own HTTP port. TURN, the Unity relay and the
natneg relay therefore ask this one module, with the same answers.

:meth:`AddressPolicy.judge` classifies an IP in this order:

1. unparsable -> ``MALFORMED``;
2. inside an explicit ``allow`` range -> ``ALLOWED`` (operators and tests opt in);
3. the address, or the IPv4 address an IPv6 form embeds, inside an explicit
   ``deny`` range -> ``DENIED``;
4. a non-global scope (loopback, private, link-local, reserved) -> refused with
   that scope as the verdict, unless the scope is admitted (a relay advertising
   127.0.0.1 serves loopback clients);
5. one of the server's own addresses (``self_addresses``: every local interface
   address and every advertised address, given as data) -> ``SELF``, unless its
   scope is admitted;
6. everything else -> ``ALLOWED``.

IPv6 forms that carry an IPv4 address are judged by that address too
(:func:`embedded_ipv4`): ``::a.b.c.d`` (IPv4-compatible, RFC 4291 §2.5.5.1),
``::ffff:a.b.c.d`` (mapped, §2.5.5.2), ``::ffff:0:a.b.c.d`` (SIIT translated,
RFC 2765 §2.1), ``64:ff9b::/96`` (NAT64 well-known prefix, RFC 6052 §2.1),
``2002::/16`` (6to4, RFC 3056 §2) and ``2001::/32`` (Teredo, RFC 4380 §4: server
IPv4 in bits 32-63, client IPv4 in the last 32 bits XOR 0xffffffff). The
local-use NAT64 prefix ``64:ff9b:1::/48`` (RFC 8215) may embed the IPv4 address
at any of several offsets, so it is refused whole.

The documentation ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24,
2001:db8::/32) count as global: nothing routes to them, and the NAT lab uses them
as its public internet. Python's ``ipaddress.is_private`` counts them as private,
which is why the ranges are written out here.

TURN adds two rules of its own on top (it knows its live allocations and the
ports it listens on); see :mod:`crossroads.proto.turn.server`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from enum import IntEnum
from typing import Final

from crossroads.types import frozen

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Scope(IntEnum):
    """Where an address can be reached from."""

    GLOBAL = 0
    #: RFC 1918, RFC 6598 shared (carrier NAT), RFC 4193 unique local, site-local.
    PRIVATE = 1
    #: RFC 3927 / RFC 4291 link-local (cloud metadata services live here).
    LINK_LOCAL = 2
    LOOPBACK = 3
    #: Unspecified, "this network", multicast, broadcast, reserved, benchmarking,
    #: IETF protocol assignments, local-use NAT64: never a peer or a client.
    RESERVED = 4


class Verdict(IntEnum):
    """The answer of :meth:`AddressPolicy.judge`; anything but ALLOWED refuses.

    The lower-case names are the ``reason`` label of the refusal metrics.
    """

    ALLOWED = 0
    MALFORMED = 1
    DENIED = 2
    SELF = 3
    LOOPBACK = 4
    PRIVATE = 5
    LINK_LOCAL = 6
    RESERVED = 7
    #: TURN only: one of the server's own listening ports on one of its addresses.
    SERVICE_PORT = 8

    @property
    def reason(self) -> str:
        return self.name.lower().replace("_", "-")


_SCOPE_VERDICT: Final = {
    Scope.PRIVATE: Verdict.PRIVATE,
    Scope.LINK_LOCAL: Verdict.LINK_LOCAL,
    Scope.LOOPBACK: Verdict.LOOPBACK,
    Scope.RESERVED: Verdict.RESERVED,
}

#: Non-global ranges and their scope, most specific first where they nest.
_RANGES: Final[tuple[tuple[IPNetwork, Scope], ...]] = tuple(
    (ipaddress.ip_network(net), scope)
    for net, scope in (
        ("0.0.0.0/8", Scope.RESERVED),  # "this network" (RFC 791); 0.0.0.0 is us
        ("10.0.0.0/8", Scope.PRIVATE),  # RFC 1918
        ("100.64.0.0/10", Scope.PRIVATE),  # RFC 6598 shared address space
        ("127.0.0.0/8", Scope.LOOPBACK),  # RFC 1122 §3.2.1.3
        ("169.254.0.0/16", Scope.LINK_LOCAL),  # RFC 3927
        ("172.16.0.0/12", Scope.PRIVATE),  # RFC 1918
        ("192.0.0.0/24", Scope.RESERVED),  # RFC 6890 IETF protocol assignments
        ("192.168.0.0/16", Scope.PRIVATE),  # RFC 1918
        ("198.18.0.0/15", Scope.RESERVED),  # RFC 2544 benchmarking
        ("224.0.0.0/4", Scope.RESERVED),  # multicast (RFC 5771)
        ("240.0.0.0/4", Scope.RESERVED),  # reserved, and 255.255.255.255 broadcast
        ("::/128", Scope.RESERVED),  # unspecified (RFC 4291 §2.5.2)
        ("::1/128", Scope.LOOPBACK),  # RFC 4291 §2.5.3
        ("64:ff9b:1::/48", Scope.RESERVED),  # RFC 8215 local-use NAT64
        ("fc00::/7", Scope.PRIVATE),  # RFC 4193 unique local
        ("fe80::/10", Scope.LINK_LOCAL),  # RFC 4291 §2.5.6
        ("fec0::/10", Scope.PRIVATE),  # deprecated site-local (RFC 3879)
        ("ff00::/8", Scope.RESERVED),  # multicast (RFC 4291 §2.7)
    )
)

_COMPATIBLE: Final = ipaddress.IPv6Network("::/96")  # RFC 4291 §2.5.5.1
_TRANSLATED: Final = ipaddress.IPv6Network("::ffff:0:0:0/96")  # RFC 2765 §2.1
_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 §2.1
_SIX_TO_FOUR: Final = ipaddress.IPv6Network("2002::/16")  # RFC 3056 §2
_TEREDO: Final = ipaddress.IPv6Network("2001::/32")  # RFC 4380 §4


def parse_networks(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Parse CIDR strings (a bare address is a /32 or /128).

    Raises:
        ValueError: naming the bad item.
    """
    networks: list[IPNetwork] = []
    for item in items:
        try:
            networks.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an address or CIDR range") from None
    return tuple(networks)


def parse_ip(text: str | IPAddress) -> IPAddress | None:
    """An address from text (an IPv6 zone ``%eth0`` is ignored); None if invalid."""
    if not isinstance(text, str):
        return text
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries (see the module docstring)."""
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.ipv4_mapped is not None:
        return (address.ipv4_mapped,)
    if address in _COMPATIBLE:
        # ::/96 also holds :: (unspecified) and ::1 (loopback), judged as such.
        return (low32,) if int(address) > 1 else ()
    if address in _TRANSLATED or address in _NAT64:
        return (low32,)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        server, client = address.teredo
        return (server, client)
    return ()


def scope_of(address: IPAddress) -> Scope:
    """The scope of one address, not looking inside IPv6 embeddings."""
    for network, scope in _RANGES:
        if address.version == network.version and address in network:
            return scope
    return Scope.GLOBAL


def _forms(address: IPAddress) -> tuple[IPAddress, ...]:
    """The address and every IPv4 address it embeds."""
    if isinstance(address, ipaddress.IPv6Address):
        return (address, *embedded_ipv4(address))
    return (address,)


def _in_any(address: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    return any(
        address.version == network.version and address in network
        for network in networks
    )


@frozen
class AddressPolicy:
    """Decides whether a relay may exchange data with an IP (module docstring)."""

    #: Ranges always allowed (``--turn-allowed-peers``, ``--natneg-relay-allow``).
    allow: tuple[IPNetwork, ...] = ()
    #: Ranges always refused (``--turn-denied-peers``).
    deny: tuple[IPNetwork, ...] = ()
    #: The server's own addresses: local interfaces and advertised addresses.
    self_addresses: frozenset[IPAddress] = frozenset()
    #: Non-global scopes accepted anyway: the scope of the address a relay
    #: advertises (:func:`scopes_for`), or LOOPBACK for ``--allow-loopback-peers``.
    admitted: frozenset[Scope] = frozenset()

    def judge(self, ip: str | IPAddress) -> Verdict:
        """Classify ``ip``; ``Verdict.ALLOWED`` or the reason to refuse it."""
        address = parse_ip(ip)
        if address is None:
            return Verdict.MALFORMED
        if _in_any(address, self.allow):
            return Verdict.ALLOWED
        forms = _forms(address)
        if any(_in_any(form, self.deny) for form in forms):
            return Verdict.DENIED
        for form in forms:
            scope = scope_of(form)
            if scope in self.admitted:
                continue
            if scope != Scope.GLOBAL:
                return _SCOPE_VERDICT[scope]
            if form in self.self_addresses:
                return Verdict.SELF
        return Verdict.ALLOWED

    def permits(self, ip: str | IPAddress) -> bool:
        """True when a relay may send to, or serve, ``ip``."""
        return self.judge(ip) == Verdict.ALLOWED

    def is_self(self, ip: str | IPAddress) -> bool:
        """Whether a datagram to ``ip`` reaches this host: one of its addresses,
        loopback or unspecified (0.0.0.0 and :: are delivered locally), in any of
        the embedded forms."""
        address = parse_ip(ip)
        if address is None:
            return False
        for form in _forms(address):
            if form in self.self_addresses:
                return True
            if form.is_loopback or form.is_unspecified or form in _THIS_NETWORK:
                return True
        return False

    def admitting(self, *scopes: Scope) -> AddressPolicy:
        """The same policy, also admitting ``scopes``."""
        return AddressPolicy(
            self.allow, self.deny, self.self_addresses, self.admitted | set(scopes)
        )


_THIS_NETWORK: Final = ipaddress.IPv4Network("0.0.0.0/8")


def scopes_for(advertised: Iterable[str]) -> frozenset[Scope]:
    """The scopes a relay advertising these addresses serves clients from.

    A relay that tells clients "reach me at 127.0.0.1" can only be reached from
    loopback, and one at 192.168.1.10 from a private network: refusing those
    clients makes its own advertisement useless (a new user's first try fails).
    Global and reserved advertisements admit nothing more.
    """
    scopes: set[Scope] = set()
    for text in advertised:
        address = parse_ip(text)
        if address is None:
            continue
        scope = scope_of(address)
        if scope in (Scope.LOOPBACK, Scope.PRIVATE, Scope.LINK_LOCAL):
            scopes.add(scope)
    return frozenset(scopes)
