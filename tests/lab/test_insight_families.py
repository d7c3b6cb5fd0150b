"""Connection insight through real kernel NAT, for the families
tests/lab/test_insight.py leaves out: an OpenTTD join, a RakNet UDP proxy
forwarder, a Unity relay session and two TURN allocations, each against the
lab's own server (``crossroads serve`` in the server namespace, as deployed)
with the clients on lab hosts behind lab routers.

OpenTTD: a real OpenTTD 13 server and client (the lab's ``openttd`` method)
join by invite code; the join's record names the rung the method's
prediction names (``expected_via``: the lab says ``punch`` for the
coordinator's STUN rung, ``relay`` for its TURN rung). Its usage stays empty:
the OpenTTD TURN relay pairs the two sockets later, by ticket, on its own
listener, and counts their bytes only in
``crossroads_openttd_turn_bytes_total`` (see ``join_record``).

RakNet, Unity relay, TURN: the test sends a known number of bytes each way
through the relay and the record's usage counts them within 1 %."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from crossroads.client.relay import Allocation, RelayConnection
from crossroads.lab import netns
from crossroads.lab.matrix import Attempt, run_attempt
from crossroads.lab.methods import openttd, raknet
from crossroads.lab.methods import relay as unity
from crossroads.lab.methods.turn_udp import open_client
from crossroads.lab.topology import SERVER_HTTP_PORT, SERVER_IPS, Lab
from crossroads.lab.udp import recv, send
from crossroads.proto.relay.messages import RELAY_HEADER_SIZE
from crossroads.state import CREDENTIALS_FILE
from crossroads.types import Address
from tests.lab.test_insight import insight
from tests.lab.test_natneg import reset

pytestmark = [pytest.mark.lab, pytest.mark.timeout(90)]

#: Datagrams each way and their size: 200 kB each way, so the handshakes and
#: keep-alives the clients send beside them stay far below 1 %.
DATAGRAMS, SIZE = 200, 1000
#: The lab's rungs by the names the OpenTTD coordinator's records use (the
#: lab is IPv4: STUN's IPv4 pair punches).
OPENTTD_RUNG = {"direct": "direct", "punch": "stun-ipv4", "relay": "turn"}


def admin_token(lab: Lab) -> str:
    credentials = lab.state_dir / "server-state" / CREDENTIALS_FILE
    token: str = json.loads(credentials.read_text())["admin_token"]
    return token


async def records(
    lab: Lab,
    family: str,
    since: int,
    want: int = 1,
    timeout: float = 20.0,
    match: Callable[[dict[str, Any]], bool] = lambda record: True,
) -> list[dict[str, Any]]:
    """The lab server's records of ``family`` since ``since`` that ``match``,
    once at least ``want`` are there (newest first)."""
    token = admin_token(lab)
    path = f"/v1/insight/attempts?family={family}&since={since}"
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = await insight(lab, path, SERVER_HTTP_PORT, token)
        found = [r for r in answer["attempts"] if match(r)]
        if len(found) >= want:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"{want} {family} records expected, got {found}")


def second_of(now: float) -> int:
    """The API's ``since`` (whole seconds) for records from ``now`` on."""
    return int(now) - 1


def after(now: float) -> Callable[[dict[str, Any]], bool]:
    """Records of attempts started at ``now`` or later (the API's ``since``
    is whole seconds: the test before may have left one in that second)."""
    return lambda record: bool(record["started"] >= now)


async def test_openttd_join_record_names_the_predicted_rung(lab: Lab) -> None:
    """A full cone hosting, a port-restricted cone joining: the lab predicts
    TCP hole punching (the coordinator's STUN rung)."""
    a, b = lab.site("full-cone-a"), lab.site("port-restricted-cone-b")
    predicted = openttd.expected_via(a.kind, b.kind)
    assert predicted == "punch"
    now = time.time()
    result = await run_attempt(openttd.METHOD, Attempt(lab, a, b))
    assert result.connected and result.via == predicted, result
    [record] = await records(lab, "openttd", second_of(now), match=after(now))
    assert (record["winner"], record["outcome"], record["cause"]) == (
        OPENTTD_RUNG[predicted],
        "direct",
        "",
    )
    # The winning rung is the last step, and it went well.
    assert (record["steps"][-1]["name"], record["steps"][-1]["outcome"]) == (
        OPENTTD_RUNG[predicted],
        "ok",
    ), record["steps"]
    assert {s["prefix"] for s in record["sides"]} == {"198.51.100.0/24"}
    assert record["usage"] is None


