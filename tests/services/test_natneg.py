"""The natneg service over loopback, driven by an SDK-like client (natneg_sdk.py).

Server addresses: natneg1 127.0.0.1, natneg2 127.0.0.2, natneg3 127.0.0.3 and an
"unsolicited IP" probe source 127.0.0.4, all on OS-chosen ports. Clients that must look
like different public hosts bind their negotiate socket to 127.0.0.5 / 127.0.0.6.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.proto.natneg.packets import (
    MAGIC,
    Init,
    MappingScheme,
    NatType,
    NegotiateResult,
    PacketType,
)
from crossroads.proto.natneg.server import NatNegSocket
from crossroads.runtime import Runtime, start
from crossroads.services.natneg import (
    Config,
    NatNegService,
    apply_seed_config,
    plan_layout,
)
from tests.conftest import eventually, loopback_config, running_service
from tests.services.natneg_sdk import (
    SdkNegotiator,
    State,
    detect_nat,
    read_game_data,
)

pytestmark = pytest.mark.timeout(60)

Address = tuple[str, int]
Starter = Callable[..., Awaitable[Runtime]]


@pytest.fixture(autouse=True)
def close_negotiators() -> Iterator[None]:
    try:
        yield
    finally:
        SdkNegotiator.close_all()


@pytest.fixture
async def natneg() -> AsyncIterator[Starter]:
    """Start a runtime with only natneg, on loopback, with tight timers."""
    runtimes: list[Runtime] = []

    async def starter(**overrides: Any) -> Runtime:
        values = {
            "core__only": "natneg",
            "natneg__natneg2_host": "127.0.0.2",
            "natneg__natneg2_port": 0,
            "natneg__natneg3_host": "127.0.0.3",
            "natneg__natneg3_port": 0,
            "natneg__probe_host": "127.0.0.4",
            "natneg__probe_port": 0,
            "natneg__session_timeout": 1.5,
            "natneg__connect_interval": 0.3,
            "natneg__linger": 2.0,
            "natneg__relay_host": "127.0.0.1",
            "natneg__relay_allow": "127.0.0.0/8",
            **overrides,
        }
        rt = await start(default_config(loopback_config(**values)))
        runtimes.append(rt)
        return rt

    try:
        yield starter
    finally:
        for rt in runtimes:
            await rt.close()


def service_of(rt: Runtime) -> NatNegService:
    return running_service(rt, "natneg", NatNegService)


def servers(rt: Runtime) -> list[Address]:
    addresses = service_of(rt).addresses
    return [
        addresses[NatNegSocket.PRIMARY],
        addresses.get(NatNegSocket.NATNEG2, addresses[NatNegSocket.PRIMARY]),
        addresses.get(NatNegSocket.NATNEG3, addresses[NatNegSocket.PRIMARY]),
    ]


def metric(rt: Runtime, name: str, **labels: str) -> float:
    value = rt.metrics.get_sample_value(name, labels)
    return 0.0 if value is None else value


def game_socket(ip: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind((ip, 0))
    return sock


def address_of(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return (host, port)


def negotiators(
    srv: list[Address],
    version: int,
    cookie: int,
    *,
    host: dict[str, Any] | None = None,
    guest: dict[str, Any] | None = None,
    **common: Any,
) -> tuple[SdkNegotiator, SdkNegotiator]:
    """The two SDK clients of one negotiation: the host (client index 1) and the
    guest (0). ``common`` goes to both, ``host`` and ``guest`` to one each."""

    def one(index: int, extra: dict[str, Any] | None) -> SdkNegotiator:
        return SdkNegotiator(
            version=version,
            cookie=cookie,
            client_index=index,
            servers=srv,
            **common,
            **(extra or {}),
        )

    return one(1, host), one(0, guest)


async def both(a: SdkNegotiator, b: SdkNegotiator) -> None:
    try:
        await asyncio.gather(a.run(), b.run())
    finally:
        a.close()
        b.close()


async def game_host_and_guest(
    srv: list[Address], cookie: int, host_game: socket.socket
) -> tuple[SdkNegotiator, SdkNegotiator]:
    """A v4 negotiation: the host (index 1) lends ``host_game``, the guest (index
    0) negotiates from another "public" address; both must succeed."""
    host, guest = negotiators(
        srv,
        4,
        cookie,
        host={"game_sock": host_game},
        guest={"bind_ip": "127.0.0.5"},
    )
    await both(host, guest)
    assert host.outcome and guest.outcome
    assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
    return host, guest


async def exchange_game_data(
    a: SdkNegotiator, b: SdkNegotiator
) -> tuple[Address, Address]:
    """Each side sends 'woohoo!!' (the SDK test program's message) to its remote
    address on the socket it got back; returns where each one came from."""
    assert a.outcome and b.outcome and a.outcome.sock and b.outcome.sock
    assert a.outcome.remote and b.outcome.remote
    a.outcome.sock.sendto(b"woohoo!! from a", a.outcome.remote)
    b.outcome.sock.sendto(b"woohoo!! from b", b.outcome.remote)
    data_at_b, from_a = await read_game_data(b.outcome.sock)
    data_at_a, from_b = await read_game_data(a.outcome.sock)
    assert data_at_b == b"woohoo!! from a"
    assert data_at_a == b"woohoo!! from b"
    return from_a, from_b


# ------------------------------------------------------------------ negotiations


@pytest.mark.parametrize("version", [2, 3, 4])
async def test_full_negotiation_direct(natneg: Starter, version: int) -> None:
    rt = await natneg()
    srv = servers(rt)
    host_game = game_socket("127.0.0.1")
    try:
        # The host (index 1, as QR2 starts it) lends its game socket; the guest
        # negotiates on the SDK's own socket from another "public" address.
        host, guest = negotiators(
            srv,
            version,
            666 + version,
            host={
                "game_sock": host_game,
                "nat_type": NatType.FULL_CONE,
                "mapping_scheme": MappingScheme.PRIVATE_AS_PUBLIC,
            },
            guest={"bind_ip": "127.0.0.5"},
            finished_idle=0.3,
        )
        await both(host, guest)
        assert host.outcome is not None and guest.outcome is not None
        assert host.outcome.result == NegotiateResult.SUCCESS
        assert guest.outcome.result == NegotiateResult.SUCCESS
        host_addr = address_of(host_game)
        guest_addr = address_of(guest.negotiate_sock)
        # Direct: each one's remote is the other's own socket, pings came from it.
        assert host.outcome.remote == guest_addr
        assert guest.outcome.remote == host_addr
        assert set(host.log.pings_from) == {guest_addr}
        assert set(guest.log.pings_from) == {host_addr}
        assert (
            host.progress[:2] == [State.INITACK, State.CONNECTPING]
            or host.progress[0] == State.CONNECTPING
        )
        # Every server reply the SDK would check was big enough.
        assert host.log.too_small == 0 and guest.log.too_small == 0
        if version >= 3:
            # REPORT answered: the negotiator ended on REPORT_ACK, not retries.
            assert host.state == State.REPORTACK and guest.state == State.REPORTACK
            assert host.reports_sent == 1
        else:
            assert host.reports_sent == 0
        from_host, from_guest = await exchange_game_data(host, guest)
        assert from_guest == guest_addr and from_host == host_addr
        # Connected means a REPORT said so; v2 clients never REPORT, so theirs is
        # "unreported", known when the session's linger ends.
        outcome = "connected" if version >= 3 else "unreported"

        async def counted() -> bool:
            return (
                metric(
                    rt,
                    "crossroads_natneg_negotiations_total",
                    outcome=outcome,
                    relayed="false",
                    attempt="first",
                )
                == 1
            )

        await eventually(counted, f"one {outcome} negotiation")
        if version >= 3:
            assert metric(rt, "crossroads_natneg_reports_total", result="success") == 2
    finally:
        host_game.close()


async def test_same_public_ip_uses_private_addresses(natneg: Starter) -> None:
    rt = await natneg()
    srv = servers(rt)
    # Both behind "one NAT": every INIT leaves from 127.0.0.1. Each game socket
    # listens on all addresses and reports a distinct private address, so the
    # server's choice of the private address is visible in CONNECT.
    a_game = game_socket("0.0.0.0")
    b_game = game_socket("0.0.0.0")
    try:
        b, a = negotiators(
            srv,
            3,
            42,
            host={"game_sock": b_game, "local_ip": "127.0.0.8"},
            guest={"game_sock": a_game, "local_ip": "127.0.0.7"},
            finished_idle=0.2,
        )
        await both(a, b)
        assert a.outcome and b.outcome
        assert a.outcome.result == b.outcome.result == NegotiateResult.SUCCESS
        assert a.connect_guess == ("127.0.0.8", address_of(b_game)[1])
        assert b.connect_guess == ("127.0.0.7", address_of(a_game)[1])
    finally:
        a_game.close()
        b_game.close()


async def test_deadbeat_partner(natneg: Starter) -> None:
    rt = await natneg()
    host = SdkNegotiator(version=4, cookie=77, client_index=1, servers=servers(rt))
    try:
        outcome = await host.run(deadline=20)
    finally:
        host.close()
    assert outcome.result == NegotiateResult.DEADBEAT_PARTNER
    # No CONNECT_ACK for an error CONNECT and no REPORT after a deadbeat (ref §6).
    sent = [kind for kind, _ in host.log.sent]
    assert PacketType.CONNECT_ACK not in sent and PacketType.REPORT not in sent
    assert (
        metric(
            rt,
            "crossroads_natneg_negotiations_total",
            outcome="deadbeat",
            relayed="false",
            attempt="first",
        )
        == 1
    )


async def test_partner_init_timeout_code(natneg: Starter) -> None:
    rt = await natneg()
    srv = servers(rt)
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0))  # natneg2 "unreachable": nothing answers here
    try:
        host = SdkNegotiator(version=3, cookie=78, client_index=1, servers=srv)
        guest = SdkNegotiator(
            version=3,
            cookie=78,
            client_index=0,
            servers=[srv[0], address_of(dead), srv[2]],
            bind_ip="127.0.0.5",
        )
        await both(host, guest)
    finally:
        dead.close()
    assert host.outcome and guest.outcome
    # finished=2 (INIT_PACKETS_TIMEDOUT) from the server, well before the clients'
    # own 6 s INIT timeout.
    assert host.outcome.result == NegotiateResult.INIT_TIMEOUT
    assert guest.outcome.result == NegotiateResult.INIT_TIMEOUT
    assert (PacketType.CONNECT, srv[0]) in [(k, a) for k, a, _ in host.log.received]
    assert (
        metric(
            rt,
            "crossroads_natneg_negotiations_total",
            outcome="init-timeout",
            relayed="false",
            attempt="first",
        )
        == 1
    )


async def test_client_init_timeout_without_server() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        client = SdkNegotiator(
            version=4, cookie=79, client_index=0, servers=[address_of(silent)] * 3
        )
        outcome = await client.run(deadline=20)
        client.close()
    finally:
        silent.close()
    # 12 INIT batches 500 ms apart, then nr_inittimeout (ref §6).
    assert outcome.result == NegotiateResult.INIT_TIMEOUT
    inits = [kind for kind, _ in client.log.sent if kind == PacketType.INIT]
    assert len(inits) == 12 * 3


# ------------------------------------------------------------------ relay


async def test_relay_forced_by_config(natneg: Starter) -> None:
    rt = await natneg(natneg__relay_mode="always", natneg__relay_idle_timeout=1.0)
    srv = servers(rt)
    host_game = game_socket()
    try:
        host, guest = await game_host_and_guest(srv, 900, host_game)
        # Each was told a relay port and heard its peer from there, not directly.
        relay_for_host, relay_for_guest = host.outcome.remote, guest.outcome.remote
        assert relay_for_host and relay_for_guest
        assert relay_for_host[0] == relay_for_guest[0] == "127.0.0.1"
        assert relay_for_host != relay_for_guest
        assert set(host.log.pings_from) == {relay_for_host}
        assert set(guest.log.pings_from) == {relay_for_guest}
        from_host, from_guest = await exchange_game_data(host, guest)
        assert from_guest == relay_for_host and from_host == relay_for_guest
        assert metric(rt, "crossroads_natneg_relays") == 1
        assert metric(rt, "crossroads_natneg_relay_packets_total") >= 4
        assert (
            metric(rt, "crossroads_natneg_relay_decisions_total", reason="forced") == 1
        )
        assert (
            metric(
                rt,
                "crossroads_natneg_negotiations_total",
                outcome="connected",
                relayed="true",
                attempt="first",
            )
            == 1
        )
        # Idle relays are released (idle timeout 1 s, swept every 0.25 s).
        for _ in range(40):
            if metric(rt, "crossroads_natneg_relays") == 0:
                break
            await asyncio.sleep(0.1)
        assert metric(rt, "crossroads_natneg_relays") == 0
    finally:
        host_game.close()


async def test_relay_for_two_symmetric_mappings(natneg: Starter) -> None:
    rt = await natneg()  # relay_mode auto
    srv = servers(rt)
    host, guest = negotiators(
        srv,
        3,
        901,
        host={"bind_ip": "127.0.0.6"},
        guest={"bind_ip": "127.0.0.5"},
        split_mappings=True,
        finished_idle=0.2,
    )
    await both(host, guest)
    assert host.outcome and guest.outcome
    assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
    assert host.outcome.remote and host.outcome.remote[0] == "127.0.0.1"
    assert (
        metric(
            rt,
            "crossroads_natneg_negotiations_total",
            outcome="connected",
            relayed="true",
            attempt="first",
        )
        == 1
    )
    # One symmetric side alone gets a direct path.
    h2, g2 = negotiators(
        srv,
        3,
        902,
        host={"bind_ip": "127.0.0.6", "split_mappings": True},
        guest={"bind_ip": "127.0.0.5"},
        finished_idle=0.2,
    )
    await both(h2, g2)
    assert h2.outcome and h2.outcome.result == NegotiateResult.SUCCESS
    assert h2.outcome.remote == address_of(g2.negotiate_sock)
    # Why each was relayed, or not: the guest answered the probe from the probe
    # port (nothing filters on loopback), so no port filter was predicted.
    decisions = {
        reason: metric(rt, "crossroads_natneg_relay_decisions_total", reason=reason)
        for reason in ("both-symmetric", "symmetric-vs-port-filtering")
    }
    assert decisions == {"both-symmetric": 1, "symmetric-vs-port-filtering": 0}


@pytest.mark.parametrize("relay_mode", ["auto", "always"])
async def test_cookie_666_back_to_back(natneg: Starter, relay_mode: str) -> None:
    """The SDK test program's way: cookie 666 every time, the host's
    own game socket lent each time, the second negotiation right after the first.
    Each gets its own session (and relay pair), none is touched by the other's."""
    rt = await natneg(natneg__relay_mode=relay_mode)
    srv = servers(rt)
    host_game = game_socket()
    relays: list[Address] = []
    try:
        for _ in range(2):
            host, guest = await game_host_and_guest(srv, 666, host_game)
            assert host.outcome and host.outcome.remote is not None
            if relay_mode == "always":
                # Told a relay port, not the guest's own socket.
                assert host.outcome.remote != address_of(guest.negotiate_sock)
                relays.append(host.outcome.remote)
            else:
                assert host.outcome.remote == address_of(guest.negotiate_sock)
            await exchange_game_data(host, guest)
        relayed = "true" if relay_mode == "always" else "false"
        assert (
            metric(
                rt,
                "crossroads_natneg_negotiations_total",
                outcome="connected",
                relayed=relayed,
                attempt="first",
            )
            == 2
        )
        assert metric(rt, "crossroads_natneg_dropped_total", reason="third-client") == 0
        if relay_mode == "always":
            assert relays[0] != relays[1]
            assert (
                metric(rt, "crossroads_natneg_relay_allocations_total", result="failed")
                == 0
            )
            # The first pair went with its session; the second carries the game.
            assert metric(rt, "crossroads_natneg_relays") == 1
    finally:
        host_game.close()


async def test_cookie_666_restart_while_waiting_then_another_pair(
    natneg: Starter,
) -> None:
    """SDK-like clients on the SDK test program's cookie:
    the host's first process has its INITs ACKed, waits for a partner who never
    comes, and dies; its restart (new game and negotiate sockets) meets the guest
    and the CONNECTs name the live sockets. Right after, another pair on 666 (other
    addresses) negotiates at once while that session lingers."""
    rt = await natneg(natneg__session_timeout=5.0, natneg__linger=10.0)
    srv = servers(rt)
    wait = {"partner_wait": 4.0}  # the SDK's is 60 s: keep a failure short
    dead_game = game_socket()
    first = SdkNegotiator(
        version=4, cookie=666, client_index=1, servers=srv, game_sock=dead_game, **wait
    )

    async def waiting() -> bool:
        first.think(time.monotonic())
        return first.state == State.INITACK

    first.send_inits(time.monotonic())
    await eventually(waiting, "the first host's INITs ACKed")
    first.release()  # the process dies with its sockets
    dead_game.close()
    host_game = game_socket()
    host, guest = negotiators(
        srv,
        4,
        666,
        host={"game_sock": host_game},
        guest={"bind_ip": "127.0.0.5"},
        **wait,
    )
    await both(host, guest)
    assert host.outcome and guest.outcome
    assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
    assert guest.connect_guess == address_of(host_game)
    assert host.connect_guess == address_of(guest.negotiate_sock)
    await exchange_game_data(host, guest)
    other_game = game_socket("127.0.0.7")
    host2, guest2 = negotiators(
        srv,
        4,
        666,
        host={"game_sock": other_game, "bind_ip": "127.0.0.7"},
        guest={"bind_ip": "127.0.0.8"},
        **wait,
    )
    try:
        await both(host2, guest2)
        assert host2.outcome and guest2.outcome
        assert host2.outcome.result == NegotiateResult.SUCCESS
        assert guest2.outcome.result == NegotiateResult.SUCCESS
        assert guest2.connect_guess == address_of(other_game)
    finally:
        host_game.close()
        other_game.close()
    assert metric(rt, "crossroads_natneg_dropped_total", reason="third-client") == 0
    counts = {
        outcome: metric(
            rt,
            "crossroads_natneg_negotiations_total",
            outcome=outcome,
            relayed="false",
            attempt="first",
        )
        for outcome in ("restarted", "connected")
    }
    assert counts == {"restarted": 1, "connected": 2}


async def test_a_dead_waiter_is_asked_and_the_partner_meets_its_restart(
    natneg: Starter,
) -> None:
    """The back-to-back race over loopback with SDK-like clients: the host's
    first process has its INITs ACKed and its ERT answered, waits past
    ``stale_after`` and dies. The guest comes first: the server asks the
    silent record (one ERT to the dead negotiate socket), gets no answer,
    drops it (``gone``) and keeps the guest waiting, instead of sending it to
    the dead ports; the host's restart, 0.4 s later, meets the guest."""
    rt = await natneg(natneg__session_timeout=5.0)
    srv = servers(rt)
    wait = {"partner_wait": 4.0}  # the SDK's is 60 s: keep a failure short
    dead_game = game_socket()
    first = SdkNegotiator(
        version=4, cookie=666, client_index=1, servers=srv, game_sock=dead_game, **wait
    )
    first.send_inits(time.monotonic())
    silent_from = time.monotonic()
    while time.monotonic() - silent_from < 0.8:  # NNThink: answers the ERT
        first.think(time.monotonic())
        await asyncio.sleep(0.01)
    assert first.state == State.INITACK
    first.release()  # the process dies with its sockets
    dead_game.close()
    host_game = game_socket()
    host, guest = negotiators(
        srv,
        4,
        666,
        host={"game_sock": host_game},
        guest={"bind_ip": "127.0.0.5"},
        **wait,
    )

    async def restart_later() -> None:
        await asyncio.sleep(0.4)
        await host.run()

    try:
        await asyncio.gather(guest.run(), restart_later())
        assert host.outcome and guest.outcome
        assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
        assert guest.connect_guess == address_of(host_game)
        await exchange_game_data(host, guest)
    finally:
        host.close()
        guest.close()
        host_game.close()
    checks = {
        result: metric(rt, "crossroads_natneg_liveness_checks_total", result=result)
        for result in ("asked", "alive", "replaced", "gone")
    }
    assert checks == {"asked": 1, "alive": 0, "replaced": 0, "gone": 1}
    gone = metric(
        rt,
        "crossroads_natneg_negotiations_total",
        outcome="gone",
        relayed="false",
        attempt="first",
    )
    assert gone == 1


@pytest.mark.parametrize(
    ("relay_host", "relayed", "result"),
    [
        # Advertised at a public address: no loopback client is relayed, the
        # negotiation falls back to a direct path.
        ("203.0.113.9", False, "refused-loopback"),
        # Advertised at 127.0.0.1: loopback clients are its scope, no
        # --natneg-relay-allow needed (refusing them made the relay useless).
        ("127.0.0.1", True, "allocated"),
    ],
)
async def test_relay_serves_only_its_advertised_scope(
    natneg: Starter, relay_host: str, relayed: bool, result: str
) -> None:
    rt = await natneg(
        natneg__relay_mode="always",
        natneg__relay_allow="",
        natneg__relay_host=relay_host,
    )
    srv = servers(rt)
    a, b = negotiators(srv, 4, 903, guest={"bind_ip": "127.0.0.5"})
    await both(a, b)
    assert a.outcome and a.outcome.result == NegotiateResult.SUCCESS
    assert (a.outcome.remote != address_of(b.negotiate_sock)) is relayed
    assert metric(rt, "crossroads_natneg_relay_allocations_total", result=result) == 1


# ------------------------------------------------------------------ NAT detection


async def test_nat_detection_over_loopback(natneg: Starter) -> None:
    rt = await natneg()
    srv = servers(rt)
    # No NAT on loopback: all three ERTs arrive (pt2 from 127.0.0.4, an IP the ERT
    # socket never contacted; pt3 from the probe port), public == private ports.
    result = await detect_nat(srv, local_ip="127.0.0.1", timeout=3)
    assert result.erts == {1, 2, 3}
    assert result.success and result.nat_type == NatType.NO_NAT
    assert result.mapping_scheme == MappingScheme.PRIVATE_AS_PUBLIC
    # A host whose first private address is 192.168.1.10 but whose traffic shows
    # 127.0.0.1: "full cone, private port as the public port" (ref §5 example).
    result = await detect_nat(srv, local_ip="192.168.1.10", timeout=3)
    assert result.nat_type == NatType.FULL_CONE
    assert result.mapping_scheme == MappingScheme.PRIVATE_AS_PUBLIC


async def test_nat_detection_single_ip(natneg: Starter) -> None:
    # natneg2/3 on natneg1's socket, no spare IP: pt2 comes from the spare port.
    rt = await natneg(
        natneg__natneg2_host="",
        natneg__natneg2_port=-1,
        natneg__natneg3_host="",
        natneg__natneg3_port=-1,
        natneg__probe_host="",
    )
    srv = servers(rt)
    assert srv[0] == srv[1] == srv[2]
    result = await detect_nat(srv, local_ip="192.168.1.10", timeout=3)
    assert result.erts == {1, 2, 3}
    assert result.nat_type == NatType.FULL_CONE


# ------------------------------------------------------------------ bad input


def send_raw(data: bytes, to: Address, source_ip: str = "127.0.0.9") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source_ip, 0))
        sock.sendto(data, to)


