"""Pieces both DTLS endpoints share: handshake reassembly, the retransmission
timer, the events a connection reports and the output side of a core
(:class:`DtlsCore`).

Reassembly (RFC 6347 §4.2.3): a handshake message may arrive in fragments, out
of order and duplicated. :class:`Reassembler` buffers fragments of the next few
expected messages (bounded in count and size) and hands out whole messages in
``message_seq`` order; anything older than the next expected message is
reported as a retransmission (the peer lost our last flight).

Retransmission (RFC 6347 §4.2.4.1): a flight is re-sent when no answer came
within the timer, which starts at 1 s and doubles up to 60 s.
"""

from __future__ import annotations

from typing import Final

from crossroads.errors import DecodeError
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.dtls.wire import (
    HandshakeFragment,
    decode_fragments,
    handshake_message,
)
from crossroads.types import Address, frozen

#: RFC 6347 §4.2.4.1: "initial timer value of 1 second".
INITIAL_RETRANSMIT: Final = 1.0
#: RFC 6347 §4.2.4.1: "double the value at each retransmission, up to no less
#: than the RFC 6298 maximum of 60 seconds".
MAX_RETRANSMIT: Final = 60.0
#: Largest handshake message we reassemble. A PSK handshake's biggest message is
#: a ClientHello (a few hundred bytes even from GnuTLS, which offers ~60 suites);
#: 8 KiB leaves room and bounds what one peer can make us buffer.
MAX_MESSAGE_SIZE: Final = 8192
#: Messages ahead of the expected one we keep fragments of (a flight of a PSK
#: handshake has at most three messages).
MAX_AHEAD: Final = 4


@frozen
class Message:
    """A whole handshake message."""

    msg_type: int
    message_seq: int
    body: bytes

    def encode(self) -> bytes:
        """As the Finished hash covers it (RFC 6347 §4.2.6: one fragment)."""
        return handshake_message(self.msg_type, self.message_seq, self.body)


class Reassembler:
    """Whole handshake messages, in order, from fragments."""

    __slots__ = ("next_seq", "_partial")

    def __init__(self, next_seq: int) -> None:
        self.next_seq = next_seq
        #: message_seq -> (type, buffer, coverage map)
        self._partial: dict[int, tuple[int, bytearray, bytearray]] = {}

    def add(self, fragment: HandshakeFragment) -> tuple[list[Message], bool]:
        """Messages completed by ``fragment``, and whether it was a
        retransmission of an already delivered message."""
        seq = fragment.message_seq
        if seq < self.next_seq:
            return [], True
        if seq >= self.next_seq + MAX_AHEAD:
            raise DecodeError("handshake message too far ahead", "too-far-ahead")
        if fragment.length > MAX_MESSAGE_SIZE:
            raise DecodeError("handshake message too large", "too-large")
        entry = self._partial.get(seq)
        if entry is None:
            entry = (
                fragment.msg_type,
                bytearray(fragment.length),
                bytearray(fragment.length),
            )
            self._partial[seq] = entry
        msg_type, buffer, covered = entry
        if msg_type != fragment.msg_type or len(buffer) != fragment.length:
            raise DecodeError("fragments of one message disagree", "bad-fragment")
        start = fragment.fragment_offset
        end = start + len(fragment.body)
        buffer[start:end] = fragment.body
        covered[start:end] = b"\x01" * (end - start)
        done = []
        while True:
            entry = self._partial.get(self.next_seq)
            if entry is None or entry[2].count(0):
                break
            del self._partial[self.next_seq]
            done.append(Message(entry[0], self.next_seq, bytes(entry[1])))
            self.next_seq += 1
        return done, False


class Retransmitter:
    """The RFC 6347 §4.2.4.1 timer of one flight."""

    __slots__ = ("interval", "deadline")

    def __init__(self, now: float) -> None:
        self.interval = INITIAL_RETRANSMIT
        self.deadline: float | None = now + self.interval

    def restart(self, now: float) -> None:
        """A new flight went out."""
        self.interval = INITIAL_RETRANSMIT
        self.deadline = now + self.interval

    def back_off(self, now: float) -> None:
        """The flight was re-sent after the timer fired."""
        self.interval = min(MAX_RETRANSMIT, self.interval * 2)
        self.deadline = now + self.interval

    def stop(self) -> None:
        self.deadline = None


# -------------------------------------------------------------------- events


@frozen
class HelloReceived:
    """A ClientHello passed the cookie check (for logging what clients offer)."""

    address: Address
    version: int
    cipher_suites: tuple[int, ...]
    extensions: tuple[int, ...]
    #: The suite chosen, None when none is shared.
    chosen: int | None


@frozen
class Established:
    """The handshake completed: records can flow."""

    address: Address
    identity: bytes
    cipher_suite: int
    extended_master_secret: bool


@frozen
class ApplicationData:
    address: Address
    data: bytes


@frozen
class HandshakeFailed:
    """A handshake ended without a session (``reason`` is a metric label)."""

    address: Address
    reason: str


@frozen
class Closed:
    """An established session ended (alert, timeout, replaced)."""

    address: Address
    reason: str


Event = HelloReceived | Established | ApplicationData | HandshakeFailed | Closed


class DtlsCore(Outbox[Datagram], EventQueue[Event]):
    """The output side both DTLS cores share (the core API of
    :mod:`crossroads.proto.core`): datagrams to send, events, and drops counted
    by reason (a metric label each)."""

    def __init__(self) -> None:
        super().__init__()
        #: Drops by reason (metrics).
        self.drops: dict[str, int] = {}

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def _reassemble(
        self, reassembler: Reassembler, fragment: HandshakeFragment
    ) -> tuple[list[Message], bool] | None:
        """:meth:`Reassembler.add`, or None (dropped, counted as
        ``handshake-<reason>``) when the fragment is refused."""
        try:
            return reassembler.add(fragment)
        except DecodeError as exc:
            self._drop(f"handshake-{exc.reason}")
            return None

    def _fragments(self, plain: bytes) -> list[HandshakeFragment] | None:
        """The handshake fragments of a record, or None (dropped, counted as
        ``handshake-<reason>``) when they do not decode."""
        try:
            return decode_fragments(plain)
        except DecodeError as exc:
            self._drop(f"handshake-{exc.reason}")
            return None