async def turn_bytes_total(lab: Lab) -> float:
    """``crossroads_openttd_turn_bytes_total`` on the lab server."""
    loop = asyncio.get_running_loop()
    sock = netns.socket_in(lab.server_ns, socket.SOCK_STREAM)
    try:
        await loop.sock_connect(sock, (SERVER_IPS[0], SERVER_HTTP_PORT))
        request = b"GET /metrics HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n"
        await loop.sock_sendall(sock, request)
        chunks = []
        while chunk := await loop.sock_recv(sock, 65536):
            chunks.append(chunk)
    finally:
        sock.close()
    for line in b"".join(chunks).decode().splitlines():
        if line.startswith("crossroads_openttd_turn_bytes_total "):
            return float(line.split()[1])
    return 0.0


async def test_openttd_relayed_join_record_carries_the_relay_bytes(lab: Lab) -> None:
    """Both behind random-port NATs: the lab predicts the TURN relay. The
    join's record is written when the relay ends (the OpenTTD processes
    stop), with the bytes the relay carried each way: the game's own
    traffic (the map download from the server, the client's commands), not
    known to the test byte for byte, but exactly what the relay's own
    counter (``crossroads_openttd_turn_bytes_total``) grew by."""
    a, b = lab.site("symmetric-random-a"), lab.site("symmetric-random-b")
    predicted = openttd.expected_via(a.kind, b.kind)
    assert predicted == "relay"
    now = time.time()
    before = await turn_bytes_total(lab)
    result = await run_attempt(openttd.METHOD, Attempt(lab, a, b))
    assert result.connected and result.via == predicted, result
    [record] = await records(lab, "openttd", second_of(now), match=after(now))
    assert (record["winner"], record["outcome"]) == (OPENTTD_RUNG[predicted], "relayed")
    # The rungs before TURN failed, and the cause says which.
    assert record["cause"] and "turn" not in record["cause"], record
    usage = record["usage"]
    # The client's commands and acks one way, the map (kilobytes) the other.
    assert 0 < usage["bytes_up"] < usage["bytes_down"], usage
    relayed = await turn_bytes_total(lab) - before
    assert usage["bytes_up"] + usage["bytes_down"] == relayed


async def test_raknet_proxy_record_counts_the_bytes_sent(lab: Lab) -> None:
    """Two random-port NATs: the punch fails, the server's own UDP proxy
    forwarder carries the game; its record names the proxy and counts what
    the test sent each way."""
    a_site, b_site = lab.site("symmetric-random-a"), lab.site("symmetric-random-b")
    assert raknet.expected_via(a_site.kind, b_site.kind) == "relay"
    await reset(lab, a_site.name, b_site.name)
    now = time.time()
    a = raknet.LabClient(lab.udp_socket(a_site))
    b = raknet.LabClient(lab.udp_socket(b_site))
    try:
        await asyncio.gather(a.connect(), b.connect())
        assert not await raknet.punchthrough(a, b)
        forwarder = await proxy_forwarder(a, b)
        # The exchange that opened the forwarder (game data every 100 ms
        # until both sides heard the other): counted too, a few datagrams.
        assert await raknet.game_data_crosses(a, forwarder, b, forwarder)
        up, down = await through_forwarder(a, b, forwarder)
        a.disconnect()
        b.disconnect()
    finally:
        a.sock.close()
        b.sock.close()
    # Written when the forwarder ends: RakNet's idle timeout the client asked
    # for in its FORWARDING_REQUEST (10 s, lab/methods/raknet.py).
    [record] = await records(
        lab,
        "raknet",
        second_of(now),
        timeout=30.0,
        match=lambda r: r["winner"] == "proxy" and after(now)(r),
    )
    assert (record["outcome"], record["cause"]) == (
        "relayed",
        "punch did not connect: the pair asked for the proxy",
    )
    usage = record["usage"]
    assert usage["bytes_up"] == pytest.approx(up, rel=0.01)
    assert usage["bytes_down"] == pytest.approx(down, rel=0.01)
    assert usage["packets_up"] >= DATAGRAMS and usage["packets_down"] >= DATAGRAMS


async def proxy_forwarder(a: raknet.LabClient, b: raknet.LabClient) -> Address:
    """UDPProxyClient's request (as lab/methods/raknet.py ``proxy``): the
    forwarder's address."""
    forwarder, _ = await raknet.request_forwarder(a, b)
    assert forwarder is not None, "the coordinator refused the forwarder"
    return forwarder


