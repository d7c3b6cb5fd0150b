"""crossroads' OpenTTD coordinator, STUN and TURN against the real OpenTTD
13.0, 14.1 and 15.1.

Everything runs on loopback (or in a private network namespace) with ports the
OS picks; the servers and clients are Debian's ``openttd`` binaries, headless:
13.0 is the host's (bookworm), 14.1 and 15.1 run in trixie and sid trees built
by mmdebstrap and cached outside the checkout (openttd_chroot.py). Every test
runs once per release with the same assertions.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossroads.proto.openttd.gameinfo import GameInfo
from tests.conftest import RedisServer
from tests.interop.openttd_chroot import (
    SUITES,
    ChrootOpenTTD,
    ensure_tree,
    missing_requirement,
)
from tests.interop.openttd_support import (
    HOST_BUILD,
    INI_VERSION,
    Crossroads,
    LoopbackCapture,
    NetNS,
    OpenTTDBuild,
    OpenTTDClient,
    OpenTTDServer,
    game_info_from_server,
    listing_as_client,
    openttd_available,
    saved_network_settings,
)

pytestmark = [pytest.mark.interop]

RELEASES = [HOST_BUILD.release, *SUITES]

JOIN_TIMEOUT = 45.0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    from tests.conftest import free_port

    return free_port(host=host)


@pytest.fixture(scope="module", params=RELEASES)
def build(request: pytest.FixtureRequest) -> OpenTTDBuild:
    """The release under test: the host's 13.0, or a cached chroot's (built
    here on the first run, printing mmdebstrap's progress; about a minute,
    which is why the tests' timeouts are ``func_only``: they bound the test,
    not this setup)."""
    release: str = request.param
    if release == HOST_BUILD.release:
        if not openttd_available():
            pytest.skip("openttd is not installed (make install)")
        return HOST_BUILD
    problem = missing_requirement()
    if problem:
        pytest.skip(problem)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        tree = ensure_tree(
            SUITES[release], say=lambda line: print(line, file=sys.stderr, flush=True)
        )
    chroot = ChrootOpenTTD(tree)
    # sid moves on: a later point release of the same major speaks the same
    # wire (game-info, encryption), so it still tests what the id says; a new
    # major fails here rather than being tested under the wrong name.
    found = chroot.version()
    assert found.split(".")[0] == release.split(".")[0], (found, release)
    return OpenTTDBuild(release, chroot)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, build: OpenTTDBuild) -> Path:
    return tmp_path_factory.mktemp(f"openttd-{build.release}")


@pytest.fixture(scope="module")
def crossroads(workdir: Path) -> Iterator[Crossroads]:
    process = Crossroads(workdir)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def servers(
    workdir: Path, crossroads: Crossroads, build: OpenTTDBuild
) -> Iterator[dict[str, OpenTTDServer]]:
    """One public and one invite-only dedicated server, started together."""
    started = {
        "public": OpenTTDServer(
            workdir, crossroads, name="Public interop", bind="127.0.0.1",
            port=free_tcp_port(), game_type="public", cpu=0, build=build,
        ),
        "invite-only": OpenTTDServer(
            workdir, crossroads, name="Invite interop", bind="127.0.0.1",
            port=free_tcp_port(), game_type="invite-only", cpu=1, build=build,
        ),
    }  # fmt: skip
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.timeout(120, func_only=True)
def test_dedicated_servers_register_public_and_invite_only(
    crossroads: Crossroads, servers: dict[str, OpenTTDServer], build: OpenTTDBuild
) -> None:
    public = servers["public"].registration()
    invite = servers["invite-only"].registration()
    assert public["game_type"] == "Public"
    assert invite["game_type"] == "Invite only"
    # The coordinator reached both with a game-protocol probe.
    assert public["connection_type"] == invite["connection_type"] == "Public"
    assert public["code"] != invite["code"]

    # The list shows a server once its first SERVER_UPDATE (sent right after
    # the ACK) is in; the HTTP list may lag by the listing cache's refresh.
    by_code: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 10
    while public["code"] not in by_code and time.monotonic() < deadline:
        listed = crossroads.json("/openttd/servers")
        assert isinstance(listed, list)
        by_code = {entry["invite_code"]: entry for entry in listed}
        time.sleep(0.2)
    assert public["code"] in by_code and invite["code"] not in by_code
    entry: dict[str, Any] = by_code[public["code"]]
    assert entry["info"]["server_name"] == "Public interop"
    assert entry["info"]["server_revision"] == build.release
    assert entry["info"]["map_width"] == entry["info"]["map_height"] == 64
    # Game-info 7 (a leading ticks_playing) from 14 on; coordinator protocol 6
    # in every release (reference section 2).
    version = 7 if build.major >= 14 else 6
    assert entry["game_info_version"] == version and entry["protocol"] == 6
    # A client of each release asks for the list in its own game-info version
    # (6 in 13, 7 from 14) and reads what the server itself answers on its
    # game port, but for the fields that move with the game clock: the
    # coordinator re-encodes what this release sent for older and newer
    # clients alike.
    own = game_info_from_server("127.0.0.1", servers["public"].port)
    assert own.version == version

    def steady(info: GameInfo) -> GameInfo:
        return dataclasses.replace(info, game_date=0, ticks_playing=None)

    for revision, wanted in (("13.0", 6), ("14.1", 7), ("15.1", 7)):
        listed = dict(listing_as_client(crossroads, revision, wanted))
        assert public["code"] in listed and invite["code"] not in listed
        assert listed[public["code"]].version == wanted
        assert steady(listed[public["code"]].info) == steady(own.info)
        assert (listed[public["code"]].info.ticks_playing is None) == (wanted < 7)
    record = crossroads.json(f"/openttd/servers/{invite['code']}")
    assert isinstance(record, dict)
    assert record["game_type"] == "invite-only"
    assert record["connection_type"] == "direct"
    status, page = crossroads.get("/openttd")
    assert status == 200 and "Public interop" in page and "Invite interop" not in page


@pytest.mark.timeout(120, func_only=True)
def test_client_joins_by_invite_code_directly(
    workdir: Path,
    crossroads: Crossroads,
    servers: dict[str, OpenTTDServer],
    build: OpenTTDBuild,
) -> None:
    server = servers["invite-only"]
    code = server.registration()["code"]
    client = OpenTTDClient(
        workdir, crossroads, name="direct-client", code=code, build=build
    )
    try:
        line = server.joined("direct-client", JOIN_TIMEOUT)
        assert "has joined the game" in line
    finally:
        client.stop()
    game_port = int(
        server.process.args[server.process.args.index("-D") + 1].rsplit(":", 1)[1]
    )  # type: ignore[union-attr, index]
    assert f"127.0.0.1:{game_port}" in client.used()  # the game connection was direct
    assert (
        crossroads.metric(
            "crossroads_openttd_connects_total", method="direct-ipv4", result="ok"
        )
        >= 1
    )


@pytest.mark.timeout(150, func_only=True)
def test_server_reconnecting_keeps_its_invite_code(
    workdir: Path, crossroads: Crossroads, servers: dict[str, OpenTTDServer]
) -> None:
    """Restart crossroads on the same ports: the running server reconnects by
    itself (after OpenTTD's back-off), presents its code and secret, and gets
    the same invite code back."""
    server = servers["public"]
    before = server.registration()
    ports = dict(crossroads.ports)
    crossroads.stop()
    restarted = Crossroads(workdir, name="crossroads-restarted", ports=ports)
    try:
        again = server.registration(timeout=90, after=1)
        assert again["code"] == before["code"]
        record = restarted.json(f"/openttd/servers/{before['code']}")
        assert isinstance(record, dict) and record["game_type"] == "public"
    finally:
        restarted.stop()


def relayed_game_bytes(streams: dict[tuple[str, str], bytes], relay: str) -> bytes:
    """Check that the relay passed the game stream unchanged and return it.

    ``streams`` are the TCP payloads to and from the relay's address. Each of
    the two peers' connections starts with one TURN packet each way
    (SERCLI_CONNECT up, TURN_CONNECTED down; an OpenTTD packet starts with its
    little-endian u16 size); after that, what one peer sent must be what the
    other received (a prefix of it while bytes are still in flight)."""

    def game(stream: bytes) -> bytes:
        return stream[int.from_bytes(stream[:2], "little") :]

    peers = sorted({src for src, dst in streams if dst == relay})
    assert len(peers) == 2, streams.keys()
    sent = {peer: game(streams.get((peer, relay), b"")) for peer in peers}
    received = {peer: game(streams.get((relay, peer), b"")) for peer in peers}
    first, second = peers
    for source, sink in ((first, second), (second, first)):
        a, b = sent[source], received[sink]
        common = min(len(a), len(b))
        assert common > 0 and a[:common] == b[:common], (source, sink, len(a), len(b))
    return b"".join(sent.values())


@pytest.mark.timeout(150, func_only=True)
def test_join_through_turn_when_the_server_is_unreachable(
    workdir: Path, build: OpenTTDBuild
) -> None:
    """In a private network namespace, the server listens on 127.0.0.2 while its
    coordinator traffic leaves from 127.0.0.1, so the direct probe fails; an
    iptables rule there refuses every new TCP connection except to the known
    service ports, so the STUN simultaneous open fails too. TURN must carry it.

    A packet capture on the namespace's loopback checks the relay from outside:
    what one peer sent after its TURN handshake is what the other received,
    byte for byte, and from 15 the game stream is encrypted (the client's name,
    plain in 13 and 14, is nowhere in it)."""
    netns = NetNS()
    processes: list[Crossroads | OpenTTDServer | OpenTTDClient | LoopbackCapture] = []
    try:
        turn_dir = workdir / "turn"
        turn_dir.mkdir()
        crossroads = Crossroads(turn_dir, netns=netns)
        processes.append(crossroads)
        game_port = 3979 + 20000  # free: the namespace is ours alone
        allowed = ",".join(str(p) for p in (*crossroads.ports.values(), game_port))
        netns.run(
            "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "-m", "multiport",
            "!", "--dports", allowed, "-j", "REJECT", "--reject-with", "tcp-reset",
        )  # fmt: skip
        server = OpenTTDServer(
            turn_dir, crossroads, name="NAT interop", bind="127.0.0.2",
            port=game_port, game_type="invite-only", netns=netns, cpu=0, build=build,
        )  # fmt: skip
        processes.append(server)
        registration = server.registration()
        assert registration["connection_type"] == "Behind NAT"
        capture = LoopbackCapture(
            turn_dir / "turn.capture", netns, crossroads.ports["turn"]
        )
        processes.append(capture)
        client = OpenTTDClient(
            turn_dir,
            crossroads,
            name="turn-client",
            code=registration["code"],
            netns=netns,
            build=build,
        )
        processes.append(client)
        assert "has joined the game" in server.joined("turn-client", JOIN_TIMEOUT)
        assert f"127.0.0.1:{crossroads.ports['turn']}" in client.used()
        assert (
            crossroads.metric(
                "crossroads_openttd_connects_total", method="turn", result="ok"
            )
            == 1
        )
        assert (
            crossroads.metric("crossroads_openttd_turn_sessions_total", result="paired")
            == 1
        )
        record = crossroads.json(f"/openttd/servers/{registration['code']}")
        assert (
            isinstance(record, dict)
            and record["connection_type"] == "stun"
            and record["direct"] == []
        )
        # The STUN attempt happened and failed before TURN.
        assert (
            crossroads.metric("crossroads_openttd_stun_requests_total", result="ok")
            >= 3
        )
        game = relayed_game_bytes(
            capture.streams(), f"127.0.0.1:{crossroads.ports['turn']}"
        )
        assert len(game) > 10_000  # the map went through the relay
        assert (b"turn-client" in game) == (build.major < 15)
    finally:
        for process in reversed(processes):
            process.stop()
        netns.close()


@pytest.mark.timeout(150, func_only=True)
@pytest.mark.redis
def test_two_coordinators_on_one_redis(
    workdir: Path, redis_server: RedisServer, build: OpenTTDBuild
) -> None:
    """The server registers with coordinator A, the client asks coordinator B.
    The server is not directly reachable, so B drives STUN and TURN through
    the server's connection on A (commands and reports cross over Redis)."""
    redis_server.flush()
    redis_dir = workdir / "redis"
    redis_dir.mkdir()
    processes: list[Crossroads | OpenTTDServer | OpenTTDClient] = []
    try:
        a = Crossroads(redis_dir, name="crossroads-a", store=redis_server.url)
        processes.append(a)
        b = Crossroads(redis_dir, name="crossroads-b", store=redis_server.url)
        processes.append(b)
        server = OpenTTDServer(
            redis_dir, a, name="Redis interop", bind="127.0.0.2",
            port=free_tcp_port("127.0.0.2"), game_type="invite-only", cpu=0,
            build=build,
        )  # fmt: skip
        processes.append(server)
        code = server.registration()["code"]
        client = OpenTTDClient(
            redis_dir, b, name="redis-client", code=code, build=build
        )
        processes.append(client)
        assert "has joined the game" in server.joined("redis-client", JOIN_TIMEOUT)
        joined = sum(
            b.metric("crossroads_openttd_connects_total", method=m, result="ok")
            for m in ("stun-ipv4", "turn")
        )
        assert joined == 1
        assert (
            a.metric("crossroads_openttd_connects_total", method="turn", result="ok")
            == 0
        )
        assert (
            a.metric("crossroads_openttd_bus_published_total") >= 2
        )  # reports went A -> B
        assert (
            b.metric("crossroads_openttd_bus_published_total") >= 2
        )  # commands went B -> A
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.mark.timeout(60, func_only=True)
def test_private_cfg_needs_a_version_group(workdir: Path, build: OpenTTDBuild) -> None:
    """The pitfall README states where ``use_relay_service`` is explained:
    OpenTTD reads private.cfg only when openttd.cfg has a ``[version]`` group
    (``ini_version`` >= 1); otherwise every setting comes from openttd.cfg.
    From 14, ``use_relay_service`` is one of private.cfg's settings, so a
    headless client configured there without the group asks the relay
    question nobody answers."""
    private = "[network]\nclient_name = probe\nuse_relay_service = allow\n"
    plain = saved_network_settings(
        build,
        workdir / "ini-plain",
        {
            "openttd.cfg": "[network]\nserver_game_type = local\n",
            "private.cfg": private,
        },
    )
    versioned = saved_network_settings(
        build,
        workdir / "ini-versioned",
        {
            "openttd.cfg": f"[version]\nini_version = {INI_VERSION[build.major]}\n"
            "[network]\nserver_game_type = local\n",
            "private.cfg": private,
        },
    )
    assert plain["private.cfg"]["client_name"] == ""  # private.cfg was ignored
    assert versioned["private.cfg"]["client_name"] == "probe"
    # Where each release keeps use_relay_service, and what it read there.
    relay_file = "private.cfg" if build.major >= 14 else "openttd.cfg"
    assert plain[relay_file]["use_relay_service"] == "ask"
    assert versioned[relay_file]["use_relay_service"] == (
        "allow" if build.major >= 14 else "ask"
    )
    # Without the group, openttd.cfg alone is read, private settings included.
    alone = saved_network_settings(
        build,
        workdir / "ini-alone",
        {"openttd.cfg": private},
    )
    assert alone["private.cfg"]["client_name"] == "probe"
    assert alone[relay_file]["use_relay_service"] == "allow"
