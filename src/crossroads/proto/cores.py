"""Every sans-I/O core in :mod:`crossroads.proto` and the shape of the one core
API (:mod:`crossroads.proto.core`) it has.

The tuples below are the table. mypy --strict checks each entry: a class given
where ``type[P]`` of a :class:`typing.Protocol` ``P`` is expected must have
``P``'s methods with compatible signatures. ``tests/proto/test_core_api.py``
checks at run time that the table names every class of ``proto/`` with an
input or output of the API (a base class its listed cores inherit it from
aside), that each entry's parameter names are the API's, and that every
``get_timer()`` / ``handle_timer(now)`` in ``proto/`` has the API's parameters,
listed or not; so a new core, or one drifting from the API, fails there. A
core that does not fit yet is listed in :data:`DEVIATIONS` with the reason.
"""

from __future__ import annotations

from typing import Any

from crossroads.proto.core import (
    DatagramCore,
    EventSource,
    MultiSocketCore,
    StreamCore,
    TimedCore,
)
from crossroads.proto.dtls.certificate_client import DtlsClient
from crossroads.proto.dtls.certificate_server import DtlsServer
from crossroads.proto.dtls.client import PskDtlsClient
from crossroads.proto.dtls.server import PskDtlsServer
from crossroads.proto.natneg.server import NatNegServer, NatNegSocket
from crossroads.proto.openttd.duties import Duties
from crossroads.proto.openttd.ladder import ConnectAttempt
from crossroads.proto.openttd.lobby import TurnLobby
from crossroads.proto.openttd.registration import ServerRegistration
from crossroads.proto.openttd.verify import RegistrationCheck
from crossroads.proto.punch.coordinator import Coordinator
from crossroads.proto.qos.server import QosServer
from crossroads.proto.raknet.nattype import NatTypeDetectionServer
from crossroads.proto.raknet.node import RakNetNode
from crossroads.proto.raknet.peer import RakNetServer
from crossroads.proto.raknet.punchthrough import NatPunchthroughServer
from crossroads.proto.raknet.udpproxy import UDPProxyCoordinator
from crossroads.proto.relay.client import RelayClient
from crossroads.proto.relay.server import RelayServer
from crossroads.proto.stun.client import StunClientCore
from crossroads.proto.stun.server import BindingCore
from crossroads.proto.turn.allocation import Listener
from crossroads.proto.turn.server import TurnServer

#: Cores on one socket (driven by :class:`~crossroads.transport.driver.DatagramDriver`
#: or an owner that feeds them the same way). RakNetNode also reads datagrams
#: of its second and NAT-type-detection sockets (``receive_second``,
#: ``receive_s3p4``), beside the API, and gives those of the latter as
#: ``side_datagrams()``, ``(data, destination, socket)`` like a
#: :class:`MultiSocketCore`.
DATAGRAM_CORES: tuple[type[DatagramCore], ...] = (
    DtlsClient,
    DtlsServer,
    QosServer,
    PskDtlsClient,
    PskDtlsServer,
    RakNetNode,
    RakNetServer,
    RelayClient,
    RelayServer,
    StunClientCore,
)

#: Cores on several sockets, each with the core's own name for its sockets:
#: natneg's endpoints, the Binding core's endpoint index (RFC 5780's four),
#: TURN's (transport, server address). The STUN/TURN port's owner
#: (transport/stunport.py) feeds the last two.
_NATNEG: type[MultiSocketCore[NatNegSocket]] = NatNegServer
_BINDING: type[MultiSocketCore[int]] = BindingCore
_TURN: type[MultiSocketCore[Listener]] = TurnServer
MULTI_SOCKET_CORES: tuple[type[MultiSocketCore[Any]], ...] = (
    _NATNEG,
    _BINDING,
    _TURN,
)

#: Cores serving many connections: the p2p signalling server's WebSockets.
_SIGNALLING: type[StreamCore[int, str | bytes, str]] = Coordinator
STREAM_CORES: tuple[type[StreamCore[Any, Any, Any]], ...] = (_SIGNALLING,)

#: Cores that take messages from another core or their owner rather than
#: datagrams: the timer half of the API. The RakNet server plugins, fed by
#: :class:`RakNetNode` from its peer's events; the OpenTTD coordinator's flows
#: (a join, a registration and its check), the OpenTTD service's periodic
#: duties and its TURN lobby, whose timers queue what they cause for
#: ``pop_events``.
TIMED_CORES: tuple[type[TimedCore], ...] = (
    ConnectAttempt,
    Duties,
    NatPunchthroughServer,
    NatTypeDetectionServer,
    RegistrationCheck,
    ServerRegistration,
    TurnLobby,
    UDPProxyCoordinator,
)

#: Cores that report what happened as typed events (``pop_events``). The
#: Binding core has none: its drops are plain counters, its replies are all
#: it gives.
EVENT_SOURCES: tuple[type[EventSource[Any]], ...] = (
    ConnectAttempt,
    Coordinator,
    Duties,
    DtlsClient,
    DtlsServer,
    PskDtlsClient,
    PskDtlsServer,
    NatNegServer,
    RakNetNode,
    RakNetServer,
    RegistrationCheck,
    RelayClient,
    RelayServer,
    ServerRegistration,
    StunClientCore,
    TurnLobby,
    TurnServer,
)

#: Cores with a timer that do not have the API's shape yet, and why: none
#: today; a new one must give its reason here.
DEVIATIONS: dict[type, str] = {}
