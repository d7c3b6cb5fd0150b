"""Method ``sdk``: crossroads' peer-to-peer SDK (crossroads.client.p2p) between two lab hosts.

Host A creates a session with ``crossroads.client.p2p`` against the lab server's
``p2p`` service and asks its router for a port mapping (PCP, then NAT-PMP: the
kinds with miniupnpd grant one); both hosts allocate a TURN relay on the lab
server (``crossroads.client.turn``: UDP, or TCP where UDP is blocked); host B
joins with the invite code. The join runs the full connection ladder — LAN,
direct, port mapping, punch-through with port prediction, the birthday
technique and the prediction spray, then the relay (TURN first, the signalling
WebSocket after) — and ends with an authenticated, encrypted datagram each way. ``via`` is the ladder
step that won; ``seconds`` is from ``join`` to the established link
(signalling, the coordinator's synchronised start, the ladder).

Expected: every pair connects (the relay step needs only TCP to the server), by
the step :func:`expected_via` names. ``detail`` says whether a relayed link runs
over TURN or the WebSocket.

A pair whose punch is a random search (the birthday technique, the prediction
spray: the two mappings the SDK learned) finds its hit with high probability,
not always; when such a ladder relays, the method runs a fresh one, as a game
that relayed would try again, up to :data:`RANDOM_SEARCH_TRIES` ladders
(``first_attempt`` false: the table says "(retry)"). Every other pair, and a
search that misses every time, is judged on one ladder.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from crossroads.client.p2p import JoinRejected, P2PClient
from crossroads.client.portmap import PortMapper
from crossroads.client.turn import TurnClientError
from crossroads.client.turnrelay import TurnClientRelay
from crossroads.lab import netns
from crossroads.lab.kinds import Allocation, Mapping, NatKind, every_pair
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.methods.turn_udp import open_client
from crossroads.lab.topology import SERVER_HTTP_PORT, SERVER_IPS, Lab, Site

URL = f"ws://{SERVER_IPS[0]}:{SERVER_HTTP_PORT}/p2p/v1/ws"
#: Port-mapping requests in the lab: PCP and NAT-PMP only (UPnP's SSDP multicast
#: would need the process inside the namespace; tests/client covers UPnP).
PORTMAP_METHODS = ("pcp", "natpmp")
#: Ladders for a pair whose punch is a random search (module docstring). The
#: birthday technique misses with P = (1 - 256/65 535)^2048 = 0.03 % when all its
#: probes go out (docs/p2p.md), more when a loaded machine slows them; a full
#: matrix has a dozen such pairs, so one ladder each made one run in a few
#: hundred fail. Three: a miss in all of them says the search is broken.
RANDOM_SEARCH_TRIES = 3
#: The mapping pairs (as the SDK learned them) for which the ladder runs a
#: random search: birthday (random against independent) and the prediction
#: spray (random against sequential; proto/punch/ladder.py).
RANDOM_SEARCHES = (
    frozenset({"random", "independent"}),
    frozenset({"random", "sequential"}),
)


def _turn(lab: Lab, site: Site) -> Callable[[], Awaitable[TurnClientRelay]]:
    """A TURN allocation on the lab server from inside the site's namespace:
    UDP, or TCP when the site's UDP is blocked (the relayed address is UDP
    either way)."""

    async def make() -> TurnClientRelay:
        try:
            return await TurnClientRelay.allocate(await open_client(lab, site, "udp"))
        except (OSError, TimeoutError, TurnClientError):
            return await TurnClientRelay.allocate(await open_client(lab, site, "tcp"))

    return make


def _client(
    lab: Lab,
    site: Site,
    *,
    portmap: bool,
    turn: bool = True,
    url: str = URL,
    ipv6: bool = False,
) -> P2PClient:
    ns = lab.host_ns(site)

    def udp() -> socket.socket:
        return lab.udp_socket(site)

    def tcp() -> socket.socket:
        return netns.socket_in(ns, socket.SOCK_STREAM)

    def mapper(port: int) -> PortMapper:
        return PortMapper(
            port,
            gateway=site.gateway,
            internal_ip=site.host_ip,
            methods=PORTMAP_METHODS,
            socket_factory=lambda: netns.socket_in(ns),
        )

    return P2PClient(
        url,
        name=site.name,
        socket_factory=udp,
        socket6_factory=(lambda: lab.udp_socket6(site)) if ipv6 else None,
        tcp_factory=tcp,
        portmap=mapper if portmap and site.kind.natted else False,
        turn=_turn(lab, site) if turn else None,
    )


async def connect(lab: Lab, a: Site, b: Site) -> tuple[Outcome, tuple[str, str]]:
    """One ladder from b (the joiner) to a (the host); and the two mappings
    the SDK learned (host's, joiner's)."""
    host = _client(lab, a, portmap=True)
    guest = _client(lab, b, portmap=True)
    try:
        await asyncio.gather(host.start(), guest.start())
        code = await host.host(2)
        started = time.monotonic()
        try:
            await guest.join(code, timeout=40)
        except JoinRejected as exc:
            return Outcome(False, detail=str(exc)), (host.mapping, guest.mapping)
        seconds = time.monotonic() - started
        link = guest.links[host.peer_id]
        guest.send(host.peer_id, b"ping")
        peer, data = await asyncio.wait_for(host.recv(), 5)
        host.send(guest.peer_id, b"pong")
        back = await asyncio.wait_for(guest.recv(), 5)
        mappings = (host.mapping, guest.mapping)
        if (peer, data) != (guest.peer_id, b"ping") or back != (host.peer_id, b"pong"):
            return Outcome(False, detail="data did not come through"), mappings
        relay = ""
        if link.step == "relay":
            relay = (
                "; over TURN"
                if link.addr[0] != "relay" and not link.addr[0].startswith("relay:")
                else "; over the WebSocket"
            )
        spray = ""
        host_link = host.links.get(guest.peer_id)
        host_sprayed = host_link.sprayed if host_link is not None else 0
        if host_sprayed or link.sprayed:
            spray = f"; sprayed A {host_sprayed}, B {link.sprayed}"
        detail = (
            f"ladder {link.seconds:.2f}s; A {host.mapping}"
            f"{' mapped' if host.mapped else ''}, B {guest.mapping}{relay}{spray}"
        )
        return Outcome(True, link.step, seconds, detail), mappings
    finally:
        await asyncio.gather(host.close(), guest.close(), return_exceptions=True)


async def run(attempt: Attempt) -> Outcome:
    relayed: list[str] = []
    for _ in range(RANDOM_SEARCH_TRIES):
        outcome, mappings = await connect(attempt.lab, attempt.a, attempt.b)
        if outcome.via != "relay" or frozenset(mappings) not in RANDOM_SEARCHES:
            break
        relayed.append(f"{outcome.seconds or 0:.2f}s")
    if not relayed or outcome.via == "relay":
        return outcome
    ladders = f"{len(relayed)} relayed ladder(s) ({', '.join(relayed)})"
    return replace(
        outcome, detail=f"{outcome.detail}; after {ladders}", first_attempt=False
    )


def needs_relay(x: NatKind, y: NatKind) -> bool:
    """Pairs no direct technique of the SDK can open (see docs/p2p.md): UDP
    blocked on either side, or random-port symmetric NAT on both sides (both
    holes unknown and new for every destination). Random against sequential is
    opened by the prediction spray, random against a cone by the birthday
    technique."""
    if not (x.udp and y.udp):
        return True
    return x.allocation is Allocation.RANDOM and y.allocation is Allocation.RANDOM


def expected_via(x: NatKind, y: NatKind) -> str:
    """The step that wins for host ``x`` (site a) and joiner ``y`` (site b).

    The joiner is the initiator. ``direct`` (the joiner alone sends) runs only
    to a host without NAT: to a NATed host it would knock on the host's router
    before the host sent, and ``port-restricted-remap`` then remaps the host's
    port (docs/natneg.md). When either side holds a port mapping from its router's
    miniupnpd (not behind a carrier-grade NAT, where the mapping is useless and
    the server drops it), ``mapping`` comes next and wins. Everything else that
    can be opened is opened by the punch step (an endpoint-independent filter at
    its first slot, prediction and birthday included); the rest relays.
    """
    if needs_relay(x, y):
        return "relay"
    if x.mapping is Mapping.NONE:
        return "direct"
    if any(k.upnp and not k.double for k in (x, y)):
        return "mapping"
    return "punch"


METHOD = register(
    Method(
        name="sdk",
        summary="crossroads p2p SDK: LAN, direct, port mapping, punch (prediction, birthday, spray), relay",
        run=run,
        # The SDK connects every pair: the relay needs only TCP to the server.
        expected=every_pair,
        expected_via=expected_via,
        timeout=60.0,
        max_parallel=4,
        needs=("p2p",),
    )
)
