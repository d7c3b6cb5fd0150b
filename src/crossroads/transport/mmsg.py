"""Batched UDP I/O with Linux ``recvmmsg``/``sendmmsg`` through ctypes.

Why: on a busy UDP server most of the per-datagram cost is the system call
(reference stun-turn.md §5: syscall entry/exit ~23 % of coturn's relay thread;
C recvmmsg/sendmmsg 164 k pps vs 106 k with recvfrom/sendto). Python has no
``recvmmsg``; calling libc through ctypes costs ~1 µs per *call*, which a batch of
up to :data:`BATCH` datagrams amortises, and the per-datagram work is then a few
``memoryview`` reads and writes on preallocated arrays — no ctypes object is
created per datagram.

:class:`MmsgSocket` owns the preallocated arrays of one socket:

- receive: ``recv()`` fills up to :data:`BATCH` slots and returns how many;
  ``data(i)`` is the datagram (a ``bytes`` copy), ``raw_address(i)`` the
  sender's IP as bytes (a dict key) and ``port(i)`` its port;
- send: ``queue_reply(i, data)`` puts a reply to the sender of slot ``i`` in
  the outgoing batch, ``flush()`` sends it with one ``sendmmsg``;
- ``drain(handle, drop, batches)``: the recvmmsg loop itself, for a server
  socket (the STUN/TURN port's): each datagram to ``handle`` with its sender
  and slot, the replies it queued out with one ``sendmmsg`` per batch.

Use :func:`available` to know whether the platform supports it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import socket
import sys
from collections.abc import Callable

from crossroads.transport.pktinfo import Control, enable_pktinfo, parse_control

#: Datagrams per system call. 64 is where coturn's and libuv's experiments saw
#: no further gain (reference §1.2, §5.2: the batch-size knee is ~8-64).
BATCH = 64
#: Bytes per receive slot: a jumbo frame; bigger datagrams are truncated and the
#: caller drops them (``truncated(i)``).
SLOT = 9216
#: Room for a sockaddr_in6 (28 bytes), rounded up.
NAME = 32
#: Room for one IP_PKTINFO / IPV6_PKTINFO control message (cmsghdr 16 bytes +
#: in_pktinfo 12 or in6_pktinfo 20, aligned), per slot.
CONTROL = 64

#: 64-bit words per address slot.
_NAME_U64 = NAME // 8
#: Bound on the sender cache of :meth:`MmsgSocket.sender`; it is cleared when
#: full (~150 bytes an entry, so ~10 MB at most).
SENDER_CACHE_SIZE = 65_536

MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


_libc: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(
                ctypes.util.find_library("c") or "libc.so.6", use_errno=True
            )
            for name in ("recvmmsg", "sendmmsg"):
                function = getattr(libc, name)
                function.restype = ctypes.c_int
            libc.recvmmsg.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_uint,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            libc.sendmmsg.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_uint,
                ctypes.c_int,
            ]
            _libc = libc
        except (OSError, AttributeError):
            _libc = None
    return _libc


def available() -> bool:
    """Whether recvmmsg/sendmmsg can be used here (Linux with a usable libc)."""
    return _load() is not None and ctypes.sizeof(ctypes.c_void_p) == 8


def _u32_words(array: ctypes.Array[_Mmsghdr]) -> memoryview[int]:
    return memoryview(array).cast("B").cast("I")


class MmsgSocket:
    """Preallocated recvmmsg/sendmmsg batches for one non-blocking UDP socket."""

    def __init__(
        self,
        sock: socket.socket,
        batch: int = BATCH,
        slot: int = SLOT,
        pktinfo: bool = False,
    ) -> None:
        """``pktinfo``: learn each datagram's destination address (IP_PKTINFO /
        IPV6_PKTINFO) and send replies *from* it. Needed on a wildcard-bound
        socket, where the kernel would otherwise pick the reply's source address
        by route, which on a multi-homed host is not always the address the
        client sent to (RFC 8489 §6.3.1.2 wants exactly that address)."""
        libc = _load()
        if libc is None:
            raise OSError(errno.ENOSYS, "recvmmsg/sendmmsg not available")
        self._recvmmsg = libc.recvmmsg
        self._sendmmsg = libc.sendmmsg
        self.sock = sock
        self.fd = sock.fileno()
        self.batch = batch
        self.slot = slot
        self.ipv6 = sock.family == socket.AF_INET6
        self.pktinfo = pktinfo
        if pktinfo:
            enable_pktinfo(sock)
        namelen = 28 if self.ipv6 else 16
        # Receive side.
        self._rbuf = ctypes.create_string_buffer(batch * slot)
        self._rnames = ctypes.create_string_buffer(batch * NAME)
        self._riov = (_Iovec * batch)()
        self._rmsgs = (_Mmsghdr * batch)()
        self._rctrl = ctypes.create_string_buffer(batch * CONTROL if pktinfo else 1)
        # Send side (replies point msg_name at the receive-side addresses).
        self._sbuf = ctypes.create_string_buffer(batch * slot)
        self._siov = (_Iovec * batch)()
        self._smsgs = (_Mmsghdr * batch)()
        rbase = ctypes.addressof(self._rbuf)
        sbase = ctypes.addressof(self._sbuf)
        rnames = ctypes.addressof(self._rnames)
        for i in range(batch):
            self._riov[i].iov_base = rbase + i * slot
            self._riov[i].iov_len = slot
            hdr = self._rmsgs[i].msg_hdr
            hdr.msg_name = rnames + i * NAME
            hdr.msg_namelen = NAME
            hdr.msg_iov = ctypes.addressof(self._riov[i])
            hdr.msg_iovlen = 1
            if pktinfo:
                hdr.msg_control = ctypes.addressof(self._rctrl) + i * CONTROL
                hdr.msg_controllen = CONTROL
            self._siov[i].iov_base = sbase + i * slot
            shdr = self._smsgs[i].msg_hdr
            shdr.msg_name = rnames + i * NAME
            shdr.msg_namelen = namelen
            shdr.msg_iov = ctypes.addressof(self._siov[i])
            shdr.msg_iovlen = 1
        size = ctypes.sizeof(_Mmsghdr)
        assert size % 8 == 0
        self._stride4 = size // 4
        self._len_at = _Mmsghdr.msg_len.offset // 4
        self._flags_at = (_Mmsghdr.msg_hdr.offset + _Msghdr.msg_flags.offset) // 4
        self._rwords = _u32_words(self._rmsgs)
        self._siov_words = memoryview(self._siov).cast("B").cast("Q")
        self._rview = memoryview(self._rbuf).cast("B")
        self._sview = memoryview(self._sbuf).cast("B")
        self._rnames_view = memoryview(self._rnames).cast("B")
        self._rnames_u32 = memoryview(self._rnames).cast("B").cast("I")
        self._rnames_addr = rnames
        self._smsgs_u64 = memoryview(self._smsgs).cast("B").cast("Q")
        self._stride8 = size // 8
        self._rmsgs_u64 = memoryview(self._rmsgs).cast("B").cast("Q")
        base = _Mmsghdr.msg_hdr.offset
        self._control_at = (base + _Msghdr.msg_control.offset) // 8
        self._controllen_at = (base + _Msghdr.msg_controllen.offset) // 8
        self._ctrl_ptrs = [
            ctypes.addressof(self._rctrl) + i * CONTROL if pktinfo else 0
            for i in range(batch)
        ]
        self._rnames_u64 = memoryview(self._rnames).cast("B").cast("Q")
        #: Raw sockaddr -> (host, port) (see :meth:`sender`).
        self._senders: dict[int | bytes, tuple[str, int]] = {}
        self._received = 0  # slots filled by the last recv()
        self.pending = 0  # replies queued in the send batch

    # ------------------------------------------------------------ receive

    def recv(self) -> int:
        """Receive up to ``batch`` datagrams without blocking; 0 when none."""
        if self.pktinfo:
            # The kernel wrote the control lengths it used: give the room back.
            words = self._rmsgs_u64
            at = self._controllen_at
            stride = self._stride8
            for i in range(self._received):
                words[i * stride + at] = CONTROL
        n = self._recvmmsg(
            self.fd, ctypes.addressof(self._rmsgs), self.batch, MSG_DONTWAIT, None
        )
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            if err == errno.ECONNREFUSED:
                return 0  # an ICMP error for an earlier send: nothing to read
            raise OSError(err, "recvmmsg failed")
        self._received = int(n)
        return int(n)

    def length(self, i: int) -> int:
        """Length of datagram ``i``."""
        return int(self._rwords[i * self._stride4 + self._len_at])

    def truncated(self, i: int) -> bool:
        """Whether datagram ``i`` was longer than a slot (and so cut)."""
        return bool(self._rwords[i * self._stride4 + self._flags_at] & MSG_TRUNC)

    def data(self, i: int, length: int) -> bytes:
        """Datagram ``i`` as bytes."""
        start = i * self.slot
        return self._rview[start : start + length].tobytes()

    def raw_address(self, i: int) -> bytes:
        """The sender's packed IP address (4 or 16 bytes)."""
        base = i * NAME
        if self.ipv6:
            return self._rnames_view[base + 8 : base + 24].tobytes()
        return self._rnames_view[base + 4 : base + 8].tobytes()

    def port(self, i: int) -> int:
        """The sender's port."""
        view = self._rnames_view
        base = i * NAME
        return (view[base + 2] << 8) | view[base + 3]

    def sender(self, i: int) -> tuple[str, int]:
        """The sender of slot ``i`` as ``(host, port)``, decoded once per
        sender: the raw sockaddr (family, port and IPv4 address as one 64-bit
        word, or the IPv6 port..address bytes) keys a bounded cache, so a known
        client costs one dict lookup."""
        base = i * NAME
        key: int | bytes = (
            self._rnames_view[base + 2 : base + 24].tobytes()
            if self.ipv6
            else self._rnames_u64[i * _NAME_U64]
        )
        address = self._senders.get(key)
        if address is None:
            raw = (
                self._rnames_view[base + 8 : base + 24]
                if self.ipv6
                else self._rnames_view[base + 4 : base + 8]
            )
            address = (socket.inet_ntop(self.sock.family, raw.tobytes()), self.port(i))
            if len(self._senders) >= SENDER_CACHE_SIZE:
                self._senders.clear()
            self._senders[key] = address
        return address

    def drain(
        self,
        handle: Callable[[bytes, tuple[str, int], int], None],
        drop: Callable[[str, int], None],
        batches: int,
    ) -> None:
        """The recvmmsg loop: read up to ``batches`` batches, call
        ``handle(data, sender, slot)`` for each datagram in order, and send the
        replies it queued (:meth:`queue_reply` with that ``slot``) with one
        sendmmsg per batch. Stops early when a batch is not full (the socket
        is empty). ``drop(reason, count)`` counts ``too-big`` (truncated),
        ``recv-failed`` and ``send-failed`` datagrams.

        Hot loop: the accessors are inlined (memoryview reads on the arrays),
        because a method call per field per datagram costs as much as the
        work done on a STUN Binding request.
        """
        words = self._rwords
        stride = self._stride4
        len_at = self._len_at
        flags_at = self._flags_at
        rview = self._rview
        slot = self.slot
        senders = self._senders
        names = self._rnames_view
        names_u64 = self._rnames_u64
        ipv6 = self.ipv6
        for _ in range(batches):
            try:
                count = self.recv()
            except OSError:
                drop("recv-failed", 1)
                break
            for i in range(count):
                w = i * stride
                if words[w + flags_at] & MSG_TRUNC:
                    drop("too-big", 1)
                    continue
                start = i * slot
                data = rview[start : start + words[w + len_at]].tobytes()
                key: int | bytes = (
                    names[i * NAME + 2 : i * NAME + 24].tobytes()
                    if ipv6
                    else names_u64[i * _NAME_U64]
                )
                address = senders.get(key)
                handle(data, address or self.sender(i), i)
            if self.pending:
                failed = self.flush()
                if failed:
                    drop("send-failed", failed)
            if count < self.batch:
                break

    def destination_control(self, i: int) -> Control | None:
        """The control message that makes a later reply to the sender of slot
        ``i`` leave from the address it sent to (``pktinfo`` sockets), for a
        :class:`~crossroads.transport.pktinfo.ReplySource`."""
        if not self.pktinfo:
            return None
        used = self._rmsgs_u64[i * self._stride8 + self._controllen_at]
        return parse_control(ctypes.string_at(self._ctrl_ptrs[i], min(used, CONTROL)))

    # ------------------------------------------------------------ send

    def queue_reply(self, i: int, data: bytes) -> bool:
        """Queue ``data`` to the sender of received slot ``i``; False if it does
        not fit (the batch is full or the datagram is larger than a slot)."""
        j = self.pending
        size = len(data)
        if j >= self.batch or size > self.slot:
            return False
        start = j * self.slot
        self._sview[start : start + size] = data
        self._siov_words[j * 2 + 1] = size
        # Point the outgoing message's address at the received one (msg_name is
        # the first field of mmsghdr); valid until the next recv().
        self._smsgs_u64[j * self._stride8] = self._rnames_addr + i * NAME
        if self.pktinfo:
            self.reply_from_destination(i, j)
        self.pending = j + 1
        return True

    def reply_from_destination(self, i: int, j: int) -> None:
        """Make outgoing message ``j`` leave from the address received datagram
        ``i`` was sent to: its IP_PKTINFO/IPV6_PKTINFO control message, reused
        as is, sets the source (``ipi_spec_dst`` / ``ipi6_addr``)."""
        out = j * self._stride8
        self._smsgs_u64[out + self._control_at] = self._ctrl_ptrs[i]
        self._smsgs_u64[out + self._controllen_at] = self._rmsgs_u64[
            i * self._stride8 + self._controllen_at
        ]

    def flush(self) -> int:
        """Send the queued replies; returns how many could not be sent."""
        count = self.pending
        if not count:
            return 0
        self.pending = 0
        sent = 0
        failed = 0
        while sent < count:
            n = self._sendmmsg(
                self.fd,
                ctypes.addressof(self._smsgs) + sent * ctypes.sizeof(_Mmsghdr),
                count - sent,
                0,
            )
            if n <= 0:
                err = ctypes.get_errno()
                if n < 0 and err == errno.EINTR:
                    continue
                # EAGAIN (buffer full) or an error on one destination: skip it.
                sent += 1
                failed += 1
                continue
            sent += n
        return failed
