"""Method ``turn-udp``: both hosts relay through crossroads' TURN server on the
lab server (RFC 8656), with :mod:`crossroads.client.turn` allocating over UDP.

Each host allocates a relayed address, permits the other's relayed address and
binds a channel to it; then one ChannelData frame goes each way
(host A -> A's relay -> B's relay -> host B, and back). Both hosts only ever talk
to the server's TURN port, so the NAT kinds' mapping and filtering do not matter:
it connects whenever both sites can reach the server over the transport.

:func:`turn_method` makes ``turn-tcp`` too (same exchange, TCP allocation).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Literal

from crossroads.client.turn import TurnClient, TurnClientError
from crossroads.lab import netns
from crossroads.lab.kinds import NatKind, both_udp
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.topology import LAB_TURN_USER, SERVER_IPS, Lab, Site
from crossroads.types import Address

#: crossroads' STUN/TURN port on the lab server (DESIGN.md default ports).
TURN_PORT = 3478
#: One request's answer (all UDP retransmissions): the lab's RTT is sub-
#: millisecond and it loses nothing, so 2 s means the transport is blocked.
REQUEST_S = 2.0
#: Wait for one relayed frame; a frame is resent every RESEND_S meanwhile
#: (covers a permission installed a moment after the first send).
RECEIVE_S = 2.0
RESEND_S = 0.25

Transport = Literal["udp", "tcp"]


async def open_client(lab: Lab, site: Site, transport: Transport) -> TurnClient:
    """A TURN client on ``site``'s host, connected to the lab server's TURN port
    over ``transport`` (its socket is made inside the host's namespace)."""
    loop = asyncio.get_running_loop()
    server: Address = (SERVER_IPS[0], TURN_PORT)
    user, password = LAB_TURN_USER.split(":", 1)
    if transport == "udp":
        sock = lab.udp_socket(site)
    else:
        sock = netns.socket_in(
            lab.host_ns(site), socket.SOCK_STREAM, bind=(site.host_ip, 0)
        )
    try:
        if transport == "udp":
            sock.connect(server)
        else:
            await asyncio.wait_for(loop.sock_connect(sock, server), REQUEST_S)
        return await TurnClient.on_socket(
            sock, server, user, password, transport=transport, timeout=REQUEST_S
        )
    except BaseException:
        sock.close()
        raise


async def _carry(src: TurnClient, dst: TurnClient, payload: bytes) -> bool:
    """``src`` sends ``payload`` to ``dst``'s relayed address until ``dst``
    receives it from ``src``'s relayed address."""
    assert src.relayed is not None and dst.relayed is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECEIVE_S
    while loop.time() < deadline:
        await src.send(payload, dst.relayed)
        with contextlib.suppress(TimeoutError):
            data, peer = await dst.receive(RESEND_S)
            if data == payload and peer == src.relayed:
                return True
    return False


async def exchange(lab: Lab, a: Site, b: Site, transport: Transport) -> Outcome:
    """Relay one frame each way between ``a`` and ``b`` through two allocations."""
    started = time.monotonic()
    clients: list[TurnClient] = []
    try:
        for site in (a, b):
            clients.append(await open_client(lab, site, transport))
        host, player = clients
        await asyncio.gather(host.allocate(), player.allocate())
        assert host.relayed is not None and player.relayed is not None
        await asyncio.gather(
            host.bind_channel(player.relayed), player.bind_channel(host.relayed)
        )
        if not await _carry(host, player, b"hello player"):
            return Outcome(False, detail="nothing relayed from A to B")
        if not await _carry(player, host, b"hello host"):
            return Outcome(False, detail="nothing relayed from B to A")
    except (OSError, TimeoutError, TurnClientError) as exc:
        return Outcome(False, detail=f"{type(exc).__name__}: {exc}")
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    return Outcome(True, "relay", time.monotonic() - started)


def turn_method(
    transport: Transport, summary: str, expected: Callable[[NatKind, NatKind], bool]
) -> Method:
    """The ``turn-<transport>`` method: :func:`exchange` with allocations over
    ``transport``, connecting for the pairs ``expected`` names."""

    async def run(attempt: Attempt) -> Outcome:
        return await exchange(attempt.lab, attempt.a, attempt.b, transport)

    return Method(
        name=f"turn-{transport}",
        summary=summary,
        run=run,
        expected=expected,
        timeout=15.0,
        needs=("turn",),
    )


METHOD = register(
    turn_method(
        "udp",
        "crossroads' TURN relay, allocations over UDP (crossroads TURN client)",
        # Both sites must send UDP to the server: only udp-blocked cannot.
        expected=both_udp,
    )
)
