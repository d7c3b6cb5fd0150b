"""RakNet's reliability layer for one connection (reference raknet-wire.md §2).

Theory of operation
-------------------
Every connected datagram starts with a one-byte header (ReliabilityLayer.cpp
110-220): bit isValid=1, bit isACK, then

- data (``0x84`` in captures): isNAK=0, isPacketPair, isContinuousSend,
  needsBAndAs, then a byte-aligned u24LE *datagram number*, then frames;
- ACK (``0xC0``): hasBAndAS (a float follows when set), then a range list;
- NAK (``0xA0``): a range list.

A range list (DS_RangeList.h) is u16 BE count, then per range u8
minEqualsMax, u24LE min and, unless min == max, u24LE max.

A *frame* (ReliabilityLayer.cpp 2610-2800) is ``reliability<<5 | hasSplit<<4``,
u16 BE payload length in bits, then u24LE reliable message number (reliable
kinds), u24LE sequencing index (sequenced kinds), u24LE ordering index + u8
channel (ordered and sequenced kinds), u32 split count + u16 split id + u32
split index (split frames), then the payload.

Receiving: every data datagram is ACKed by number; a jump in datagram numbers
NAKs the hole so the sender resends at once. Reliable frames are de-duplicated
by reliable message number (a window above the lowest number not yet seen),
split frames are reassembled (bounded per connection and by a budget shared
by every connection), then ordered/sequenced frames go through their channel:
an ordered frame is delivered when its ordering index is the next expected
one, later ones wait (bounded); a sequenced frame is delivered if it belongs to
the current ordering index and is newer than the last one delivered, and
dropped when stale.

What a peer makes the layer hold -- split parts, frames waiting for their
order, reliable numbers seen above the lowest missing one -- is charged to a
:class:`~crossroads.proto.admission.MemoryCharge` (the process's resource
budget in production) with its
measured per-item overhead, not the payload alone: 4,095 one-byte parts cost
~70 bytes each, not one. A layer whose peer has not finished its handshake
(:attr:`ReliabilityLayer.buffering` False) holds none of it: a datagram with a
frame that would have to wait is neither processed further nor ACKed, so the
sender resends it once the connection is complete.

Sending: payloads larger than one datagram are split (and made reliable, as
RakNet does). A split message's fragments go out one at a time, each once
the previous one is acknowledged: RakNet 4.081's receiver joins fragments in
the order they *arrive* (measured with the real library: when fragment 0 is
lost and resent after fragment 1 arrived, the message is delivered
scrambled), so a resent fragment must never be overtaken by a later one. Reliable frames wait in a resend buffer of at most 512 messages
(``RESEND_BUFFER_ARRAY_LENGTH``) until a datagram carrying them is ACKed; a NAK
or the retransmission timeout (from measured round trips, as
CCRakNetSlidingWindow's ``GetRTOForRetransmission``) sends them again. Frames
beyond the resend buffer wait in a bounded queue.

What the send side holds -- queued messages, the resend buffer, the ACK
records of sent datagrams -- is charged to the same budget with its measured
overhead, at most :data:`MAX_SEND_BYTES` per connection. A peer that never
ACKs fills it: an unreliable message that does not fit is dropped, one that
waited longer than RakNet's unreliable timeout (1 s) is dropped unsent, and a
reliable message that does not fit first makes every queued unreliable one
go, then, if it still does not fit, raises :class:`LimitExceeded`
(``send-memory``): the owner loses the connection, as RakNet does a peer
that stops ACKing.

Everything is in integer milliseconds of one monotonic clock (``now_ms``).
Violating a bound raises :class:`LimitExceeded`; malformed bytes raise
:class:`DecodeError`. The owner closes the connection on either.
"""

from __future__ import annotations

import struct
from collections import deque
from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.admission import MemoryCharge
from crossroads.proto.bounded import BoundedMap
from crossroads.types import frozen

