"""Which peer addresses a relay may talk to.

A TURN relay that forwards to any address is an open door into the network it runs
in (coturn CVE-2020-26262; reference §3.3 "Security"). By default crossroads
refuses peers in loopback, private, link-local, shared (CGNAT), multicast,
unspecified and reserved ranges — the same idea as coturn's recommended
``denied-peer-ip`` list and eturnal's ``blacklist_peers: recommended``.

The policy is applied when a permission is installed (CreatePermission,
ChannelBind) and on Connect (RFC 6062): a refused address gets 403 Forbidden
(RFC 8656 §10.2, §12.2). Data can only flow to and from peers that hold a
permission, so the data path needs no check of its own.

Order of decision: an explicit ``allow`` range wins; then an explicit ``deny``
range; then the built-in ranges (unless ``allow_loopback`` lifts the loopback
ones); everything else is allowed. IPv4-mapped IPv6 addresses are judged as the
IPv4 address they carry.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LOOPBACK: tuple[str, ...] = ("127.0.0.0/8", "::1/128")

#: Built-in deny list (besides loopback). Documentation ranges (192.0.2.0/24,
#: 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32) are NOT here: nothing routes
#: to them, and the NAT lab uses them as its "public internet".
_DENIED: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network" (RFC 791); 0.0.0.0 reaches local services
    "10.0.0.0/8",  # RFC 1918 private
    "100.64.0.0/10",  # RFC 6598 shared address space (carrier NAT)
    "169.254.0.0/16",  # RFC 3927 link-local (cloud metadata services live here)
    "172.16.0.0/12",  # RFC 1918 private
    "192.0.0.0/24",  # RFC 6890 IETF protocol assignments
    "192.168.0.0/16",  # RFC 1918 private
    "198.18.0.0/15",  # RFC 2544 benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, includes 255.255.255.255 broadcast
    "::/128",  # unspecified
    "64:ff9b:1::/48",  # RFC 8215 local-use NAT64
    "fc00::/7",  # RFC 4193 unique local
    "fe80::/10",  # link-local
    "fec0::/10",  # deprecated site-local
    "ff00::/8",  # multicast
)


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


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    """Decides whether a relay may exchange data with a peer IP."""

    allow_loopback: bool = False
    allow: tuple[IPNetwork, ...] = ()
    deny: tuple[IPNetwork, ...] = ()
    _builtin: tuple[IPNetwork, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        ranges = _DENIED if self.allow_loopback else _DENIED + _LOOPBACK
        object.__setattr__(self, "_builtin", parse_networks(ranges))

    def permits(self, ip: str | IPAddress) -> bool:
        """True when a relay may send to and receive from ``ip``."""
        try:
            address = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        if any(address in network for network in self.allow):
            return True
        if any(address in network for network in self.deny):
            return False
        return not any(address in network for network in self._builtin)
