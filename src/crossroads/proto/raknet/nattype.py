"""RakNet's NatTypeDetectionServer, sans-I/O (reference raknet-wire.md §4).

Theory of operation
-------------------
Besides the RakNet socket S1 (IP1), the server has four plain UDP sockets:
``s1p2`` (IP1, another port), ``s2p3``, ``s3p4`` and ``s4p5`` (on other IPs;
the stock server, through a shared-buffer bug in ``GetLocalIP``, binds all
three on its second IP, so two IPs are what it really uses; with three extra
IPs configured each socket gets its own).

A connected client sends ``ID_NAT_TYPE_DETECTION_REQUEST`` · bit isRequest=1 ·
u16 (unaligned) c2Port, the port of a fresh socket C2 of its own. From then on,
every ``lastPing×3+50`` ms the attempt moves one state on
(NatTypeDetectionServer.cpp:389, 120-240), each test sent twice:

1. NONE: ``s4p5`` sends the raw byte ``00`` to C2. Arriving means no NAT.
2. FULL_CONE: ``s2p3`` (other IP) sends out-of-band ``02 01`` to C1.
3. ADDRESS_RESTRICTED: ``s1p2`` (same IP, other port) sends ``02 02`` to C1.
4. PORT_RESTRICTED: over the connection, ``60`` RakString(s3p4's IP) u16
   port; the client sends the raw datagram ``03`` GUID from C1 to s3p4. The
   same source address as the connection means PORT_RESTRICTED (``61 03``),
   another one SYMMETRIC (``61 04``).
5. Past the last state: SYMMETRIC.

A client that detected NONE / FULL_CONE / ADDRESS_RESTRICTED itself says so
with ``60`` bit 0, which ends its attempt; so does a disconnection.

Bounds: one attempt per client, at most :data:`MAX_ATTEMPTS` at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.punch.nattype import NatType
from crossroads.proto.raknet.bitstream import BitReader, BitWriter
from crossroads.proto.raknet.messages import MessageId, OutOfBand
from crossroads.proto.raknet.peer import RakNetServer
from crossroads.proto.raknet.reliability import Reliability
from crossroads.types import Address

__all__ = ["NatType", "NatTypeDetectionServer", "Socket"]

#: ``ID_NAT_TYPE_DETECT``: the out-of-band sub-id of the cone tests.
NAT_TYPE_DETECT = 0x02
#: ``timeBetweenAttempts = GetLastPing()*3+50`` (NatTypeDetectionServer.cpp:389).
PING_MULTIPLE = 3
EXTRA_MS = 50
#: Detection attempts at once (stock RakNet has no bound).
MAX_ATTEMPTS = 10_000


class Socket(IntEnum):
    """The extra sockets, named as in RakNet's source."""

    S1P2 = 1
    S2P3 = 2
    S3P4 = 3
    S4P5 = 4


class State(IntEnum):
    """NATDetectionState; each test state is sent twice."""

    NONE = 0
    TESTING_NONE_1 = 1
    TESTING_NONE_2 = 2
    TESTING_FULL_CONE_1 = 3
    TESTING_FULL_CONE_2 = 4
    TESTING_ADDRESS_RESTRICTED_1 = 5
    TESTING_ADDRESS_RESTRICTED_2 = 6
    TESTING_PORT_RESTRICTED_1 = 7
    TESTING_PORT_RESTRICTED_2 = 8


@dataclass(eq=False, slots=True)
class Attempt:
    guid: int
    address: Address
    c2_port: int
    interval_ms: int
    state: State = State.NONE
    next_ms: int = 0


@dataclass
class DetectionStats:
    started: int = 0
    results: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)


