"""A Unity Relay client core (sans-I/O): what a host or joining player runs.

Theory of operation
-------------------
The client behaves like Unity Transport's relay layer (reference §1.1–1.2):

- **Binding.** :meth:`RelayClient.start` sends BIND and repeats it every
  ``connect_retry`` (1 s, UTP ``connectTimeoutMS``) with the nonce bumped each
  time, until BIND_RECEIVED. After ``max_connect_time`` (60 s, UTP 60 attempts) it
  gives up and the allocation is *invalid*.
- **Connecting (joiners).** Once bound, :meth:`RelayClient.connect` sends
  CONNECT_REQUEST with the host's connection data every ``connect_retry`` until
  ACCEPTED (which names the host's allocation ID) or REJECTED (host full).
- **Keep-alive.** When nothing was sent for ``heartbeat`` (3 s, UTP
  ``relayConnectionTimeMS``) a PING goes out. When nothing was received for three
  heartbeats the client re-BINDs (UTP does the same), which also recovers a
  binding the relay lost to a NAT rebinding.
- **Errors.** ERROR 3 (the relay sees us at another IP:port) bumps the nonce and
  re-BINDs at once. ERROR 1 (timed out) and 4 (allocation not found) make the
  allocation invalid. Others are reported.
- **Data.** :meth:`RelayClient.send` frames a RELAY; received RELAY frames come out
  as :class:`Data` events. A host learns of a joiner from its first frame
  (:class:`PeerJoined`), as UTP does; DISCONNECT gives :class:`PeerLeft`.

Datagrams from anywhere but the relay server are ignored.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.relay import messages as m
from crossroads.proto.relay.token import bind_hmac
from crossroads.types import Address, frozen

_HEARTBEATS_BEFORE_REBIND: Final = 3  # UTP RelayLayer: re-BIND after 3 x heartbeat


class ClientState(IntEnum):
    BINDING = 0
    BOUND = 1
    CONNECTING = 2
    CONNECTED = 3
    INVALID = 4
    CLOSED = 5


@frozen
class RelayClientConfig:
    """Client timers (reference §1.2, UTP defaults)."""

    #: Retry interval for BIND and CONNECT_REQUEST (UTP ``connectTimeoutMS``).
    connect_retry: float = 1.0
    #: Give up binding/connecting after this long (UTP 60 attempts x 1 s).
    max_connect_time: float = 60.0
    #: PING when nothing was sent for this long (UTP ``relayConnectionTimeMS``).
    heartbeat: float = 3.0


@frozen
class Bound:
    """BIND_RECEIVED arrived (``rebind``: it was not the first)."""

    rebind: bool


@frozen
class Connected:
    """ACCEPTED: the joiner is connected to the host ``host_allocation_id``."""

    host_allocation_id: bytes


@frozen
class Rejected:
    """REJECTED: the host already has its maximum number of connections."""


@frozen
class Data:
    from_allocation_id: bytes
    payload: bytes


@frozen
class PeerJoined:
    """A host got the first frame from a new joiner."""

    allocation_id: bytes


@frozen
class PeerLeft:
    allocation_id: bytes


@frozen
class RelayError:
    """An ERROR from the relay (already acted upon, reported for the record)."""

    code: int


@frozen
class Invalid:
    """The allocation is unusable: ``timed-out``, ``not-found`` or ``no-answer``."""

    reason: str


ClientEvent = (
    Bound | Connected | Rejected | Data | PeerJoined | PeerLeft | RelayError | Invalid
)


class RelayClient(Outbox[Datagram], EventQueue[ClientEvent]):
    """One allocation's connection to a relay server.

    Args:
        allocation_id: the 16-byte ``allocationIdBytes``.
        key: the 64-byte HMAC ``key``.
        connection_data: this allocation's ``connectionData``.
        server: the relay's UDP address.
        host_connection_data: a joiner's ``hostConnectionData`` (None for a host).
        nonce: the first BIND nonce (0 for a fresh allocation).
    """

    def __init__(
        self,
        allocation_id: bytes,
        key: bytes,
        connection_data: bytes,
        server: Address,
        *,
        host_connection_data: bytes | None = None,
        config: RelayClientConfig | None = None,
        nonce: int = 0,
    ) -> None:
        super().__init__()
        if len(allocation_id) != m.ALLOCATION_ID_SIZE or len(key) != m.KEY_SIZE:
            raise LocalProtocolError("allocation ID is 16 bytes and key 64 bytes")
        self.allocation_id = allocation_id
        self.server = server
        self.config = config or RelayClientConfig()
        self.state = ClientState.BINDING
        self.nonce = nonce
        #: Host: joiners heard from. Joiner: the host once connected.
        self.peers: set[bytes] = set()
        self.host_allocation_id: bytes | None = None
        self._key = key
        self._connection_data = m.pad_connection_data(connection_data)
        self._host_connection_data = (
            m.pad_connection_data(host_connection_data)
            if host_connection_data is not None
            else None
        )
        self._want_connect = False
        self._bound_once = False
        self._started_at: float | None = None
        self._connect_started: float | None = None
        self._next_retry: float | None = None
        self._last_sent = 0.0
        self._last_received = 0.0

    # ------------------------------------------------------------- commands

    def start(self, now: float) -> None:
        """Begin binding."""
        self._started_at = now
        self._last_received = now
        self._send_bind(now)

    def connect(self, now: float) -> None:
        """Joiner: connect to the host once bound (CONNECT_REQUEST until ACCEPTED)."""
        if self._host_connection_data is None:
            raise LocalProtocolError(
                "only a joiner (with host connection data) connects"
            )
        self._want_connect = True
        if self.state is ClientState.BOUND:
            self._begin_connect(now)

    def send(self, to_allocation_id: bytes, payload: bytes, now: float) -> None:
        """Relay ``payload`` to another allocation of the session."""
        if len(payload) > m.MAX_PAYLOAD:
            raise LocalProtocolError(f"payload is larger than {m.MAX_PAYLOAD} bytes")
        self._emit(m.relay_frame(self.allocation_id, to_allocation_id, payload), now)

    def ping(self, now: float) -> None:
        self._emit(m.Ping(self.allocation_id).encode(), now)

    def disconnect(self, peer: bytes, now: float) -> None:
        """End the link with ``peer`` (the relay tells it)."""
        self.peers.discard(peer)
        self._emit(m.Disconnect(self.allocation_id, peer).encode(), now)
        if peer == self.host_allocation_id:
            self.state = ClientState.BOUND
            self.host_allocation_id = None

    def close(self, now: float) -> None:
        """CLOSE: end the allocation on the relay."""
        if self.state not in (ClientState.CLOSED, ClientState.INVALID):
            self._emit(m.Close(self.allocation_id).encode(), now)
        self.state = ClientState.CLOSED
        self._next_retry = None

    def rebind(self, now: float) -> None:
        """Re-BIND now with the next nonce (e.g. after changing local address)."""
        if self.state not in (ClientState.CLOSED, ClientState.INVALID):
            self._send_bind(now)

    # ------------------------------------------------------------- sans-I/O

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        if addr != self.server or self.state in (
            ClientState.CLOSED,
            ClientState.INVALID,
        ):
            return
        if len(data) >= m.RELAY_HEADER_SIZE and data[:4] == b"\xda\x72\x00\x0a":
            # RELAY, the common case, without building a message object.
            self._last_received = now
            if data[20:36] != self.allocation_id:
                return
            if len(data) != m.RELAY_HEADER_SIZE + int.from_bytes(data[36:38], "big"):
                return
            sender = bytes(data[4:20])
            if sender not in self.peers and self.host_allocation_id is None:
                self.peers.add(sender)
                self._events.append(PeerJoined(sender))
            self._events.append(Data(sender, bytes(data[38:])))
            return
        try:
            message = m.decode(data)
        except DecodeError:
            return
        self._last_received = now
        match message:
            case m.BindReceived():
                self._on_bind_received(now)
            case m.Accepted(from_allocation_id=host, to_allocation_id=me):
                if me == self.allocation_id and self.state is ClientState.CONNECTING:
                    self.state = ClientState.CONNECTED
                    self.host_allocation_id = host
                    self.peers = {host}
                    self._next_retry = None
                    self._events.append(Connected(host))
            case m.Rejected():
                if self.state is ClientState.CONNECTING:
                    self.state = ClientState.BOUND
                    self._want_connect = False
                    self._next_retry = None
                    self._events.append(Rejected())
            case m.Disconnect(from_allocation_id=peer, to_allocation_id=me):
                if me == self.allocation_id and peer in self.peers:
                    self.peers.discard(peer)
                    if peer == self.host_allocation_id:
                        self.host_allocation_id = None
                        self.state = ClientState.BOUND
                    self._events.append(PeerLeft(peer))
            case m.Error(code=code):
                self._on_error(code, now)
            case _:
                pass  # PING echoes: receiving them is the point.

    def get_timer(self) -> float | None:
        if (
            self.state in (ClientState.CLOSED, ClientState.INVALID)
            or self._started_at is None
        ):
            return None
        heartbeat = self.config.heartbeat
        deadlines = [
            self._last_sent + heartbeat,
            self._last_received + heartbeat * _HEARTBEATS_BEFORE_REBIND,
        ]
        if self._next_retry is not None:
            deadlines.append(self._next_retry)
        return min(deadlines)

    def handle_timer(self, now: float) -> None:
        if (
            self.state in (ClientState.CLOSED, ClientState.INVALID)
            or self._started_at is None
        ):
            return
        cfg = self.config
        if self._next_retry is not None and now >= self._next_retry:
            if self.state is ClientState.BINDING:
                if now - self._started_at >= cfg.max_connect_time:
                    self._invalidate("no-answer")
                    return
                self._send_bind(now)
            elif self.state is ClientState.CONNECTING:
                assert self._connect_started is not None
                if now - self._connect_started >= cfg.max_connect_time:
                    self._invalidate("no-answer")
                    return
                self._send_connect(now)
        if now - self._last_received >= cfg.heartbeat * _HEARTBEATS_BEFORE_REBIND:
            self._last_received = now
            self._send_bind(now)
        if (
            now - self._last_sent >= cfg.heartbeat
            and self.state is not ClientState.BINDING
        ):
            self.ping(now)

    # ------------------------------------------------------------- internals

    def _emit(self, data: bytes, now: float) -> None:
        self._last_sent = now
        self._outbox.append((data, self.server))

    def _send_bind(self, now: float) -> None:
        unsigned = m.Bind(
            nonce=self.nonce, connection_data=self._connection_data, hmac=bytes(32)
        )
        mac = bind_hmac(self._key, unsigned.signed_bytes())
        self._emit(unsigned.signed_bytes() + mac, now)
        # UTP increments the nonce after every BIND sent.
        self.nonce = (self.nonce + 1) & 0xFFFF
        if self.state is ClientState.BINDING:
            self._next_retry = now + self.config.connect_retry

    def _send_connect(self, now: float) -> None:
        assert self._host_connection_data is not None
        request = m.ConnectRequest(self.allocation_id, self._host_connection_data)
        self._emit(request.encode(), now)
        self._next_retry = now + self.config.connect_retry

    def _begin_connect(self, now: float) -> None:
        self.state = ClientState.CONNECTING
        self._connect_started = now
        self._send_connect(now)

    def _on_bind_received(self, now: float) -> None:
        rebind = self._bound_once
        self._bound_once = True
        if self.state is ClientState.BINDING:
            self.state = ClientState.BOUND
            self._next_retry = None
            if self._want_connect:
                self._begin_connect(now)
        self._events.append(Bound(rebind=rebind))

    def _on_error(self, code: int, now: float) -> None:
        self._events.append(RelayError(code))
        if code == m.ErrorCode.ALLOCATION_ID_CLIENT_MISMATCH:
            self._send_bind(now)
        elif code == m.ErrorCode.PLAYER_TIMED_OUT:
            self._invalidate("timed-out")
        elif code == m.ErrorCode.ALLOCATION_ID_NOT_FOUND:
            self._invalidate("not-found")

    def _invalidate(self, reason: str) -> None:
        self.state = ClientState.INVALID
        self._next_retry = None
        self._events.append(Invalid(reason))