async def through_forwarder(
    a: raknet.LabClient, b: raknet.LabClient, forwarder: Address
) -> tuple[int, int]:
    """DATAGRAMS each way through ``forwarder``, each read by the other side
    (from the forwarder's address; the server's own traffic is set aside);
    the UDP payload bytes sent a->b and b->a. (The opening exchange's game
    data, 11 bytes every 100 ms until both sides heard the other, stays well
    inside 1 % of it.)"""
    sent = {"a": 0, "b": 0}
    for n in range(DATAGRAMS):
        for name, sender, receiver in (("a", a, b), ("b", b, a)):
            payload = bytes([0x86, n % 256]) * (SIZE // 2)
            send(sender.sock, payload, forwarder)
            sent[name] += len(payload)
            while True:
                got = await recv(receiver.sock, 2.0)
                assert got is not None, f"datagram {n} from {name} lost"
                if got[1] == forwarder and got[0] == payload:
                    break
    return sent["a"], sent["b"]


async def test_unity_relay_record_counts_the_bytes_sent(lab: Lab) -> None:
    """A host and a player behind two different NATs meet through the lab
        server's Unity relay; the link's record counts the RELAY frames each way
    (each ``RELAY_HEADER_SIZE`` bytes of header and its payload)."""
    a_site, b_site = lab.site("symmetric-random-a"), lab.site("port-restricted-cone-b")
    await reset(lab, a_site.name, b_site.name)
    now = time.time()
    host_alloc = Allocation.from_json(
        (await unity.api(lab, "/v1/allocate", {"maxConnections": 1}))["allocation"]
    )
    code = (
        await unity.api(
            lab, "/v1/joincode", {"allocationId": str(host_alloc.allocation_id)}
        )
    )["joinCode"]
    join_alloc = Allocation.from_json(
        (await unity.api(lab, "/v1/join", {"joinCode": code}))["allocation"]
    )
    host = await RelayConnection.open(
        host_alloc, config=unity.CLIENT, sock=lab.udp_socket(a_site)
    )
    player = await RelayConnection.open(
        join_alloc, config=unity.CLIENT, sock=lab.udp_socket(b_site)
    )
    up = down = 0
    try:
        await asyncio.gather(host.bind(unity.BIND_S), player.bind(unity.BIND_S))
        await player.connect(unity.STEP_S)
        for n in range(DATAGRAMS):
            payload = bytes([n % 256]) * SIZE
            player.send(host.allocation_id, payload)
            assert await host.recv(unity.STEP_S) == (player.allocation_id, payload)
            up += RELAY_HEADER_SIZE + len(payload)
            host.send(player.allocation_id, payload)
            assert await player.recv(unity.STEP_S) == (host.allocation_id, payload)
            down += RELAY_HEADER_SIZE + len(payload)
    finally:
        await player.close()
        await host.close()
    [record] = await records(
        lab, "relay", second_of(now), match=lambda r: bool(r["session"] == code)
    )
    assert (record["winner"], record["outcome"], record["cause"]) == (
        "relay",
        "relayed",
        "relay-only",
    )
    usage = record["usage"]
    # "up" is the joiner's way (joiner -> host). The relay counts the RELAY
    # frames it forwarded, as they crossed the wire (header and payload: the
    # receiver gets the frame itself), as TURN and natneg count the UDP
    # payloads their relays forward.
    assert usage["bytes_up"] == pytest.approx(up, rel=0.01), usage
    assert usage["bytes_down"] == pytest.approx(down, rel=0.01), usage
    assert usage["packets_up"] >= DATAGRAMS and usage["packets_down"] >= DATAGRAMS


async def test_turn_allocation_records_count_the_bytes_sent(lab: Lab) -> None:
    """Two TURN-over-UDP allocations from behind two NATs, bound to each
    other by channel: each allocation's record counts what its client sent
    to the peer (up) and what came back to it (down)."""
    a_site, b_site = lab.site("symmetric-random-a"), lab.site("full-cone-b")
    await reset(lab, a_site.name, b_site.name)
    now = time.time()
    host = await open_client(lab, a_site, "udp")
    player = await open_client(lab, b_site, "udp")
    sent = {"host": 0, "player": 0}
    try:
        await asyncio.gather(host.allocate(), player.allocate())
        assert host.relayed is not None and player.relayed is not None
        relayed = {"host": host.relayed, "player": player.relayed}
        await asyncio.gather(
            host.bind_channel(player.relayed), player.bind_channel(host.relayed)
        )
        for n in range(DATAGRAMS):
            for name, src, dst in (("host", host, player), ("player", player, host)):
                payload = bytes([n % 256]) * SIZE
                assert src.relayed is not None and dst.relayed is not None
                await src.send(payload, dst.relayed)
                assert await dst.receive(2.0) == (payload, src.relayed)
                sent[name] += len(payload)
    finally:
        await asyncio.gather(host.close(), player.close())
    found = await records(lab, "turn", second_of(now), want=2, match=after(now))
    by_relay = {r["session"]: r for r in found}
    for name, other in (("host", "player"), ("player", "host")):
        address = relayed[name]
        record = by_relay[f"udp/{address[0]}:{address[1]}"]
        assert (record["winner"], record["outcome"], record["cause"]) == (
            "relay",
            "relayed",
            "relay-only",
        )
        usage = record["usage"]
        assert usage["bytes_up"] == pytest.approx(sent[name], rel=0.01), usage
        assert usage["bytes_down"] == pytest.approx(sent[other], rel=0.01), usage
