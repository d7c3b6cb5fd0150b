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
ROUTES_MAP = b"routes"
RELAY_ROUTES_MAP = b"relay_routes"
LEASE_MAP = b"lease"
#: How long a classic filter's program forwards after its process last
#: renewed the lease (a SIGKILLed process's routes stop within this), and how
#: often a live process renews it: four renewals per lease ride out a busy
#: second without letting a live process's routes lapse.
LEASE_SECONDS = 2.0
LEASE_REFRESH = 0.5
#: The bytes of a Unity RELAY frame that name its route (relay.bpf.c RELAY_HEAD).
RELAY_HEAD = 36
#: The map's max_entries in relay.bpf.c.
MAX_ROUTES = 65536

#: enum bpf_attach_type BPF_TCX_INGRESS (include/uapi/linux/bpf.h, Linux 6.6).
BPF_TCX_INGRESS = 46
BPF_TC_INGRESS = 1
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


def egress_ifindex(host: str) -> int:
    """The device the kernel routes ``host`` by (RTM_GETROUTE over rtnetlink)."""
    family = socket.AF_INET if _family(host) == 4 else socket.AF_INET6
    packed = ipaddress.ip_address(host).packed
    rta = struct.pack("=HH", 4 + len(packed), 1) + packed  # RTA_DST
    rtmsg = struct.pack("=BBBBBBBBI", family, len(packed) * 8, 0, 0, 0, 0, 0, 0, 0)
    body = rtmsg + rta
    header = struct.pack("=IHHII", 16 + len(body), 26, 1, 1, 0)  # RTM_GETROUTE, REQUEST
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        nl.settimeout(2.0)
        nl.send(header + body)
        reply = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", reply)
    if kind == 2:  # NLMSG_ERROR
        (code,) = struct.unpack_from("=i", reply, 16)
        raise OSError(-code, f"no route to {host}")
    offset = 16 + 12
    while offset + 4 <= length:
        size, attr = struct.unpack_from("=HH", reply, offset)
        if size < 4:
            break
        if attr == 4:  # RTA_OIF
            return int(struct.unpack_from("=I", reply, offset + 4)[0])
        offset += (size + 3) & ~3
    raise OSError(errno.ENETUNREACH, f"no output device for {host}")


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


@dataclass(eq=False)
class KernelPlane:
    """The loaded program, its route map and the devices it is attached to."""

    _lib: ctypes.CDLL
    _obj: int
    _prog_fd: int
    _map_fd: int
    _relay_map_fd: int
    _lease_fd: int = -1
    _attached: dict[int, _Attachment] = field(default_factory=dict)
    _routes: dict[bytes, KernelRoute] = field(default_factory=dict)
    _renewer: threading.Thread | None = None
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
        return cls(
            lib,
            obj,
            lib.bpf_program__fd(prog),
            lib.bpf_map__fd(rmap),
            lib.bpf_map__fd(relay),
            lib.bpf_map__fd(lease),
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
        value = _value(route, out)
        rc = self._lib.bpf_map_update_elem(self._map(route), key, value, BPF_ANY)
        if rc != 0:
            return False
        self._routes[key] = route
        return True

    def remove(self, route: KernelRoute) -> None:
        """Stop forwarding ``route`` (the next datagram goes to the sockets)."""
        key = _key(route)
        self._routes.pop(key, None)
        self._lib.bpf_map_delete_elem(self._map(route), key)

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
        for ifindex in list(self._attached):
            self.detach(ifindex)
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
        self._routes.clear()
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = 0
