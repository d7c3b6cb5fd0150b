"""The kernel data plane: relayed UDP forwarded by an eBPF program on tc ingress.

Theory of operation
-------------------
``bpf/relay.bpf.c`` (compiled at install into ``bpf/relay.bpf.o``; see
``hatch_build.py``) is loaded through libbpf and attached to the ingress of
each device relayed traffic arrives on. It forwards a datagram only when its
``(family, source, destination, ChannelData channel)`` is a key of its
``routes`` map, rewriting it on the way (see the C file for the three
actions); everything else reaches the sockets as before. This module is the
only writer of that map: :meth:`KernelPlane.install` puts a
:class:`KernelRoute` in, :meth:`KernelPlane.remove` takes it out (the next
datagram of that flow goes to the socket plane, which refuses what has no
route: a freed allocation, an expired permission), and
:meth:`KernelPlane.counters` reads its packets and payload bytes.

Why libbpf through :mod:`ctypes`: libbpf is the kernel's own loader (ELF and
BTF relocation, map creation, the verifier log), packaged by Debian
(``libbpf1``) and stable in its 1.x ABI; calling its handful of functions
from Python needs no second C extension built against libbpf-dev and keeps
the loader readable next to the route logic. No Python binding of libbpf is
packaged or maintained well enough to depend on.

Several processes on one host (``--workers N``, two servers, a test suite)
each load their own program with their own maps and attach it to the same
devices. The program passes what it does not route *down the chain*
(``TCX_NEXT`` / ``TC_ACT_UNSPEC``), so every process's program sees every
packet until one of them routes it; the last one's "next" is the stack.

Attachment: a tcx link (Linux >= 6.6) when the kernel has it — links on
one device run in order, and the program comes off the device when the
link's descriptor closes, so a crashed process leaves no forwarding
behind; otherwise a classic clsact filter (Linux >= 4.5) at a priority of
its own (the first free one from :data:`TC_PRIORITY`), which
:meth:`KernelPlane.close` removes (with the clsact qdisc when this plane
made it and no other filter is left on it). A classic filter outlives a
SIGKILLed process, and holds its program and maps with it: the program
then forwards only while its *lease* runs — a deadline a thread of this
process pushes forward every :data:`LEASE_REFRESH` seconds — and passes
everything once it is :data:`LEASE_SECONDS` old. Nothing is pinned in
bpffs: the maps live as long as the process (or its stale filter).

XDP (``--kernel-hook``, :func:`xdp_policy`): the object's second program,
``crossroads_relay_xdp``, over the same maps, is attached in driver mode in
front of the tc program where the policy says so, through a bpf_link (it
goes with the process's descriptor) and only if the device has no XDP
program yet (one per device: a second process runs tc there). It forwards
what it can finish and passes the rest, untouched, to tc. It sends frames
only out of devices :func:`xdp_families` allows (map ``xdp_egress``), which
a thread of the process looks at again every :data:`EGRESS_RECHECK`
seconds: a frame sent out of a device that stopped taking them (its veth
peer's XDP program, a NIC's, gone) is dropped after the program returned,
so such a device must leave the map before many are. Its next hop comes
from ``bpf_fib_lookup`` where the device forwards; where it does not (a
relay host need not), from map ``next_hops``, which the same thread keeps
from the routing and neighbour tables (:func:`next_hop`) for the
destinations of the routes XDP may send.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

from crossroads.types import frozen

log = logging.getLogger("crossroads.dataplane")

#: The compiled program beside its source (made at install).
OBJECT_PATH = Path(__file__).with_name("bpf") / "relay.bpf.o"
PROGRAM = b"crossroads_relay"
XDP_PROGRAM = b"crossroads_relay_xdp"
XDP_EGRESS_MAP = b"xdp_egress"
XDP_STATS_MAP = b"xdp_stats"
#: The slots of ``xdp_stats`` (relay.bpf.c XDP_FORWARDED, XDP_LEFT_*).
XDP_STATS = ("forwarded", "left-egress", "left-checksum", "left-next-hop", "left-other")
TC_MOVES_MAP = b"tc_moves"
#: The slots of ``tc_moves`` (relay.bpf.c TC_MOVED_HEADERS, TC_MOVED_DATA).
TC_MOVES = ("headers", "data")
ROUTES_MAP = b"routes"
RELAY_ROUTES_MAP = b"relay_routes"
NEXT_HOPS_MAP = b"next_hops"
LEASE_MAP = b"lease"
#: How long a classic filter's program forwards after its process last
#: renewed the lease (a SIGKILLed process's routes stop within this), and how
#: often a live process renews it: four renewals per lease ride out a busy
#: second without letting a live process's routes lapse.
LEASE_SECONDS = 2.0
LEASE_REFRESH = 0.5
#: How often the XDP egress facts and next hops are read again (a few
#: rtnetlink requests per device and per destination): the most a device
#: that stopped taking XDP frames can black-hole what XDP sends there, and
#: the most a next hop can lag the neighbour table.
EGRESS_RECHECK = 1.0
#: Next hops resolved again per recheck at most (a route lookup each, and a
#: neighbour and link lookup per gateway and device): a host relaying to ten
#: thousand destinations takes each one's route change within 40 s, and a
#: destination the kernel has not resolved yet within a recheck.
NEXT_HOP_BATCH = 256
#: The bytes of a Unity RELAY frame that name its route (relay.bpf.c RELAY_HEAD).
RELAY_HEAD = 36
#: The map's max_entries in relay.bpf.c.
MAX_ROUTES = 65536

#: enum bpf_attach_type BPF_TCX_INGRESS (include/uapi/linux/bpf.h, Linux 6.6).
BPF_TCX_INGRESS = 46
BPF_TC_INGRESS = 1
#: enum bpf_attach_type BPF_XDP, and XDP_FLAGS_DRV_MODE (include/uapi/linux/
#: if_link.h): driver mode only, never the generic (skb) mode, slower than tc.
BPF_XDP = 37
XDP_FLAGS_DRV_MODE = 1 << 2
#: The per-device hook choices (``--kernel-hook``; docs/architecture.md).
HOOKS: tuple[str, ...] = ("auto", "tc", "xdp")
BPF_TC_EGRESS = 2
#: Our classic tc filters' handle, and the first of the priorities they take
#: on a device: each process the first free one of :data:`TC_PRIORITIES`
#: (tc runs lower priorities first; all of ours pass what they do not route).
TC_HANDLE = 0xC055
TC_PRIORITY = 0xC055
TC_PRIORITIES = 256

BPF_ANY = 0


class KernelPlaneUnavailable(RuntimeError):
    """The kernel plane cannot run here; ``str()`` says why (for the log line)."""


class RouteKind(IntEnum):
    """What the program does to a routed datagram (relay.bpf.c ``KIND_*``)."""

    UNWRAP_CHANNEL = 1  # TURN client -> peer: ChannelData header off
    WRAP_CHANNEL = 2  # TURN peer -> client: ChannelData header on
    REWRITE = 3  # natneg pairs, RakNet forwarders: as is
    #: Unity RELAY frames: as is, keyed also by the frame's first 36 bytes
    #: (header, from and to allocation IDs) with its DataLength checked.
    RELAY = 4


@frozen
class KernelRoute:
    """One direction of one relayed flow.

    A datagram from ``source`` to ``target`` (one of our addresses) — with
    ``UNWRAP_CHANNEL``, carrying ChannelData for ``channel`` — leaves from
    ``out_source`` to ``out_dest``; with ``WRAP_CHANNEL`` it gets ``channel``'s
    header. Addresses are concrete (no wildcard) and of one family.
    """

    kind: RouteKind
    source: tuple[str, int]
    target: tuple[str, int]
    out_source: tuple[str, int]
    out_dest: tuple[str, int]
    channel: int = 0
    #: ``RELAY``: the first 36 bytes of the frames it forwards.
    header: bytes = b""


def _family(host: str) -> int:
    return 4 if ipaddress.ip_address(host).version == 4 else 6


def _addr16(host: str) -> bytes:
    """The address as 16 bytes (IPv4 in the first four, as the key holds it)."""
    packed = ipaddress.ip_address(host).packed
    return packed + bytes(16 - len(packed))


def _key(route: KernelRoute) -> bytes:
    channel = route.channel if route.kind is RouteKind.UNWRAP_CHANNEL else 0
    key = (
        _addr16(route.source[0])
        + _addr16(route.target[0])
        + struct.pack("!HH", route.source[1], route.target[1])
        + struct.pack("=HBx", channel, _family(route.source[0]))
    )
    if route.kind is RouteKind.RELAY:
        if len(route.header) != RELAY_HEAD:
            raise ValueError("a RELAY route needs the frame's 36-byte header")
        key += route.header
    return key


_VALUE = struct.Struct("=16s16s2s2sHBxIIQQ")
#: relay.bpf.c struct next_hop_key (ifindex, destination, family) and
#: struct next_hop (the next hop's MAC, the device's, the device's MTU).
_NEXT_HOP_KEY = struct.Struct("=I16sB3x")
_NEXT_HOP = struct.Struct("=6s6sI")
#: Neighbour states whose link-layer address may be sent to
#: (include/uapi/linux/neighbour.h NUD_REACHABLE, STALE, DELAY, PROBE,
#: PERMANENT): not INCOMPLETE or FAILED, nor NOARP (no address).
_NUD_USABLE = 0x02 | 0x04 | 0x08 | 0x10 | 0x80


def _value(route: KernelRoute, ifindex: int) -> bytes:
    return _VALUE.pack(
        _addr16(route.out_source[0]),
        _addr16(route.out_dest[0]),
        struct.pack("!H", route.out_source[1]),
        struct.pack("!H", route.out_dest[1]),
        route.channel if route.kind is RouteKind.WRAP_CHANNEL else 0,
        int(route.kind),
        ifindex,
        0,
        0,
        0,
    )


# ------------------------------------------------------------------ routing


def _rtnetlink(message_type: int, body: bytes, what: str) -> tuple[bytes, int]:
    """One rtnetlink request (NLM_F_REQUEST) and its reply, and the reply's
    length; an NLMSG_ERROR reply raises OSError naming ``what``."""
    header = struct.pack("=IHHII", 16 + len(body), message_type, 1, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.settimeout(2.0)
        nl.send(header + body)
        reply = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", reply)
    if kind == 2:  # NLMSG_ERROR
        (code,) = struct.unpack_from("=i", reply, 16)
        raise OSError(-code, what)
    return reply, length


def route_to(host: str) -> tuple[int, str | None]:
    """The device the kernel routes ``host`` by and the next hop's address
    on it: the gateway, or ``host`` itself on a link (RTM_GETROUTE over
    rtnetlink); None for a next hop of another family (RTA_VIA)."""
    family = socket.AF_INET if _family(host) == 4 else socket.AF_INET6
    packed = ipaddress.ip_address(host).packed
    rta = struct.pack("=HH", 4 + len(packed), 1) + packed  # RTA_DST
    rtmsg = struct.pack("=BBBBBBBBI", family, len(packed) * 8, 0, 0, 0, 0, 0, 0, 0)
    reply, length = _rtnetlink(26, rtmsg + rta, f"no route to {host}")  # RTM_GETROUTE
    attrs = _attrs(reply, 16 + 12, length)
    oif = attrs.get(4)  # RTA_OIF
    if oif is None or len(oif) < 4:
        raise OSError(errno.ENETUNREACH, f"no output device for {host}")
    gateway = attrs.get(5)  # RTA_GATEWAY
    if gateway is not None and len(gateway) == len(packed):
        hop: str | None = str(ipaddress.ip_address(gateway))
    else:
        hop = None if 18 in attrs else host  # RTA_VIA
    return int(struct.unpack_from("=I", oif)[0]), hop


def egress_ifindex(host: str) -> int:
    """The device the kernel routes ``host`` by (RTM_GETROUTE over rtnetlink)."""
    return route_to(host)[0]


def neighbour_mac(ifindex: int, host: str) -> bytes | None:
    """The link-layer address the neighbour table holds for ``host`` on
    ``ifindex`` (RTM_GETNEIGH, Linux >= 4.18), or None: no entry, or one
    not usable (still resolving, failed)."""
    family = socket.AF_INET if _family(host) == 4 else socket.AF_INET6
    packed = ipaddress.ip_address(host).packed
    ndmsg = struct.pack("=BBHiHBB", family, 0, 0, ifindex, 0, 0, 0)
    nda = struct.pack("=HH", 4 + len(packed), 1) + packed  # NDA_DST
    try:
        reply, length = _rtnetlink(30, ndmsg + nda, f"no neighbour {host}")
    except OSError:
        return None
    (state,) = struct.unpack_from("=H", reply, 16 + 8)
    mac = _attrs(reply, 16 + 12, length).get(2)  # NDA_LLADDR
    if not state & _NUD_USABLE or mac is None or len(mac) != 6:
        return None
    return mac


@dataclass
class NextHopLookups:
    """Answers shared by the next hops resolved in one go: many destinations
    go through one gateway and out of one device."""

    neighbours: dict[tuple[int, str], bytes | None] = field(default_factory=dict)
    links: dict[int, LinkFacts] = field(default_factory=dict)


def next_hop(
    ifindex: int, host: str, lookups: NextHopLookups | None = None
) -> tuple[bytes, str] | None:
    """relay.bpf.c's struct next_hop for sending to ``host`` out of
    ``ifindex`` (the next hop's MAC, the device's, its MTU) and the next
    hop's address (a gateway, or ``host``), or None while the kernel routes
    ``host`` elsewhere or has not resolved the next hop."""
    lookups = lookups or NextHopLookups()
    try:
        out, hop = route_to(host)
        if out != ifindex or hop is None:
            return None
        if (ifindex, hop) not in lookups.neighbours:
            lookups.neighbours[ifindex, hop] = neighbour_mac(ifindex, hop)
        dmac = lookups.neighbours[ifindex, hop]
        if ifindex not in lookups.links:
            lookups.links[ifindex] = link_facts(ifindex)
        facts = lookups.links[ifindex]
    except OSError:
        return None
    if dmac is None or len(facts.mac) != 6 or not facts.mtu:
        return None
    return _NEXT_HOP.pack(dmac, facts.mac, facts.mtu), hop


@frozen
class LinkFacts:
    """What rtnetlink says of a device (RTM_GETLINK)."""

    #: IFLA_INFO_KIND ("veth", "bridge", ...); None for a hardware or
    #: paravirtual NIC's driver (no link kind: packets come from a wire).
    kind: str | None
    #: An XDP program is attached (IFLA_XDP_ATTACHED != 0).
    xdp: bool
    #: The other end of a veth (IFLA_LINK) and its namespace's id as seen
    #: from here (IFLA_LINK_NETNSID; None: this namespace).
    peer: int | None = None
    peer_netnsid: int | None = None
    #: Its own link-layer address (IFLA_ADDRESS) and MTU (IFLA_MTU).
    mac: bytes = b""
    mtu: int = 0


def _attrs(buf: bytes, offset: int, end: int) -> dict[int, bytes]:
    found: dict[int, bytes] = {}
    while offset + 4 <= end:
        size, attr = struct.unpack_from("=HH", buf, offset)
        if size < 4:
            break
        found[attr & 0x3FFF] = buf[offset + 4 : offset + size]
        offset += (size + 3) & ~3
    return found


def link_facts(ifindex: int, netnsid: int | None = None) -> LinkFacts:
    """The device ``ifindex`` of this namespace, or of the one this
    namespace knows as ``netnsid`` (IFLA_TARGET_NETNSID, Linux >= 4.20)."""
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, ifindex, 0, 0)
    if netnsid is not None:
        body += struct.pack("=HHi", 8, 46, netnsid)  # IFLA_TARGET_NETNSID
    reply, length = _rtnetlink(18, body, f"no device {ifindex}")  # RTM_GETLINK
    top = _attrs(reply, 32, length)
    info = top.get(18)  # IFLA_LINKINFO
    link_kind = None
    if info is not None:
        raw = _attrs(info, 0, len(info)).get(1)  # IFLA_INFO_KIND
        if raw is not None:
            link_kind = raw.rstrip(b"\0").decode(errors="replace")
    xdp = top.get(43)  # IFLA_XDP
    attached = False
    if xdp is not None:
        mode = _attrs(xdp, 0, len(xdp)).get(2)  # IFLA_XDP_ATTACHED
        attached = bool(mode and mode[0])
    peer = top.get(5)  # IFLA_LINK
    nsid = top.get(37)  # IFLA_LINK_NETNSID
    mtu = top.get(4)  # IFLA_MTU
    return LinkFacts(
        link_kind,
        attached,
        struct.unpack("=i", peer[:4])[0] if peer else None,
        struct.unpack("=i", nsid[:4])[0] if nsid else None,
        top.get(1, b""),  # IFLA_ADDRESS
        struct.unpack("=I", mtu[:4])[0] if mtu and len(mtu) >= 4 else 0,
    )


def device_name(ifindex: int) -> str:
    """``ifindex``'s name in this thread's namespace, or "ifindex N" once gone."""
    try:
        return socket.if_indextoname(ifindex)
    except OSError:  # gone
        return f"ifindex {ifindex}"


def xdp_families(ifindex: int) -> tuple[int, str]:
    """The IP families (bit 0: IPv4, bit 1: IPv6) whose datagrams the XDP
    program may send out of ``ifindex`` (XDP_TX, a redirect), and why not
    when 0: a NIC takes XDP frames only with its driver's XDP transmit path
    set up (an XDP program on it); a veth drops frames sent into it unless
    its peer has NAPI (an XDP program there; GRO on the peer also enables
    NAPI but rtnetlink does not show it, so such a peer is not counted on).
    The next hop comes from bpf_fib_lookup where the device forwards, else
    from user space (:func:`next_hop`)."""
    ok, why = _xdp_transmits(ifindex)
    return (3 if ok else 0), why


def _xdp_transmits(ifindex: int) -> tuple[bool, str]:
    facts = link_facts(ifindex)
    if facts.kind is None:
        # A NIC driver sets up its XDP transmit queues with a program on it.
        if facts.xdp:
            return True, "a NIC driver with an XDP program on it"
        return False, "a NIC driver without an XDP program"
    if facts.kind != "veth":
        return False, f"a {facts.kind} device"
    if facts.peer is None:
        return False, "a veth without a peer"
    try:
        peer = link_facts(facts.peer, facts.peer_netnsid)
    except OSError as exc:
        return False, f"its veth peer cannot be seen ({exc.strerror})"
    if peer.xdp:
        return True, "its veth peer has an XDP program (NAPI)"
    return False, "its veth peer has no XDP program (no NAPI: frames would drop)"


# ------------------------------------------------------------------ libbpf


class _TcHook(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("ifindex", ctypes.c_int),
        ("attach_point", ctypes.c_int),
        ("parent", ctypes.c_uint32),
        ("_pad", ctypes.c_size_t),
    ]


class _TcOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("prog_fd", ctypes.c_int),
        ("flags", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("handle", ctypes.c_uint32),
        ("priority", ctypes.c_uint32),
        ("_pad", ctypes.c_size_t),
    ]


def _libbpf() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise KernelPlaneUnavailable(f"libbpf not found ({exc})") from exc
    vp, cp, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures: dict[str, tuple[list[type], type | None]] = {
        "bpf_object__open_file": ([cp, vp], vp),
        "bpf_object__load": ([vp], i),
        "bpf_object__close": ([vp], None),
        "bpf_object__find_program_by_name": ([vp, cp], vp),
        "bpf_object__find_map_by_name": ([vp, cp], vp),
        "bpf_program__fd": ([vp], i),
        "bpf_map__fd": ([vp], i),
        "bpf_map_update_elem": ([i, vp, vp, ctypes.c_uint64], i),
        "bpf_map_delete_elem": ([i, vp], i),
        "bpf_map_lookup_elem": ([i, vp, vp], i),
        "bpf_link_create": ([i, i, ctypes.c_int, vp], i),
        "bpf_tc_hook_create": ([vp], i),
        "bpf_tc_hook_destroy": ([vp], i),
        "bpf_tc_attach": ([vp, vp], i),
        "bpf_tc_detach": ([vp, vp], i),
        "libbpf_set_print": ([vp], vp),
        "libbpf_num_possible_cpus": ([], i),
    }
    for fn, (args, res) in signatures.items():
        func = getattr(lib, fn)
        func.argtypes = args
        func.restype = res
    return lib


def _hook(ifindex: int) -> _TcHook:
    return _TcHook(
        sz=ctypes.sizeof(_TcHook), ifindex=ifindex, attach_point=BPF_TC_INGRESS
    )


def _tc_opts(priority: int, prog_fd: int = 0) -> _TcOpts:
    return _TcOpts(
        sz=ctypes.sizeof(_TcOpts),
        prog_fd=prog_fd,
        handle=TC_HANDLE,
        priority=priority,
    )


#: tc's parents of the clsact qdisc's two hooks (TC_H_MAKE(TC_H_CLSACT,
#: TC_H_MIN_INGRESS / TC_H_MIN_EGRESS), include/uapi/linux/pkt_sched.h).
_CLSACT_INGRESS = 0xFFFFFFF2
_CLSACT_EGRESS = 0xFFFFFFF3


def tc_filters(ifindex: int, parent: int = _CLSACT_INGRESS) -> int:
    """How many classic tc filter entries hang on ``ifindex``'s clsact hook
    (an RTM_GETTFILTER dump over rtnetlink; 0 when there is no clsact)."""
    tcmsg = struct.pack("=BBHiIII", socket.AF_UNSPEC, 0, 0, ifindex, 0, parent, 0)
    # RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP
    header = struct.pack("=IHHII", 16 + len(tcmsg), 46, 0x301, 1, 0)
    count = 0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.settimeout(2.0)
        nl.send(header + tcmsg)
        while True:
            reply = nl.recv(65536)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind = struct.unpack_from("=IH", reply, offset)
                if kind in (2, 3) or length < 16:  # NLMSG_ERROR, NLMSG_DONE
                    return count
                count += kind == 44  # RTM_NEWTFILTER
                offset += (length + 3) & ~3


@dataclass(eq=False)
class _Attachment:
    ifindex: int
    link_fd: int  # tcx link, or -1 for a classic filter
    made_qdisc: bool
    priority: int = 0  # the classic filter's
    xdp_fd: int = -1  # the XDP link in front of it, if any


class _LinkOpts(ctypes.Structure):
    """struct bpf_link_create_opts up to its ``flags`` (libbpf reads no
    further than ``sz`` says)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("flags", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


def xdp_policy(hook: str, facts: LinkFacts) -> str | None:
    """Why ``hook`` leaves ``facts``' device to tc alone, or None to try XDP
    in driver mode there (docs/architecture.md "Which hook, per device")."""
    if hook == "tc":
        return "--kernel-hook tc"
    if hook == "xdp" or facts.kind is None:  # a NIC's packets come from a wire
        return None
    if facts.kind == "veth":
        # Measured (docs/architecture.md): what local senders put on a veth
        # is CHECKSUM_PARTIAL, which the XDP program must pass to tc anyway,
        # and a frame sent into a veth is dropped unless its peer has NAPI.
        return "a veth: its local senders' checksums are partial (auto)"
    return f"a {facts.kind} device (auto: XDP only on NIC drivers)"


@dataclass(eq=False)
class KernelPlane:
    """The loaded program, its route map and the devices it is attached to."""

    _lib: ctypes.CDLL
    _obj: int
    _prog_fd: int
    _map_fd: int
    _relay_map_fd: int
    _lease_fd: int = -1
    _xdp_prog_fd: int = -1
    _xdp_egress_fd: int = -1
    _xdp_stats_fd: int = -1
    _tc_moves_fd: int = -1
    _next_hops_fd: int = -1
    #: ``--kernel-hook``: where XDP runs in front of tc (:data:`HOOKS`).
    hook: str = "tc"
    #: Per device: "xdp" or "tc", and why (the log line).
    hooks: dict[int, tuple[str, str]] = field(default_factory=dict)
    _egress: dict[int, int] = field(default_factory=dict)
    _attached: dict[int, _Attachment] = field(default_factory=dict)
    _routes: dict[bytes, KernelRoute] = field(default_factory=dict)
    _renewer: threading.Thread | None = None
    _egress_watcher: threading.Thread | None = None
    _egress_lock: threading.Lock = field(default_factory=threading.Lock)
    #: next_hops entries (struct next_hop_key): the value written (b"":
    #: none yet) and how many routes send to it; each route's entry.
    _hops: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    _route_hop: dict[bytes, bytes] = field(default_factory=dict)
    #: Each written next hop's (device, gateway or destination).
    _hop_via: dict[bytes, tuple[int, str]] = field(default_factory=dict)
    #: Where the next resolved next hops' turn starts (:meth:`_refresh_next_hops`).
    _hop_turn: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def load(cls, path: Path | None = None) -> KernelPlane:
        """Load (verify) the program; raises :class:`KernelPlaneUnavailable`."""
        path = path or OBJECT_PATH
        if not path.exists():
            raise KernelPlaneUnavailable(
                f"{path.name} not built (needs clang at install)"
            )
        lib = _libbpf()
        lib.libbpf_set_print(None)  # the reason goes in our one log line
        obj = lib.bpf_object__open_file(str(path).encode(), None)
        if not obj:
            raise KernelPlaneUnavailable(
                f"cannot open {path.name}: {os.strerror(ctypes.get_errno())}"
            )
        rc = lib.bpf_object__load(obj)
        if rc != 0:
            lib.bpf_object__close(obj)
            why = os.strerror(-rc)
            if -rc == errno.EPERM:
                why += " (needs root or CAP_BPF and CAP_NET_ADMIN)"
            raise KernelPlaneUnavailable(f"the kernel refused the program: {why}")
        prog = lib.bpf_object__find_program_by_name(obj, PROGRAM)
        rmap = lib.bpf_object__find_map_by_name(obj, ROUTES_MAP)
        relay = lib.bpf_object__find_map_by_name(obj, RELAY_ROUTES_MAP)
        lease = lib.bpf_object__find_map_by_name(obj, LEASE_MAP)
        xdp = lib.bpf_object__find_program_by_name(obj, XDP_PROGRAM)
        egress = lib.bpf_object__find_map_by_name(obj, XDP_EGRESS_MAP)
        stats = lib.bpf_object__find_map_by_name(obj, XDP_STATS_MAP)
        moves = lib.bpf_object__find_map_by_name(obj, TC_MOVES_MAP)
        hops = lib.bpf_object__find_map_by_name(obj, NEXT_HOPS_MAP)
        return cls(
            lib,
            obj,
            lib.bpf_program__fd(prog),
            lib.bpf_map__fd(rmap),
            lib.bpf_map__fd(relay),
            lib.bpf_map__fd(lease),
            lib.bpf_program__fd(xdp),
            lib.bpf_map__fd(egress),
            lib.bpf_map__fd(stats),
            lib.bpf_map__fd(moves),
            lib.bpf_map__fd(hops),
        )

    def _map(self, route: KernelRoute) -> int:
        return self._relay_map_fd if route.kind is RouteKind.RELAY else self._map_fd

    # ------------------------------------------------------------- devices

    def attach(self, device: str | int, *, tcx: bool = True) -> None:
        """Run the program on ``device``'s ingress (a name or an ifindex),
        after any other process's (``tcx=False``: as a classic filter even
        where tcx exists, which the tests of Linux < 6.6's path use)."""
        ifindex = device if isinstance(device, int) else socket.if_nametoindex(device)
        if ifindex in self._attached:
            return
        self._attach_tc(ifindex, tcx)
        self._attach_xdp(self._attached[ifindex])

    def _attach_xdp(self, att: _Attachment) -> None:
        """XDP in driver mode in front of the tc program, where the policy
        and the device allow; one log line per device saying which hook."""
        ifindex = att.ifindex
        try:
            name = socket.if_indextoname(ifindex)
            why = xdp_policy(self.hook, link_facts(ifindex))
        except OSError as exc:
            name, why = str(ifindex), f"no link facts ({exc.strerror})"
        if why is None:
            opts = _LinkOpts(sz=ctypes.sizeof(_LinkOpts), flags=XDP_FLAGS_DRV_MODE)
            link = self._lib.bpf_link_create(
                self._xdp_prog_fd, ifindex, BPF_XDP, ctypes.byref(opts)
            )
            if link >= 0:
                att.xdp_fd = link
                self._recheck_egress()  # a new XDP program: egress facts change
                why = "driver mode, passing what it cannot finish to tc"
            elif -link in (errno.EBUSY, errno.EEXIST):
                why = "another XDP program is on it (another process's?)"
            elif -link in (errno.EOPNOTSUPP, errno.EINVAL):
                why = "its driver has no native XDP"
            else:
                why = f"XDP refused: {os.strerror(-link)}"
        hook = "xdp" if att.xdp_fd >= 0 else "tc"
        self.hooks[ifindex] = (hook, why)
        log.info("dataplane: device %s: %s (%s)", name, hook, why)

    def _attach_tc(self, ifindex: int, tcx: bool) -> None:
        if tcx:
            link = self._lib.bpf_link_create(
                self._prog_fd, ifindex, BPF_TCX_INGRESS, None
            )
            if link >= 0:
                self._attached[ifindex] = _Attachment(ifindex, link, made_qdisc=False)
                return
        # No tcx (Linux < 6.6): a classic clsact filter at a priority of our own
        # (never another process's: replacing it would take its routes away),
        # forwarding only while this process renews its lease.
        self._renew_lease()
        hook = _hook(ifindex)
        made = self._lib.bpf_tc_hook_create(ctypes.byref(hook)) == 0
        rc = -errno.EEXIST
        priority = TC_PRIORITY
        for priority in range(TC_PRIORITY, TC_PRIORITY + TC_PRIORITIES):
            rc = self._lib.bpf_tc_attach(
                ctypes.byref(hook), ctypes.byref(_tc_opts(priority, self._prog_fd))
            )
            if rc != -errno.EEXIST:
                break
        if rc != 0:
            raise OSError(
                -rc, f"cannot attach to ifindex {ifindex}: {os.strerror(-rc)}"
            )
        self._attached[ifindex] = _Attachment(ifindex, -1, made, priority)
        if self._renewer is None:
            self._renewer = threading.Thread(
                target=self._keep_lease, name="crossroads-bpf-lease", daemon=True
            )
            self._renewer.start()

    def _renew_lease(self) -> None:
        deadline = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + int(
            LEASE_SECONDS * 1e9
        )
        self._lib.bpf_map_update_elem(
            self._lease_fd,
            struct.pack("=I", 0),
            struct.pack("=Q", deadline),
            BPF_ANY,
        )

    def _keep_lease(self) -> None:
        while not self._stop.wait(LEASE_REFRESH):
            self._renew_lease()

    def detach(self, device: str | int) -> None:
        """Stop running the program on ``device``."""
        ifindex = device if isinstance(device, int) else socket.if_nametoindex(device)
        att = self._attached.pop(ifindex, None)
        if att is None:
            return
        self.hooks.pop(ifindex, None)
        if att.xdp_fd >= 0:
            os.close(att.xdp_fd)
            self._recheck_egress()
        if att.link_fd >= 0:
            os.close(att.link_fd)
            return
        hook = _hook(ifindex)
        self._lib.bpf_tc_detach(
            ctypes.byref(hook), ctypes.byref(_tc_opts(att.priority))
        )
        # The clsact qdisc goes only when we made it and nobody else's filter
        # (another process's, a stale one) is on it: deleting it deletes them.
        if att.made_qdisc and not (
            tc_filters(ifindex, _CLSACT_INGRESS) or tc_filters(ifindex, _CLSACT_EGRESS)
        ):
            hook.attach_point = BPF_TC_INGRESS | BPF_TC_EGRESS
            self._lib.bpf_tc_hook_destroy(ctypes.byref(hook))

    @property
    def devices(self) -> list[int]:
        return sorted(self._attached)

    @property
    def program_fd(self) -> int:
        """The loaded program's descriptor (its /proc fdinfo has the kernel's
        run_time_ns and run_cnt when kernel.bpf_stats_enabled is 1)."""
        return self._prog_fd

    @property
    def xdp_program_fd(self) -> int:
        """The XDP program's descriptor (the same fdinfo figures)."""
        return self._xdp_prog_fd

    # ------------------------------------------------------------- routes

    def install(self, route: KernelRoute, *, ifindex: int | None = None) -> bool:
        """Forward ``route`` in the kernel from now on; False when it cannot
        (mixed families, a port no datagram carries, the map full, no route
        out): it stays on the socket plane."""
        ports = (route.source, route.target, route.out_source, route.out_dest)
        if not all(0 <= address[1] <= 0xFFFF for address in ports):
            return False
        if (
            len(
                {
                    _family(h)
                    for h in (
                        route.source[0],
                        route.target[0],
                        route.out_source[0],
                        route.out_dest[0],
                    )
                }
            )
            != 1
        ):
            return False
        key = _key(route)
        if key not in self._routes and len(self._routes) >= MAX_ROUTES:
            return False
        try:
            out = ifindex if ifindex is not None else egress_ifindex(route.out_dest[0])
        except OSError:
            return False
        if self.hook != "tc":
            self._xdp_egress(out)
            self._watch_egress()
        value = _value(route, out)
        rc = self._lib.bpf_map_update_elem(self._map(route), key, value, BPF_ANY)
        if rc != 0:
            return False
        self._routes[key] = route
        if self.hook != "tc":
            self._hold_next_hop(key, out, route.out_dest[0])
        return True

    def _xdp_egress(self, ifindex: int, *, again: bool = False) -> None:
        """Tell the XDP program whether it may send frames out of ``ifindex``
        (else it passes them to tc); looked up again after any XDP attach or
        detach of ours, and every :data:`EGRESS_RECHECK` seconds."""
        with self._egress_lock:
            was = self._egress.get(ifindex)
            if was is not None and not again:
                return
            try:
                families, why = xdp_families(ifindex)
            except OSError:
                families, why = 0, "no link facts"
            self._egress[ifindex] = families
            if families == was:
                return
            key = struct.pack("=I", ifindex)
            if families:
                self._lib.bpf_map_update_elem(
                    self._xdp_egress_fd, key, struct.pack("=I", families), BPF_ANY
                )
            else:
                self._lib.bpf_map_delete_elem(self._xdp_egress_fd, key)
        if was is None:
            log.debug("XDP egress ifindex %d: families %d (%s)", ifindex, families, why)
        else:
            log.info(
                "dataplane: XDP %s out of %s (%s)",
                "may send" if families else "no longer sends",
                device_name(ifindex),
                why,
            )

    def _recheck_egress(self) -> None:
        for ifindex in list(self._egress):
            self._xdp_egress(ifindex, again=True)

    def _watch_egress(self) -> None:
        """Read the egress facts again every :data:`EGRESS_RECHECK` seconds,
        from a thread of this one's network namespace (it inherits it)."""
        if self._egress_watcher is None:
            self._egress_watcher = threading.Thread(
                target=self._keep_egress, name="crossroads-bpf-egress", daemon=True
            )
            self._egress_watcher.start()

    def _keep_egress(self) -> None:
        while not self._stop.wait(EGRESS_RECHECK):
            self._recheck_egress()
            self._refresh_next_hops()

    def _hold_next_hop(self, route_key: bytes, ifindex: int, host: str) -> None:
        """Count the route ``route_key`` as sending to ``host`` out of
        ``ifindex``. The first such route writes the next hop if XDP may
        send out of ``ifindex`` and the kernel has resolved it; else the
        watcher writes it once both hold."""
        hop_key = _NEXT_HOP_KEY.pack(ifindex, _addr16(host), _family(host))
        self._release_next_hop(route_key)
        with self._egress_lock:
            self._route_hop[route_key] = hop_key
            written, users = self._hops.get(hop_key, (b"", 0))
            self._hops[hop_key] = (written, users + 1)
            if users:
                return
        if self._egress.get(ifindex):
            self._write_next_hop(hop_key)

    def _release_next_hop(self, route_key: bytes) -> None:
        with self._egress_lock:
            hop_key = self._route_hop.pop(route_key, None)
            if hop_key is None:
                return
            written, users = self._hops.pop(hop_key)
            if users > 1:
                self._hops[hop_key] = (written, users - 1)
                return
            self._hop_via.pop(hop_key, None)
            if written:
                self._lib.bpf_map_delete_elem(self._next_hops_fd, hop_key)

    def _write_next_hop(
        self, hop_key: bytes, lookups: NextHopLookups | None = None
    ) -> None:
        """Resolve ``hop_key``'s next hop now and write (or delete) it if it
        changed: a new MAC, MTU or route is taken when its turn comes."""
        ifindex, packed, family = _NEXT_HOP_KEY.unpack(hop_key)
        host = str(ipaddress.ip_address(packed[: 4 if family == 4 else 16]))
        found = next_hop(ifindex, host, lookups)
        value = found[0] if found else b""
        with self._egress_lock:
            if hop_key not in self._hops:
                return  # released meanwhile
            if found:
                self._hop_via[hop_key] = (ifindex, found[1])
            else:
                self._hop_via.pop(hop_key, None)
            self._set_next_hop(hop_key, value)

    def _set_next_hop(self, hop_key: bytes, value: bytes) -> None:
        """Write ``value`` (b"": none) as ``hop_key``'s next hop, in the map
        and in the books; the caller holds the lock."""
        written, users = self._hops[hop_key]
        if value == written:
            return
        if value and self._lib.bpf_map_update_elem(
            self._next_hops_fd, hop_key, value, BPF_ANY
        ):
            value = b""  # not written (the map full): unresolved, tried again
        if not value:
            self._lib.bpf_map_delete_elem(self._next_hops_fd, hop_key)
        self._hops[hop_key] = (value, users)

    def _follow_gateways(self, lookups: NextHopLookups) -> None:
        """One neighbour lookup per gateway (or on-link destination) of the
        written next hops, and every next hop through one whose MAC changed
        takes the new one, or goes (to tc, until resolved again) if the
        kernel lost it: a gateway's failover is followed within a recheck
        however many destinations go through it."""
        with self._egress_lock:
            by_via: dict[tuple[int, str], list[bytes]] = {}
            for hop_key, via in self._hop_via.items():
                by_via.setdefault(via, []).append(hop_key)
        for via, hop_keys in by_via.items():
            if via not in lookups.neighbours:
                lookups.neighbours[via] = neighbour_mac(*via)
            mac = lookups.neighbours[via]
            with self._egress_lock:
                for hop_key in hop_keys:
                    written = self._hops.get(hop_key, (b"", 0))[0]
                    if not written or written[:6] == mac:
                        continue
                    if mac is None:
                        self._hop_via.pop(hop_key, None)
                    self._set_next_hop(hop_key, mac + written[6:] if mac else b"")

    def next_hops(self) -> dict[tuple[int, str], tuple[bytes, bytes, int]]:
        """The next hops in the map for the routes' destinations, by
        (ifindex, destination): (next hop's MAC, the device's, MTU)."""
        with self._egress_lock:
            held = list(self._hops)
        found = {}
        for hop_key in held:
            buf = ctypes.create_string_buffer(_NEXT_HOP.size)
            if self._lib.bpf_map_lookup_elem(self._next_hops_fd, hop_key, buf):
                continue
            ifindex, packed, family = _NEXT_HOP_KEY.unpack(hop_key)
            host = str(ipaddress.ip_address(packed[: 4 if family == 4 else 16]))
            dmac, smac, mtu = _NEXT_HOP.unpack(buf.raw)
            found[ifindex, host] = (dmac, smac, mtu)
        return found

    def _refresh_next_hops(self) -> None:
        """Resolve again up to :data:`NEXT_HOP_BATCH` next hops out of
        devices XDP may send out of (only those: the rest cost no netlink
        request): the unresolved ones first, then the others in turn."""
        with self._egress_lock:
            held = [
                (hop_key, bool(written))
                for hop_key, (written, _users) in self._hops.items()
                if self._egress.get(struct.unpack_from("=I", hop_key)[0])
            ]
        unresolved = [hop_key for hop_key, written in held if not written]
        resolved = [hop_key for hop_key, written in held if written]
        start = self._hop_turn % len(resolved) if resolved else 0
        turn = (resolved[start:] + resolved[:start])[
            : max(0, NEXT_HOP_BATCH - len(unresolved))
        ]
        self._hop_turn = start + len(turn)
        lookups = NextHopLookups()
        self._follow_gateways(lookups)
        for hop_key in (unresolved + turn)[:NEXT_HOP_BATCH]:
            self._write_next_hop(hop_key, lookups)

    def xdp_stats(self) -> dict[str, int]:
        """What the XDP program did, summed over CPUs: datagrams it forwarded
        ("forwarded") and routed ones it passed to tc, by why (relay.bpf.c
        ``xdp_stats``)."""
        return self._per_cpu_counts(self._xdp_stats_fd, XDP_STATS)

    def tc_moves(self) -> dict[str, int]:
        """How the tc program moved ChannelData datagrams by the header's 4
        bytes, summed over CPUs: "headers" (a finished checksum) or "data"
        (a partial one; relay.bpf.c ``tc_moves``)."""
        return self._per_cpu_counts(self._tc_moves_fd, TC_MOVES)

    def _per_cpu_counts(self, map_fd: int, names: tuple[str, ...]) -> dict[str, int]:
        cpus = max(1, self._lib.libbpf_num_possible_cpus())
        totals: dict[str, int] = {}
        for which, name in enumerate(names):
            buf = ctypes.create_string_buffer(8 * cpus)
            key = struct.pack("=I", which)
            if self._lib.bpf_map_lookup_elem(map_fd, key, buf):
                totals[name] = 0
            else:
                totals[name] = sum(struct.unpack(f"={cpus}Q", buf.raw))
        return totals

    def remove(self, route: KernelRoute) -> None:
        """Stop forwarding ``route`` (the next datagram goes to the sockets)."""
        key = _key(route)
        self._routes.pop(key, None)
        self._lib.bpf_map_delete_elem(self._map(route), key)
        self._release_next_hop(key)

    def counters(self, route: KernelRoute) -> tuple[int, int] | None:
        """(packets, payload bytes) the kernel forwarded on ``route``; None if not installed."""
        buf = ctypes.create_string_buffer(_VALUE.size)
        if self._lib.bpf_map_lookup_elem(self._map(route), _key(route), buf) != 0:
            return None
        *_, packets, octets = _VALUE.unpack(buf.raw)
        return int(packets), int(octets)

    def __len__(self) -> int:
        return len(self._routes)

    def close(self) -> None:
        """Detach from every device and free the program and its map."""
        self._stop.set()
        for thread in (self._renewer, self._egress_watcher):
            if thread is not None:
                thread.join()
        self._renewer = self._egress_watcher = None
        self._egress.clear()
        for ifindex in list(self._attached):
            self.detach(ifindex)
        self._routes.clear()
        self._hops.clear()
        self._route_hop.clear()
        self._hop_via.clear()
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = 0
