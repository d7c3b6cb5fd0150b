"""An in-memory harness for the sans-I/O TURN core: fake clock, fake relay binder."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from crossroads.proto.policy import AddressPolicy
from crossroads.proto.stun import (
    Attribute,
    Class,
    Message,
    Method,
    RequestedTransport,
    decode,
    encode,
)
from crossroads.proto.turn.allocation import Allocation, FiveTuple
from crossroads.proto.turn.auth import Credentials, NonceMinter
from crossroads.proto.turn.constants import Family, Transport
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.ports import PortAllocator
from crossroads.proto.turn.server import TurnServer, TurnSettings, error_code_of
from crossroads.types import Address

#: Unix time at ``now == 0`` in these tests.
EPOCH = 1_700_000_000.0
SERVER: Address = ("192.0.2.1", 3478)


class SeededEntropy:
    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)

    def randbelow(self, exclusive_upper_bound: int) -> int:
        return self.rng.randrange(exclusive_upper_bound)

    def token_bytes(self, nbytes: int) -> bytes:
        return self.rng.randbytes(nbytes)


@dataclass
class FakeRelay:
    address: Address
    family: Family
    allocation: Allocation
    peer_channels: dict[Address, int] = field(default_factory=dict)
    closed: bool = False
    sent: list[tuple[bytes, Address]] = field(default_factory=list)
    bps: float = 0.0

    #: What the core routes client -> peer: channel number -> peer.
    channel_routes: dict[int, Address] = field(default_factory=dict)
    #: IPs whose permission lapsed (their learned data-plane routes go).
    lapsed: list[str] = field(default_factory=list)

    def allow(self, size: int) -> bool:
        return True

    def sendto(self, data: bytes, addr: Address) -> None:
        self.sent.append((data, addr))

    def route_channel(self, number: int, peer: Address) -> None:
        self.channel_routes[number] = peer

    def unroute_channel(self, number: int) -> None:
        self.channel_routes.pop(number, None)

    def route_peer(self, peer: Address, number: int) -> None:
        self.peer_channels[peer] = number

    def unroute_peer(self, peer: Address) -> None:
        self.peer_channels.pop(peer, None)

    def unroute_permission(self, ip: str) -> None:
        self.lapsed.append(ip)

    def unroute_all(self) -> None:
        self.peer_channels.clear()
        self.channel_routes.clear()

    def close(self) -> None:
        self.closed = True


class FakeBinder:
    """Binds nothing: hands out relay ports on documentation addresses."""

    def __init__(
        self, families: tuple[Family, ...] = (Family.IPV4, Family.IPV6)
    ) -> None:
        self.families = families
        self.busy: set[int] = set()
        self.relays: list[FakeRelay] = []

    def has_relay_address(self, family: Family) -> bool:
        return family in self.families

    def open_relay(
        self,
        allocation: Allocation,
        family: Family,
        port: int,
        transport: Transport,
        dont_fragment: bool,
    ) -> FakeRelay | None:
        if port in self.busy:
            return None
        host = "203.0.113.5" if family == Family.IPV4 else "2001:db8::5"
        relay = FakeRelay((host, port), family, allocation)
        self.relays.append(relay)
        return relay

    @property
    def open_count(self) -> int:
        return sum(1 for r in self.relays if not r.closed)


class Harness:
    """A TurnServer plus helpers to talk to it like a client."""

    def __init__(self, **settings: Any) -> None:
        self.binder = FakeBinder(settings.pop("families", (Family.IPV4, Family.IPV6)))
        credentials = Credentials(
            settings.pop("realm", "example.org"),
            settings.pop("users", {"alice": "secret", "bob": "hunter2"}),
            settings.pop("secrets", ("s3cr3t",)),
        )
        policy = settings.pop("policy", AddressPolicy())
        self.server = TurnServer(
            TurnSettings(realm=credentials.realm, **settings),
            credentials,
            NonceMinter(b"n" * 32),
            policy,
            PortAllocator(49152, 49251, SeededEntropy()),
            self.binder,
        )
        self.server.wall_offset = EPOCH
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        deadline = self.server.get_timer()
        while deadline is not None and deadline <= self.now:
            self.server.handle_timer(self.now)
            deadline = self.server.get_timer()

    def send(self, data: bytes, five: FiveTuple) -> bytes | None:
        """One datagram through the core API: its answer to ``five``'s client
        (None: none), which must be all the core has to send."""
        self.server.receive_datagram(data, five[1], self.now, (five[0], five[2]))
        out = self.server.datagrams_to_send(self.now)
        if not out:
            return None
        ((answer, client, listener),) = out
        assert (client, listener) == (five[1], (five[0], five[2]))
        return answer

    def raw(self, data: bytes, five: FiveTuple) -> Message | None:
        answer = self.send(data, five)
        return None if answer is None else decode(answer)

    def sent(self) -> list[tuple[bytes, FiveTuple]]:
        """What the core queued for clients outside an answer (late responses,
        indications), with the 5-tuple of each."""
        return [
            (data, (listener[0], client, listener[1]))
            for data, client, listener in self.server.datagrams_to_send(self.now)
        ]

    def request(
        self,
        method: int,
        attributes: list[Attribute],
        five: FiveTuple,
        session: LongTermSession | None = None,
        txid: bytes | None = None,
        retry_stale: bool = True,
    ) -> Message | None:
        """Send a request; with a session, do the 401 dance first if needed
        (and, unless told otherwise, retry once after a 438)."""
        message = Message(
            Class.REQUEST, method, txid or os.urandom(12), tuple(attributes)
        )
        if session is None:
            return self.raw(encode(message, fingerprint=True), five)
        if not session.ready:
            challenge = self.raw(encode(message, fingerprint=True), five)
            assert challenge is not None
            session.learn(challenge)
        answer = self.raw(session.sign(message), five)
        if retry_stale and answer is not None and error_code_of(answer) == 438:
            session.learn(answer)
            answer = self.raw(session.sign(message), five)
        return answer

    def allocate(
        self,
        five: FiveTuple,
        session: LongTermSession,
        extra: list[Attribute] | None = None,
        transport: int = 17,
    ) -> Message:
        answer = self.request(
            Method.ALLOCATE,
            [RequestedTransport(transport), *(extra or [])],
            five,
            session,
        )
        assert answer is not None
        return answer


def udp(client_port: int = 40000, host: str = "198.51.100.7") -> FiveTuple:
    return (Transport.UDP, (host, client_port), SERVER)


def tcp(client_port: int = 40000, host: str = "198.51.100.7") -> FiveTuple:
    return (Transport.TCP, (host, client_port), SERVER)


@pytest.fixture
def harness() -> Harness:
    return Harness()
