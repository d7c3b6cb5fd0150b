"""Sans-I/O STUN server core: Binding (RFC 8489) and behaviour discovery (RFC 5780).

Theory of operation
-------------------
The server listens on up to four local endpoints, indexed ``ip * 2 + port``:

====  ==============  ==========================================
 idx   endpoint        present when
====  ==============  ==========================================
 0     A1:P1           always (the primary address and port)
 1     A1:P2           RFC 5780 on (the alternate port)
 2     A2:P1           RFC 5780 on and a second IP (``alt_host``)
 3     A2:P2           idem
====  ==============  ==========================================

The core has the core API of a core on several sockets
(:class:`~crossroads.proto.core.MultiSocketCore`, the endpoint index as the
socket's name): :meth:`BindingCore.receive_datagram` takes one STUN message
received on endpoint ``socket``, and :meth:`BindingCore.datagrams_to_send`
gives the replies as ``(bytes, destination, send_from)`` — ``send_from`` is the
endpoint index the transport must send from. A reply to the request's own
source carries the very ``addr`` object it was given (``dest is addr``), so an
owner that reads in batches can answer in the same batch's ``sendmmsg`` slot
(with the slot's IP_PKTINFO on a wildcard bind). Input that gets no answer is
counted in :attr:`BindingCore.drops` by reason (a metric label). It never
raises on network input. There are no timers (``get_timer`` is always None):
the only state is the per-source rate limiter, the reflection budget (a UDP
answer is sent only while its address has been sent no more than it sent plus
an allowance, :mod:`crossroads.proto.reflection`) and a bounded cache of
encoded client addresses.

A core made with ``stream=True`` answers over connections (TCP, TLS, DTLS):
the handshake proved the client's address, so there is no reflection budget,
and what needs another socket or port (CHANGE-REQUEST with a flag set,
RESPONSE-PORT) is answered 400. It shares the rate limiter of the datagram
core of the same sockets (``limiter=``), as one client's requests over both
count once.

The Binding success response carries, in this order: XOR-MAPPED-ADDRESS (or
MAPPED-ADDRESS alone for an RFC 3489 request, RFC 8489 §12), MAPPED-ADDRESS when
RFC 5780 is on (§6.1 "MUST include both"), RESPONSE-ORIGIN (when the sending
address is known), OTHER-ADDRESS (only with a second IP), SOFTWARE, PADDING when
asked, and FINGERPRINT when the request had one.

RFC 5780 decisions (documented in the README):

- Without a second IP the server MUST NOT send OTHER-ADDRESS and MUST answer any
  CHANGE-REQUEST (even one with no flag set) with 420 (RFC 5780 §6, §7.4) — so it never claims an address it
  does not have. RESPONSE-ORIGIN, RESPONSE-PORT and PADDING still work, and the
  alternate port still answers (a client told about it can test port-dependent
  mapping), but it is not advertised.
- With RFC 5780 off, CHANGE-REQUEST, RESPONSE-PORT and PADDING are unknown
  comprehension-required attributes: 420 with UNKNOWN-ATTRIBUTES.
- Over TCP, CHANGE-REQUEST with a flag set and RESPONSE-PORT cannot be honoured
  (the answer must use the connection): 400.
- PADDING + RESPONSE-PORT: 400 (RFC 5780 §6.1, the amplification rule).
- Abuse limit on PADDING: the response pads to the request's own PADDING length
  (RFC 5780 says "SHOULD" use the MTU; echoing the request's size keeps the
  answer no larger than the question plus the usual attributes, so PADDING is
  never an amplifier), and RESPONSE-PORT 0 is refused (400).

The Binding path reads the header and walks the attribute TLVs by hand; an IPv4
reply is one ``struct.pack`` of the echoed transaction id and the client's
address into a per-endpoint format whose constant parts (header, attribute
headers, RESPONSE-ORIGIN, OTHER-ADDRESS, SOFTWARE) are encoded once at start.
No message object is allocated for a Binding request; the general codec is only
used for the rare error responses.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from collections.abc import Sequence

from crossroads.proto.core import Outbox
from crossroads.proto.reflection import DROP_REFLECTION, ReflectionBudget
from crossroads.proto.stun.attributes import (
    ATTRIBUTE_CLASSES,
    ErrorCodeAttribute,
    Software,
    UnknownAttributes,
)
from crossroads.proto.stun.constants import (
    BINDING_ERROR,
    BINDING_INDICATION,
    BINDING_REQUEST,
    FINGERPRINT_XOR,
    MAGIC_COOKIE,
    AttrType,
    Class,
    Method,
    reason_phrase,
)
from crossroads.proto.stun.message import Message, encode
from crossroads.proto.stun.ratelimit import SourceRateLimiter
from crossroads.types import Address

#: A reply: (datagram, destination address, endpoint index to send from).
Reply = tuple[bytes, tuple[str, int], int]

_HEADER = struct.Struct("!HHI")
_AH = struct.Struct("!HH")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
# IPv6: header (type, length, cookie+txid) then XOR-MAPPED-ADDRESS, optionally
# followed by MAPPED-ADDRESS. (IPv4 uses per-endpoint Structs, see __init__.)
_V6X = struct.Struct("!HH16sHHxBH16s")
_V6XM = struct.Struct("!HH16sHHxBH16sHHxBH16s")
# Header then MAPPED-ADDRESS only (RFC 3489 clients).
_V4M = struct.Struct("!HH16sHHxBH4s")
_V6M = struct.Struct("!HH16sHHxBH16s")

_XMA = AttrType.XOR_MAPPED_ADDRESS
_MA = AttrType.MAPPED_ADDRESS
_FP = AttrType.FINGERPRINT
_MI = AttrType.MESSAGE_INTEGRITY
_MI256 = AttrType.MESSAGE_INTEGRITY_SHA256
_CHANGE = AttrType.CHANGE_REQUEST
_RPORT = AttrType.RESPONSE_PORT
_PADDING = AttrType.PADDING
_RFC5780_REQUEST_ATTRS = (_CHANGE, _RPORT, _PADDING)
_COOKIE_XOR = MAGIC_COOKIE.to_bytes(4, "big")
# The method bits of a message type (RFC 8489 §5: the class is bits 0x0110).
_METHOD_BITS = 0x3EEF
_BINDING_METHOD = int(Method.BINDING)
_PORT_XOR = MAGIC_COOKIE >> 16

#: Bound on the encoded-address cache; cleared when full (one dict per server, a
#: few hundred bytes per entry, so ~6 MB at most).
ADDRESS_CACHE_SIZE = 65_536

#: Bound on the PADDING we echo: the largest UDP payload (RFC 5780 §7.6: "MUST NOT
#: be longer than the length that brings the total IP datagram size to 64K").
MAX_PADDING = 65_507 - 200

# Reason labels for dropped input (metric label values).
DROP_RATE_LIMITED = "rate-limited"
DROP_MALFORMED = "malformed"
DROP_BAD_FINGERPRINT = "bad-fingerprint"
DROP_NOT_STUN = "not-stun"
DROP_INDICATION = "indication"
DROP_RESPONSE = "unexpected-response"
DROP_UNSUPPORTED = "unsupported-method"


def _attr(atype: int, value: bytes) -> bytes:
    return _AH.pack(atype, len(value)) + value + b"\0" * (-len(value) & 3)


def _address_attr(atype: int, address: tuple[str, int]) -> bytes:
    ip = ipaddress.ip_address(address[0])
    family = 1 if ip.version == 4 else 2
    return _attr(atype, struct.pack("!xBH", family, address[1]) + ip.packed)


class BindingCore(Outbox[Reply]):
    """Answers STUN Binding requests; see the module docstring.

    Args:
        advertised: per endpoint index, the address clients see for that socket
            (for RESPONSE-ORIGIN / OTHER-ADDRESS), or None when unknown (a
            wildcard bind): then RESPONSE-ORIGIN is left out. One entry: RFC 5780
            off; two: alternate port only; four: full RFC 5780.
        software: SOFTWARE value ("" to leave it out).
        rate_limit: Binding requests per second per source IP (0 = unlimited).
        max_sources: bound on the rate limiter's table.
        reflection: the service's reflection budget: a UDP reply is sent only
            while the client's address has been sent no more than it sent plus
            the allowance (None: no budget).
        stream: answer over connections (see the module docstring).
        limiter: share this rate limiter (another core's ``limiter``) instead
            of making one from ``rate_limit`` and ``max_sources``.
        drops: count drops in this dict (the service's own counters, so its
            metrics see them live) instead of a new one.
    """

    def __init__(
        self,
        advertised: Sequence[tuple[str, int] | None],
        *,
        software: str = "",
        rate_limit: int = 0,
        max_sources: int = 100_000,
        reflection: ReflectionBudget | None = None,
        stream: bool = False,
        limiter: SourceRateLimiter | None = None,
        drops: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        if len(advertised) not in (1, 2, 4):
            raise ValueError("advertised must have 1, 2 or 4 endpoints")
        self.advertised = tuple(advertised)
        self.rfc5780 = len(advertised) > 1
        self.change_supported = len(advertised) == 4
        self.software = software
        self.stream = stream
        self.limiter = (
            limiter
            if limiter is not None
            else SourceRateLimiter(rate_limit, max_sources)
        )
        self.reflection = ReflectionBudget.or_unlimited(reflection)
        #: Input that got no answer, by reason (metric labels): plain ints, the
        #: service exports them at scrape time.
        self.drops: dict[str, int] = {} if drops is None else drops
        self._cache: dict[str, tuple[int, bytes, bytes]] = {}
        software_attr = _attr(AttrType.SOFTWARE, software.encode()) if software else b""
        # Pre-encoded tails per (receiving, sending) endpoint pair, for RFC 5389+
        # and RFC 3489 clients. RFC 5780 Table 1: RESPONSE-ORIGIN is the socket
        # that sends; OTHER-ADDRESS is Ca:Cp of the socket that *received* the
        # request, whatever the CHANGE-REQUEST flags.
        count = len(self.advertised)
        self._count = count
        self._tail: list[bytes] = []
        self._tail3489: list[bytes] = []
        for received in range(count):
            other = self.advertised[received ^ 3] if self.change_supported else None
            for sending in range(count):
                origin = self.advertised[sending]
                tail = b""
                tail3489 = b""
                if self.rfc5780 and origin is not None:
                    tail += _address_attr(AttrType.RESPONSE_ORIGIN, origin)
                    tail3489 += _address_attr(AttrType.SOURCE_ADDRESS, origin)
                if other is not None:
                    tail += _address_attr(AttrType.OTHER_ADDRESS, other)
                    tail3489 += _address_attr(AttrType.CHANGED_ADDRESS, other)
                self._tail.append(tail + software_attr)
                self._tail3489.append(tail3489 + software_attr)
        # IPv4 with the magic cookie, the common case: per endpoint pair, a Struct
        # and the pre-encoded constant parts (header type+length, attribute
        # headers, tail), so a reply is one pack() call.
        self._v4: list[tuple[struct.Struct, bytes, bytes, bytes, bytes]] = []
        xma = _AH.pack(_XMA, 8) + b"\x00\x01"
        ma = _AH.pack(_MA, 8) + b"\x00\x01" if self.rfc5780 else b""
        for tail in self._tail:
            body = 12 + len(ma) + (6 if ma else 0) + len(tail)
            prefix = struct.pack("!HH", 0x0101, body)
            if ma:
                fmt = struct.Struct(f"!4s16s6sH4s6sH4s{len(tail)}s")
            else:
                fmt = struct.Struct(f"!4s16s6sH4s{len(tail)}s")
            self._v4.append((fmt, prefix, xma, ma, tail))
        self._known = frozenset(
            t
            for t in ATTRIBUTE_CLASSES
            if self.rfc5780 or t not in _RFC5780_REQUEST_ATTRS
        )

    # ------------------------------------------------------------ addresses

    def _encoded(self, host: str) -> tuple[int, bytes, bytes] | None:
        """(family, packed, packed XOR cookie) for a client host, cached."""
        entry = self._cache.get(host)
        if entry is None:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return None
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
            packed = ip.packed
            if ip.version == 4:
                xored = bytes(a ^ b for a, b in zip(packed, _COOKIE_XOR, strict=True))
                entry = (1, packed, xored)
            else:
                entry = (2, packed, b"")
            if len(self._cache) >= ADDRESS_CACHE_SIZE:
                self._cache.clear()
            self._cache[host] = entry
        return entry

    # ------------------------------------------------------------ requests

    def receive_datagram(
        self, data: bytes, addr: Address, now: float, socket: int
    ) -> None:
        """One STUN message (first bits 00) from ``addr``, received on endpoint
        index ``socket``: a Binding request is answered (see
        :meth:`datagrams_to_send`); anything else is counted in :attr:`drops`
        (RFC 8489 §6.3: other methods are silently discarded). The same as
        :meth:`answer`, with the reply queued."""
        reply = self.answer(data, addr, socket, now)
        if reply is not None:
            self._outbox.append(reply)

    def answer(
        self, data: bytes, addr: Address, socket: int, now: float
    ) -> Reply | None:
        """:meth:`receive_datagram` without the queue: the reply itself, or
        None (the drop is counted). The hot path of the STUN/TURN port calls
        this: a Binding request is a few hundred nanoseconds of work in all,
        and queueing the reply to take it out again with
        :meth:`datagrams_to_send` adds a third to that (two calls, one list).

        ``addr`` is the client address as the transport reports it; the reply
        goes back to it (the same object) or to RESPONSE-PORT. A UDP reply the
        reflection budget refuses is the drop ``reflection-budget`` (a stream
        client proved its address by the handshake).
        """
        reply = self._reply(data, addr, socket, now)
        if type(reply) is str:
            drops = self.drops
            drops[reply] = drops.get(reply, 0) + 1
            return None
        if self.stream or self.reflection.answer(
            addr[0],
            len(data),
            len(reply[0]),
            now,
        ):
            return reply  # type: ignore[return-value]
        drops = self.drops
        drops[DROP_REFLECTION] = drops.get(DROP_REFLECTION, 0) + 1
        return None

    def get_timer(self) -> float | None:
        """Always None: the Binding core keeps no deadlines (the limiter and
        the reflection budget age by the ``now`` of each request)."""
        return None

    def handle_timer(self, now: float) -> None:
        """Nothing is ever due (see :meth:`get_timer`)."""

    def _reply(self, data: bytes, addr: Address, local: int, now: float) -> Reply | str:
        size = len(data)
        tcp = self.stream
        if size < 20:
            return DROP_MALFORMED
        mtype, length, cookie = _HEADER.unpack_from(data)
        if length & 3 or length + 20 != size:
            return DROP_MALFORMED
        if mtype != BINDING_REQUEST:
            if mtype & _METHOD_BITS != _BINDING_METHOD:
                return DROP_UNSUPPORTED  # RFC 8489 §6.3: silently discarded
            if mtype == BINDING_INDICATION:
                return DROP_INDICATION  # RFC 8489 §6.3.2: keepalive, no answer
            return DROP_RESPONSE if mtype & 0x0100 else DROP_UNSUPPORTED
        host = addr[0]
        limiter = self.limiter
        if limiter.limit and not limiter.allow(host, now):
            return DROP_RATE_LIMITED

        fingerprint = False
        flags = -1  # -1: no CHANGE-REQUEST; else its A|B bits
        response_port = -1
        padding = -1
        unknown: list[int] | None = None
        if length:
            known = self._known
            offset = 20
            integrity_seen = 0  # 1 after MI, 2 after MI-SHA256 (RFC 8489 §14.5/6)
            while offset < size:
                if offset + 4 > size:
                    return DROP_MALFORMED
                atype, alen = _AH.unpack_from(data, offset)
                nxt = offset + 4 + alen + (-alen & 3)
                if nxt > size:
                    return DROP_MALFORMED
                if atype == _FP:
                    if nxt != size or alen != 4:
                        return DROP_MALFORMED
                    crc = zlib.crc32(data[:offset]) ^ FINGERPRINT_XOR
                    if _U32.unpack_from(data, offset + 4)[0] != crc:
                        return DROP_BAD_FINGERPRINT
                    fingerprint = True
                elif integrity_seen == 2 or (integrity_seen and atype != _MI256):
                    pass  # ignored after MESSAGE-INTEGRITY(-SHA256)
                elif atype == _MI:
                    integrity_seen = 1
                elif atype == _MI256:
                    integrity_seen = 2
                elif atype not in known:
                    if atype < 0x8000:
                        if unknown is None:
                            unknown = []
                        unknown.append(atype)
                elif atype == _CHANGE:
                    if alen != 4:
                        return DROP_MALFORMED
                    flags = data[offset + 7] & 6
                elif atype == _RPORT:
                    if alen != 4:
                        return DROP_MALFORMED
                    response_port = _U16.unpack_from(data, offset + 4)[0]
                elif atype == _PADDING:
                    padding = alen
                offset = nxt

        entry = self._cache.get(host)
        if entry is None:
            entry = self._encoded(host)
            if entry is None:
                return DROP_MALFORMED
        if unknown is not None:
            return self._error(
                data, addr, local, fingerprint, 420, [UnknownAttributes(tuple(unknown))]
            )
        send_from = local
        dest = addr
        if flags >= 0 and not self.change_supported:
            # RFC 5780 §6: without a second IP, 420 to *any* CHANGE-REQUEST (even
            # one with no flag set), so the client learns it is unsupported.
            return self._error(
                data, addr, local, fingerprint, 420, [UnknownAttributes((_CHANGE,))]
            )
        if flags > 0 or response_port >= 0:
            refused = _refused_rfc5780(flags, response_port, padding, tcp)
            if refused:
                return self._error(data, addr, local, fingerprint, 400, reason=refused)
            if flags > 0:
                send_from = local ^ ((2 if flags & 4 else 0) | (1 if flags & 2 else 0))
            if response_port >= 0:
                dest = (host, response_port)

        family, packed, xored = entry
        port = addr[1]
        slot = local * self._count + send_from
        txid = data[4:20]  # cookie + transaction id, echoed (RFC 8489 §12)
        if cookie == MAGIC_COOKIE:
            if family == 1:
                # IPv4 fast path: one pack, constant parts pre-encoded.
                fmt, prefix, xma, ma, tail = self._v4[slot]
                if ma:
                    response = fmt.pack(
                        prefix,
                        txid,
                        xma,
                        port ^ _PORT_XOR,
                        xored,
                        ma,
                        port,
                        packed,
                        tail,
                    )
                else:
                    response = fmt.pack(
                        prefix, txid, xma, port ^ _PORT_XOR, xored, tail
                    )
            else:
                tail = self._tail[slot]
                x6 = (
                    int.from_bytes(packed, "big") ^ int.from_bytes(txid, "big")
                ).to_bytes(16, "big")
                if self.rfc5780:
                    response = _V6XM.pack(
                        0x0101, 48 + len(tail), txid, _XMA, 20, 2, port ^ _PORT_XOR, x6,
                        _MA, 20, 2, port, packed,
                    ) + tail  # fmt: skip
                else:
                    response = _V6X.pack(
                        0x0101, 24 + len(tail), txid, _XMA, 20, 2, port ^ _PORT_XOR, x6
                    ) + tail  # fmt: skip
        else:
            # RFC 8489 §12: an RFC 3489 client gets MAPPED-ADDRESS instead of
            # XOR-MAPPED-ADDRESS, and the request's cookie back.
            tail = self._tail3489[slot]
            if family == 1:
                response = _V4M.pack(
                    0x0101, 12 + len(tail), txid, _MA, 8, 1, port, packed
                ) + tail  # fmt: skip
            else:
                response = _V6M.pack(
                    0x0101, 24 + len(tail), txid, _MA, 20, 2, port, packed
                ) + tail  # fmt: skip
        if padding >= 0:
            # Abuse limit: echo the request's PADDING size, never more (see above).
            pad_len = min((padding + 3) & ~3, MAX_PADDING)
            response = _with_length(
                response + _AH.pack(_PADDING, pad_len) + bytes(pad_len)
            )
        if fingerprint:
            response = _with_length(response, 8)
            response += _AH.pack(_FP, 4) + _U32.pack(
                zlib.crc32(response) ^ FINGERPRINT_XOR
            )
        return response, dest, send_from

    def _error(
        self,
        data: bytes,
        addr: tuple[str, int],
        local: int,
        fingerprint: bool,
        code: int,
        extra: list[UnknownAttributes] | None = None,
        reason: str | None = None,
    ) -> Reply:
        """An error response to a Binding request (rare path: full encoder)."""
        cookie = _U32.unpack_from(data, 4)[0]
        attrs: list[ErrorCodeAttribute | UnknownAttributes | Software] = [
            ErrorCodeAttribute(code, reason or reason_phrase(code))
        ]
        attrs.extend(extra or [])
        if self.software:
            attrs.append(Software(self.software))
        msg = Message(Class.ERROR, Method.BINDING, data[8:20], tuple(attrs), cookie)
        return encode(msg, fingerprint=fingerprint), addr, local


def _refused_rfc5780(flags: int, response_port: int, padding: int, tcp: bool) -> str:
    """Why a Binding request's RFC 5780 attributes earn a 400, or ``""``.

    ``flags`` are CHANGE-REQUEST's A|B bits, ``response_port`` RESPONSE-PORT's
    value and ``padding`` PADDING's length (each -1 when absent); the server
    rules of RFC 5780 §6.1: a change of address or port cannot be answered over
    TCP, PADDING and RESPONSE-PORT together are refused, and a RESPONSE-PORT is
    for UDP only (port 0 cannot be sent to).
    """
    if flags > 0 and tcp:
        return "CHANGE-REQUEST over TCP"
    if response_port >= 0:
        if padding >= 0:
            return "PADDING with RESPONSE-PORT"
        if tcp or response_port == 0:
            return "bad RESPONSE-PORT"
    return ""


def _with_length(response: bytes, extra: int = 0) -> bytes:
    """Rewrite the header length field to cover ``response`` plus ``extra``."""
    return response[:2] + _U16.pack(len(response) - 20 + extra) + response[4:]


__all__ = [
    "ADDRESS_CACHE_SIZE",
    "BINDING_ERROR",
    "BindingCore",
    "DROP_BAD_FINGERPRINT",
    "DROP_INDICATION",
    "DROP_MALFORMED",
    "DROP_NOT_STUN",
    "DROP_RATE_LIMITED",
    "DROP_REFLECTION",
    "DROP_RESPONSE",
    "DROP_UNSUPPORTED",
    "Reply",
]
