"""Method ``punch``: classic UDP hole punching with an oracle rendezvous. Each host
learns its mapped address from the lab's probe reflector (one request, as a STUN
binding would), the two addresses are exchanged, and both sides send to each
other every 20 ms for up to three seconds, also answering to wherever a packet
from the peer came from (a peer-reflexive address, as ICE does). Connected when
each side has heard the other and knows that the other heard it.

No port prediction, no birthday technique: those are the SDK's (method ``sdk``). So two
endpoint-dependent mappings, or one against address-and-port-dependent
filtering, do not connect here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from typing import Any

from crossroads.lab.kinds import Filtering, Mapping, NatKind
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.probe import Reflector, ask
from crossroads.lab.topology import Lab, Site
from crossroads.lab.udp import recv, send
from crossroads.types import Address

MAGIC = b"XRH1"
_PACKET = struct.Struct("!4s8sBB")
#: Send interval while punching; short, since the lab's RTT is sub-millisecond
#: and the NATs keep mappings for minutes.
INTERVAL_S = 0.02
#: Give up after this long: far beyond the lab's round trip, so a failure is a
#: filter, not a slow path.
DURATION_S = 3.0


async def prepare(lab: Lab, shared: dict[str, Any]) -> None:
    """One probe reflector on the lab server for the whole matrix run."""
    if "reflector" in shared:
        return
    reflector = Reflector(lab)
    await reflector.__aenter__()
    shared["reflector"] = reflector

    async def close() -> None:
        await reflector.__aexit__(None, None, None)

    shared["cleanups"].append(close)


async def _peer(
    sock: socket.socket, target: Address, token: bytes, me: int, deadline: float
) -> bool:
    loop = asyncio.get_running_loop()
    targets = [target]
    heard = False
    acked = False
    next_send = 0.0
    while loop.time() < deadline:
        if loop.time() >= next_send:
            for addr in targets:
                send(sock, _PACKET.pack(MAGIC, token, me, int(heard)), addr)
            next_send = loop.time() + INTERVAL_S
        got = await recv(sock, max(0.001, next_send - loop.time()))
        if got is not None and len(got[0]) == _PACKET.size:
            magic, got_token, sender, their_heard = _PACKET.unpack(got[0])
            if magic == MAGIC and got_token == token and sender != me:
                heard = True
                acked = acked or bool(their_heard)
                if got[1] not in targets:
                    targets.append(got[1])
        if heard and acked:
            # Two more so the peer learns that we heard it, then done.
            for _ in range(2):
                for addr in targets:
                    send(sock, _PACKET.pack(MAGIC, token, me, 1), addr)
            return True
    return False


async def punch(lab: Lab, a: Site, b: Site, reflector: Reflector) -> float | None:
    """Seconds from the exchange of mapped addresses to a two-way path, or None."""
    sa = lab.udp_socket(a)
    sb = lab.udp_socket(b)
    try:
        ma, mb = await asyncio.gather(
            ask(sa, reflector.address()), ask(sb, reflector.address())
        )
        if ma is None or mb is None:
            return None
        token = os.urandom(8)
        started = time.monotonic()
        deadline = asyncio.get_running_loop().time() + DURATION_S
        ok_a, ok_b = await asyncio.gather(
            _peer(sa, mb, token, 1, deadline), _peer(sb, ma, token, 2, deadline)
        )
        return time.monotonic() - started if ok_a and ok_b else None
    finally:
        sa.close()
        sb.close()


async def run(attempt: Attempt) -> Outcome:
    seconds = await punch(
        attempt.lab, attempt.a, attempt.b, attempt.shared["reflector"]
    )
    if seconds is None:
        return Outcome(False)
    return Outcome(True, "punch", seconds)


_DEPENDENT = (Mapping.ADDRESS_DEPENDENT, Mapping.ADDRESS_AND_PORT_DEPENDENT)


def _first_packet_gets_through(sender: NatKind, receiver: NatKind) -> bool:
    """Does sender's packet reach receiver (and then receiver's reply come back)?"""
    if receiver.mapping in _DEPENDENT:
        # The mapped address the peer was told is the one towards the reflector;
        # towards the peer the receiver's NAT has another, unknown one.
        return False
    if receiver.filtering in (
        Filtering.NONE,
        Filtering.ENDPOINT_INDEPENDENT,
        Filtering.ADDRESS_DEPENDENT,
    ):
        return True
    # Address-and-port-dependent filtering lets in only the endpoint the receiver
    # sent to: the sender's reflector-mapped address, i.e. an EIM sender.
    return sender.mapping not in _DEPENDENT


def expected(x: NatKind, y: NatKind) -> bool:
    if not (x.udp and y.udp):
        return False
    return _first_packet_gets_through(x, y) or _first_packet_gets_through(y, x)


METHOD = register(
    Method(
        name="punch",
        summary="UDP hole punching to reflexive addresses (no port prediction)",
        run=run,
        expected=expected,
        timeout=8.0,
        prepare=prepare,
    )
)
