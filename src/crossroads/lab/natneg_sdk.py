"""A GameSpy SDK natneg client, re-implemented from the reference, for tests and the lab.

This is test tooling, not a crossroads feature: it plays the part of an unmodified
game against crossroads' natneg server, in ``tests/`` (loopback) and in the NAT lab
(``crossroads.lab.methods.natneg``, real kernel NAT), which is why it lives in the
package rather than under ``tests/``. It follows the
SDK client as ``shared/reference/gamespy-natneg.md`` describes it (§3 layouts, §5
NATify, §6 state machine and timers), per protocol version:

* sockets: the *game socket* (optional, lent by the game: sends the GP INIT and all
  CONNECT_PINGs, and is handed back on success) and the *negotiate socket* (created
  per negotiation, unbound until its first ``sendto``: NN1/NN2/NN3 INITs, CONNECT_ACK,
  ERT_ACK, REPORT, and the pings when there is no game socket);
* INITs: GP/NN1 to natneg1, NN2 to natneg2, NN3 to natneg3 (not in v2); GP and NN1
  carry local port 0, NN2/NN3 the game socket's port (or the negotiate socket's);
  every 500 ms the un-acked ones are resent; after 11 retries -> init timeout;
* size checks as ``NNProcessData``: magic, then CONNECT/CONNECT_PING need 20 bytes,
  everything else 21; then the cookie must match;
* CONNECT accepted in any state before pinging; ACKed (21 bytes, garbage in bytes 12
  and 14-20, as the SDK's uninitialised stack) whenever finished == 0; only the
  first one is used; finished 1/2 end the negotiation without ACK or REPORT;
* pings every 700 ms to the guess; a ping's *source* replaces the guess; success
  on a ping with gotyourdata=1;
* after success: v2 lingers 5 s then calls back; v3 lingers 5 s, sends REPORT and
  calls back on REPORT_ACK or after 7 REPORTs 1 s apart; v4 sends REPORT and calls
  back at once (REPORT resent 6 times 500 ms apart until REPORT_ACK);
* REPORT: 73 bytes, porttype garbage (0x7f), natType/scheme as little-endian int32
  (an x86 PC).

Deliberate test-only differences, each a knob the real SDK lacks:
``bind_ip`` binds the negotiate socket to one loopback address so two clients on
one machine have different "public" IPs; server ports are explicit (the SDK always
uses 27901); ``partner_wait`` / ``finished_idle`` can be shortened (60 s / 5 s in the
SDK) to keep tests fast; ``split_mappings`` sends NN1/NN2/NN3 from three sockets,
which is what a symmetric NAT makes of one socket. The availability check the SDK
runs first (§6.1) belongs to the master server, not to natneg, and is not emulated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from crossroads.proto.natneg.packets import (
    CONNECT_SIZE,
    INIT_SIZE,
    MAGIC,
    NATIFY_COOKIE,
    UNION_SIZE,
    AddressCheck,
    ConnectAck,
    ConnectPing,
    Init,
    MappingScheme,
    NatifyRequest,
    NatType,
    NegotiateResult,
    PacketType,
    Report,
    bytes_to_ip,
)
from crossroads.types import Address


class State(IntEnum):
    """``NegotiateState`` (SDK12 numbering; v2/v3 use a subset in the same order)."""

    INITSENT = 2
    INITACK = 3
    CONNECTPING = 4
    FINISHED = 5
    CANCELED = 6
    REPORTSENT = 7
    REPORTACK = 8


@dataclass(frozen=True)
class Timers:
    """``nninternal.h`` constants per version (ref §6 table), in seconds."""

    init_retry_time: float
    init_retry_count: int
    partner_wait: float
    ping_retry_time: float
    ping_retry_count: int
    finished_idle: float
    report_retry_time: float
    report_retry_count: int

    @classmethod
    def for_version(
        cls,
        version: int,
        *,
        partner_wait: float | None = None,
        finished_idle: float | None = None,
    ) -> Timers:
        if version <= 2:  # V2PC
            base = cls(0.5, 30, 60.0, 0.7, 20, 5.0, 1.0, 0)
        elif version == 3:  # SDK07
            base = cls(0.5, 10, 60.0, 0.7, 7, 5.0, 1.0, 6)
        else:  # SDK12: REPORT 6 sends 500 ms apart
            base = cls(0.5, 10, 60.0, 0.7, 7, 0.0, 0.5, 5)
        if partner_wait is not None:
            base = dataclasses.replace(base, partner_wait=partner_wait)
        if finished_idle is not None and version <= 3:
            base = dataclasses.replace(base, finished_idle=finished_idle)
        return base


@dataclass
class Outcome:
    """What the completed callback received."""

    result: NegotiateResult
    sock: socket.socket | None
    remote: Address | None


SocketFactory = Callable[[], socket.socket]

#: What the SDK test program sends on the handed-back socket after success.
GAME_DATA = b"woohoo!!"


def _udp(bind: Address | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    if bind is not None:
        sock.bind(bind)
    return sock


@dataclass
class Log:
    """What happened on the wire, for assertions."""

    sent: list[tuple[PacketType, Address]] = field(default_factory=list)
    received: list[tuple[PacketType, Address, int]] = field(default_factory=list)
    pings_from: list[Address] = field(default_factory=list)
    too_small: int = 0


class SdkNegotiator:
    """One negotiation, as ``NNBeginNegotiation[WithSocket]`` runs it."""

    instances: list[SdkNegotiator] = []

    def __init__(
        self,
        *,
        version: int,
        cookie: int,
        client_index: int,
        servers: list[Address],
        game_sock: socket.socket | None = None,
        bind_ip: str | None = None,
        local_ip: str = "0.0.0.0",
        game_name: str = "gmtest",
        nat_type: int = NatType.UNKNOWN,
        mapping_scheme: int = MappingScheme.UNRECOGNIZED,
        split_mappings: bool = False,
        negotiate_sock: socket.socket | None = None,
        partner_wait: float | None = None,
        finished_idle: float | None = None,
    ) -> None:
        self.version = version
        self.cookie = cookie
        self.client_index = client_index
        self.servers = servers
        self.game_sock = game_sock
        self.local_ip = local_ip
        self.game_name = game_name
        self.nat_type = nat_type
        self.mapping_scheme = mapping_scheme
        self.timers = Timers.for_version(
            version, partner_wait=partner_wait, finished_idle=finished_idle
        )
        bind = (bind_ip, 0) if bind_ip is not None else None
        # Unbound until the first sendto, as the SDK's socket() (or one made by the
        # caller, e.g. inside a lab namespace).
        self.negotiate_sock = (
            negotiate_sock if negotiate_sock is not None else _udp(bind)
        )
        # A symmetric NAT gives one socket a new public port per destination; on
        # loopback, three sockets stand in for those three mappings.
        self.extra_socks = [_udp(bind), _udp(bind)] if split_mappings else []
        self.state = State.INITSENT
        self.init_acked = [False] * 4
        self.retry_count = 0
        self.max_retry_count = 0
        self.retry_time = 0.0
        self.guess: Address = ("0.0.0.0", 0)
        #: The address the first accepted CONNECT named.
        self.connect_guess: Address | None = None
        self.got_remote_data = False
        self.send_got_remote_data = False
        self.result = NegotiateResult.NO_RESULT
        self.outcome: Outcome | None = None
        self.progress: list[State] = []
        self.log = Log()
        self.reports_sent = 0
        self._connected: tuple[socket.socket | None, Address | None] = (None, None)
        SdkNegotiator.instances.append(self)

    # ------------------------------------------------------------ sending

    def _sendto(self, sock: socket.socket, data: bytes, addr: Address) -> None:
        try:
            sock.sendto(data, addr)
        except OSError:
            return
        self.log.sent.append((PacketType(data[7]), addr))

    def _port_types(self) -> list[int]:
        types = [1, 2] if self.version <= 2 else [1, 2, 3]
        return ([0] if self.game_sock is not None else []) + types

    def _nn_sock(self, port_type: int) -> socket.socket:
        if self.extra_socks and port_type >= 2:
            return self.extra_socks[port_type - 2]
        return self.negotiate_sock

    def send_inits(self, now: float) -> None:
        use_game = 1 if self.game_sock is not None else 0
        for port_type in self._port_types():
            if self.init_acked[port_type]:
                continue
            local_port = 0
            if port_type >= 2:
                # "this should be determined now...": after the first sendto.
                owner = (
                    self.game_sock
                    if self.game_sock is not None
                    else self.negotiate_sock
                )
                local_port = owner.getsockname()[1]
            packet = Init(
                self.version,
                self.cookie,
                port_type,
                self.client_index,
                use_game,
                self.local_ip,
                local_port,
                self.game_name,
            ).encode()
            server = self.servers[max(port_type, 1) - 1]
            sock = (
                self.game_sock
                if port_type == 0 and self.game_sock
                else self._nn_sock(port_type)
            )
            self._sendto(sock, packet, server)
        self.retry_time = now + self.timers.init_retry_time
        self.max_retry_count = self.timers.init_retry_count

    def send_ping(self, now: float) -> None:
        packet = ConnectPing(
            self.version,
            self.cookie,
            self.guess[0],
            self.guess[1],
            1 if self.got_remote_data else 0,
            0 if self.state == State.CONNECTPING else 1,
        ).encode()
        sock = self.game_sock if self.game_sock is not None else self.negotiate_sock
        self._sendto(sock, packet, self.guess)
        self.retry_time = now + self.timers.ping_retry_time
        self.max_retry_count = self.timers.ping_retry_count
        if self.got_remote_data:
            self.send_got_remote_data = True

    def send_report(self) -> None:
        report = Report.build(
            version=self.version,
            cookie=self.cookie,
            port_type=0x7F,  # never set by the SDK: stack garbage (ref §3.4)
            client_index=self.client_index,
            success=self.result == NegotiateResult.SUCCESS,
            nat_type=self.nat_type,
            mapping_scheme=self.mapping_scheme,
            game_name=self.game_name,
        ).encode()
        self._sendto(self.negotiate_sock, report, self.servers[0])
        self.reports_sent += 1

    def send_connect_ack(self, to: Address, via: socket.socket) -> None:
        wire = bytearray(
            ConnectAck(self.version, self.cookie, 0, self.client_index).encode()
        )
        # Uninitialised stack in the SDK's NatNegPacket (ref §3.2).
        wire[12] = 0xFC
        wire[14:21] = b"\x00\x00\xb0\x4b\x69\xe0\xfc"
        self._sendto(via, bytes(wire), to)

    # ------------------------------------------------------------ receiving

    def process_data(
        self, data: bytes, addr: Address, via: socket.socket, now: float
    ) -> None:
        """``NNProcessData``: magic, size by type, cookie, then dispatch."""
        if data[:6] != MAGIC or len(data) < 8:
            return
        ptype = data[7]
        if ptype in (PacketType.CONNECT, PacketType.CONNECT_PING):
            if len(data) < CONNECT_SIZE:
                self.log.too_small += 1
                return
        elif len(data) < INIT_SIZE:
            self.log.too_small += 1
            return
        if int.from_bytes(data[8:12], "big") != self.cookie:
            return
        try:
            kind = PacketType(ptype)
        except ValueError:
            return
        self.log.received.append((kind, addr, len(data)))
        if kind == PacketType.CONNECT:
            self._on_connect(data, addr, via, now)
        elif kind == PacketType.CONNECT_PING:
            self._on_ping(data, addr, now)
        elif kind == PacketType.INIT_ACK:
            port_type = data[12]
            if port_type > (2 if self.version <= 2 else 3):
                return
            self.init_acked[port_type] = True
            if self.state == State.INITSENT and all(
                self.init_acked[pt] for pt in self._port_types()
            ):
                self.state = State.INITACK
                self.retry_time = now + self.timers.partner_wait
                self.progress.append(self.state)
        elif kind == PacketType.ERT_TEST:
            ack = data[:7] + bytes((PacketType.ERT_ACK,)) + data[8:INIT_SIZE]
            self._sendto(self.negotiate_sock, ack, addr)
        elif kind == PacketType.REPORT_ACK and self.version >= 3:
            if self.state == State.REPORTSENT:
                self.state = State.REPORTACK
                self._complete()

    def _on_connect(
        self, data: bytes, addr: Address, via: socket.socket, now: float
    ) -> None:
        finished = data[19]
        if finished == 0:
            # ACKed from the negotiate socket (whichever mapping received it).
            nn_sock = via if via is not self.game_sock else self.negotiate_sock
            self.send_connect_ack(addr, nn_sock)
        if self.state >= State.CONNECTPING:
            return
        if finished != 0:
            codes = {
                1: NegotiateResult.DEADBEAT_PARTNER,
                2: NegotiateResult.INIT_TIMEOUT,
            }
            self._start_report(codes.get(finished, NegotiateResult.UNKNOWN_ERROR), now)
            return
        self.guess = (bytes_to_ip(data, 12), int.from_bytes(data[16:18], "big"))
        self.connect_guess = self.guess
        self.retry_count = 0
        self.state = State.CONNECTPING
        self.progress.append(self.state)
        self.send_ping(now)

    def _on_ping(self, data: bytes, addr: Address, now: float) -> None:
        if self.state < State.CONNECTPING:
            return
        self.log.pings_from.append(addr)
        self.guess = addr
        self.got_remote_data = True
        if not data[18]:
            self.send_ping(now)
        elif self.state == State.CONNECTPING:
            if not self.send_got_remote_data:
                self.send_ping(now)
            self._connected = (self._connected_socket(), self.guess)
            if self.version >= 4:
                self._start_report(NegotiateResult.SUCCESS, now)
            else:
                self.state = State.FINISHED
                self.retry_time = now + self.timers.finished_idle
        elif not data[19]:
            self.send_ping(now)

    def _connected_socket(self) -> socket.socket:
        return self.game_sock if self.game_sock is not None else self.negotiate_sock

    # ------------------------------------------------------------ results

    def _start_report(self, result: NegotiateResult, now: float) -> None:
        self.result = result
        if result in (NegotiateResult.INIT_TIMEOUT, NegotiateResult.DEADBEAT_PARTNER):
            self.state = State.FINISHED
            self._complete()
            return
        if self.version <= 2:
            # v2 has no REPORT (ref §1).
            self._complete()
            return
        self.send_report()
        self.state = State.REPORTSENT
        self.retry_time = now + self.timers.report_retry_time
        self.retry_count = 0
        self.max_retry_count = self.timers.report_retry_count
        if self.version >= 4:
            # SDK12 calls back at once and keeps resending the REPORT (ref §6).
            self._complete()

    def _complete(self) -> None:
        if self.outcome is not None:
            return
        sock, remote = self._connected
        if self.result != NegotiateResult.SUCCESS:
            sock, remote = None, None
        self.outcome = Outcome(self.result, sock, remote)

    # ------------------------------------------------------------ NNThink

    def think(self, now: float) -> None:
        """One ``NNThink`` pass: read sockets, run timers."""
        socks = [self.negotiate_sock, *self.extra_socks]
        if self.game_sock is not None and self.state < State.REPORTACK:
            # The game feeds NN-magic packets from its socket to NNProcessData.
            socks.append(self.game_sock)
        for sock in socks:
            while True:
                try:
                    data, addr = sock.recvfrom(512)
                except OSError:
                    # EAGAIN, or an ICMP error from an earlier send: the SDK's
                    # loop stops reading this socket for this pass too.
                    break
                self.process_data(data, addr, sock, now)
        state = self.state
        if state in (State.INITSENT, State.CONNECTPING) and now > self.retry_time:
            if self.retry_count > self.max_retry_count:
                failure = (
                    NegotiateResult.INIT_TIMEOUT
                    if state == State.INITSENT
                    else NegotiateResult.PING_TIMEOUT
                )
                self._start_report(failure, now)
            else:
                self.retry_count += 1
                if state == State.INITSENT:
                    self.send_inits(now)
                else:
                    self.send_ping(now)
        if (
            self.state == State.FINISHED
            and self.outcome is None
            and now > self.retry_time
        ):
            self._start_report(NegotiateResult.SUCCESS, now)
        if self.state == State.INITACK and now > self.retry_time:
            self._start_report(NegotiateResult.DEADBEAT_PARTNER, now)
        if self.state == State.REPORTSENT and now > self.retry_time:
            if self.retry_count > self.max_retry_count:
                self.state = State.CANCELED
                self._complete()
            else:
                self.send_report()
                self.retry_count += 1
                self.retry_time = now + self.timers.report_retry_time

    @property
    def done(self) -> bool:
        """The negotiator has nothing left to do (called back and not reporting)."""
        return self.outcome is not None and self.state != State.REPORTSENT

    async def run(self, deadline: float = 60.0) -> Outcome:
        """Begin, then ``NNThink`` every 10 ms until done (or ``deadline`` seconds)."""
        start = time.monotonic()
        self.send_inits(start)
        while not self.done:
            now = time.monotonic()
            if now - start > deadline:
                raise TimeoutError(f"negotiation {self.cookie} still {self.state.name}")
            self.think(now)
            await asyncio.sleep(0.01)
        assert self.outcome is not None
        return self.outcome

    def close(self) -> None:
        """End the negotiation; the socket handed to the game on success stays open
        (the SDK does not close it) until :meth:`close_all`."""
        handed = self.outcome.sock if self.outcome is not None else None
        for sock in (self.negotiate_sock, *self.extra_socks):
            if sock is not handed:
                sock.close()

    def release(self) -> None:
        """Close every socket of this negotiator, the handed-over one included."""
        for sock in (self.negotiate_sock, *self.extra_socks):
            sock.close()
        if self in SdkNegotiator.instances:
            SdkNegotiator.instances.remove(self)

    @classmethod
    def close_all(cls) -> None:
        """Close every socket of every negotiator (test teardown)."""
        for negotiator in cls.instances:
            for sock in (negotiator.negotiate_sock, *negotiator.extra_socks):
                sock.close()
        cls.instances.clear()


# ---------------------------------------------------------------- NAT detection


@dataclass
class Mapping:
    private: Address
    public: Address


@dataclass
class NatDetection:
    """``NNStartNatDetection`` result (``DetermineNatType`` in NATify.c, ref §5)."""

    success: bool
    nat_type: NatType
    mapping_scheme: MappingScheme
    ip_restricted: bool
    port_restricted: bool
    erts: set[int]
    mappings: dict[int, Mapping]


async def detect_nat(
    servers: list[Address],
    *,
    version: int = 4,
    local_ip: str = "0.0.0.0",
    timeout: float = 10.0,
    make_socket: SocketFactory = _udp,
) -> NatDetection:
    """Run the SDK's NAT detection: two fresh sockets, each packet sent once,
    results collected for NATIFY_TIMEOUT (10 s) or until all 7 replies arrive."""
    ert_sock, map_sock = make_socket(), make_socket()
    try:
        for port_type, server in ((1, servers[0]), (2, servers[0]), (3, servers[1])):
            request = NatifyRequest(
                version, NATIFY_COOKIE, port_type, extra=bytes(UNION_SIZE - INIT_SIZE)
            )
            ert_sock.sendto(request.encode(), server)
        # The client sends the ADDRESS_CHECKs for ids 0, 3, 1, 2 (ref §3.5).
        checks = (
            (0, 1, servers[0]),
            (3, 1, servers[0]),
            (1, 2, servers[1]),
            (2, 3, servers[2]),
        )
        for mapping_id, port_type, server in checks:
            check = AddressCheck(
                version, mapping_id, port_type, extra=bytes(UNION_SIZE - INIT_SIZE)
            )
            map_sock.sendto(check.encode(), server)
        erts: set[int] = set()
        mappings: dict[int, Mapping] = {}
        start = time.monotonic()
        while time.monotonic() - start < timeout and (
            len(erts) < 3 or len(mappings) < 4
        ):
            for sock in (ert_sock, map_sock):
                while True:
                    try:
                        data, _ = sock.recvfrom(512)
                    except OSError:
                        break
                    # NATify's Think drops bad magic and anything under 21 bytes.
                    if data[:6] != MAGIC or len(data) < INIT_SIZE:
                        continue
                    if data[7] == PacketType.ERT_TEST and data[12] in (1, 2, 3):
                        erts.add(data[12])
                    elif data[7] == PacketType.ADDRESS_REPLY:
                        mapping_id = int.from_bytes(data[8:12], "big")
                        if mapping_id > 3:
                            continue  # would be an out-of-bounds write in the SDK
                        private = (local_ip, sock.getsockname()[1])
                        public = (
                            bytes_to_ip(data, 15),
                            int.from_bytes(data[19:21], "big"),
                        )
                        mappings[mapping_id] = Mapping(private, public)
            await asyncio.sleep(0.01)
    finally:
        ert_sock.close()
        map_sock.close()
    return determine_nat_type(erts, mappings)


def determine_nat_type(erts: set[int], mappings: dict[int, Mapping]) -> NatDetection:
    """``DetermineNatType`` (NATify.c), re-stated."""
    ip_restricted = 2 not in erts
    port_restricted = 3 not in erts
    result = NatDetection(
        False,
        NatType.UNKNOWN,
        MappingScheme.UNRECOGNIZED,
        ip_restricted,
        port_restricted,
        erts,
        mappings,
    )
    if any(
        mappings.get(i) is None or mappings[i].public[0] == "0.0.0.0" for i in (0, 1, 2)
    ):
        return result
    m1a, m2, m3 = mappings[0], mappings[1], mappings[2]
    spread = abs(m3.public[1] - m2.public[1]) >= 1
    if not port_restricted and not ip_restricted and m1a.public[0] == m1a.private[0]:
        nat_type = NatType.NO_NAT
    elif m1a.public[0] == m1a.private[0]:
        nat_type = NatType.FIREWALL_ONLY
    elif spread:
        nat_type = NatType.SYMMETRIC
    elif port_restricted:
        nat_type = NatType.PORT_RESTRICTED_CONE
    elif ip_restricted:
        nat_type = NatType.RESTRICTED_CONE
    else:
        nat_type = NatType.FULL_CONE
    if all(m.public[1] == m.private[1] for m in (m1a, m2, m3)):
        scheme = MappingScheme.PRIVATE_AS_PUBLIC
    elif m1a.public[1] == m2.public[1] == m3.public[1]:
        scheme = MappingScheme.CONSISTENT_PORT
    elif m1a.public[1] == m1a.private[1] and m3.public[1] - m2.public[1] == 1:
        scheme = MappingScheme.MIXED
    elif m3.public[1] - m2.public[1] == 1:
        scheme = MappingScheme.INCREMENTAL
    else:
        scheme = MappingScheme.UNRECOGNIZED
    result.success = True
    result.nat_type = nat_type
    result.mapping_scheme = scheme
    return result


async def read_game_data(
    sock: socket.socket, timeout: float = 5.0
) -> tuple[bytes, Address]:
    """What the game does after success: read its socket, skipping NN packets
    (a game hands those to ``NNProcessData``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        remaining = end - loop.time()
        if remaining <= 0:
            raise TimeoutError("no game data")
        data, addr = await asyncio.wait_for(loop.sock_recvfrom(sock, 2048), remaining)
        if data[:6] != MAGIC:
            return data, addr