U24 = 1 << 24
HALF_U24 = 1 << 23
#: ``NUMBER_OF_ORDERED_STREAMS`` (ReliabilityLayer.h:52).
ORDERING_CHANNELS = 32
#: ``RESEND_BUFFER_ARRAY_LENGTH`` (ReliabilityLayer.h): reliable messages in
#: flight per connection.
RESEND_BUFFER = 512
#: Frames waiting behind a full resend buffer before the connection is
#: considered hopeless (a peer that never ACKs cannot make us hold more).
MAX_SEND_QUEUE = 4096
#: Reliable message numbers accepted above the lowest one not yet received.
#: RakNet gives up at a hole of 1 000 000 (ReliabilityLayer.cpp ~980); a hostile
#: peer could then make us hold a million-entry set, so the window is smaller:
#: far more than a resend buffer (512) of any RakNet sender can be in flight.
RELIABLE_WINDOW = 8192
#: Out-of-order frames held for the ordering channels, all channels together.
MAX_ORDERING_QUEUE = 1024
#: Split messages being reassembled at once per connection, fragments per
#: message, and bytes held per connection.
MAX_SPLITS_IN_PROGRESS = 16
MAX_SPLIT_COUNT = 4096
#: Charged bytes (payload and overhead) of split reassembly per connection.
MAX_SPLIT_BYTES = 1024 * 1024
#: RakPeer's default unreliable timeout (RakPeer.cpp:238 ``unreliableTimeout=1000``;
#: ReliabilityLayer.cpp:1745-1787 frees queued unreliable messages older than
#: it): an unreliable message that could not leave within 1 s is dropped.
UNRELIABLE_TIMEOUT_MS = 1000
#: Bytes (charged, with overhead) the send side of one connection may hold:
#: queued messages, the resend buffer and the ACK records of sent datagrams.
#: Everything this server sends a connected peer is a control message of
#: ~10-100 bytes, a few per exchange (pongs, punchthrough and proxy replies,
#: NAT-type probes): 256 KiB holds RakNet's whole resend buffer (512) of them
#: with their ACK records (charged ~200-250 KB), and a peer that ACKs holds a
#: round trip's worth, never near it. RakNet itself
#: has no bound (a peer that stops ACKing is lost after 10 s,
#: ReliabilityLayer.cpp:1799-1806): here a peer whose reliable backlog would
#: pass it is lost at once (``send-memory``).
MAX_SEND_BYTES = 256 * 1024
#: Measured fixed cost of what a peer makes a layer hold, beyond the payload
#: (CPython 3.11/3.12, 64-bit, ``tracemalloc``; checked by
#: tests/proto/raknet/test_reliability.py::test_charged_bytes_cover_what_is_held):
#: one split part (its bytes object header and its slot in the parts dict, int
#: key, dict growth), one split in progress (the ``_Split`` and its dict), one
#: frame waiting for its order (the ``Frame``, its list, dict slot and bytes
#: header), one reliable number seen ahead (an int in a set at 60 % load).
SPLIT_PART_OVERHEAD = 128
SPLIT_OVERHEAD = 1024
ORDERED_FRAME_OVERHEAD = 448
SEEN_NUMBER_OVERHEAD = 128
#: A channel's table of waiting frames, from its first frame until it is
#: empty again (then it is replaced: a dict never gives back its table).
WAITING_CHANNEL_OVERHEAD = 384
#: Measured fixed cost of what the send side holds per message beyond its
#: payload, the larger of its two states: queued (the ``Frame``, its queue
#: tuple and deque slot, its ints, the payload's bytes header: ~273 bytes)
#: and in the resend buffer (``_InFlight``, the encoded frame's bytes header
#: and frame header, its dict slot and ints: ~195 + up to 23); and of one
#: sent datagram's ACK record (its tuple, list and map entry: ~290) plus its
#: list slot per reliable number (~20-38 with the list's growth). CPython
#: 3.11, 64-bit, ``tracemalloc``; checked by
#: tests/proto/raknet/test_reliability.py::test_send_side_charges_cover_what_is_held.
SEND_MESSAGE_OVERHEAD = 320
DATAGRAM_RECORD_OVERHEAD = 320
RECORD_NUMBER_OVERHEAD = 40
#: Datagram-number holes NAKed at once; a larger jump is ACKed without NAKs
#: (the sender's RTO covers it) so one forged number cannot cost a huge NAK.
MAX_NAK_GAP = 512
#: Ranges read from one ACK/NAK: one datagram of ranges is at most ~200.
MAX_RANGES = 512
#: Retransmission timeout bounds and the extra allowance for delayed ACKs,
#: after CCRakNetSlidingWindow::GetRTOForRetransmission (reference §2): 2 s
#: before any round trip is measured and at most, ``2*RTT + 4*dev + 30 ms``.
RTO_MAX_MS = 2000
RTO_MIN_MS = 100
RTO_ADDITIONAL_MS = 30
#: Datagram header bytes (flags + u24) and the largest frame header.
DATAGRAM_HEADER = 4
MAX_FRAME_HEADER = 1 + 2 + 3 + 3 + 3 + 1 + 10

FLAG_VALID = 0x80
FLAG_ACK = 0x40
FLAG_NAK = 0x20
DATA_FLAGS = 0x84  # valid, needsBAndAs: what stock RakNet sends (pcap)
ACK_FLAGS = 0xC0
NAK_FLAGS = 0xA0


class Reliability(IntEnum):
    """PacketReliability as it appears on the wire (0..4)."""

    UNRELIABLE = 0
    UNRELIABLE_SEQUENCED = 1
    RELIABLE = 2
    RELIABLE_ORDERED = 3
    RELIABLE_SEQUENCED = 4