async def test_bad_input_is_dropped_and_sessions_survive(natneg: Starter) -> None:
    rt = await natneg(natneg__max_sessions_per_ip=5, natneg__rate_limit=0)
    srv = servers(rt)
    host_game = game_socket()
    host, guest = negotiators(
        srv,
        4,
        1000,
        host={"game_sock": host_game},
        guest={"bind_ip": "127.0.0.5"},
    )
    try:
        host.send_inits(asyncio.get_running_loop().time())
        host.think(0.0)
        garbage = [
            b"",
            b"\x00" * 40,
            MAGIC + b"\x09\x00" + bytes(20),  # unknown version
            MAGIC + b"\x03\x77" + bytes(20),  # unknown type
            MAGIC + b"\x03\x00" + bytes(4),  # truncated INIT
            MAGIC + b"\x04\x0d" + bytes(30),  # truncated REPORT
            MAGIC + b"\x03\x05" + bytes(12),  # CONNECT to the server
        ]
        for data in garbage:
            send_raw(data, srv[0])
        # A third client on the host's cookie, from another address.
        third = Init(4, 1000, 1, 1, 0, "10.9.9.9", 0, "gmtest").encode()
        send_raw(third, srv[0], "127.0.0.10")
        # A cookie flood from one source: only max_sessions_per_ip get sessions.
        for cookie in range(5000, 5040):
            send_raw(
                Init(4, cookie, 1, 0, 0, "10.0.0.1", 0, "x").encode(),
                srv[0],
                "127.0.0.11",
            )
        await both(host, guest)
        assert host.outcome and guest.outcome
        assert host.outcome.result == guest.outcome.result == NegotiateResult.SUCCESS
        reasons = {
            reason: metric(rt, "crossroads_natneg_dropped_total", reason=reason)
            for reason in (
                "short",
                "bad-magic",
                "bad-version",
                "bad-type",
                "unexpected-type",
                "third-client",
                "source-limit",
            )
        }
        assert reasons == {
            "short": 3,
            "bad-magic": 1,
            "bad-version": 1,
            "bad-type": 1,
            "unexpected-type": 1,
            "third-client": 1,
            "source-limit": 35,
        }
    finally:
        host_game.close()


