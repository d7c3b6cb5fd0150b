"""The RakNet server node: the peer with its server plugins, one core.

:class:`RakNetNode` is what the service runs on its socket: the
:class:`~crossroads.proto.raknet.peer.RakNetServer` and the server plugins
behind it (NatPunchthroughServer, UDPProxyCoordinator, and
NatTypeDetectionServer when its extra sockets are configured), with the one core API
(``receive_datagram``, ``datagrams_to_send``, ``get_timer``, ``handle_timer``,
``pop_events``). After every input the node hands the peer's events to the
plugins; a message no plugin claims is counted and ignored, as a stock RakPeer
without that plugin would (FullyConnectedMesh2 and Router2 clients message
every connection, reference §6).

Datagrams that reach the *second* socket go to :meth:`receive_second`: only
out-of-band messages are read there (the port-stride NAT_PING); the answers
leave through the first socket, as RakNet's do.
"""

from __future__ import annotations

from collections import Counter, deque

from crossroads.proto.admission import Table
from crossroads.proto.raknet import messages as m
from crossroads.proto.raknet.nattype import NatTypeDetectionServer, Socket
from crossroads.proto.raknet.peer import (
    Connected,
    Disconnected,
    Event,
    MessageReceived,
    OutOfBandReceived,
    RakNetServer,
    ServerConfig,
)
from crossroads.proto.raknet.punchthrough import NatPunchthroughServer
from crossroads.proto.raknet.udpproxy import Forwarders, UDPProxyCoordinator
from crossroads.proto.reflection import ReflectionBudget
from crossroads.types import Address

#: Events kept for :meth:`RakNetNode.pop_events` (the oldest go first).
MAX_EVENTS = 4096


class RakNetNode:
    """See the module docstring."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        bound_addresses: list[Address] | None = None,
        guid: int | None = None,
        s3p4: Address | None = None,
        forwarders: Forwarders | None = None,
        proxy_public_ip: str = "",
        proxy_password: str = "",
        handshakes: Table | None = None,
        connections: Table | None = None,
        reflection: ReflectionBudget | None = None,
    ) -> None:
        self.peer = RakNetServer(
            config,
            guid=guid,
            handshakes=handshakes,
            connections=connections,
            reflection=reflection,
        )
        self.punch = NatPunchthroughServer(self.peer, bound_addresses or [])
        #: UDPProxyCoordinator; ``forwarders`` is the built-in UDPProxyServer.
        self.proxy = UDPProxyCoordinator(
            self.peer, forwarders, proxy_public_ip, proxy_password
        )
        #: NatTypeDetectionServer, when its extra sockets exist (``s3p4`` is
        #: where clients send their port-restricted probe).
        self.detection = (
            None if s3p4 is None else NatTypeDetectionServer(self.peer, s3p4)
        )
        #: Messages no plugin handles, by message id.
        self.unhandled: Counter[int] = Counter()
        #: Datagrams refused on the second socket.
        self.second_dropped = 0
        #: Events for an observer; bounded, so nobody reading them costs nothing.
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        self.peer.receive_datagram(data, addr, now)
        self._dispatch(now)

    def receive_second(self, data: bytes, addr: Address, now: float) -> None:
        if data[:1] != bytes([m.MessageId.OUT_OF_BAND_INTERNAL]) or not m.is_offline(
            data
        ):
            self.second_dropped += 1
            return
        self.peer.receive_datagram(data, addr, now)
        self._dispatch(now)

    def receive_s3p4(self, data: bytes, addr: Address, now: float) -> None:
        """A datagram on NAT type detection's s3p4 socket."""
        if self.detection is not None and data:
            self.detection.receive_s3p4(data, addr, now)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        return self.peer.datagrams_to_send(now)

    def side_datagrams(self) -> list[tuple[bytes, Address, Socket]]:
        """Datagrams for NAT type detection's extra sockets, as ``(data,
        destination, socket)``."""
        return [] if self.detection is None else self.detection.side_datagrams()

    def get_timer(self) -> float | None:
        timers = [
            t
            for t in (
                self.peer.get_timer(),
                self.punch.get_timer(),
                self.proxy.get_timer(),
                None if self.detection is None else self.detection.get_timer(),
            )
            if t is not None
        ]
        return min(timers) if timers else None

    def handle_timer(self, now: float) -> None:
        self.peer.handle_timer(now)
        self.punch.handle_timer(now)
        self.proxy.handle_timer(now)
        if self.detection is not None:
            self.detection.handle_timer(now)
        self._dispatch(now)

    def pop_events(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events

    def _dispatch(self, now: float) -> None:
        for event in self.peer.pop_events():
            match event:
                case Connected(guid, address, internal):
                    self.punch.on_connected(guid, address, internal)
                case Disconnected(guid, address, _):
                    self.punch.on_disconnected(guid, now)
                    self.proxy.on_disconnected(address, now)
                    if self.detection is not None:
                        self.detection.on_disconnected(guid)
                case MessageReceived(guid, address, payload):
                    handled = (
                        self.punch.on_message(guid, address, payload, now)
                        or self.proxy.on_message(guid, address, payload, now)
                    ) or (
                        self.detection is not None
                        and self.detection.on_message(guid, address, payload, now)
                    )
                    if not handled:
                        self.unhandled[payload[0]] += 1
                case OutOfBandReceived(_, address, payload):
                    if not self.punch.on_out_of_band(address, payload):
                        self.unhandled[m.MessageId.OUT_OF_BAND_INTERNAL] += 1
            self._events.append(event)
