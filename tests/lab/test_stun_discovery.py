"""Behaviour discovery through real NAT: crossroads' RFC 5780 client
(``crossroads.client.stun.discover_nat``), run on each kind's lab host, against
crossroads' STUN server with two addresses on the lab server, classifies every
kind correctly (mapping, filtering, hairpinning) — one test per kind."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from typing import Any

import pytest

from crossroads.lab import netns
from crossroads.lab.kinds import KINDS, Filtering, Mapping, NatKind
from crossroads.lab.topology import SERVER_IPS, Lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]

#: The lab server's STUN port (crossroads' default).
STUN_PORT = 3478

SCRIPT = """
import asyncio, json, sys
from crossroads.client.stun import StunTimeout, discover_nat

async def main():
    try:
        b = await discover_nat((sys.argv[1], int(sys.argv[2])))
    except StunTimeout:
        print(json.dumps({"udp": False}))
        return
    print(json.dumps({
        "udp": True,
        "behind_nat": b.behind_nat,
        "mapping": None if b.mapping is None else str(b.mapping),
        "filtering": None if b.filtering is None else str(b.filtering),
        "hairpinning": b.hairpinning,
        "mapped": list(b.mapped),
    }))

asyncio.run(main())
"""

# With no NAT, RFC 5780 tests see an endpoint-independent "mapping" (the host's
# own address) and no filter at all.
EXPECTED_MAPPING = {
    Mapping.NONE: "endpoint-independent",
    Mapping.ENDPOINT_INDEPENDENT: "endpoint-independent",
    Mapping.ADDRESS_DEPENDENT: "address-dependent",
    Mapping.ADDRESS_AND_PORT_DEPENDENT: "address-and-port-dependent",
}
EXPECTED_FILTERING = {
    Filtering.NONE: "endpoint-independent",
    Filtering.ENDPOINT_INDEPENDENT: "endpoint-independent",
    Filtering.ADDRESS_DEPENDENT: "address-dependent",
    Filtering.ADDRESS_AND_PORT_DEPENDENT: "address-and-port-dependent",
}


@pytest.fixture(scope="module")
def discovered(lab: Lab) -> dict[str, dict[str, Any]]:
    if importlib.util.find_spec("crossroads.client.stun") is None:
        pytest.skip("crossroads.client.stun is not merged into this tree yet")
    from crossroads.services import SERVICE_MODULES

    if "stun" not in SERVICE_MODULES:
        pytest.skip("the STUN service is not merged into this tree yet")

    async def run_all() -> list[str]:
        argv = [sys.executable, "-c", SCRIPT, SERVER_IPS[0], str(STUN_PORT)]
        return await asyncio.gather(
            *(
                netns.run_in(lab.host_ns(lab.site(k.name)), argv, timeout=90)
                for k in KINDS
            )
        )

    outputs = asyncio.run(run_all())
    return {k.name: json.loads(out) for k, out in zip(KINDS, outputs, strict=True)}


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_crossroads_client_classifies(
    lab: Lab, discovered: dict[str, dict[str, Any]], kind: NatKind
) -> None:
    got = discovered[kind.name]
    assert got["udp"] == kind.udp, got
    if not kind.udp:
        return
    site = lab.site(kind.name)
    assert got["behind_nat"] == kind.natted, got
    assert got["mapped"][0] == site.public_ip, got
    assert got["mapping"] == EXPECTED_MAPPING[kind.mapping], got
    assert got["filtering"] == EXPECTED_FILTERING[kind.filtering], got
    assert got["hairpinning"] == kind.hairpin, got
