"""One side of a GameSpy game's NAT negotiation, as its own process (lab tooling).

The lab's ``natneg`` method runs each player in a separate process inside its
host's network namespace, as two games on two machines would be::

    ip netns exec <host ns> python -m crossroads.lab.natneg_game --role host ...

What the process does is what an SDK game does around ``NNBeginNegotiation``
(``shared/reference/gamespy-natneg.md`` §3.7, §5, §6):

* it opens its *game socket* at start-up and lends it to the negotiation (GP
  INIT, the CONNECT_PINGs and, after success, the game data all leave from it),
  as the SDK test program does on both sides (``USE_OWN_SOCK``, ref §3.1) and a
  QR2 host does with its heartbeat socket (ref §3.7); ``--no-game-socket`` lets
  the SDK make the negotiate socket and plays on the socket handed back;
* it runs the SDK's NAT detection (``NNStartNatDetection``: NATIFY/ERT probes and
  ADDRESS_CHECKs from two more sockets of its own) *alongside* the negotiation,
  and the REPORT carries the NAT type and mapping scheme found so far (unknown
  until the detection ends, as in a game that starts negotiating right away);
* it drives everything from one loop that polls every 10 ms (``NNThink`` and
  the game socket, as the SDK test program's ``msleep(10)`` loop): a packet
  waits up to a poll before it is answered;
* after success it sends game data on the socket it got back, until the other
  side's arrives;
* its cookie is the one it is given (the SDK test program always uses 666). The
  lab's lobby retries a failed negotiation as players do: both games start
  again as *new processes* with new sockets and the same cookie; ``retry``
  (negotiate again in this process, same game socket) is a game that retries
  in-process.

Lines on stdin/stdout, one JSON object each, are the lobby:

* out ``{"event": "ready"}`` once the sockets exist; in ``go`` to start
  negotiating;
* out ``{"event": "result", ...}`` after each negotiation (result name, the
  remote address, whether the other side's game data arrived, the detection);
* in ``retry`` (negotiate again, same cookie), ``cancel`` (end the running
  negotiation: the partner will never come) or ``quit``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from crossroads.lab.natneg_sdk import (
    GAME_DATA,
    NatDetection,
    SdkNegotiator,
    detect_nat,
    read_game_data,
)
from crossroads.proto.natneg.packets import MappingScheme, NatType, NegotiateResult
from crossroads.transport.tasks import cancel_and_wait
from crossroads.types import Address

#: Game data after success: one datagram every 100 ms for at most 2 s, and three
#: more after the partner's arrived (it may have started later).
DATA_INTERVAL_S = 0.1
DATA_WINDOW_S = 2.0
DATA_AFTER = 3
#: NATIFY_TIMEOUT (ref §5): the detection collects answers for 10 s at most.
DETECTION_S = 10.0


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def exchange_game_data(sock: socket.socket, remote: Address) -> bool:
    """Send game data to ``remote`` until the partner's arrives (then a few more,
    for a partner that started later); whether it arrived."""
    received = False
    extra = 0
    end = time.monotonic() + DATA_WINDOW_S
    while time.monotonic() < end and extra < DATA_AFTER:
        with contextlib.suppress(OSError):
            sock.sendto(GAME_DATA, remote)
        if received:
            extra += 1
        try:
            data, _ = await read_game_data(sock, timeout=DATA_INTERVAL_S)
        except TimeoutError:
            continue
        received = received or data == GAME_DATA
    return received


@dataclass(eq=False)
class Player:
    """One game: its sockets, its detection, its negotiations."""

    role: str
    cookie: int
    servers: list[Address]
    local_ip: str
    deadline: float
    #: Lend a game socket to the negotiation (``NNBeginNegotiationWithSocket``).
    lend_socket: bool = True
    game_sock: socket.socket | None = field(init=False)
    detection: NatDetection | None = field(default=None, init=False)
    negotiator: SdkNegotiator | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.game_sock = _udp() if self.lend_socket else None
        if self.game_sock is not None:
            self.game_sock.bind(("0.0.0.0", 0))

    async def detect(self) -> None:
        self.detection = await detect_nat(
            self.servers, local_ip=self.local_ip, timeout=DETECTION_S
        )

    def _nat(self) -> tuple[int, int]:
        if self.detection is None or not self.detection.success:
            return NatType.UNKNOWN, MappingScheme.UNRECOGNIZED
        return self.detection.nat_type, self.detection.mapping_scheme

    async def negotiate(self, attempt: int) -> dict[str, Any]:
        nat_type, scheme = self._nat()
        negotiator = SdkNegotiator(
            version=4,
            cookie=self.cookie,
            client_index=1 if self.role == "host" else 0,
            servers=self.servers,
            game_sock=self.game_sock,
            local_ip=self.local_ip,
            nat_type=nat_type,
            mapping_scheme=scheme,
        )
        if self.negotiator is not None:
            self.negotiator.release()
        self.negotiator = negotiator
        started = time.monotonic()
        try:
            outcome = await negotiator.run(self.deadline)
            result = outcome.result
        except (TimeoutError, asyncio.CancelledError):
            result = NegotiateResult.NO_RESULT
            outcome = None
        seconds = time.monotonic() - started
        data = False
        remote: Address | None = None
        if outcome is not None and outcome.sock is not None and outcome.remote:
            remote = outcome.remote
            data = await exchange_game_data(outcome.sock, remote)
        return {
            "event": "result",
            "attempt": attempt,
            "result": result.name,
            "remote": list(remote) if remote else None,
            "data": data,
            "seconds": round(seconds, 3),
            "nat_type": NatType(nat_type).name,
            "detected": self._detected(),
        }

    def _detected(self) -> str | None:
        if self.detection is None:
            return None
        if not self.detection.success:
            return "failed"
        return NatType(self.detection.nat_type).name

    def close(self) -> None:
        if self.negotiator is not None:
            self.negotiator.release()
        if self.game_sock is not None:
            self.game_sock.close()


async def _lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    return reader


async def play(args: argparse.Namespace) -> None:
    servers = [_address(s) for s in args.servers.split(",")]
    player = Player(
        args.role,
        args.cookie,
        servers,
        args.local_ip,
        args.deadline,
        lend_socket=args.game_socket,
    )
    detection = asyncio.ensure_future(player.detect())
    try:
        reader = await _lines()
        _emit({"event": "ready"})
        attempt = 0
        command = (await reader.readline()).decode().strip()
        while command in ("go", "retry"):
            attempt += 1
            negotiation = asyncio.ensure_future(player.negotiate(attempt))
            lobby = asyncio.ensure_future(reader.readline())
            done, _ = await asyncio.wait(
                {negotiation, lobby}, return_when=asyncio.FIRST_COMPLETED
            )
            if lobby in done:
                # Only "cancel" arrives during a negotiation: the partner is gone.
                negotiation.cancel()
                _emit(await negotiation)
                line = await reader.readline()
            else:
                _emit(negotiation.result())
                line = await lobby
                if line.decode().strip() == "cancel":  # too late: already ended
                    line = await reader.readline()
            command = line.decode().strip()
    finally:
        await cancel_and_wait(detection)
        player.close()


def _address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return (host, int(port))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("host", "guest"), required=True)
    parser.add_argument("--cookie", type=int, required=True)
    parser.add_argument(
        "--servers", required=True, help="natneg1,natneg2,natneg3 as HOST:PORT"
    )
    parser.add_argument("--local-ip", default="0.0.0.0")
    parser.add_argument(
        "--deadline", type=float, default=9.0, help="seconds per negotiation"
    )
    parser.add_argument(
        "--game-socket",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lend the game socket to the negotiation (GP INIT, pings, game data)",
    )
    asyncio.run(play(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
