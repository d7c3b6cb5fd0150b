"""Method ``natneg``: GameSpy NAT negotiation through crossroads' natneg server.

Both hosts run the SDK client emulation (:mod:`crossroads.lab.natneg_sdk`, protocol
v4, the SDK's negotiate socket, its timers) against the lab server, where natneg1 and
natneg2 resolve to the first server address and natneg3 to the second (the two-IP
layout: symmetric NATs show in the NN1/NN3 mappings, the NATify "unsolicited IP"
probe comes from natneg3). Connected when both clients succeed and a game datagram
then crosses both ways on the sockets they got back.

The host lends its game socket (as a QR2 host does: GP INIT, pings and game data
from it, ref §3.7). As a game does, a failed negotiation is retried once, with the
same cookie and the same game socket (the SDK test program always uses cookie 666;
games reuse theirs): the failed REPORT makes the server relay the retry, and the
server must tell the new negotiation from the old one (docs/natneg.md, "Cookie
reuse").
So two symmetric NATs connect through the relay at once, a symmetric NAT against an
address-and-port-dependent filter on the second try, everything else directly. A
negotiation whose INITs never reached the server (UDP blocked) is not retried: the
clients sent no REPORT, so the retry would fail the same way.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

from crossroads.lab.kinds import Filtering, Mapping, NatKind
from crossroads.lab.matrix import Attempt, Method, Outcome, register
from crossroads.lab.natneg_sdk import SdkNegotiator, read_game_data
from crossroads.lab.topology import SERVER_IPS, Lab, Site
from crossroads.proto.natneg.packets import NegotiateResult
from crossroads.types import Address

#: natneg1, natneg2, natneg3 as a game resolves them in the lab (MATCHUP_PORT 27901).
SERVERS: list[Address] = [
    (SERVER_IPS[0], 27901),
    (SERVER_IPS[0], 27901),
    (SERVER_IPS[1], 27901),
]


def extra_server_args(port: int, *, timed: bool, relay: str = "auto") -> list[str]:
    """``crossroads serve`` arguments of a natneg server on ``port`` in the lab's
    two-IP layout (see :meth:`Lab.start_extra_server`): ``timed`` CONNECTs or
    both at once (GameSpy's way), relay mode ``relay``."""
    args = ["--only", "natneg", "--natneg-port", str(port)]
    args += ["--natneg-probe-port", str(port + 1)]
    args += ["--natneg-natneg3-host", SERVER_IPS[1]]
    args += ["--natneg-relay-allow", "198.51.100.0/24", "--natneg-relay-mode", relay]
    args.append("--natneg-timed-connect" if timed else "--no-natneg-timed-connect")
    return args


def servers_at(port: int) -> list[Address]:
    """natneg1, natneg2, natneg3 of a natneg server on ``port`` in the lab."""
    return [(SERVER_IPS[0], port), (SERVER_IPS[0], port), (SERVER_IPS[1], port)]


#: One negotiation: ~0.1 s to CONNECT in the lab, then at most the v4 ping phase
#: (7 x 700 ms, ref §6) before the client gives up itself; the INIT phase gives up
#: after ~6 s (12 x 500 ms).
NEGOTIATION_S = 9.0
GAME_DATA = b"woohoo!!"  # what the SDK test program sends after success


async def negotiate(
    lab: Lab,
    a: Site,
    b: Site,
    cookie: int,
    servers: list[Address] = SERVERS,
    game_sock: socket.socket | None = None,
) -> tuple[SdkNegotiator, SdkNegotiator]:
    """One negotiation between a (index 1, the host, lending ``game_sock`` if
    given) and b (index 0)."""
    host = SdkNegotiator(
        version=4,
        cookie=cookie,
        client_index=1,
        servers=servers,
        negotiate_sock=lab.udp_socket(a),
        game_sock=game_sock,
        local_ip=a.host_ip,
    )
    guest = SdkNegotiator(
        version=4,
        cookie=cookie,
        client_index=0,
        servers=servers,
        negotiate_sock=lab.udp_socket(b),
        local_ip=b.host_ip,
    )
    tasks = {asyncio.ensure_future(n.run(NEGOTIATION_S)) for n in (host, guest)}
    pending = tasks
    while pending:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if init_failed(host, guest):
            # One side never reached the server: the other would only wait for
            # its deadbeat CONNECT. A game would learn this from its lobby.
            break
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return host, guest


def init_failed(host: SdkNegotiator, guest: SdkNegotiator) -> bool:
    return any(
        n.outcome is not None and n.outcome.result == NegotiateResult.INIT_TIMEOUT
        for n in (host, guest)
    )


async def game_data_crosses(host: SdkNegotiator, guest: SdkNegotiator) -> bool:
    """Each sends a datagram to the address natneg gave it; both arrive."""
    if host.outcome is None or guest.outcome is None:
        return False
    pairs = ((host, guest), (guest, host))
    for sender, _receiver in pairs:
        if (
            sender.outcome is None
            or sender.outcome.sock is None
            or sender.outcome.remote is None
        ):
            return False
        try:
            sender.outcome.sock.sendto(GAME_DATA, sender.outcome.remote)
        except OSError:
            return False
    for _, receiver in pairs:
        assert receiver.outcome is not None and receiver.outcome.sock is not None
        try:
            data, _ = await read_game_data(receiver.outcome.sock, timeout=2.0)
        except TimeoutError:
            return False
        if data != GAME_DATA:
            return False
    return True


def succeeded(host: SdkNegotiator, guest: SdkNegotiator) -> bool:
    return all(
        n.outcome is not None and n.outcome.result == NegotiateResult.SUCCESS
        for n in (host, guest)
    )


async def run(attempt: Attempt) -> Outcome:
    game_sock = attempt.lab.udp_socket(attempt.a)
    try:
        return await _run(attempt, game_sock)
    finally:
        game_sock.close()


async def _run(attempt: Attempt, game_sock: socket.socket) -> Outcome:
    started = time.monotonic()
    details: list[str] = []
    cookie = int.from_bytes(os.urandom(4), "big")  # one per game: kept for the retry
    for tries in range(2):
        host, guest = await negotiate(
            attempt.lab, attempt.a, attempt.b, cookie, game_sock=game_sock
        )
        try:
            if succeeded(host, guest) and await game_data_crosses(host, guest):
                assert host.outcome is not None and host.outcome.remote is not None
                via = "relay" if host.outcome.remote[0] in SERVER_IPS else "punch"
                return Outcome(
                    True,
                    via,
                    time.monotonic() - started,
                    "; ".join(details),
                    first_attempt=tries == 0,
                )
            results = [
                n.outcome.result.name if n.outcome else n.state.name
                for n in (host, guest)
            ]
            details.append("/".join(results).lower())
            if init_failed(host, guest):
                break  # no REPORT was sent: a retry would fail the same way
        finally:
            # Only this attempt's sockets: other attempts run at the same time.
            host.release()
            guest.release()
    return Outcome(False, detail="; ".join(details))


def expected(x: NatKind, y: NatKind) -> bool:
    """Everything with UDP connects: directly, or through the relay."""
    return x.udp and y.udp


def direct_expected(x: NatKind, y: NatKind) -> bool:
    """Whether the negotiated direct path (server-observed addresses, both sides
    pinging) works, without the relay: an endpoint-dependent mapping defeats it
    against another one or against address-and-port-dependent filtering."""
    for s, t in ((x, y), (y, x)):
        if s.mapping is Mapping.ADDRESS_AND_PORT_DEPENDENT:
            if t.mapping is Mapping.ADDRESS_AND_PORT_DEPENDENT:
                return False
            if t.filtering is Filtering.ADDRESS_AND_PORT_DEPENDENT:
                return False
    return x.udp and y.udp


def first_expected(x: NatKind, y: NatKind) -> bool | None:
    """The first attempt connects wherever a direct path works, and between two
    endpoint-dependent mappings, which the server relays at once. A symmetric NAT
    against address-and-port-dependent filtering needs the retry: only the failed
    REPORT tells the server to relay.

    Not predicted (None) with a router that remaps on a knock
    (``accepts_unsolicited``): timed CONNECTs make the first pings cross within
    the peer-to-peer delay, and between the lab's sites that delay is a few
    microseconds, less than the clients' own 10 ms polling -- a race no server
    can settle. With real distances it holds (tests/lab/test_natneg.py and
    benchmarks/natneg_first_attempt.py use delay lines)."""
    if x.accepts_unsolicited or y.accepts_unsolicited:
        return None
    both_symmetric = all(
        k.mapping is Mapping.ADDRESS_AND_PORT_DEPENDENT for k in (x, y)
    )
    return direct_expected(x, y) or (both_symmetric and x.udp and y.udp)


METHOD = register(
    Method(
        name="natneg",
        summary="GameSpy natneg (SDK client v4) via crossroads, one retry; relay when needed",
        run=run,
        expected=expected,
        expected_first=first_expected,
        timeout=2 * NEGOTIATION_S + 6,
        needs=("natneg",),
    )
)
