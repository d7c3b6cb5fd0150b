"""Datagrams the kernel dropped before crossroads could read them, as metrics.

Theory of operation
-------------------
A UDP socket whose receive buffer is full drops what arrives, silently: the
sender sees nothing, crossroads sees nothing, and an overloaded relay looks
healthy. The kernel counts these drops per socket (``sk_drops``), and prints
the count in the last column of ``/proc/net/udp`` and ``/proc/net/udp6`` next
to the socket's inode. ``SO_RXQ_OVFL`` would report the same counter, but only
to a reader that asks for it in ``recvmsg`` ancillary data: the asyncio
endpoints and the C data plane (``_turnfast``, which reads relay sockets with
``recvmmsg`` itself) do not, so ``/proc`` is the one source that covers every
UDP socket of the process, whoever reads it.

At scrape time :class:`KernelDropCollector` lists the process's socket inodes
(``/proc/self/fd``), reads both tables of the process's network namespace and
sums the drops of its own sockets by label: the service whose listening port
the socket is bound to, or ``relayed`` for every other UDP socket (TURN relayed
addresses, natneg relay and proxy sockets). A socket's count dies with the
socket, so the collector remembers the last count of each live socket and adds
it to its label's total when the socket goes: the exported counter never goes
down. The cost is one ``readlink`` per open descriptor and one pass over the
namespace's UDP table per scrape, nothing on the data path.

A socket that lives between two scrapes (a TURN relay of a short call, a
browser's bulk test, a natneg relay pair, a RakNet UDPProxy forwarder) would
never be seen that way: about a third of the drops of a browser bulk test went
missing. So every per-client relay socket is closed through
:meth:`KernelDropCollector.close`, which first reads the socket's own counter
with ``getsockopt(SO_MEMINFO)`` (``SK_MEMINFO_DROPS``, the same ``sk_drops``;
one system call, no table walk) and adds it to the total
(:meth:`KernelDropCollector.closing`).

TCP listeners do not have a per-socket drop counter; the namespace-wide
``TcpExt: ListenOverflows ListenDrops`` of ``/proc/self/net/netstat`` (SYNs
dropped because an accept queue was full) are exported beside them.

Metrics: ``crossroads_udp_kernel_drops_total{socket}``,
``crossroads_tcp_listen_overflows_total``, ``crossroads_tcp_listen_drops_total``.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from crossroads.metrics import counter_by

#: Label of UDP sockets bound to no service's listening port.
RELAYED = "relayed"
#: Column of the inode and of the drop count in /proc/net/udp{,6} rows
#: (Linux net/ipv4/udp.c udp4_format_sock, net/ipv6/datagram.c).
_INODE_COLUMN = 9
_DROPS_COLUMN = 12
#: getsockopt(SOL_SOCKET, SO_MEMINFO): u32 sk_meminfo[SK_MEMINFO_VARS], whose
#: SK_MEMINFO_DROPS (index 8) is the socket's sk_drops (Linux 4.12+,
#: include/uapi/linux/sock_diag.h; Python does not name the option).
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
_MEMINFO = struct.Struct("=9I")
_MEMINFO_DROPS = 8


def socket_drops(sock: socket.socket) -> int | None:
    """Datagrams the kernel dropped on ``sock`` so far (None: not known)."""
    try:
        info = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size)
    except OSError:
        return None
    if len(info) < _MEMINFO.size:
        return None
    return int(_MEMINFO.unpack_from(info)[_MEMINFO_DROPS])


def socket_inodes(proc: str = "/proc") -> set[int]:
    """Inodes of the sockets this process has open."""
    inodes: set[int] = set()
    fd_dir = f"{proc}/self/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def udp_table(proc: str = "/proc") -> dict[int, tuple[int, int]]:
    """inode -> (local port, drops) for every UDP socket of the namespace."""
    table: dict[int, tuple[int, int]] = {}
    for name in ("udp", "udp6"):
        try:
            with open(f"{proc}/self/net/{name}", encoding="ascii") as f:
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    if len(fields) <= _DROPS_COLUMN:
                        continue
                    port = int(fields[1].rsplit(":", 1)[1], 16)
                    table[int(fields[_INODE_COLUMN])] = (
                        port,
                        int(fields[_DROPS_COLUMN]),
                    )
        except (OSError, ValueError):
            continue
    return table


def listen_counters(proc: str = "/proc") -> dict[str, int]:
    """``TcpExt`` ListenOverflows and ListenDrops of the namespace (0 if absent)."""
    counters = {"ListenOverflows": 0, "ListenDrops": 0}
    try:
        with open(f"{proc}/self/net/netstat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return counters
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:") and values.startswith("TcpExt:"):
            for key, value in zip(names.split()[1:], values.split()[1:], strict=False):
                if key in counters:
                    counters[key] = int(value)
    return counters


class KernelDropCollector(Collector):
    """Kernel drop counters of this process's sockets (see module docstring).

    ``listeners`` returns, when called at scrape time, local UDP port -> the
    name of the service listening on it.
    """

    def __init__(
        self, listeners: Callable[[], dict[int, str]], proc: str = "/proc"
    ) -> None:
        self.listeners = listeners
        self.proc = proc
        #: Live socket inode -> (label, last drop count seen).
        self._live: dict[int, tuple[str, int]] = {}
        #: Drops of sockets already closed, by label.
        self._gone: dict[str, int] = {}

    def closing(self, sock: socket.socket, label: str = RELAYED) -> None:
        """``sock`` (a UDP socket, still open) is about to be closed: count
        its drops now, whether or not a scrape ever saw it."""
        try:
            inode = os.fstat(sock.fileno()).st_ino
        except (OSError, ValueError):
            return
        drops = socket_drops(sock)
        if drops is None:
            return
        # A scrape that saw it must not add its last count again.
        self._live.pop(inode, None)
        if drops:
            self._gone[label] = self._gone.get(label, 0) + drops

    def close(self, sock: socket.socket, label: str = RELAYED) -> None:
        """Close ``sock``, a per-client UDP socket (a TURN relayed address, a
        natneg relay side, a RakNet forwarder), counting its drops first: the
        one close path of every short-lived relay socket."""
        self.closing(sock, label)
        sock.close()

    def drops(self) -> dict[str, int]:
        """Total kernel drops by label, closed sockets included."""
        ports = self.listeners()
        table = udp_table(self.proc)
        live: dict[int, tuple[str, int]] = {}
        for inode in socket_inodes(self.proc):
            row = table.get(inode)
            if row is not None:
                port, drops = row
                live[inode] = (ports.get(port, RELAYED), drops)
        for inode, (label, drops) in self._live.items():
            if inode not in live:
                self._gone[label] = self._gone.get(label, 0) + drops
        self._live = live
        totals = dict(self._gone)
        for label, drops in live.values():
            totals[label] = totals.get(label, 0) + drops
        for label in set(ports.values()) | {RELAYED}:
            totals.setdefault(label, 0)
        return totals

    def collect(self) -> Iterator[Any]:
        yield counter_by(
            "crossroads_udp_kernel_drops",
            "Datagrams the kernel dropped on this process's UDP sockets (receive "
            "buffer full), by listening service or 'relayed' for the others.",
            "socket",
            self.drops(),
        )
        listen = listen_counters(self.proc)
        overflows = CounterMetricFamily(
            "crossroads_tcp_listen_overflows",
            "Connections dropped because a TCP accept queue was full "
            "(TcpExt ListenOverflows, whole network namespace).",
        )
        overflows.add_metric([], listen["ListenOverflows"])
        yield overflows
        drops = CounterMetricFamily(
            "crossroads_tcp_listen_drops",
            "SYNs dropped by TCP listeners (TcpExt ListenDrops, whole network "
            "namespace).",
        )
        drops.add_metric([], listen["ListenDrops"])
        yield drops
