"""The SDK-like natneg test client.

The client (``SdkNegotiator``, ``detect_nat``) is a re-implementation of the GameSpy
SDK client used only by tests and by the NAT lab's ``natneg`` matrix method; it lives
in :mod:`crossroads.lab.natneg_sdk` because the lab runs from the installed package.
This module is where the tests take it from.
"""

import asyncio

from crossroads.lab.natneg_sdk import (
    NatDetection,
    Outcome,
    SdkNegotiator,
    State,
    Timers,
    detect_nat,
    determine_nat_type,
    read_game_data,
)
from crossroads.proto.natneg.packets import NegotiateResult

__all__ = [
    "NatDetection",
    "Outcome",
    "SdkNegotiator",
    "State",
    "Timers",
    "detect_nat",
    "determine_nat_type",
    "negotiate_on_loopback",
    "read_game_data",
]


async def negotiate_on_loopback(port: int, cookie: int) -> None:
    """Negotiate two SDK clients (127.0.0.1 and 127.0.0.5, version 3) through
    the natneg server on ``port`` of 127.0.0.1 (natneg1/2/3 on one socket), and
    check that both succeed and the host learns the guest's address."""
    servers = [("127.0.0.1", port)] * 3
    host = SdkNegotiator(
        version=3, cookie=cookie, client_index=1, servers=servers, finished_idle=0.2
    )
    guest = SdkNegotiator(
        version=3,
        cookie=cookie,
        client_index=0,
        servers=servers,
        bind_ip="127.0.0.5",
        finished_idle=0.2,
    )
    try:
        await asyncio.gather(host.run(), guest.run())
        assert host.outcome and guest.outcome
        assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
        assert host.outcome.remote == guest.negotiate_sock.getsockname()
    finally:
        SdkNegotiator.close_all()
