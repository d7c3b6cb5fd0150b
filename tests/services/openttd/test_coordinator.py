"""The coordinator against protocol-level peers that behave like OpenTTD 13."""

from __future__ import annotations

import pytest

from crossroads.client.openttd import GameInfoResponder
from crossroads.proto.openttd.codes import looks_like_invite_code
from crossroads.proto.openttd.coordinator import (
    ClientConnect,
    ClientConnected,
    ClientListing,
    ConnectFailed,
    ConnectionType,
    ErrorType,
    GcConnectFailed,
    GcConnecting,
    GcDirectConnect,
    GcError,
    GcListing,
    GcNewgrfLookup,
    GcRegisterAck,
    GcStunConnect,
    GcStunRequest,
    GcTurnConnect,
    ServerRegister,
    StunResult,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, NewGRFSerialization
from crossroads.runtime import Runtime
from crossroads.services.openttd.registry import NEWGRF_COUNTER_KEY
from tests.conftest import eventually
from tests.services.openttd.helpers import (
    AF_INET,
    AF_INET6,
    answer_stun_request,
    gc,
    http_get,
    recv_until,
    register,
    service,
    turn_connect,
    turn_connected,
    until_gone,
    until_listed,
    until_metric,
    until_named,
    update,
)

pytestmark = pytest.mark.timeout(60)

INFO = GameInfo(
    server_name="Protocol test",
    server_revision="13.0",
    clients_max=25,
    map_width=256,
    map_height=256,
    dedicated=True,
    companies_max=15,
    game_date=712223,
    start_date=712223,
    newgrfs=(NewGRF(0x4D560101, bytes(range(16)), "Some trains"),),
)


async def test_register_direct_server(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    try:
        # The check: GC_STUN_REQUEST with a V token, then GC_CONNECT_FAILED for it.
        assert isinstance(server.messages[0], GcStunRequest)
        assert server.messages[0].token.startswith("V")
        assert GcConnectFailed(server.messages[0].token) in server.messages
        assert server.ack.connection_type is ConnectionType.DIRECT
        assert looks_like_invite_code(server.code)
        assert len(server.ack.invite_code_secret) == 64
        assert game_server.queries >= 1  # a real game-info exchange happened
        record = (await http_get(ottd, f"/openttd/servers/{server.code}")).json()
        assert record["connection_type"] == "direct"
        assert record["direct"] == [f"127.0.0.1:{game_server.port}"]
        assert record["game_type"] == "public"
    finally:
        await server.close()


async def test_unreachable_server_behind_nat_is_stun(ottd: Runtime) -> None:
    server = await register(ottd, 1)  # nothing answers the probe on port 1
    try:
        assert server.ack.connection_type is ConnectionType.STUN
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("version", "expected"),
    [(6, ConnectionType.TURN), (5, ConnectionType.TURN), (4, ConnectionType.ISOLATED)],
)
async def test_isolated_server_is_turn_from_version_5(
    ottd: Runtime, version: int, expected: ConnectionType
) -> None:
    server = await register(ottd, 1, version=version, stun_ok=False)
    try:
        assert server.ack.connection_type is expected
    finally:
        await server.close()


async def test_version_1_and_2_registrations(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    v1 = await register(ottd, game_server.port, version=1)
    v2 = await register(ottd, game_server.port, version=2)
    try:
        # No STUN below 3; no invite code in the ACK below 2.
        assert v1.messages == [GcRegisterAck(ConnectionType.DIRECT)]
        assert len(v2.messages) == 1 and looks_like_invite_code(v2.code)
        assert v2.ack.connection_type is ConnectionType.DIRECT
    finally:
        await v1.close()
        await v2.close()


async def test_update_and_listing_with_newgrf_lookup(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    invite_only = await register(ottd, game_server.port, game_type=2)
    lister = await gc(ottd)
    old_lister = await gc(ottd, version=3)
    try:
        await update(server, INFO)
        await update(
            invite_only, GameInfo(server_name="hidden", server_revision="13.0")
        )
        await until_named(ottd, invite_only.code, "hidden")
        await until_listed(ottd, "Protocol test")

        await lister.send_message(ClientListing(6, 6, "13.0", 0))
        lookup = await lister.recv()
        assert isinstance(lookup, GcNewgrfLookup)
        assert [g.name for _, g in lookup.entries] == ["Some trains"]
        listing = await lister.recv()
        assert isinstance(listing, GcListing)
        assert listing.serialization is NewGRFSerialization.LOOKUP_ID
        assert [e.connection_string for e in listing.entries] == [server.code]
        assert listing.entries[0].info == INFO
        assert await lister.recv() == GcListing(0, NewGRFSerialization.GRFID_MD5, ())

        # A second listing with the cursor gets no lookup entries again.
        await lister.send_message(ClientListing(6, 6, "13.0", lister.cursor))
        assert isinstance(await lister.recv(), GcListing)

        # Protocol 3 has no lookup table: NewGRFs come with names; game info 4
        # has no NST byte at all.
        await old_lister.send_message(ClientListing(3, 4, "12.0", 0))
        listing = await old_lister.recv()
        assert isinstance(listing, GcListing) and listing.game_info_version == 4
        assert listing.entries[0].info.server_name == "Protocol test"
        assert listing.entries[0].info.newgrfs[0].grfid == 0x4D560101

        servers = (await http_get(ottd, "/openttd/servers")).json()
        assert [s["invite_code"] for s in servers] == [server.code]
        assert servers[0]["info"]["server_name"] == "Protocol test"
        page = (await http_get(ottd, "/openttd")).text
        assert "Protocol test" in page and "hidden" not in page
    finally:
        for peer in (server, invite_only):
            await peer.close()
        await lister.close()
        await old_lister.close()


async def test_invite_code_is_kept_across_reconnects(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    first = await register(ottd, game_server.port)
    code, secret = first.code, first.ack.invite_code_secret
    await first.close()
    again = await register(ottd, game_server.port, code=code, secret=secret)
    assert again.code == code
    # A wrong secret gets a fresh code, not an error.
    other = await register(ottd, game_server.port + 1, code=code, secret="0" * 64)
    try:
        assert other.code != code
    finally:
        await again.close()
        await other.close()


async def test_duplicate_registration_of_the_same_server_replaces_the_old(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    first = await register(ottd, game_server.port)
    # Same address and game port, new connection (the old one not yet noticed dead).
    second = await register(
        ottd, game_server.port, code=first.code, secret=first.ack.invite_code_secret
    )
    try:
        assert second.code == first.code
        assert await first.client.at_eof(5)
        record = (await http_get(ottd, f"/openttd/servers/{first.code}")).json()
        assert record["invite_code"] == first.code
    finally:
        await first.close()
        await second.close()
    await until_gone(ottd, first.code)


@pytest.mark.parametrize(
    ("version", "error"),
    [(6, ErrorType.REUSE_OF_INVITE_CODE), (5, ErrorType.REGISTRATION_FAILED)],
)
async def test_a_second_server_cannot_take_a_live_code(
    ottd: Runtime, game_server: GameInfoResponder, version: int, error: ErrorType
) -> None:
    first = await register(ottd, game_server.port)
    thief = await gc(ottd, version)
    try:
        await thief.send_message(
            ServerRegister(
                version,
                1,
                game_server.port + 7,
                first.code,
                first.ack.invite_code_secret,
            )
        )
        reply = await thief.recv()
        assert isinstance(reply, GcError) and reply.error is error
        assert await thief.at_eof(5)
        assert not first.client.reader.at_eof()
    finally:
        await first.close()
        await thief.close()


async def test_reregistering_on_the_same_connection_keeps_the_code(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port, game_type=1)
    again = await register(
        ottd,
        game_server.port,
        game_type=2,
        code=server.code,
        secret=server.ack.invite_code_secret,
        client=server.client,
    )
    try:
        assert again.code == server.code
        record = (await http_get(ottd, f"/openttd/servers/{server.code}")).json()
        assert record["game_type"] == "invite-only"
    finally:
        await server.close()


async def test_unknown_invite_code_keeps_the_connection(ottd: Runtime) -> None:
    client = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, "+nothere"))
        assert await client.recv() == GcError(ErrorType.INVALID_INVITE_CODE, "+nothere")
        await client.send_message(ClientListing(6, 6, "13.0", 0))
        assert isinstance(await recv_until(client, GcListing), GcListing)
    finally:
        await client.close()


async def test_direct_join(ottd: Runtime, game_server: GameInfoResponder) -> None:
    server = await register(ottd, game_server.port)
    client = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        assert (
            isinstance(connecting, GcConnecting)
            and connecting.invite_code == server.code
        )
        direct = await client.recv()
        assert direct == GcDirectConnect(
            connecting.token, 1, "127.0.0.1", game_server.port
        )
        await client.send_message(ClientConnected(6, connecting.token))
        await until_metric(
            ottd,
            "crossroads_openttd_connects_total",
            1,
            method="direct-ipv4",
            result="ok",
        )
        # The join's insight record: one rung, direct, the winner.
        [record] = [a for a in ottd.insight.ring if a.family == "openttd"]
        assert (record.session, record.game) == (server.code, server.code)
        assert (record.winner, record.outcome, record.cause) == (
            "direct-ipv4",
            "direct",
            "",
        )
        assert [(s.name, s.outcome) for s in record.steps] == [("direct-ipv4", "ok")]
        assert [s.prefix for s in record.sides] == ["127.0.0.0/24"] * 2
    finally:
        await server.close()
        await client.close()


async def test_join_through_stun_then_turn(ottd: Runtime) -> None:
    server = await register(ottd, 1)  # probe fails: STUN type
    client = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        assert isinstance(connecting, GcConnecting)
        # No direct address: straight to STUN on both sides.
        client_request = await client.recv()
        server_request = await recv_until(server.client, GcStunRequest)
        assert client_request == GcStunRequest(connecting.token)
        assert server_request.token == "S" + connecting.token[1:]
        streams = await answer_stun_request(ottd, client, client_request.token)
        streams += await answer_stun_request(ottd, server.client, server_request.token)
        client_stun = await client.recv()
        server_stun = await recv_until(server.client, GcStunConnect)
        assert isinstance(client_stun, GcStunConnect)
        # Each side is sent to where the STUN service saw the other.
        assert client_stun.family == server_stun.family == AF_INET
        client_seen = streams[0].writer.get_extra_info("sockname")[1]
        server_seen = streams[1].writer.get_extra_info("sockname")[1]
        assert (client_stun.host, client_stun.port) == ("127.0.0.1", server_seen)
        assert (server_stun.host, server_stun.port) == ("127.0.0.1", client_seen)
        assert client_stun.tracking_number == server_stun.tracking_number == 1
        # The simultaneous open fails; the client says so: TURN next.
        await client.send_message(ConnectFailed(6, client_stun.token, 1))
        client_turn = await client.recv()
        server_turn = await recv_until(server.client, GcTurnConnect)
        assert isinstance(client_turn, GcTurnConnect)
        assert (
            client_turn.ticket == server_turn.ticket
            and client_turn.tracking_number == 2
        )
        assert (
            client_turn.connection_string
            == f"127.0.0.1:{ottd.services['openttd'].address('turn')[1]}"
        )  # type: ignore[attr-defined]
        relay_client, _ = await turn_connect(
            client_turn.connection_string, client_turn.ticket
        )
        relay_server, _ = await turn_connect(
            server_turn.connection_string, server_turn.ticket
        )
        assert await turn_connected(relay_client) == "127.0.0.1"
        assert await turn_connected(relay_server) == "127.0.0.1"
        # From here the sockets carry the game protocol, byte for byte.
        await relay_client.send(b"\x03\x00\x07")
        assert await relay_server.reader.readexactly(3) == b"\x03\x00\x07"
        await relay_server.send(b"x" * 100_000)
        assert await relay_client.reader.readexactly(100_000) == b"x" * 100_000
        await client.send_message(ClientConnected(6, client_turn.token))
        await until_metric(
            ottd, "crossroads_openttd_connects_total", 1, method="turn", result="ok"
        )
        for stream in streams + [relay_client, relay_server]:
            await stream.close()

        # The record: STUN paired IPv4, its simultaneous open failed, TURN won;
        # written when this instance's relay ended, with the bytes it carried
        # each way (the client connected to the relay first: both sides are
        # 127.0.0.1 here, and the relay takes the first for the client).
        async def recorded() -> bool:
            return any(a.family == "openttd" for a in ottd.insight.ring)

        await eventually(recorded, "the join's record")
        [record] = [a for a in ottd.insight.ring if a.family == "openttd"]
        assert (record.winner, record.outcome) == ("turn", "relayed")
        assert record.cause == "stun-ipv4 failed"
        assert [(s.name, s.outcome) for s in record.steps] == [
            ("stun-request", "ok"),
            ("stun-ipv4", "failed"),
            ("turn", "ok"),
        ]
        assert record.usage is not None
        assert (record.usage.bytes_up, record.usage.bytes_down) == (3, 100_000)
    finally:
        await server.close()
        await client.close()


async def test_client_giving_up_tells_the_server(ottd: Runtime) -> None:
    server = await register(ottd, 1)
    client = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        await recv_until(server.client, GcStunRequest)
        await client.send_message(ConnectFailed(6, connecting.token, 0))
        failed = await recv_until(server.client, GcConnectFailed)
        assert failed.token == "S" + connecting.token[1:]
    finally:
        await server.close()
        await client.close()


async def test_join_times_out() -> None:
    from tests.services.openttd.helpers import running

    async with running(connect_timeout=0.5, stun_wait=5.0) as rt:
        server = await register(rt, 1)
        client = await gc(rt)
        try:
            await client.send_message(ClientConnect(6, server.code))
            connecting = await client.recv()
            await recv_until(client, GcStunRequest)
            # Nobody answers the STUN request: the overall limit fires.
            assert await recv_until(client, GcConnectFailed) == GcConnectFailed(
                connecting.token
            )
        finally:
            await server.close()
            await client.close()


async def test_server_leaving_removes_it(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    await update(server, INFO)
    await server.close()
    await until_gone(ottd, server.code)
    client = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, server.code))
        assert await client.recv() == GcError(
            ErrorType.INVALID_INVITE_CODE, server.code
        )
    finally:
        await client.close()


async def test_reports_with_foreign_tokens_are_ignored(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    client = await gc(ottd)
    stranger = await gc(ottd)
    try:
        await client.send_message(ClientConnect(6, server.code))
        connecting = await client.recv()
        await client.recv()  # GC_DIRECT_CONNECT
        # Another connection cannot report on this attempt, nor can made-up tokens.
        await stranger.send_message(ClientConnected(6, connecting.token))
        await stranger.send_message(ConnectFailed(6, connecting.token, 1))
        await stranger.send_message(StunResult(6, "Cnot-a-token", AF_INET6, True))
        await until_metric(
            ottd, "crossroads_openttd_ignored_total", 2, reason="wrong-sender"
        )
        await until_metric(
            ottd, "crossroads_openttd_ignored_total", 1, reason="unknown-token"
        )
        await client.send_message(ClientConnected(6, connecting.token))
        await until_metric(
            ottd,
            "crossroads_openttd_connects_total",
            1,
            method="direct-ipv4",
            result="ok",
        )
    finally:
        for peer in (client, stranger):
            await peer.close()
        await server.close()


async def test_version_1_clients_get_ip_and_port(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    server = await register(ottd, game_server.port)
    unreachable = await register(ottd, 1)
    lister = await gc(ottd, version=1)
    try:
        await update(server, INFO)
        await update(
            unreachable, GameInfo(server_name="no direct", server_revision="13.0")
        )
        await until_listed(ottd, "Protocol test", "no direct")
        await lister.send_message(ClientListing(1, 4, "12.0", 0))
        listing = await lister.recv()
        assert isinstance(listing, GcListing)
        # No invite codes below protocol 2: only the directly reachable server,
        # by address.
        assert [e.connection_string for e in listing.entries] == [
            f"127.0.0.1:{game_server.port}"
        ]
    finally:
        await server.close()
        await unreachable.close()
        await lister.close()


async def test_listing_puts_the_clients_revision_first(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    old = await register(ottd, game_server.port)
    new = await register(ottd, game_server.port + 1)
    lister = await gc(ottd)
    try:
        await update(old, GameInfo(server_name="old", server_revision="13.0"))
        await update(new, GameInfo(server_name="new", server_revision="14.0"))
        await until_listed(ottd, "old", "new")
        for revision, expected in (("14.0", ["new", "old"]), ("13.0", ["old", "new"])):
            await lister.send_message(ClientListing(6, 7, revision, 0))
            listing = await recv_until(lister, GcListing)
            assert [e.info.server_name for e in listing.entries] == expected
            assert listing.game_info_version == 7
            await recv_until(lister, GcListing)  # end of list
    finally:
        for peer in (old, new):
            await peer.close()
        await lister.close()


async def test_a_corrupt_newgrf_counter_in_the_store_does_not_stop_the_listing(
    ottd: Runtime, game_server: GameInfoResponder
) -> None:
    """The counter is read on every listing refresh; a value that is not a
    number (another writer, a hand edit) is ignored, not a crash of every
    CLIENT_LISTING."""
    registry = service(ottd).registry
    assert registry is not None
    server = await register(ottd, game_server.port)
    lister = await gc(ottd)
    try:
        await update(server, INFO)
        await until_listed(ottd, "Protocol test")
        await registry.store.set(NEWGRF_COUNTER_KEY, b"not a number")
        coordinator = service(ottd).coordinator
        assert coordinator is not None
        coordinator.listing.loaded_at = -1e9  # the next listing re-reads
        await lister.send_message(ClientListing(6, 6, "13.0", 0))
        listing = await recv_until(lister, GcListing)
        assert [e.connection_string for e in listing.entries] == [server.code]
    finally:
        await lister.close()
        await server.close()
