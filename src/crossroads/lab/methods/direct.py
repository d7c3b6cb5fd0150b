"""Method ``direct``: no traversal at all. B listens on a UDP port and advertises
its public address with that port (what a game host without any NAT help would
publish); A sends there and waits for B's answer. Then the roles swap. It connects
when either side is reachable as it stands: a public host (``open``) on one end,
and UDP allowed on the other."""

from __future__ import annotations

import os
import socket
import time

from crossroads.lab.kinds import Mapping, NatKind
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.topology import Lab, Site
from crossroads.lab.udp import local, recv, send
from crossroads.types import Address

HELLO = b"XRD1"
ACK = b"XRD2"
#: Three sends 150 ms apart: the lab loses nothing, so a silent third try means
#: the packet was filtered, not lost.
TRIES = 3
PER_TRY_S = 0.15


async def exchange(
    sender: socket.socket, listener: socket.socket, target: Address
) -> float | None:
    """sender sends to ``target``; if listener gets it, it answers to the source
    it saw. Seconds to the round trip, or None."""
    started = time.monotonic()
    token = os.urandom(8)
    for _ in range(TRIES):
        send(sender, HELLO + token, target)
        got = await recv(listener, PER_TRY_S)
        if got is None or got[0] != HELLO + token:
            continue
        send(listener, ACK + token, got[1])
        reply = await recv(sender, PER_TRY_S * 2)
        if reply is not None and reply[0] == ACK + token:
            return time.monotonic() - started
        return None
    return None


async def reach(lab: Lab, x: Site, y: Site) -> float | None:
    """x sends to y's advertised public address; seconds to a round trip, or None."""
    listener = lab.udp_socket(y)
    sender = lab.udp_socket(x)
    try:
        return await exchange(sender, listener, (y.public_ip, local(listener)[1]))
    finally:
        listener.close()
        sender.close()


async def run(attempt: Attempt) -> Outcome:
    started = time.monotonic()
    for x, y in ((attempt.a, attempt.b), (attempt.b, attempt.a)):
        if await reach(attempt.lab, x, y) is not None:
            return Outcome(True, "direct", time.monotonic() - started)
    return Outcome(False)


def expected(x: NatKind, y: NatKind) -> bool:
    if not (x.udp and y.udp):
        return False
    return x.mapping is Mapping.NONE or y.mapping is Mapping.NONE


METHOD = register(
    Method(
        name="direct",
        summary="plain UDP to the peer's public address, no traversal, both directions",
        run=run,
        expected=expected,
        timeout=5.0,
    )
)