async def test_many_concurrent_negotiations(natneg: Starter) -> None:
    rt = await natneg()
    srv = servers(rt)
    pairs = [
        negotiators(srv, 4, 20000 + i, guest={"bind_ip": "127.0.0.5"})
        for i in range(20)
    ]
    await asyncio.gather(*(both(a, b) for a, b in pairs))
    for a, b in pairs:
        assert a.outcome and b.outcome
        assert a.outcome.result == b.outcome.result == NegotiateResult.SUCCESS
        assert a.outcome.remote == address_of(b.negotiate_sock)
    assert (
        metric(
            rt,
            "crossroads_natneg_negotiations_total",
            outcome="connected",
            relayed="false",
            attempt="first",
        )
        == 20
    )


# ------------------------------------------------------------------ config


def test_layout_single_ip_and_three_ips() -> None:
    single = plan_layout(Config(), "0.0.0.0")
    assert single.binds == {
        NatNegSocket.PRIMARY: ("0.0.0.0", 27901),
        NatNegSocket.PROBE_PORT: ("0.0.0.0", 27902),
    }
    assert single.shared == {
        NatNegSocket.NATNEG2: NatNegSocket.PRIMARY,
        NatNegSocket.NATNEG3: NatNegSocket.PRIMARY,
    }
    assert (
        single.unsolicited_ip is None
        and single.unsolicited_port is NatNegSocket.PROBE_PORT
    )
    three = plan_layout(
        Config(host="192.0.2.1", natneg2_host="192.0.2.2", natneg3_host="192.0.2.3"),
        "0.0.0.0",
    )
    assert three.binds[NatNegSocket.NATNEG3] == ("192.0.2.3", 27901)
    # natneg3's IP is never contacted by the NATify ERT socket: the unsolicited-IP source.
    assert three.unsolicited_ip is NatNegSocket.NATNEG3
    with pytest.raises(ConfigError, match="IPv4-only"):
        plan_layout(Config(host="2001:db8::1"), "0.0.0.0")