_RELIABLE = frozenset(
    {Reliability.RELIABLE, Reliability.RELIABLE_ORDERED, Reliability.RELIABLE_SEQUENCED}
)
_SEQUENCED = frozenset(
    {Reliability.UNRELIABLE_SEQUENCED, Reliability.RELIABLE_SEQUENCED}
)
_ORDERED = frozenset(
    {
        Reliability.UNRELIABLE_SEQUENCED,
        Reliability.RELIABLE_ORDERED,
        Reliability.RELIABLE_SEQUENCED,
    }
)


class LimitExceeded(DecodeError):
    """The peer made this connection exceed one of the bounds above."""


@frozen
class Frame:
    """One message (or one fragment of a split message) inside a datagram."""

    reliability: Reliability
    payload: bytes
    reliable_index: int = 0
    sequencing_index: int = 0
    ordering_index: int = 0
    channel: int = 0
    split_count: int = 0
    split_id: int = 0
    split_index: int = 0

    def encode(self) -> bytes:
        rel = self.reliability
        split = self.split_count > 0
        out = bytearray(
            struct.pack(">BH", rel << 5 | (0x10 if split else 0), len(self.payload) * 8)
        )
        if rel in _RELIABLE:
            out += self.reliable_index.to_bytes(3, "little")
        if rel in _SEQUENCED:
            out += self.sequencing_index.to_bytes(3, "little")
        if rel in _ORDERED:
            out += self.ordering_index.to_bytes(3, "little")
            out.append(self.channel)
        if split:
            out += struct.pack(
                ">IHI", self.split_count, self.split_id, self.split_index
            )
        out += self.payload
        return bytes(out)


def decode_frames(data: bytes, offset: int) -> list[Frame]:
    """The frames of a data datagram from ``offset`` on."""
    frames: list[Frame] = []
    end = len(data)
    while offset < end:
        if end - offset < 3:
            raise DecodeError("truncated frame header", "short")
        flags, bit_length = struct.unpack_from(">BH", data, offset)
        offset += 3
        kind = flags >> 5
        if kind > Reliability.RELIABLE_SEQUENCED:
            raise DecodeError(
                f"reliability {kind} is not sent on the wire", "bad-frame"
            )
        rel = Reliability(kind)
        reliable_index = sequencing_index = ordering_index = channel = 0
        split_count = split_id = split_index = 0
        need = (
            (3 if rel in _RELIABLE else 0)
            + (3 if rel in _SEQUENCED else 0)
            + (4 if rel in _ORDERED else 0)
            + (10 if flags & 0x10 else 0)
        )
        if end - offset < need:
            raise DecodeError("truncated frame header", "short")
        if rel in _RELIABLE:
            reliable_index = int.from_bytes(data[offset : offset + 3], "little")
            offset += 3
        if rel in _SEQUENCED:
            sequencing_index = int.from_bytes(data[offset : offset + 3], "little")
            offset += 3
        if rel in _ORDERED:
            ordering_index = int.from_bytes(data[offset : offset + 3], "little")
            channel = data[offset + 3]
            offset += 4
            if channel >= ORDERING_CHANNELS:
                raise DecodeError("ordering channel above 31", "bad-frame")
        if flags & 0x10:
            split_count, split_id, split_index = struct.unpack_from(
                ">IHI", data, offset
            )
            offset += 10
            if not 0 < split_count <= MAX_SPLIT_COUNT or split_index >= split_count:
                raise LimitExceeded("split count or index out of range", "split-count")
        length = (bit_length + 7) // 8
        if length == 0:
            raise DecodeError("empty frame", "bad-frame")
        if end - offset < length:
            raise DecodeError("frame longer than the datagram", "short")
        payload = data[offset : offset + length]
        offset += length
        frames.append(
            Frame(
                rel,
                payload,
                reliable_index,
                sequencing_index,
                ordering_index,
                channel,
                split_count,
                split_id,
                split_index,
            )
        )
    return frames


def encode_ranges(flags: int, numbers: list[int]) -> bytes:
    """An ACK/NAK datagram for ``numbers`` (sorted, merged into ranges)."""
    ranges: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if ranges and n == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], n)
        else:
            ranges.append((n, n))
    out = bytearray([flags])
    out += len(ranges).to_bytes(2, "big")
    for low, high in ranges:
        if low == high:
            out += b"\x01" + low.to_bytes(3, "little")
        else:
            out += b"\x00" + low.to_bytes(3, "little") + high.to_bytes(3, "little")
    return bytes(out)


def decode_ranges(data: bytes, offset: int) -> list[tuple[int, int]]:
    """The (min, max) ranges of an ACK/NAK from ``offset`` (the u16 count)."""
    if len(data) - offset < 2:
        raise DecodeError("truncated range list", "short")
    count = int.from_bytes(data[offset : offset + 2], "big")
    offset += 2
    if count > MAX_RANGES:
        raise LimitExceeded("too many ACK ranges", "ack-ranges")
    ranges: list[tuple[int, int]] = []
    for _ in range(count):
        if len(data) - offset < 4:
            raise DecodeError("truncated range", "short")
        single = data[offset]
        low = int.from_bytes(data[offset + 1 : offset + 4], "little")
        offset += 4
        high = low
        if not single:
            if len(data) - offset < 3:
                raise DecodeError("truncated range", "short")
            high = int.from_bytes(data[offset : offset + 3], "little")
            offset += 3
        if (high - low) % U24 >= HALF_U24:
            raise DecodeError("range with max before min", "bad-range")
        ranges.append((low, high))
    return ranges


