"""GameSpy NAT negotiation through real kernel NAT: the SDK client emulation on lab
hosts, crossroads' natneg server on the lab server (natneg1/2 on its first address,
natneg3 on its second)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from crossroads.lab.kinds import KINDS_BY_NAME
from crossroads.lab.matrix import (
    SDK_TEST_COOKIE,
    SHARED_COOKIE,
    Attempt,
    Delays,
    run_attempt,
    run_matrix,
    unexpected,
)
from crossroads.lab.methods.natneg import (
    METHOD,
    SERVERS,
    extra_server_args,
    game_data_crosses,
    negotiate,
    run,
    servers_at,
    succeeded,
)
from crossroads.lab.natneg_sdk import SdkNegotiator, detect_nat
from crossroads.lab.topology import SERVER_IPS, Lab
from crossroads.proto.natneg.packets import NatType, NegotiateResult
from crossroads.types import Address

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


async def reset(lab: Lab, *names: str) -> None:
    await asyncio.gather(*(lab.reset_nat(lab.site(name)) for name in names))


async def test_direct_negotiation_through_nat(lab: Lab) -> None:
    await reset(lab, "port-restricted-cone-a", "full-cone-b")
    a, b = lab.site("port-restricted-cone-a"), lab.site("full-cone-b")
    host, guest = await negotiate(lab, a, b, 0x11112222)
    try:
        assert succeeded(host, guest)
        assert host.outcome and guest.outcome
        # Each pings the other's public mapping (the routers keep the host's port).
        assert host.outcome.remote and host.outcome.remote[0] == b.public_ip
        assert guest.outcome.remote and guest.outcome.remote[0] == a.public_ip
        assert await game_data_crosses(host, guest)
    finally:
        SdkNegotiator.close_all()


async def test_symmetric_pair_is_relayed(lab: Lab) -> None:
    await reset(lab, "symmetric-random-a", "symmetric-sequential-b")
    a, b = lab.site("symmetric-random-a"), lab.site("symmetric-sequential-b")
    host, guest = await negotiate(lab, a, b, 0x33334444)
    try:
        assert succeeded(host, guest)
        assert host.outcome and guest.outcome
        # The server saw different NN1/NN3 mappings on both sides and put a relay
        # port pair on its own address into the CONNECTs.
        assert host.outcome.remote and host.outcome.remote[0] == SERVER_IPS[0]
        assert guest.outcome.remote and guest.outcome.remote[0] == SERVER_IPS[0]
        assert host.outcome.remote != guest.outcome.remote
        assert await game_data_crosses(host, guest)
    finally:
        SdkNegotiator.close_all()


async def test_symmetric_against_port_filtering_is_relayed_on_the_first_attempt(
    lab: Lab,
) -> None:
    """One endpoint-dependent mapping against address-and-port-dependent
    filtering: the pings could never meet (they failed for ~6.4 s, and only the
    retry was relayed). The server sees the symmetric NAT in the NN1/NN3 INITs
    and the port filter in its probe (an ERT from another port goes unanswered),
    and relays the first attempt."""
    await reset(lab, "symmetric-random-b", "port-restricted-cone-b")
    a, b = lab.site("symmetric-random-b"), lab.site("port-restricted-cone-b")
    host, guest = await negotiate(lab, a, b, 0x55556666)
    try:
        assert succeeded(host, guest)
        assert host.outcome and host.outcome.remote
        assert guest.outcome and guest.outcome.remote
        assert host.outcome.remote[0] == SERVER_IPS[0]  # relayed
        assert guest.outcome.remote[0] == SERVER_IPS[0]
        assert await game_data_crosses(host, guest)
    finally:
        SdkNegotiator.close_all()


async def test_back_to_back_on_cookie_666_every_pair_connects_first(
    lab: Lab,
) -> None:
    """A small back-to-back matrix with the SDK-faithful players (a process
    each, game socket lent, NAT detection alongside, 10 ms poll): one cell after
    another on cookie 666 with no pause, so every negotiation meets the session
    the previous cell left on the cookie. Every cell connects on the first
    attempt as predicted: directly between the cones, through the relay the
    server picks at INIT for the symmetric NAT against the port filters."""
    kinds = [
        KINDS_BY_NAME[name]
        for name in ("port-restricted-cone", "symmetric-random", "cgnat")
    ]
    results = await run_matrix(lab, [METHOD], kinds=kinds, back_to_back=True)
    assert len(results) == 6
    assert unexpected(results) == [], [r for r in unexpected(results)]
    assert all(r.first_attempt for r in results), results
    vias = {(r.a, r.b): r.via for r in results}
    assert vias[("port-restricted-cone", "symmetric-random")] == "relay"
    assert vias[("symmetric-random", "cgnat")] == "relay"
    assert vias[("port-restricted-cone", "cgnat")] == "punch"


async def test_a_partner_nearer_than_a_dead_waiters_restart_connects_first(
    lab: Lab,
) -> None:
    """The back-to-back matrix's last differing cell, alone: on cookie 666 the
    `cgnat` host waits for a partner behind a UDP-blocking router, which never
    reaches the server, and the lobby stops both; the next game pairs the same
    host (a new process, new sockets) with a `port-restricted-remap` guest
    nearer the server. The guest's INITs complete the pair with the dead
    host's record. The matrix's draw (21.8 against 74.1 ms) left the CONNECTs
    a few ms before the new host's INITs, a race that connected alone (6/6);
    here the host is 100 ms away and the guest 10 ms, so the CONNECTs (after
    the guest's ~20 ms round trip) always left before the restart and the
    guest pinged the dead process's ports for 6.4 s. The server now asks the
    silent record whether it is alive (one ERT); the restart replaces it, or
    the unanswered ERT drops it and the restart joins, and the pair punches on
    its first attempt."""
    shared: dict[str, object] = {SHARED_COOKIE: SDK_TEST_COOKIE, "cleanups": []}
    host = lab.site("cgnat-a")
    blocked = Attempt(lab, host, lab.site("udp-blocked-b"), shared)
    alone = await run_attempt(METHOD, blocked)
    assert not alone.connected, alone
    pair = Attempt(lab, host, lab.site("port-restricted-remap-b"), shared)
    result = await run_attempt(METHOD, pair, Delays(0.1, 0.01, 0.0215))
    assert result.connected and result.first_attempt, result
    assert result.via == "punch", result


async def test_players_in_two_processes_connect_on_the_first_attempt(
    lab: Lab,
) -> None:
    """The matrix's natneg attempt: each player a process in its own host's
    namespace (game socket lent by the host, NAT detection alongside), the lobby
    starting both; a port-restricted cone and a full cone punch at once and
    their game data crosses."""
    await reset(lab, "port-restricted-cone-a", "full-cone-b")
    a, b = lab.site("port-restricted-cone-a"), lab.site("full-cone-b")
    outcome = await run(Attempt(lab, a, b))
    assert outcome.connected and outcome.first_attempt, outcome
    assert outcome.via == "punch"
    # Each REPORT carried what that player's own detection had found by then.
    assert outcome.detail.startswith("detected A "), outcome


async def test_cookie_666_back_to_back_through_the_relay(lab: Lab) -> None:
    """The two cookie-reuse bugs, as the SDK test program meets them: cookie
    666 every time, the host's game socket lent each time, the second negotiation
    right after the first, both relayed (two symmetric NATs). The second must get
    a session of its own (its game-socket INIT counted, no deadline of the first)
    and a relay pair of its own."""
    a, b = lab.site("symmetric-random-b"), lab.site("symmetric-sequential-a")
    await reset(lab, a.name, b.name)
    game_sock = lab.udp_socket(a)
    relays: list[Address] = []
    try:
        for _ in range(2):
            host, guest = await negotiate(lab, a, b, 666, game_sock=game_sock)
            try:
                assert succeeded(host, guest)
                assert host.outcome and host.outcome.remote
                assert host.outcome.remote[0] == SERVER_IPS[0]  # relayed
                assert host.outcome.sock is game_sock
                relays.append(host.outcome.remote)
                assert await game_data_crosses(host, guest)
            finally:
                host.release()
                guest.release()
        assert relays[0] != relays[1]
    finally:
        game_sock.close()


@pytest.mark.parametrize(
    ("site", "want"),
    [
        ("open-a", NatType.NO_NAT),
        ("full-cone-a", NatType.FULL_CONE),
        ("restricted-cone-a", NatType.RESTRICTED_CONE),
        ("port-restricted-cone-a", NatType.PORT_RESTRICTED_CONE),
        ("symmetric-random-a", NatType.SYMMETRIC),
    ],
)
async def test_sdk_nat_detection_through_nat(
    lab: Lab, site: str, want: NatType
) -> None:
    """The SDK's own NAT detection classifies each kind right: the server's ERTs
    come from an uncontacted IP (natneg3) and from a second port, and natneg2/3
    sit on different IPs."""
    await reset(lab, site)
    where = lab.site(site)
    result = await detect_nat(
        SERVERS,
        local_ip=where.host_ip,
        timeout=2.0,
        make_socket=lambda: lab.udp_socket(where),
    )
    assert result.success
    assert result.nat_type == want, result


# --------------------------------------------------------- remapping routers

#: The two sites where the first attempt failed: port-restricted cones behind routers that accept
#: unsolicited input, so a ping that arrives first makes the router remap.
REMAP_A, REMAP_B = "port-restricted-remap-a", "port-restricted-remap-b"
#: Geometry that makes the race real: the server is 100 ms (one way) from site a
#: and next to site b, while a and b are 40 ms apart. With CONNECTs sent together,
#: b pings 100 ms before a and its ping is at a's router 60 ms before a sends;
#: timed, both ping together and each ping has 40 ms to spare (more than the
#: clients' 10 ms polling and a loaded machine's timer slack).
FAR_SERVER_S, PEERS_S = 0.100, 0.040
#: Ports of a second natneg server that sends both CONNECTs at once (as GameSpy's
#: did), beside the lab's own (timed) one.
UNTIMED_PORT, UNTIMED_HTTP_PORT = 27911, 8091


@pytest.fixture
async def untimed_server(lab: Lab) -> AsyncIterator[list[Address]]:
    """A second natneg server in the server namespace that sends both CONNECTs
    at once; yields its natneg1/2/3 addresses."""
    args = extra_server_args(UNTIMED_PORT, timed=False)
    await lab.start_extra_server("natneg-untimed", args, UNTIMED_HTTP_PORT)
    try:
        yield servers_at(UNTIMED_PORT)
    finally:
        await lab.stop_extra_server("natneg-untimed")


async def negotiate_far_server(
    lab: Lab, cookie: int, servers: list[Address]
) -> tuple[SdkNegotiator, SdkNegotiator]:
    a, b = lab.site(REMAP_A), lab.site(REMAP_B)
    await reset(lab, REMAP_A, REMAP_B)
    async with (
        lab.path_delay(a, "server", FAR_SERVER_S, table=77) as far,
        lab.path_delay(a, b, PEERS_S, table=78) as near,
    ):
        host, guest = await negotiate(lab, a, b, cookie, servers)
    assert far.packets and near.packets  # both lines carried the negotiation
    return host, guest


async def test_remapping_routers_fail_first_when_connects_go_together(
    lab: Lab, untimed_server: list[Address]
) -> None:
    """The failure: CONNECTs sent together (GameSpy's way). b's first
    ping reaches a's router before a has sent anything; the router takes it in,
    and a's own pings leave from a remapped port that b's router never opened."""
    host, guest = await negotiate_far_server(lab, 0x15151515, untimed_server)
    try:
        assert host.outcome and guest.outcome
        assert NegotiateResult.PING_TIMEOUT in (
            host.outcome.result,
            guest.outcome.result,
        )
    finally:
        SdkNegotiator.close_all()


async def test_timed_connects_cross_behind_remapping_routers(lab: Lab) -> None:
    """The fix: the lab server times the CONNECTs from the measured
    round trips; both first pings leave together, cross in flight, and the first
    attempt connects directly."""
    host, guest = await negotiate_far_server(lab, 0x15151516, SERVERS)
    try:
        assert succeeded(host, guest)
        assert host.outcome and guest.outcome
        a, b = lab.site(REMAP_A), lab.site(REMAP_B)
        assert host.outcome.remote and host.outcome.remote[0] == b.public_ip
        assert guest.outcome.remote == (
            a.public_ip,
            host.negotiate_sock.getsockname()[1],
        )
        assert await game_data_crosses(host, guest)
    finally:
        SdkNegotiator.close_all()
