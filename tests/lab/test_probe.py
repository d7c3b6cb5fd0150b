"""Every lab NAT kind behaves as declared: mapping, port allocation, filtering and
hairpinning, measured with the lab's own UDP probes from the hosts to the
server's two addresses and two ports (RFC 5780 section 4 tests)."""

from __future__ import annotations

import pytest

from crossroads.lab.kinds import KINDS, Filtering, Mapping, NatKind
from crossroads.lab.probe import Reflector, measure
from crossroads.lab.topology import Lab

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


@pytest.mark.parametrize("letter", ["a", "b"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
async def test_kind_behaves_as_declared(lab: Lab, kind: NatKind, letter: str) -> None:
    site = lab.site(f"{kind.name}-{letter}")
    async with Reflector(lab) as reflector:
        got = await measure(lab, site, reflector)
    k = site.kind
    assert got.udp == k.udp
    if not k.udp:
        return
    assert got.public_ip == site.public_ip
    assert (got.mapping, got.filtering, got.allocation, got.hairpin) == (
        k.mapping,
        k.filtering,
        k.allocation,
        k.hairpin,
    )


async def test_hairpinning_can_be_switched(lab: Lab) -> None:
    cone = lab.site("port-restricted-cone-b")
    symmetric = lab.site("symmetric-sequential-b")
    async with Reflector(lab) as reflector:
        try:
            await lab.set_hairpin(cone, False)
            await lab.set_hairpin(symmetric, True)
            off = await measure(lab, cone, reflector)
            on = await measure(lab, symmetric, reflector)
        finally:
            await lab.set_hairpin(cone, True)
            await lab.set_hairpin(symmetric, False)
        restored = await measure(lab, cone, reflector)
    assert not off.hairpin and on.hairpin and restored.hairpin
    # Switching hairpinning leaves mapping and filtering alone.
    assert off.mapping is Mapping.ENDPOINT_INDEPENDENT
    assert off.filtering is Filtering.ADDRESS_AND_PORT_DEPENDENT
    assert on.mapping is Mapping.ADDRESS_AND_PORT_DEPENDENT
