"""NAT reports in RakNet's terms from RFC 5780 behaviour."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import pytest

from crossroads.client.nat import report_from
from crossroads.proto.punch.nattype import NatType, can_connect


class B(Enum):
    EI = "endpoint-independent"
    AD = "address-dependent"
    APD = "address-and-port-dependent"


@dataclass
class Behaviour:
    mapping: B | None
    filtering: B | None
    behind_nat: bool = True
    mapped: tuple[str, int] | None = ("198.51.100.10", 40000)
    notes: tuple[str, ...] = ()


@pytest.mark.parametrize(
    ("mapping", "filtering", "behind", "raknet", "friendly"),
    [
        (B.EI, B.EI, False, NatType.NONE, "Open"),
        (B.EI, B.EI, True, NatType.FULL_CONE, "Relaxed"),
        (B.EI, B.AD, True, NatType.ADDRESS_RESTRICTED, "Relaxed"),
        (B.EI, B.APD, True, NatType.PORT_RESTRICTED, "Moderate"),
        (B.APD, B.APD, True, NatType.SYMMETRIC, "Strict"),
        (None, B.APD, True, NatType.UNKNOWN, "Unknown"),
    ],
)
def test_report(
    mapping: B | None, filtering: B | None, behind: bool, raknet: NatType, friendly: str
) -> None:
    report = report_from(Behaviour(mapping, filtering, behind))
    assert report.raknet == raknet and report.friendly == friendly
    assert report.mapping == (mapping.value if mapping else "")


def test_port_restricted_players_cannot_reach_symmetric_ones() -> None:
    moderate = report_from(Behaviour(B.EI, B.APD)).raknet
    strict = report_from(Behaviour(B.APD, B.APD)).raknet
    # RakNet says no; the SDK's birthday step connects them anyway (lab test).
    assert not can_connect(moderate, strict)
    assert can_connect(report_from(Behaviour(B.EI, B.EI)).raknet, strict)


async def test_sdk_detects_nat_type_against_crossroads_stun() -> None:
    from crossroads.client.p2p import P2PClient
    from crossroads.config import default_config
    from crossroads.runtime import start
    from tests.conftest import loopback_config

    rt = await start(
        default_config(
            loopback_config(
                core__only="stun,p2p", stun__alt_host="127.0.0.2", stun__rfc5780=True
            )
        )
    )
    try:
        udp = next(
            d for d in rt.services["stun"].describe() if d.startswith("udp 127.0.0.1:")
        )
        stun_port = int(udp.rsplit(":", 1)[1].split()[0])
        host, port = rt.http_address
        client = P2PClient(
            f"ws://{host}:{port}/p2p/v1/ws",
            bind=("127.0.0.1", 0),
            stun=("127.0.0.1", stun_port),
        )
        try:
            await client.start()
            assert client.nat is not None
            # loopback: no NAT, nothing filtered; RakNet calls that "None" / "Open"
            assert client.nat.behind_nat is False
            assert client.nat.mapping == "endpoint-independent"
            assert client.nat.filtering == "endpoint-independent"
            assert (client.nat.raknet, client.nat.friendly) == (NatType.NONE, "Open")
            assert client._candidates().nat == "None"
        finally:
            await client.close()
    finally:
        await rt.close()
