"""Cross-check the lab with a third-party RFC 5780 client: coturn's
``turnutils_natdiscovery`` (mapping, filtering, hairpinning) run on every kind's
host against the lab's coturn STUN server on the two server addresses must
report each kind's declared behaviour."""

from __future__ import annotations

import asyncio
import re

import pytest

from crossroads.lab import netns
from crossroads.lab.kinds import KINDS, Filtering, Mapping
from crossroads.lab.topology import COTURN_STUN_PORT, SERVER_IPS, Lab

pytestmark = [pytest.mark.lab, pytest.mark.interop, pytest.mark.timeout(120)]

# coturn names a host without NAT "endpoint independent" (it cannot tell them apart).
MAPPING_NAMES = {
    Mapping.NONE: "Endpoint Independent",
    Mapping.ENDPOINT_INDEPENDENT: "Endpoint Independent",
    Mapping.ADDRESS_DEPENDENT: "Address Dependent",
    Mapping.ADDRESS_AND_PORT_DEPENDENT: "Address and Port Dependent",
}
FILTERING_NAMES = {
    Filtering.NONE: "Endpoint Independent",
    Filtering.ENDPOINT_INDEPENDENT: "Endpoint Independent",
    Filtering.ADDRESS_DEPENDENT: "Address Dependent",
    Filtering.ADDRESS_AND_PORT_DEPENDENT: "Address and Port Dependent",
}


async def natdiscovery_agrees(lab: Lab, port: int) -> None:
    """turnutils_natdiscovery on every kind's host against the STUN server on
    ``port`` of the lab server reports each kind's declared behaviour."""
    argv = ["turnutils_natdiscovery", "-m", "-f", "-H", "-p", str(port), SERVER_IPS[0]]
    sites = [lab.site(kind.name) for kind in KINDS]
    outputs = await asyncio.gather(
        *(
            netns.run_in(lab.host_ns(site), argv, check=False, timeout=60)
            for site in sites
        )
    )
    for site, out in zip(sites, outputs, strict=True):
        kind = site.kind
        mapping = re.search(r"NAT with (.+) Mapping!", out)
        filtering = re.search(r"NAT with (.+) Filtering!", out)
        hairpin = "successful hairpinning" in out
        if not kind.udp:
            assert mapping is None and filtering is None, out
            continue
        assert mapping is not None and filtering is not None, (kind.name, out)
        assert mapping.group(1) == MAPPING_NAMES[kind.mapping], (kind.name, out)
        assert filtering.group(1) == FILTERING_NAMES[kind.filtering], (kind.name, out)
        assert hairpin == kind.hairpin, (kind.name, out)


async def test_coturn_natdiscovery_agrees_with_every_kind(lab: Lab) -> None:
    await natdiscovery_agrees(lab, COTURN_STUN_PORT)


async def test_crossroads_stun_classifies_every_kind_for_coturn_client(
    lab: Lab,
) -> None:
    """The same third-party RFC 5780 client against crossroads' own STUN server
    (two addresses, alternate port) on the lab server."""
    from crossroads.services import SERVICE_MODULES

    if "stun" not in SERVICE_MODULES:
        pytest.skip("the STUN service is not merged into this tree yet")
    await natdiscovery_agrees(lab, 3478)
