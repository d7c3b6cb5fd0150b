"""Method ``ladder``: the full connection ladder, one step after another with
tight per-step timeouts, reporting the step that won:

1. ``lan`` — both hosts behind the same NAT (same public address): the private
   address, directly;
2. ``direct`` — the peer's advertised public address as it stands;
3. ``mapping`` — the peer asks its router for a port mapping over NAT-PMP (real
   miniupnpd) and the other side sends to the mapped address;
4. ``punch`` — UDP hole punching to reflexive addresses;
5. ``relay`` — a TURN relay on the lab server (UDP, then TCP), through the relay
   methods registered by the TURN area (``turn-udp``, ``turn-tcp``).

Each step is tried in both directions where it has a direction.
"""

from __future__ import annotations

import time

from crossroads.lab import natpmp
from crossroads.lab.kinds import NatKind
from crossroads.lab.matrix import METHODS, Attempt, Method, Outcome, register
from crossroads.lab.methods import direct, punch
from crossroads.lab.topology import Lab, Site
from crossroads.lab.udp import local

#: The relay methods the ``relay`` step tries, in order, when registered.
RELAY_METHODS = ("turn-udp", "turn-tcp")
#: NAT-PMP answers come from the LAN gateway: a quarter second is plenty.
NATPMP_TIMEOUT_S = 0.25


async def lan_step(lab: Lab, a: Site, b: Site) -> float | None:
    if a.public_ip != b.public_ip or not a.kind.natted:
        return None  # not behind one NAT: no LAN path to try
    sender = lab.udp_socket(a)
    listener = lab.udp_socket(b)
    try:
        return await direct.exchange(sender, listener, (b.host_ip, local(listener)[1]))
    finally:
        sender.close()
        listener.close()


async def mapping_step(lab: Lab, x: Site, y: Site) -> float | None:
    """y maps its port on its router with NAT-PMP; x sends to the mapping."""
    if not y.kind.natted:
        return None
    started = time.monotonic()
    listener = lab.udp_socket(y)
    sender = lab.udp_socket(x)
    port = local(listener)[1]
    mapped = None
    try:
        answer = await natpmp.public_address(listener, y.gateway, NATPMP_TIMEOUT_S)
        if answer is None or answer[0] != 0:
            return None
        mapped = await natpmp.map_udp(
            listener, y.gateway, port, 60, timeout=NATPMP_TIMEOUT_S
        )
        if mapped is None or mapped.result != 0:
            return None
        rtt = await direct.exchange(sender, listener, (answer[1], mapped.external_port))
        return None if rtt is None else time.monotonic() - started
    finally:
        if mapped is not None and mapped.result == 0:
            await natpmp.map_udp(listener, y.gateway, port, 0, NATPMP_TIMEOUT_S)
        listener.close()
        sender.close()


async def run(attempt: Attempt) -> Outcome:
    lab, a, b = attempt.lab, attempt.a, attempt.b
    started = time.monotonic()

    def won(step: str) -> Outcome:
        return Outcome(True, step, time.monotonic() - started)

    if await lan_step(lab, a, b) is not None:
        return won("lan")
    for x, y in ((a, b), (b, a)):
        if await direct.reach(lab, x, y) is not None:
            return won("direct")
    for x, y in ((a, b), (b, a)):
        if await mapping_step(lab, x, y) is not None:
            return won("mapping")
    if await punch.punch(lab, a, b, attempt.shared["reflector"]) is not None:
        return won("punch")
    for name in RELAY_METHODS:
        method = METHODS.get(name)
        if method is None:
            continue
        outcome = await method.run(attempt)
        if outcome.connected:
            return won("relay")
    return Outcome(False, seconds=time.monotonic() - started)


def mapping_expected(x: NatKind, y: NatKind) -> bool:
    """A NAT-PMP mapping helps when a router with miniupnpd has a public WAN
    address (behind a CGN, miniupnpd's STUN check disables port forwarding)."""
    return (y.upnp and not y.double and x.udp) or (x.upnp and not x.double and y.udp)


def expected(x: NatKind, y: NatKind) -> bool:
    if any(name in METHODS for name in RELAY_METHODS):
        relay = METHODS.get("turn-tcp") or METHODS.get("turn-udp")
        if relay is not None and relay.expected is not None and relay.expected(x, y):
            return True
    return direct.expected(x, y) or mapping_expected(x, y) or punch.expected(x, y)


METHOD = register(
    Method(
        name="ladder",
        summary="the full ladder: lan → direct → mapping (NAT-PMP) → punch → relay (TURN)",
        run=run,
        expected=expected,
        timeout=30.0,
        prepare=punch.prepare,
    )
)