def test_seed_config_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "natneg": {
                    "host": "127.0.0.1",
                    "port": 28000,
                    "enabled": True,
                    "session_timeout": 12,
                },
                "gpcm": {"port": 29900},
            }
        )
    )
    config = apply_seed_config(Config(), path)
    assert (config.host, config.port, config.enabled, config.session_timeout) == (
        "127.0.0.1",
        28000,
        True,
        12.0,
    )
    # Left out: the seed's default, LAN mode on.
    assert config.force_lan_mode is True
    path.write_text(json.dumps({"natneg": {"force_lan_mode": False, "enabled": False}}))
    config = apply_seed_config(Config(), path)
    assert config.force_lan_mode is False and config.enabled is False
    for bad, message in [
        ({"natneg": {"prot": 1}}, "unknown key natneg.prot"),
        ({"natneg": {"port": 70000}}, "natneg.port"),
        ({"natneg": {"session_timeout": -1}}, "session_timeout"),
        ({"other": {}}, 'no "natneg" object'),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            apply_seed_config(Config(), path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        apply_seed_config(Config(), path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"natneg__max_sessions": 0}, "--natneg-max-sessions): must be > 0"),
        ({"natneg__linger": -1.0}, "--natneg-linger): must be > 0"),
        ({"natneg__rate_limit": -1.0}, "--natneg-rate-limit): must be >= 0"),
    ],
)
def test_bad_settings_name_their_flag(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        default_config(loopback_config(**override))
    assert message in str(refused.value)


async def test_disabled_by_seed_config(natneg: Starter, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"natneg": {"enabled": False}}))
    rt = await natneg(natneg__config_json=str(path))
    assert rt.services["natneg"].describe() == ["disabled"]