def ahead(index: int, base: int) -> int:
    """How far ``index`` is at or after ``base`` in u24 serial arithmetic (<0: before)."""
    d = (index - base) % U24
    return d if d < HALF_U24 else d - U24


def _record_cost(reliables: list[int]) -> int:
    """What the ACK record of a datagram carrying ``reliables`` is charged."""
    return DATAGRAM_RECORD_OVERHEAD + RECORD_NUMBER_OVERHEAD * len(reliables)


class _Split:
    __slots__ = ("count", "parts", "size", "first")

    def __init__(self, count: int, first: Frame) -> None:
        self.count = count
        self.parts: dict[int, bytes] = {}
        self.size = 0
        self.first = first


class _InFlight:
    __slots__ = ("data", "cost", "sent_ms", "resend_ms", "first_ms")

    def __init__(self, data: bytes, cost: int, now_ms: int) -> None:
        self.data = data
        #: What its message charged when it was queued (given back on its ACK).
        self.cost = cost
        self.first_ms = now_ms
        self.sent_ms = now_ms
        self.resend_ms = now_ms


class ReliabilityLayer:
    """Send and receive state of one connection; see the module docstring."""

    def __init__(
        self, mtu: int, budget: MemoryCharge, *, buffering: bool = True
    ) -> None:
        #: Largest datagram payload: the MTU minus IP + UDP headers (28).
        self.max_datagram = mtu - 28
        self.budget = budget
        #: False until the peer completed its handshake: nothing is held for
        #: it (no split part, no frame out of order, no reliable number ahead).
        self.buffering = buffering
        #: Bytes this layer has charged to :attr:`budget` and not given back.
        self.charged = 0
        #: Datagrams refused because they would have made an unfinished
        #: connection hold something (neither processed further nor ACKed).
        self.held_back = 0
        # receive side
        self._expected_datagram = 0
        self._acks: list[int] = []
        self._naks: list[int] = []
        self._reliable_base = 0
        self._reliable_seen: set[int] = set()
        self._splits: dict[int, _Split] = {}
        self._split_bytes = 0
        self._ordered_read = [0] * ORDERING_CHANNELS
        self._sequenced_read = [0] * ORDERING_CHANNELS
        self._waiting: list[dict[int, list[Frame]]] = [
            {} for _ in range(ORDERING_CHANNELS)
        ]
        self._waiting_count = 0
        # send side
        self._next_datagram = 0
        self._next_reliable = 0
        self._ordered_write = [0] * ORDERING_CHANNELS
        self._sequenced_write = [0] * ORDERING_CHANNELS
        self._next_split_id = 0
        #: Reliable number of the split fragment sent last (see _pack's caller).
        self._split_gate = -1
        #: Messages not sent yet: (frame, when it was queued, what it charged).
        self._queue: deque[tuple[Frame, int, int]] = deque()
        #: Unreliable messages in :attr:`_queue` (the ones that go first).
        self._queued_unreliable = 0
        self._in_flight: dict[int, _InFlight] = {}
        #: Sent datagrams awaiting an ACK: (sent ms, reliable numbers). A peer
        #: that never ACKs leaves the oldest forgotten (their frames were resent
        #: in later datagrams anyway).
        self._datagrams: BoundedMap[int, tuple[int, list[int]]] = BoundedMap(
            4 * RESEND_BUFFER, lru=False
        )
        #: Bytes the send side holds (queue, resend buffer, ACK records),
        #: charged to :attr:`budget` with their overhead; part of
        #: :attr:`charged`, at most :data:`MAX_SEND_BYTES`.
        self.send_bytes = 0
        #: Unreliable messages dropped unsent: no room for them
        #: (:data:`MAX_SEND_BYTES` or the budget), their unreliable timeout, or
        #: to make room for a reliable one.
        self.unreliable_dropped = 0
        self._srtt: float | None = None
        self._rttvar = 0.0
        #: Time of the last reliable send, for the keep-alive ping rule.
        self.last_reliable_send_ms = 0
        self.resends = 0

    # ----------------------------------------------------------- receiving

    def receive(self, data: bytes, now_ms: int) -> list[bytes]:
        """One connected datagram; returns the messages it completes, in order."""
        flags = data[0]
        if not flags & FLAG_VALID:
            raise DecodeError("not a connected datagram", "not-valid")
        if flags & FLAG_ACK:
            offset = 5 if flags & 0x20 else 1  # hasBAndAS: a float AS follows
            self._on_ack(decode_ranges(data, offset), now_ms)
            return []
        if flags & FLAG_NAK:
            self._on_nak(decode_ranges(data, 1), now_ms)
            return []
        if len(data) < DATAGRAM_HEADER:
            raise DecodeError("truncated datagram header", "short")
        number = int.from_bytes(data[1:4], "little")
        frames = decode_frames(data, DATAGRAM_HEADER)
        self._note_datagram(number)
        out: list[bytes] = []
        for frame in frames:
            if not self._receive_frame(frame, out):
                # Not ACKed: the sender resends what it had reliable in this
                # datagram (frames delivered already are duplicates by then).
                self.held_back += 1
                return out
        if len(self._acks) < RESEND_BUFFER * 4:
            self._acks.append(number)
        return out

    def _note_datagram(self, number: int) -> None:
        gap = ahead(number, self._expected_datagram)
        if gap >= 0:
            if 0 < gap <= MAX_NAK_GAP:
                self._naks.extend(
                    (self._expected_datagram + i) % U24 for i in range(gap)
                )
            self._expected_datagram = (number + 1) % U24

    def _charge(self, nbytes: int, reason: str) -> None:
        if not self.budget.charge(nbytes):
            raise LimitExceeded(f"{reason} over the server's memory budget", reason)
        self.charged += nbytes

    def _uncharge(self, nbytes: int) -> None:
        self.budget.uncharge(nbytes)
        self.charged -= nbytes

    def _must_wait(self, frame: Frame, offset: int) -> bool:
        """Whether ``frame`` (``offset`` above the lowest reliable number
        missing) would be held rather than delivered or dropped now."""
        if offset > 0 or frame.split_count:
            return True
        if frame.reliability not in _ORDERED:
            return False
        return ahead(frame.ordering_index, self._ordered_read[frame.channel]) > 0

    def _receive_frame(self, frame: Frame, out: list[bytes]) -> bool:
        """Deliver, hold or drop one frame; False when it would be held while
        :attr:`buffering` is off (nothing of it is taken)."""
        offset = 0
        if frame.reliability in _RELIABLE:
            offset = ahead(frame.reliable_index, self._reliable_base)
            if offset < 0 or frame.reliable_index in self._reliable_seen:
                return True  # duplicate
            if offset >= RELIABLE_WINDOW:
                raise LimitExceeded("reliable message number too far ahead", "window")
        if not self.buffering and self._must_wait(frame, offset):
            return False
        if offset > 0:
            self._charge(SEEN_NUMBER_OVERHEAD, "window-memory")
            self._reliable_seen.add(frame.reliable_index)
        elif frame.reliability in _RELIABLE:
            self._reliable_base = (self._reliable_base + 1) % U24
            seen = self._reliable_seen
            if self._reliable_base in seen:
                while self._reliable_base in seen:
                    seen.discard(self._reliable_base)
                    self._uncharge(SEEN_NUMBER_OVERHEAD)
                    self._reliable_base = (self._reliable_base + 1) % U24
                if not seen:
                    # A set never gives back its table: start a small one.
                    self._reliable_seen = set()
        if frame.split_count:
            whole = self._reassemble(frame)
            if whole is None:
                return True
            frame = whole
        if frame.reliability not in _ORDERED:
            out.append(frame.payload)
            return True
        channel = frame.channel
        expected = self._ordered_read[channel]
        distance = ahead(frame.ordering_index, expected)
        if distance < 0:
            return True  # older than what was delivered: a stale sequenced frame
        if distance == 0:
            self._deliver_ordered(frame, out)
            return True
        if self._waiting_count >= MAX_ORDERING_QUEUE:
            raise LimitExceeded("too many frames waiting for order", "ordering")
        waiting = self._waiting[channel]
        cost = ORDERED_FRAME_OVERHEAD + len(frame.payload)
        self._charge(
            cost if waiting else cost + WAITING_CHANNEL_OVERHEAD, "ordering-memory"
        )
        waiting.setdefault(frame.ordering_index, []).append(frame)
        self._waiting_count += 1
        return True

    def _deliver_ordered(self, frame: Frame, out: list[bytes]) -> None:
        channel = frame.channel
        if frame.reliability in _SEQUENCED:
            if ahead(frame.sequencing_index, self._sequenced_read[channel]) >= 0:
                self._sequenced_read[channel] = (frame.sequencing_index + 1) % U24
                out.append(frame.payload)
            return
        out.append(frame.payload)
        waiting = self._waiting[channel]
        while True:
            self._ordered_read[channel] = (self._ordered_read[channel] + 1) % U24
            self._sequenced_read[channel] = 0
            held = waiting.pop(self._ordered_read[channel], None)
            if held is None:
                return
            self._waiting_count -= len(held)
            freed = sum(ORDERED_FRAME_OVERHEAD + len(f.payload) for f in held)
            if not waiting:
                # A dict never gives back its table: start a small one.
                waiting = self._waiting[channel] = {}
                freed += WAITING_CHANNEL_OVERHEAD
            self._uncharge(freed)
            held.sort(
                key=lambda f: (f.reliability not in _SEQUENCED, f.sequencing_index)
            )
            advanced = False
            for item in held:
                if item.reliability in _SEQUENCED:
                    if ahead(item.sequencing_index, self._sequenced_read[channel]) >= 0:
                        self._sequenced_read[channel] = (
                            item.sequencing_index + 1
                        ) % U24
                        out.append(item.payload)
                elif not advanced:
                    out.append(item.payload)
                    advanced = True
            if not advanced:
                return

    def _reassemble(self, frame: Frame) -> Frame | None:
        split = self._splits.get(frame.split_id)
        if split is None:
            if len(self._splits) >= MAX_SPLITS_IN_PROGRESS:
                raise LimitExceeded("too many split messages at once", "splits")
            if self._split_bytes + SPLIT_OVERHEAD > MAX_SPLIT_BYTES:
                raise LimitExceeded(
                    "split reassembly over its per-connection cap", "split-memory"
                )
            self._charge(SPLIT_OVERHEAD, "split-memory")
            self._split_bytes += SPLIT_OVERHEAD
            split = self._splits[frame.split_id] = _Split(frame.split_count, frame)
            split.size = SPLIT_OVERHEAD
        if frame.split_count != split.count:
            raise DecodeError("split count changed within one message", "bad-split")
        if frame.split_index in split.parts:
            return None
        cost = SPLIT_PART_OVERHEAD + len(frame.payload)
        if self._split_bytes + cost > MAX_SPLIT_BYTES:
            raise LimitExceeded(
                "split reassembly over its per-connection cap", "split-memory"
            )
        self._charge(cost, "split-memory")
        split.parts[frame.split_index] = frame.payload
        split.size += cost
        self._split_bytes += cost
        if frame.split_index == 0:
            split.first = frame
        if len(split.parts) < split.count:
            return None
        del self._splits[frame.split_id]
        self._split_bytes -= split.size
        self._uncharge(split.size)
        payload = b"".join(split.parts[i] for i in range(split.count))
        first = split.first
        return Frame(
            first.reliability,
            payload,
            first.reliable_index,
            first.sequencing_index,
            first.ordering_index,
            first.channel,
        )

    def release(self) -> None:
        """Give back everything this layer holds for its peer (on close)."""
        self.budget.uncharge(self.charged)
        self.charged = 0
        self._split_bytes = 0
        self._splits.clear()
        self._waiting = [{} for _ in range(ORDERING_CHANNELS)]
        self._waiting_count = 0
        self._reliable_seen = set()
        self.send_bytes = 0
        self._queue = deque()
        self._queued_unreliable = 0
        self._in_flight = {}
        self._datagrams.clear()

    def _forget_datagram(self, number: int) -> tuple[int, list[int]] | None:
        """Remove the ACK record of datagram ``number`` (giving back its charge)."""
        entry = self._datagrams.pop(number)
        if entry is not None:
            self._give_send(_record_cost(entry[1]))
        return entry

    def _forget_records_before(self, sent_ms: int) -> None:
        """Forget the ACK records of datagrams sent before ``sent_ms``, the
        last send of the oldest message in flight: every frame they carried
        was ACKed or sent again since, so an ACK of them changes nothing
        (a lost datagram's record would otherwise stay until pushed out)."""
        records = self._datagrams
        while records:
            number = next(iter(records))
            entry = records.peek(number)
            if entry is None or entry[0] >= sent_ms:
                return
            self._forget_datagram(number)

    def _on_ack(self, ranges: list[tuple[int, int]], now_ms: int) -> None:
        freed = 0
        for number in self._numbers_in(ranges):
            entry = self._forget_datagram(number)
            if entry is None:
                continue
            sent_ms, reliables = entry
            fresh = False
            for index in reliables:
                flight = self._in_flight.get(index)
                if flight is not None and flight.sent_ms == sent_ms:
                    fresh = fresh or flight.first_ms == sent_ms
                    freed += flight.cost
                    del self._in_flight[index]
            if fresh:
                self._sample_rtt(now_ms - sent_ms)
        if freed:
            self._give_send(freed)
            if not self._in_flight:
                self._forget_records_before(now_ms + 1)

    def _on_nak(self, ranges: list[tuple[int, int]], now_ms: int) -> None:
        for number in self._numbers_in(ranges):
            entry = self._forget_datagram(number)
            if entry is None:
                continue
            for index in entry[1]:
                flight = self._in_flight.get(index)
                if flight is not None:
                    flight.resend_ms = now_ms

    def _numbers_in(self, ranges: list[tuple[int, int]]) -> list[int]:
        """Datagram numbers we track inside ``ranges``: at most the smaller of
        the span and the tracked set, so a forged 0..2^24-1 range is cheap."""
        found: list[int] = []
        for low, high in ranges:
            span = (high - low) % U24 + 1
            if span <= len(self._datagrams):
                found.extend(
                    n
                    for n in ((low + i) % U24 for i in range(span))
                    if n in self._datagrams
                )
            else:
                found.extend(
                    n
                    for n in self._datagrams
                    if ahead(n, low) >= 0 and ahead(high, n) >= 0
                )
        return found

    def _sample_rtt(self, rtt: int) -> None:
        if self._srtt is None:
            self._srtt = float(rtt)
            self._rttvar = rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt

    @property
    def rto_ms(self) -> int:
        if self._srtt is None:
            return RTO_MAX_MS
        rto = int(2 * self._srtt + 4 * self._rttvar) + RTO_ADDITIONAL_MS
        return max(RTO_MIN_MS, min(RTO_MAX_MS, rto))

    @property
    def rtt_ms(self) -> int | None:
        """Smoothed round-trip time, once a datagram has been ACKed."""
        return None if self._srtt is None else int(self._srtt)

    # ------------------------------------------------------------- sending

    def send(
        self, payload: bytes, reliability: Reliability, channel: int, now_ms: int
    ) -> bool:
        """Queue one message; large ones are split. Everything queued is
        charged (:meth:`_take_send`) until it is sent (unreliable) or ACKed
        (reliable). An unreliable message that does not fit is dropped
        (False); a reliable one first makes the queued unreliable ones go,
        and if it still does not fit the connection cannot be kept:
        :class:`LimitExceeded` (``send-memory``), as RakNet loses a
        connection whose reliable data the peer does not take."""
        if len(self._queue) >= MAX_SEND_QUEUE:
            raise LimitExceeded("send queue full", "send-queue")
        room = self.max_datagram - DATAGRAM_HEADER - MAX_FRAME_HEADER
        split = len(payload) > room
        if split:
            # RakNet sends every fragment reliably (ReliabilityLayer.cpp, SplitPacket).
            if reliability == Reliability.UNRELIABLE:
                reliability = Reliability.RELIABLE
            elif reliability == Reliability.UNRELIABLE_SEQUENCED:
                reliability = Reliability.RELIABLE_SEQUENCED
        count = (len(payload) + room - 1) // room if split else 1
        if split and (
            count > MAX_SPLIT_COUNT or len(self._queue) + count > MAX_SEND_QUEUE
        ):
            raise LimitExceeded("message too large to send", "send-queue")
        reliable = reliability in _RELIABLE
        cost = count * SEND_MESSAGE_OVERHEAD + len(payload)
        if not self._take_send(cost):
            if not reliable:
                self.unreliable_dropped += 1
                return False
            self._drop_queued_unreliable()
            if not self._take_send(cost):
                raise LimitExceeded(
                    "reliable backlog over the send memory", "send-memory"
                )
        ordering = sequencing = 0
        if reliability in _SEQUENCED:
            ordering = self._ordered_write[channel]
            sequencing = self._sequenced_write[channel]
            self._sequenced_write[channel] = (sequencing + 1) % U24
        elif reliability in _ORDERED:
            ordering = self._ordered_write[channel]
            self._ordered_write[channel] = (ordering + 1) % U24
            self._sequenced_write[channel] = 0
        if not split:
            self._queue.append(
                (
                    Frame(reliability, payload, 0, sequencing, ordering, channel),
                    now_ms,
                    cost,
                )
            )
            if not reliable:
                self._queued_unreliable += 1
            return True
        split_id = self._next_split_id
        self._next_split_id = (split_id + 1) % 65536
        for i in range(count):
            part = payload[i * room : (i + 1) * room]
            self._queue.append(
                (
                    Frame(
                        reliability,
                        part,
                        0,
                        sequencing,
                        ordering,
                        channel,
                        count,
                        split_id,
                        i,
                    ),
                    now_ms,
                    SEND_MESSAGE_OVERHEAD + len(part),
                )
            )
        return True

    def _take_send(self, nbytes: int) -> bool:
        """Charge ``nbytes`` of the send side: within :data:`MAX_SEND_BYTES`
        for this connection and within the budget; False (nothing taken)
        when either is full."""
        if self.send_bytes + nbytes > MAX_SEND_BYTES:
            return False
        if not self.budget.charge(nbytes):
            return False
        self.send_bytes += nbytes
        self.charged += nbytes
        return True

    def _give_send(self, nbytes: int) -> None:
        self.budget.uncharge(nbytes)
        self.send_bytes -= nbytes
        self.charged -= nbytes

    def _drop_queued_unreliable(self, older_than_ms: int | None = None) -> int:
        """Drop the queued unreliable messages (those queued before
        ``older_than_ms`` when given); how many went."""
        if not self._queued_unreliable:
            return 0
        kept: deque[tuple[Frame, int, int]] = deque()
        dropped = freed = 0
        for item in self._queue:
            frame, queued_ms, cost = item
            if frame.reliability not in _RELIABLE and (
                older_than_ms is None or queued_ms < older_than_ms
            ):
                dropped += 1
                freed += cost
            else:
                kept.append(item)
        if dropped:
            self._queue = kept
            self._queued_unreliable -= dropped
            self.unreliable_dropped += dropped
            self._give_send(freed)
        return dropped

    def cull_unreliable(self, now_ms: int) -> int:
        """Drop unreliable messages queued longer than
        :data:`UNRELIABLE_TIMEOUT_MS` (RakPeer's unreliable timeout); how
        many went."""
        return self._drop_queued_unreliable(now_ms - UNRELIABLE_TIMEOUT_MS)

    def datagrams(self, now_ms: int) -> list[bytes]:
        """ACKs, NAKs, due resends and queued frames, packed into datagrams."""
        out: list[bytes] = []
        if self._acks:
            out.extend(self._chunked_ranges(ACK_FLAGS, self._acks))
            self._acks = []
        if self._naks:
            out.extend(self._chunked_ranges(NAK_FLAGS, self._naks))
            self._naks = []
        pending: list[tuple[bytes, int | None]] = []
        rto = self.rto_ms
        oldest_sent = now_ms
        for number, flight in self._in_flight.items():
            if flight.resend_ms <= now_ms:
                flight.resend_ms = now_ms + rto
                flight.sent_ms = now_ms
                pending.append((flight.data, number))
                self.resends += 1
            elif flight.sent_ms < oldest_sent:
                oldest_sent = flight.sent_ms
        self._forget_records_before(oldest_sent)
        sent_unreliable = 0
        while self._queue and len(self._in_flight) < RESEND_BUFFER:
            frame = self._queue[0][0]
            if frame.split_index > 0 and self._split_gate in self._in_flight:
                break  # the previous fragment is not acknowledged yet
            _, queued_ms, cost = self._queue.popleft()
            index: int | None = None
            if frame.reliability in _RELIABLE:
                index = self._next_reliable
                self._next_reliable = (index + 1) % U24
                frame = Frame(
                    frame.reliability,
                    frame.payload,
                    index,
                    frame.sequencing_index,
                    frame.ordering_index,
                    frame.channel,
                    frame.split_count,
                    frame.split_id,
                    frame.split_index,
                )
            else:
                self._queued_unreliable -= 1
                sent_unreliable += cost
                if now_ms - queued_ms > UNRELIABLE_TIMEOUT_MS:
                    self.unreliable_dropped += 1
                    continue
            data = frame.encode()
            if index is not None:
                flight = _InFlight(data, cost, now_ms)
                flight.resend_ms = now_ms + rto
                self._in_flight[index] = flight
                self.last_reliable_send_ms = now_ms
                if frame.split_count:
                    self._split_gate = index
            pending.append((data, index))
        if sent_unreliable:
            self._give_send(sent_unreliable)
        if pending:
            out.extend(self._pack(pending, now_ms))
        return out

    def _pack(
        self, pending: list[tuple[bytes, int | None]], now_ms: int
    ) -> list[bytes]:
        out: list[bytes] = []
        body = bytearray()
        reliables: list[int] = []
        for data, index in pending:
            if body and DATAGRAM_HEADER + len(body) + len(data) > self.max_datagram:
                out.append(self._seal(body, reliables, now_ms))
                body = bytearray()
                reliables = []
            body += data
            if index is not None:
                reliables.append(index)
        if body:
            out.append(self._seal(body, reliables, now_ms))
        return out

    def _seal(self, body: bytearray, reliables: list[int], now_ms: int) -> bytes:
        number = self._next_datagram
        self._next_datagram = (number + 1) % U24
        if reliables:
            records = self._datagrams
            if len(records) >= records.capacity:
                self._forget_datagram(next(iter(records)))
            # Not recorded when it does not fit: its frames are resent at
            # their RTO and acknowledged in a later datagram.
            if self._take_send(_record_cost(reliables)):
                records.put(number, (now_ms, reliables))
        return bytes([DATA_FLAGS]) + number.to_bytes(3, "little") + bytes(body)

    def _chunked_ranges(self, flags: int, numbers: list[int]) -> list[bytes]:
        # ~200 ranges of 7 bytes fit any MTU RakNet uses (576 and up).
        step = max(1, (self.max_datagram - 3) // 7)
        ordered = sorted(set(numbers))
        return [
            encode_ranges(flags, ordered[i : i + step])
            for i in range(0, len(ordered), step)
        ]

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def oldest_unacked_ms(self) -> int | None:
        """When the oldest reliable message still unacknowledged was first sent."""
        if not self._in_flight:
            return None
        return min(f.first_ms for f in self._in_flight.values())

    def next_resend_ms(self) -> int | None:
        if not self._in_flight:
            return None
        return min(f.resend_ms for f in self._in_flight.values())
