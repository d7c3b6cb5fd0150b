"""Every lab NAT kind behaves as declared: mapping, port allocation, filtering and
hairpinning, measured with the lab's own UDP probes from the hosts to the
server's two addresses and two ports (RFC 5780 section 4 tests)."""

from __future__ import annotations

import pytest

from crossroads.lab import netns
from crossroads.lab.kinds import KINDS, VARIANT_KINDS, Filtering, Mapping, NatKind
from crossroads.lab.probe import Reflector, measure
from crossroads.lab.topology import Lab
from crossroads.lab.udp import local, recv, send
from tests.conftest import eventually

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


@pytest.mark.parametrize("letter", ["a", "b"])
@pytest.mark.parametrize(
    "kind", (*KINDS, *VARIANT_KINDS), ids=[k.name for k in (*KINDS, *VARIANT_KINDS)]
)
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


async def test_remap_router_remaps_after_a_knock(lab: Lab) -> None:
    """port-restricted-remap: a packet from a peer that arrives before the host
    has sent anything is taken in by the router (conntrack confirms it), and the
    host's own first packet to that peer then leaves from another port."""
    site, peer = lab.site("port-restricted-remap-a"), lab.site("open-a")
    await lab.reset_nat(site)
    host = lab.udp_socket(site)
    knocker = lab.udp_socket(peer)
    try:
        port = local(host)[1]
        send(knocker, b"knock", (site.public_ip, port))

        async def knock_is_state() -> bool:
            table = await netns.run_in(
                lab.router_ns(site), ["conntrack", "-L", "-p", "udp"]
            )
            return f"dport={port} " in table

        await eventually(knock_is_state, "the knock in the router's conntrack")
        send(host, b"hello", local(knocker))
        got = await recv(knocker, 5.0)
        assert got is not None and got[0] == b"hello"
        assert got[1][0] == site.public_ip and got[1][1] != port  # remapped
    finally:
        host.close()
        knocker.close()
