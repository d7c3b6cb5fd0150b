"""Method ``natneg``: GameSpy NAT negotiation through crossroads' natneg server.

Both hosts run the SDK client emulation (:mod:`crossroads.lab.natneg_sdk`, protocol
v4, the SDK's negotiate socket, its timers) against the lab server, where natneg1 and
natneg2 resolve to the first server address and natneg3 to the second (the two-IP
layout: symmetric NATs show in the NN1/NN3 mappings, the NATify "unsolicited IP"
probe comes from natneg3). Connected when both clients succeed and a game datagram
then crosses both ways on the sockets they got back.

Each player is its own process in its host's namespace
(:mod:`crossroads.lab.natneg_game`), as two games on two machines, and behaves like
the SDK test program: it lends its game socket (GP INIT, pings and game data from
it, ref §3.1), runs the SDK's NAT detection alongside the negotiation on sockets of
its own (its REPORT carries what the detection found by then) and polls every
10 ms. This coroutine is the lobby: it starts both together and, as players do,
retries a failed negotiation once with two *new processes* (new sockets) and the
same cookie. In a back-to-back matrix (``crossroads lab matrix --back-to-back``)
every cell uses one cookie, 666 as the SDK test program, one after another, so
each negotiation meets the previous cell's session on the cookie and the server
must tell them apart (docs/natneg.md, "Cookie reuse"); otherwise each game draws
its own. :func:`negotiate` runs both sides in this process instead, for tests
that look at the negotiators themselves.

Every pair with UDP connects on the first attempt: directly where the NAT kinds
allow it, else through the relay the server picks at once from what it learns at
INIT (docs/natneg.md, "First-attempt relay"). A negotiation whose INITs never
reached the server (UDP blocked) is not retried: the clients sent no REPORT, so
the retry would fail the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from crossroads.lab.kinds import Filtering, Mapping, NatKind, both_udp
from crossroads.lab.matrix import SHARED_COOKIE, Attempt, Method, Outcome, register
from crossroads.lab.natneg_sdk import GAME_DATA, SdkNegotiator, read_game_data
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

    def negotiator(
        site: Site, index: int, game: socket.socket | None = None
    ) -> SdkNegotiator:
        return SdkNegotiator(
            version=4,
            cookie=cookie,
            client_index=index,
            servers=servers,
            negotiate_sock=lab.udp_socket(site),
            game_sock=game,
            local_ip=site.host_ip,
        )

    host, guest = negotiator(a, 1, game_sock), negotiator(b, 0)
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


class _Game:
    """One player's process (:mod:`crossroads.lab.natneg_game`) in its host's
    namespace, and the lobby's side of its stdin/stdout lines."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(
        cls, lab: Lab, site: Site, role: str, cookie: int, servers: list[Address]
    ) -> _Game:
        argv = ["ip", "netns", "exec", lab.host_ns(site), sys.executable]
        argv += ["-m", "crossroads.lab.natneg_game", "--role", role]
        argv += ["--cookie", str(cookie), "--local-ip", site.host_ip]
        argv += ["--servers", ",".join(f"{h}:{p}" for h, p in servers)]
        argv += ["--deadline", str(NEGOTIATION_S)]
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        return cls(process)

    async def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        if not line:
            raise EOFError(f"player exited ({self.process.returncode})")
        event: dict[str, Any] = json.loads(line)
        return event

    def tell(self, command: str) -> None:
        assert self.process.stdin is not None
        if not self.process.stdin.is_closing():
            self.process.stdin.write(command.encode() + b"\n")

    async def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            self.tell("quit")
        try:
            await asyncio.wait_for(self.process.wait(), 3.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()


async def _round(host: _Game, guest: _Game) -> list[dict[str, Any]]:
    """Both players' results of one negotiation. When one side gives up at the
    INIT stage (it never reached the server), the lobby cancels the other, which
    would only wait for its deadbeat CONNECT."""
    pending = {asyncio.ensure_future(g.read()): g for g in (host, guest)}
    results: dict[_Game, dict[str, Any]] = {}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                game = pending.pop(task)
                results[game] = task.result()
                if results[game]["result"] == NegotiateResult.INIT_TIMEOUT.name:
                    for other in pending.values():
                        other.tell("cancel")
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [results[host], results[guest]]


async def _start_players(attempt: Attempt, cookie: int) -> list[_Game]:
    """Two fresh game processes (new sockets), both ready, or an exception."""
    games: list[_Game] = []
    try:
        for site, role in ((attempt.a, "host"), (attempt.b, "guest")):
            games.append(await _Game.start(attempt.lab, site, role, cookie, SERVERS))
        for game in games:
            if (await game.read())["event"] != "ready":
                raise EOFError("a player did not start")
    except BaseException:
        await asyncio.gather(*(g.stop() for g in games))
        raise
    return games


async def run(attempt: Attempt) -> Outcome:
    """Two game processes; the lobby (this coroutine) starts them together and,
    after a failure, has both retry once as players do: new processes (new
    sockets), the same cookie. The cookie is the matrix's (a back-to-back run:
    :data:`crossroads.lab.matrix.SHARED_COOKIE`), else one drawn for this game."""
    cookie = attempt.shared.get(SHARED_COOKIE)
    if cookie is None:
        cookie = int.from_bytes(os.urandom(4), "big")
    started: float | None = None
    details: list[str] = []
    for tries in range(2):
        try:
            games = await _start_players(attempt, cookie)
        except EOFError as exc:
            return Outcome(False, detail=str(exc))
        try:
            if started is None:
                started = time.monotonic()
            for game in games:
                game.tell("go")
            results = await _round(*games)
        finally:
            await asyncio.gather(*(g.stop() for g in games))
        if all(r["result"] == "SUCCESS" and r["data"] for r in results):
            remote = results[0]["remote"]
            via = "relay" if remote and remote[0] in SERVER_IPS else "punch"
            details.append(_detections(results))
            return Outcome(
                True,
                via,
                time.monotonic() - started,
                "; ".join(details),
                first_attempt=tries == 0,
            )
        details.append("/".join(r["result"].lower() for r in results))
        if any(r["result"] == NegotiateResult.INIT_TIMEOUT.name for r in results):
            break  # no REPORT was sent: a retry would fail the same way
    return Outcome(False, detail="; ".join(details))


def _detections(results: list[dict[str, Any]]) -> str:
    """What each side's own NAT detection had found when its REPORT left."""
    return "detected A {}, B {}".format(*(r["nat_type"].lower() for r in results))


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
    return both_udp(x, y)


def first_expected(x: NatKind, y: NatKind) -> bool:
    """Every pair with UDP connects on the first attempt: directly where a direct
    path works, else through the relay the server picks at once -- from the
    NN1/NN2/NN3 mappings (endpoint-dependent mapping) and its INIT-time ERT probe
    from another port (address-and-port-dependent filtering), docs/natneg.md
    "First-attempt relay".

    A router that remaps on a knock (``accepts_unsolicited``) is predicted like
    its port-restricted cone: timed CONNECTs make the first pings cross within
    the peer-to-peer delay, and the matrix runs such pairs with delay lines
    (:data:`crossroads.lab.matrix.REMAP_DELAY`). Without distance (a few
    microseconds between the lab's sites, less than the clients' own 10 ms
    polling) it would be a race no server can settle."""
    return both_udp(x, y)


def expected_via(x: NatKind, y: NatKind) -> str | None:
    """``punch`` where the negotiated direct path works, else ``relay``."""
    if not both_udp(x, y):
        return None
    return "punch" if direct_expected(x, y) else "relay"


METHOD = register(
    Method(
        name="natneg",
        summary="GameSpy natneg (SDK client v4) via crossroads, one retry; relay when needed",
        run=run,
        # Everything with UDP connects: directly, or through the relay.
        expected=both_udp,
        expected_first=first_expected,
        expected_via=expected_via,
        timeout=2 * NEGOTIATION_S + 6,
        needs=("natneg",),
    )
)
