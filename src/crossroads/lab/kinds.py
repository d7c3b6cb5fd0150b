"""The NAT kinds of the lab, in RFC 4787 terms, and the nftables rules that make them.

Every kind is built from real kernel NAT (netfilter conntrack + nftables) in the
router's network namespace; docs/nat-lab.md explains each one. In short:

- *Mapping*. ``masquerade`` keeps the host's source port when it can, and conntrack
  reuses the same external port for every destination of one internal endpoint:
  endpoint-independent mapping (EIM). ``masquerade fully-random`` picks a new random
  port per 5-tuple: address-and-port-dependent mapping (APDM) with random ports. For
  APDM with *sequential* ports the kernel has no mode (its port search starts at a
  random offset), so the rule feeds ``snat`` from ``numgen inc``: every new UDP flow
  takes the next port of a window.
- *Filtering*. conntrack alone lets in only replies from the exact remote endpoint:
  address-and-port-dependent filtering (APDF). Endpoint-independent (EIF) and
  address-dependent (ADF) filtering need state conntrack does not keep; they are
  built in the kernel too, from nftables dynamic sets that the router fills from its
  own outbound packets: ``emap`` (external port -> internal endpoint, refreshed by
  every outbound packet) and, for ADF, ``adf`` (external port . remote address).
  A new inbound flow whose external port is in ``emap`` (and, for ADF, whose source
  address is in ``adf``) is DNATed to the internal endpoint; anything else is dropped.
- *Hairpinning*: a LAN packet to the router's own public address whose port is in
  ``emap`` is DNATed back into the LAN and SNATed to the public address.
- *Unsolicited input* (``port-restricted-remap``): most kinds drop what arrives on
  the WAN for the router itself. Many home routers do not (a Linux box with no input
  firewall): the packet is delivered to the router, conntrack confirms an entry for
  it, and when the host later sends from that port to that remote endpoint, SNAT
  finds the reply tuple taken and picks another external port: the mapping is
  *remapped* for exactly the peer that knocked first (docs/natneg.md).
"""

from __future__ import annotations

from enum import StrEnum

from crossroads.types import frozen


class Mapping(StrEnum):
    """RFC 4787 section 4.1 mapping behaviour (RFC 5780 section 4.3 test)."""

    NONE = "none"  # no NAT: the host's own address is public
    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


class Filtering(StrEnum):
    """RFC 4787 section 5 filtering behaviour (RFC 5780 section 4.4 test)."""

    NONE = "none"  # no filter at all
    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


class Allocation(StrEnum):
    """How a new external port is chosen (RFC 4787 section 4.2)."""

    NONE = "none"
    PRESERVE = "preserve"  # the host's own port when free
    SEQUENTIAL = "sequential"  # the next port of a window, one per new mapping
    RANDOM = "random"


@frozen
class NatKind:
    """One kind of router in the lab, and the behaviour a probe must see."""

    name: str
    summary: str
    mapping: Mapping
    filtering: Filtering
    allocation: Allocation
    hairpin: bool
    #: False for the firewall that passes only TCP.
    udp: bool = True
    #: A carrier-grade NAT (EIM, APDF, port preserving) in front of the home NAT.
    double: bool = False
    #: A real miniupnpd (UPnP IGD + NAT-PMP/PCP) runs on the (home) router.
    upnp: bool = False
    #: The router's input chain accepts unsolicited WAN packets (see above).
    accepts_unsolicited: bool = False

    @property
    def natted(self) -> bool:
        return self.mapping is not Mapping.NONE


def both_udp(x: NatKind, y: NatKind) -> bool:
    """Both sites can send UDP to the server (every kind but ``udp-blocked``):
    the expectation of a method that connects every such pair, directly or
    through a UDP relay."""
    return x.udp and y.udp


def every_pair(x: NatKind, y: NatKind) -> bool:
    """Every pair of lab sites: the expectation of a method that needs only a
    TCP connection to the server, which every lab NAT and firewall passes."""
    return True


