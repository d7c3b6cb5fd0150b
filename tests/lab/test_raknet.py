"""RakNet's TTL-2 datagram in the lab (reference raknet-wire.md §3, §8): before
punching, a stock NatPunchthroughClient sends its peer two bytes with IP TTL 2
(``RakPeer::SendTTL``), which open its own NAT's mapping and die at the next
router. That only works if the lab, like the internet, has a routed hop
between the NAT sites: with both NATs on one segment the datagram reaches the
other NAT and can disturb its mapping (the stock client failed 2/2 there).
The lab's ``raknet`` method sends it (lab/methods/raknet.py); its proxy
fallback is checked here too."""

from __future__ import annotations

import pytest

from crossroads.lab import netns
from crossroads.lab.kinds import KINDS_BY_NAME
from crossroads.lab.matrix import Attempt, run_attempt, run_matrix
from crossroads.lab.methods.raknet import (
    METHOD,
    TTL_PROBE,
    TTL_PROBE_HOPS,
    send_with_ttl,
)
from crossroads.lab.topology import Lab
from crossroads.lab.udp import local, recv, send
from tests.conftest import eventually

pytestmark = [pytest.mark.lab, pytest.mark.timeout(60)]


async def test_the_ttl_2_datagram_dies_at_the_internet_router(lab: Lab) -> None:
    """Sent to a public host behind no NAT: a datagram sent after it at TTL 3
    (one hop more: host -> its NAT -> internet router -> receiver) arrives
    first, so the probe went no further than the internet router -- but it did
    leave the sender's NAT (its router's conntrack holds the flow)."""
    sender_site, receiver_site = lab.site("port-restricted-cone-a"), lab.site("open-a")
    await lab.reset_nat(sender_site)
    sender, receiver = lab.udp_socket(sender_site), lab.udp_socket(receiver_site)
    try:
        to = local(receiver)
        send_with_ttl(sender, TTL_PROBE, to, TTL_PROBE_HOPS)
        send_with_ttl(sender, b"one hop more", to, TTL_PROBE_HOPS + 1)
        got = await recv(receiver, 10.0)
        assert got is not None and got[0] == b"one hop more"

        async def mapping_opened() -> bool:
            table = await netns.run_in(
                lab.router_ns(sender_site), ["conntrack", "-L", "-p", "udp"]
            )
            return f"dport={to[1]} " in table

        await eventually(mapping_opened, "the probe's flow in the sender's NAT")
        # the socket's own TTL is back: a plain datagram arrives too
        send(sender, b"plain", to)
        got = await recv(receiver, 10.0)
        assert got is not None and got[0] == b"plain"
    finally:
        sender.close()
        receiver.close()


async def test_the_probe_lets_the_peer_in_without_disturbing_its_nat(
    lab: Lab,
) -> None:
    """What the probe is for, between two NATs: host S (port-restricted: only
    flows it opened get in) probes T's public address; T sits behind the
    router that remaps a mapping once a stranger's packet arrived first
    (port-restricted-remap). T's first datagram to S still leaves from its
    usual port -- the probe never reached T's router -- and gets into S's
    NAT, which the probe opened. (A probe at the normal TTL would reach T's
    router first and make it remap: tests/lab/test_probe.py.)"""
    s_site, t_site = (
        lab.site("port-restricted-cone-a"),
        lab.site("port-restricted-remap-a"),
    )
    await lab.reset_nat(s_site)
    await lab.reset_nat(t_site)
    s, t = lab.udp_socket(s_site), lab.udp_socket(t_site)
    try:
        t_port, s_port = local(t)[1], local(s)[1]
        send_with_ttl(s, TTL_PROBE, (t_site.public_ip, t_port), TTL_PROBE_HOPS)

        async def probe_left_s() -> bool:
            table = await netns.run_in(
                lab.router_ns(s_site), ["conntrack", "-L", "-p", "udp"]
            )
            return f"dport={t_port} " in table

        await eventually(probe_left_s, "the probe's flow in S's NAT")
        send(t, b"hello", (s_site.public_ip, s_port))
        got = await recv(s, 10.0)
        assert got is not None
        assert got == (b"hello", (t_site.public_ip, t_port))
    finally:
        s.close()
        t.close()


async def test_the_proxy_fallback_chooses_between_two_forwarders_by_ping(
    lab: Lab,
) -> None:
    """The ``raknet`` method between two random-port NATs: the punch fails and
    the UDP proxy carries the game, after RakNet's ping round (``5c 07`` /
    ``5c 08``) over two forwarders -- the server's own (a relay node) and the
    lab's second UDPProxyServer, logged in from the other server address."""
    a, b = lab.site("symmetric-random-a"), lab.site("symmetric-random-b")
    result = await run_attempt(METHOD, Attempt(lab, a, b))
    assert result.connected and result.via == "relay"
    assert "chosen by ping from 2" in result.detail, result.detail


async def test_parallel_attempts_share_one_second_proxy_server(lab: Lab) -> None:
    """A matrix run logs one second UDPProxyServer in for all its attempts: two
    relay pairs that run at once (no site in common) are each offered the
    server's own forwarder and that one, never the other attempt's -- which,
    when it was its own and closed with its attempt, took the forwarder of a
    pair still sending game data through it (the flaky matrix cell)."""
    kinds = [KINDS_BY_NAME["symmetric-random"], KINDS_BY_NAME["symmetric-sequential"]]
    results = await run_matrix(lab, [METHOD], kinds=kinds)
    assert len(results) == 3
    for result in results:
        assert result.connected and result.via == "relay", result
        assert "chosen by ping from 2" in result.detail, result
