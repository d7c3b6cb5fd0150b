"""Unity Relay over DTLS 1.2 (PSK): the relay node's second UDP port.

What Unity Transport does (reference unity-secure-transports.md §1): DTLS 1.2
with a pre-shared key, PSK = the allocation's 64-byte ``key``, PSK identity =
the 16 raw ``allocationIdBytes`` (Unity's docs say the UUID text: both are
accepted here); after the handshake every relay message is one DTLS record in
one datagram. So the DTLS listener decrypts each record and hands it to the
same relay core as the plain UDP port
(:meth:`crossroads.transport.relay.RelayEndpoint.receive`); what the core sends
to a DTLS client's address goes back through its session, encrypted.

A DTLS session that ends (idle, alert) ends the allocations bound at its
address: nothing is ever relayed to a DTLS client in clear.

Handshakes and sessions are admitted by two tables of the process's resource
budget, ``dtls-handshakes:relay`` and ``dtls-sessions:relay`` (per-source caps
an eighth of the totals at most, memory per item measured). A session whose
client does not BIND within :data:`FIRST_MESSAGE_TIMEOUT` seconds of the
handshake ends (the PSK proves the client was given a key; only a bound
allocation needs the session kept).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from crossroads.metrics import counter_by
from crossroads.proto.admission import Admitter
from crossroads.proto.dtls.crypto import SUITES
from crossroads.proto.dtls.handshake import (
    ApplicationData,
    Closed,
    Event,
    HandshakeFailed,
    HelloReceived,
)
from crossroads.proto.dtls.server import PskDtlsServer, PskDtlsServerConfig
from crossroads.proto.relay.server import RelayServer
from crossroads.ratelog import RateLimitedLog
from crossroads.transport.admission import Pool, ResourceBudget
from crossroads.transport.dtls_endpoint import PskDtlsEndpoint
from crossroads.transport.relay import RelayEndpoint
from crossroads.types import Address

log = logging.getLogger("crossroads.relay")

#: Reference §1.3: the raw allocationIdBytes, or the 36-character UUID text.
RAW_ID_SIZE: Final = 16
UUID_TEXT_SIZE: Final = 36
#: Distinct ClientHello offers logged at INFO (then DEBUG): enough to see every
#: client family once, bounded against a flood of made-up offers.
MAX_OFFERS_LOGGED: Final = 32
#: Seconds a session has, after its handshake, to BIND: Unity Transport
#: sends its BIND right after the handshake and repeats it every second
#: until BIND_RECEIVED (reference unity-relay-protocol.md); 10 s is the
#: pre-auth deadline of every other handshake-then-request listener.
FIRST_MESSAGE_TIMEOUT: Final = 10.0
#: Memory of one established session of the pure-Python core (keys, record
#: protection, replay window, the final flight kept for resends), with a
#: margin: 6.4 KB of RSS growth per session measured over 4,000 in-memory
#: handshakes (AES-128-GCM, extended master secret).
SESSION_BYTES: Final = 10 * 1024
#: Memory of one handshake in progress (transcript, flight, reassembler,
#: candidate keys): a few KB by tracemalloc; counted like a session.
HANDSHAKE_BYTES: Final = 10 * 1024
TABLE_HANDSHAKES: Final = "dtls-handshakes:relay"
TABLE_SESSIONS: Final = "dtls-sessions:relay"


def allocation_id_of(identity: bytes) -> bytes | None:
    """The 16-byte allocation ID a PSK identity names, or None."""
    if len(identity) == RAW_ID_SIZE:
        return identity
    if len(identity) == UUID_TEXT_SIZE:
        try:
            parsed = uuid.UUID(identity.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        # uuid.UUID accepts other spellings of 36 characters (braces, urn:):
        # only the canonical text (any case) names an allocation.
        if str(parsed) != identity.decode("ascii").lower():
            return None
        return parsed.bytes
    return None


def psk_lookup(core: RelayServer) -> Callable[[bytes], tuple[bytes, ...]]:
    """The PSKs an identity may use: the allocation's key under the node's
    current secret and the previous ones (the sealer is read at each handshake,
    so an adopted secret is picked up, and allocations handed out before it
    still connect, as their BINDs do)."""

    def psk_for(identity: bytes) -> tuple[bytes, ...]:
        allocation_id = allocation_id_of(identity)
        if allocation_id is None:
            return ()
        return core.sealer.keys_for(allocation_id)

    return psk_for


class RelayDtls:
    """The DTLS side of a relay node: endpoint, event handling, metrics."""

    def __init__(
        self,
        relay: RelayEndpoint,
        sock: socket.socket,
        budget: ResourceBudget | None = None,
    ) -> None:
        self.relay = relay
        config = PskDtlsServerConfig(first_message_timeout=FIRST_MESSAGE_TIMEOUT)
        self.budget = budget
        handshakes: Admitter | None = None
        sessions: Admitter | None = None
        if budget is not None:
            handshakes = budget.table(
                TABLE_HANDSHAKES,
                max_items=config.max_handshakes,
                max_per_source=config.max_handshakes_per_ip,
                pool=Pool.NONE,
                bytes_per_item=HANDSHAKE_BYTES,
                preauth_deadline=config.handshake_timeout,
            )
            sessions = budget.table(
                TABLE_SESSIONS,
                max_items=config.max_sessions,
                max_per_source=config.max_sessions_per_ip,
                pool=Pool.NONE,
                bytes_per_item=SESSION_BYTES,
                preauth_deadline=FIRST_MESSAGE_TIMEOUT,
            )
        core = PskDtlsServer(
            config,
            psk_lookup(relay.core),
            os.urandom,
            handshake_table=handshakes,
            session_table=sessions,
        )
        self.endpoint = PskDtlsEndpoint(core, sock, self._on_events)
        self.auth_log = RateLimitedLog(log)
        self._offers_logged: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    def start(self) -> None:
        self.relay.attach_secure(self.endpoint)
        self.endpoint.start()

    def close(self) -> None:
        self.endpoint.close()
        if self.budget is not None:
            self.budget.forget(TABLE_HANDSHAKES)
            self.budget.forget(TABLE_SESSIONS)

    def bound(self, address: Address) -> None:
        """The relay bound an allocation at ``address``: if that is a DTLS
        session, it is no longer pre-auth state."""
        self.endpoint.core.confirm(address)

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            match event:
                case ApplicationData(address=address, data=data):
                    self.relay.receive(data, address)
                case HelloReceived():
                    self._log_offer(event)
                case HandshakeFailed(address=address, reason=reason):
                    self.auth_log.log(
                        reason,
                        "relay DTLS handshake failed (%s) from %s",
                        reason,
                        address[0],
                    )
                case Closed(address=address, reason=reason) if reason != "replaced":
                    # Its allocations cannot be reached in clear: end them,
                    # without an ERROR to a client whose session is gone (it
                    # could only be dropped, counted as send-no-session).
                    for allocation in list(self.relay.core.allocations.values()):
                        if allocation.address == address:
                            self.relay.kick(allocation.allocation_id, notify=False)
                case _:
                    pass

    def _log_offer(self, event: HelloReceived) -> None:
        offer = (event.cipher_suites, event.extensions)
        first = offer not in self._offers_logged
        if first and len(self._offers_logged) < MAX_OFFERS_LOGGED:
            self._offers_logged.add(offer)
        level = logging.INFO if first else logging.DEBUG
        log.log(
            level,
            "relay DTLS client %s offers suites [%s], extensions [%s]; chosen %s",
            event.address[0],
            ", ".join(
                SUITES[s].name if s in SUITES else f"0x{s:04X}"
                for s in event.cipher_suites
            ),
            ", ".join(f"0x{e:04X}" for e in event.extensions),
            SUITES[event.chosen].name if event.chosen is not None else "none",
        )

    def metrics(self) -> Iterable[Metric]:
        core = self.endpoint.core
        dropped = counter_by(
            "crossroads_relay_dtls_dropped_records",
            "DTLS datagrams or records the relay dropped, by reason.",
            "reason",
            core.drops,
        )
        dropped.add_metric(["plaintext-from-dtls-client"], self.relay.plaintext_refused)
        yield dropped
        yield counter_by(
            "crossroads_relay_dtls_handshake_failures",
            "DTLS handshakes that failed, by reason.",
            "reason",
            core.failures,
        )
        yield CounterMetricFamily(
            "crossroads_relay_dtls_hello_verify_requests",
            "HelloVerifyRequests sent (stateless cookie challenges).",
            value=core.hello_verify_sent,
        )
        yield CounterMetricFamily(
            "crossroads_relay_dtls_handshakes_completed",
            "DTLS handshakes completed.",
            value=core.established_total,
        )
        yield GaugeMetricFamily(
            "crossroads_relay_dtls_handshakes",
            "DTLS handshakes in progress.",
            value=len(core.handshakes),
        )
        yield GaugeMetricFamily(
            "crossroads_relay_dtls_sessions",
            "Established DTLS sessions.",
            value=len(core.sessions),
        )