KINDS: tuple[NatKind, ...] = (
    NatKind(
        "open",
        "no NAT: the host has a public address",
        Mapping.NONE,
        Filtering.NONE,
        Allocation.NONE,
        # Trivially: a packet to the host's own public address reaches it.
        hairpin=True,
    ),
    NatKind(
        "full-cone",
        "EIM + endpoint-independent filtering, hairpinning",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ENDPOINT_INDEPENDENT,
        Allocation.PRESERVE,
        hairpin=True,
    ),
    NatKind(
        "restricted-cone",
        "EIM + address-dependent filtering, hairpinning, miniupnpd",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_DEPENDENT,
        Allocation.PRESERVE,
        hairpin=True,
        upnp=True,
    ),
    NatKind(
        "port-restricted-cone",
        "EIM + address-and-port-dependent filtering, hairpinning",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.PRESERVE,
        hairpin=True,
    ),
    NatKind(
        "symmetric-sequential",
        "APDM with sequential ports + APDF, no hairpinning",
        Mapping.ADDRESS_AND_PORT_DEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.SEQUENTIAL,
        hairpin=False,
    ),
    NatKind(
        "symmetric-random",
        "APDM with random ports + APDF, no hairpinning",
        Mapping.ADDRESS_AND_PORT_DEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.RANDOM,
        hairpin=False,
    ),
    NatKind(
        "cgnat",
        "home NAT (EIM + APDF, miniupnpd) behind a carrier-grade NAT (EIM + APDF)",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.PRESERVE,
        hairpin=False,
        double=True,
        upnp=True,
    ),
    NatKind(
        "udp-blocked",
        "NAT + firewall passing only TCP",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.PRESERVE,
        hairpin=False,
        udp=False,
    ),
    NatKind(
        "port-restricted-remap",
        "port-restricted-cone whose router accepts unsolicited input (no input"
        " firewall): a packet that knocks first makes it remap the later mapping",
        Mapping.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_AND_PORT_DEPENDENT,
        Allocation.PRESERVE,
        hairpin=True,
        accepts_unsolicited=True,
    ),
)

#: Router variants: built in the lab (sites ``-a`` and ``-b``) and usable by name
#: (``lab matrix --kinds``, ``lab exec``), but not in the default matrix. None at
#: the moment: ``port-restricted-remap`` is in the default matrix, as common as it is.
VARIANT_KINDS: tuple[NatKind, ...] = ()

KINDS_BY_NAME: dict[str, NatKind] = {
    kind.name: kind for kind in (*KINDS, *VARIANT_KINDS)
}

#: First external port of the symmetric-sequential window, and its size. The
#: window only has to be larger than the number of flows one lab run opens
#: through one router, so that ports never wrap onto a live mapping.
SEQUENTIAL_BASE = 20000
SEQUENTIAL_SPAN = 4000

#: Lifetime of the nftables mapping state (emap/adf), refreshed by every outbound
#: packet. RFC 4787 REQ-5: a UDP mapping timer MUST NOT expire in less than two
#: minutes; conntrack's own UDP stream timeout is 120 s as well.
MAPPING_TIMEOUT_S = 180


def router_ruleset(
    kind: NatKind,
    *,
    lan_net: str,
    wan_ip: str,
    hairpin: bool,
    stun_check: tuple[tuple[str, ...], tuple[int, ...]] | None = None,
) -> str:
    """The nftables ruleset (table ``ip xr``) of a home router of ``kind``.

    ``stun_check`` (addresses, ports) opens the router's own input to that STUN
    server: miniupnpd checks with RFC 5780 change requests that its WAN address
    is reachable (answers from the other address and port) before it agrees to
    forward ports.

    ``lan`` and ``wan`` are the router's interface names. Only traffic from
    ``lan_net`` is translated: the router's own traffic (miniupnpd's STUN check)
    leaves with its WAN address, as on a real router.
    """
    pre: list[str] = []
    post: list[str] = []
    record: list[str] = []
    forward = _forward_rules(
        kind,
        "ct state established,related accept",
        'iifname "lan" accept',
        'iifname "wan" ct status dnat accept',
    )

    udp_flow = f'ip saddr {lan_net} oifname "wan" meta l4proto udp'
    match kind.allocation:
        case Allocation.SEQUENTIAL:
            ports = ", ".join(
                f"{i} : {SEQUENTIAL_BASE + i}" for i in range(SEQUENTIAL_SPAN)
            )
            # numgen yields a host-order u32; a literal map turns it into a
            # network-order port (feeding numgen straight to snat swaps bytes).
            post.append(
                f"{udp_flow} snat ip to {wan_ip} : numgen inc mod {SEQUENTIAL_SPAN}"
                f" map {{ {ports} }}"
            )
            post.append(f'ip saddr {lan_net} oifname "wan" masquerade')
        case Allocation.RANDOM:
            post.append(f'ip saddr {lan_net} oifname "wan" masquerade fully-random')
        case _:
            post.append(f'ip saddr {lan_net} oifname "wan" masquerade')

    # emap: external port -> internal endpoint, after SNAT (priority 300 > srcnat).
    record.append(
        'oifname "wan" ct status snat meta l4proto udp update @emap '
        "{ udp sport : ct original ip saddr . ct original proto-src }"
    )
    match kind.filtering:
        case Filtering.ENDPOINT_INDEPENDENT:
            pre.append('iifname "wan" meta l4proto udp dnat ip to udp dport map @emap')
        case Filtering.ADDRESS_DEPENDENT:
            record.append(
                'oifname "wan" ct status snat meta l4proto udp update @adf '
                "{ udp sport . ip daddr }"
            )
            pre.append(
                'iifname "wan" udp dport . ip saddr @adf dnat ip to udp dport map @emap'
            )
        case _:
            pass  # conntrack alone: only the exact remote endpoint gets in
    if hairpin:
        pre.append(
            f'iifname "lan" ip daddr {wan_ip} meta l4proto udp '
            "dnat ip to udp dport map @emap"
        )
        post.insert(
            0, f'ip saddr {lan_net} oifname "lan" ct status dnat snat ip to {wan_ip}'
        )
    accept_input = []
    if stun_check is not None:
        ips = ", ".join(stun_check[0])
        ports = ", ".join(str(p) for p in stun_check[1])
        accept_input.append(
            f'iifname "wan" ip saddr {{ {ips} }} udp sport {{ {ports} }} accept'
        )
    return _table(
        pre=pre,
        post=post,
        record=record,
        forward=forward,
        input_wan_drop=not kind.accepts_unsolicited,
        accept_input=accept_input,
    )