class NatTypeDetectionServer:
    """See the module docstring. ``s3p4`` is the (IP, port) clients are told
    to send their port-restricted probe to."""

    def __init__(self, peer: RakNetServer, s3p4: Address) -> None:
        self.peer = peer
        self.s3p4 = s3p4
        self.attempts: dict[int, Attempt] = {}
        self.stats = DetectionStats()
        self._out: list[tuple[bytes, Address, Socket]] = []

    def side_datagrams(self) -> list[tuple[bytes, Address, Socket]]:
        """Datagrams for the extra sockets, as ``(data, destination, socket)``
        (the order of the core API's :class:`~crossroads.proto.core.MultiSocketCore`)."""
        out, self._out = self._out, []
        return out

    def on_message(
        self, guid: int, address: Address, payload: bytes, now: float
    ) -> bool:
        if payload[0] != MessageId.NAT_TYPE_DETECTION_REQUEST:
            return False
        try:
            reader = BitReader(payload, start_bits=8)
            if not reader.read_bool():
                self.attempts.pop(guid, None)  # the client found its type itself
                return True
            c2_port = reader.read_u16()
        except DecodeError as exc:
            self.stats.dropped[exc.reason] += 1
            return True
        if guid in self.attempts:
            return True  # already in progress
        if len(self.attempts) >= MAX_ATTEMPTS:
            self.stats.dropped["attempts-full"] += 1
            return True
        conn = self.peer.connection(address)
        ping = (conn.rtt_ms if conn is not None else None) or 0
        self.attempts[guid] = Attempt(
            guid, address, c2_port, ping * PING_MULTIPLE + EXTRA_MS, next_ms=0
        )
        self.stats.started += 1
        return True

    def on_disconnected(self, guid: int) -> None:
        self.attempts.pop(guid, None)

    def receive_s3p4(self, data: bytes, addr: Address, now: float) -> None:
        """The client's ``03`` GUID probe, on s3p4."""
        if len(data) < 9 or data[0] != NatType.PORT_RESTRICTED:
            self.stats.dropped["s3p4-not-a-probe"] += 1
            return
        attempt = self.attempts.pop(int.from_bytes(data[1:9], "big"), None)
        if attempt is None:
            self.stats.dropped["s3p4-unknown-guid"] += 1
            return
        same = addr == attempt.address
        self._result(
            attempt, NatType.PORT_RESTRICTED if same else NatType.SYMMETRIC, now
        )

    def get_timer(self) -> float | None:
        if not self.attempts:
            return None
        return min(a.next_ms for a in self.attempts.values()) / 1000

    def handle_timer(self, now: float) -> None:
        now_ms = int(now * 1000)
        for attempt in list(self.attempts.values()):
            if now_ms < attempt.next_ms:
                continue
            attempt.next_ms = now_ms + attempt.interval_ms
            if attempt.state == State.TESTING_PORT_RESTRICTED_2:
                del self.attempts[attempt.guid]
                self._result(attempt, NatType.SYMMETRIC, now)
                continue
            attempt.state = State(attempt.state + 1)
            self._test(attempt, now)

    def _test(self, attempt: Attempt, now: float) -> None:
        host, c1_port = attempt.address
        if attempt.state <= State.TESTING_NONE_2:
            self._out.append(
                (bytes([NatType.NONE]), (host, attempt.c2_port), Socket.S4P5)
            )
        elif attempt.state <= State.TESTING_FULL_CONE_2:
            oob = OutOfBand(self.peer.guid, bytes([NAT_TYPE_DETECT, NatType.FULL_CONE]))
            self._out.append((oob.encode(), (host, c1_port), Socket.S2P3))
        elif attempt.state <= State.TESTING_ADDRESS_RESTRICTED_2:
            oob = OutOfBand(
                self.peer.guid, bytes([NAT_TYPE_DETECT, NatType.ADDRESS_RESTRICTED])
            )
            self._out.append((oob.encode(), (host, c1_port), Socket.S1P2))
        else:
            writer = BitWriter()
            writer.write_u8(MessageId.NAT_TYPE_DETECTION_REQUEST)
            writer.write_rakstring(self.s3p4[0].encode())
            writer.write_u16(self.s3p4[1])
            self.peer.send(
                attempt.address, writer.data(), Reliability.RELIABLE, now=now
            )

    def _result(self, attempt: Attempt, result: NatType, now: float) -> None:
        self.stats.results[result.name.lower()] += 1
        self.peer.send(
            attempt.address,
            bytes([MessageId.NAT_TYPE_DETECTION_RESULT, result]),
            Reliability.RELIABLE,
            now=now,
        )
