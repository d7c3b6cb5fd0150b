"""A real miniupnpd answers NAT-PMP on the LAN side of the restricted-cone and
cgnat routers; a mapping makes the host reachable from another site; behind the
carrier-grade NAT, miniupnpd's own STUN check refuses port forwarding."""

from __future__ import annotations

import pytest

from crossroads.lab import natpmp
from crossroads.lab.methods import direct
from crossroads.lab.topology import Lab
from crossroads.lab.udp import local

pytestmark = [pytest.mark.lab, pytest.mark.interop, pytest.mark.timeout(60)]


async def test_miniupnpd_maps_a_port_that_another_site_reaches(lab: Lab) -> None:
    home = lab.site("restricted-cone-a")
    other = lab.site("symmetric-random-b")
    await lab.reset_nat(home)
    listener = lab.udp_socket(home)
    sender = lab.udp_socket(other)
    port = local(listener)[1]
    try:
        assert await direct.exchange(sender, listener, (home.public_ip, port)) is None
        answer = await natpmp.public_address(listener, home.gateway)
        assert answer == (0, home.public_ip)
        mapping = await natpmp.map_udp(listener, home.gateway, port, 60)
        assert mapping is not None and mapping.result == 0
        target = (home.public_ip, mapping.external_port)
        assert await direct.exchange(sender, listener, target) is not None
        removed = await natpmp.map_udp(listener, home.gateway, port, 0)
        assert removed is not None and removed.result == 0
        await lab.reset_nat(home)
        assert await direct.exchange(sender, listener, target) is None
    finally:
        listener.close()
        sender.close()


async def test_miniupnpd_behind_cgnat_refuses_to_forward(lab: Lab) -> None:
    home = lab.site("cgnat-a")
    sock = lab.udp_socket(home)
    try:
        # It learnt the CGN's public address by STUN, and that the CGN filters.
        assert await natpmp.public_address(sock, home.gateway) == (0, home.public_ip)
        mapping = await natpmp.map_udp(sock, home.gateway, local(sock)[1], 60)
        # RFC 6886 section 3.5 result 3: Network Failure.
        assert mapping is not None and mapping.result == 3
    finally:
        sock.close()


async def test_no_natpmp_on_routers_without_miniupnpd(lab: Lab) -> None:
    site = lab.site("port-restricted-cone-a")
    sock = lab.udp_socket(site)
    try:
        assert await natpmp.public_address(sock, site.gateway, 0.3) is None
    finally:
        sock.close()