def cgn_ruleset(*, inside_net: str) -> str:
    """The carrier-grade NAT in front of a ``cgnat`` home router.

    RFC 6888 REQ-1 asks a CGN for endpoint-independent mapping; ``masquerade`` gives
    EIM with port preservation, and conntrack gives APDF. No hairpinning.
    """
    return _table(
        pre=[],
        post=[f'ip saddr {inside_net} oifname "wan" masquerade'],
        record=[],
        forward=["ct state established,related accept", 'iifname "lan" accept'],
        input_wan_drop=True,
        accept_input=[],
    )


def _forward_rules(kind: NatKind, *rules: str) -> list[str]:
    """A router's forward chain: ``rules``, after a UDP drop for a firewall
    that passes only TCP (and ICMP), so that UDP dies both ways."""
    return ["meta l4proto udp drop", *rules] if not kind.udp else list(rules)


def _chain(name: str, hook: str, rules: list[str], policy: str = "accept") -> str:
    """One nftables base chain, a rule a line."""
    body = "".join(f"    {rule}\n" for rule in rules)
    return f"  chain {name} {{\n    {hook}; policy {policy};\n{body}  }}\n"


def _table(
    *,
    pre: list[str],
    post: list[str],
    record: list[str],
    forward: list[str],
    input_wan_drop: bool,
    accept_input: list[str],
) -> str:
    input_rules = [
        'iifname "wan" ct state established,related accept',
        'iifname "wan" meta l4proto icmp accept',
        *accept_input,
    ]
    if input_wan_drop:
        input_rules.append('iifname "wan" drop')
    return (
        "table ip xr {\n"
        "  map emap {\n"
        "    type inet_service : ipv4_addr . inet_service\n"
        f"    flags dynamic,timeout; timeout {MAPPING_TIMEOUT_S}s\n"
        "  }\n"
        "  set adf {\n"
        "    type inet_service . ipv4_addr\n"
        f"    flags dynamic,timeout; timeout {MAPPING_TIMEOUT_S}s\n"
        "  }\n"
        + _chain("prerouting", "type nat hook prerouting priority dstnat", pre)
        + _chain("postrouting", "type nat hook postrouting priority srcnat", post)
        + _chain("record", "type filter hook postrouting priority 300", record)
        + _chain("forward", "type filter hook forward priority filter", forward, "drop")
        + _chain("input", "type filter hook input priority filter", input_rules)
        + "}\n"
    )


def router_firewall6(kind: NatKind) -> str:
    """The IPv6 side of a home router (table ``ip6 xr6``): no NAT, a stateful
    firewall (RFC 6092): the LAN's flows out and their replies in; nothing
    unsolicited from the WAN. Its filtering is conntrack's (address and port
    dependent), so two hosts reach each other only by sending at the same time.
    ICMPv6 passes (neighbour discovery, errors)."""
    forward = _forward_rules(
        kind,
        "ct state established,related accept",
        "meta l4proto ipv6-icmp accept",
        'iifname "lan" accept',
    )
    input_rules = [
        'iifname "wan" ct state established,related accept',
        'iifname "wan" meta l4proto ipv6-icmp accept',
        'iifname "wan" drop',
    ]
    return (
        "table ip6 xr6 {\n"
        + _chain("forward", "type filter hook forward priority filter", forward, "drop")
        + _chain("input", "type filter hook input priority filter", input_rules)
        + "}\n"
    )


#: The empty chains miniupnpd 2.3 (nftables backend) fills with its port
#: forwards; the names are fixed in its source (table ``inet filter``).
MINIUPNPD_TABLE = """\
table inet filter {
  chain forward { type filter hook forward priority 0; policy accept; jump miniupnpd; }
  chain miniupnpd { }
  chain prerouting { type nat hook prerouting priority -100; policy accept; jump prerouting_miniupnpd; }
  chain postrouting { type nat hook postrouting priority 100; policy accept; jump postrouting_miniupnpd; }
  chain prerouting_miniupnpd { }
  chain postrouting_miniupnpd { }
}
"""
