"""Connection insight through real kernel NAT. natneg: a natneg server in the
lab (``crossroads serve`` in the server namespace, as deployed), two GameSpy
SDK clients behind lab routers; for a pair the lab's NAT kinds say must punch
and one they say must be relayed, the record's winner matches the prediction
docs/nat-matrix.md prints (``expected_via`` of the natneg method), the relayed
one names the reason (both endpoint-dependent mappings), and its usage counts
the bytes the test sent through the relay each way within 1 %. p2p: one SDK
ladder against the lab's own server; its record names the step the SDK
method's prediction names, from both sides' reports."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

from crossroads.lab import netns
from crossroads.lab.methods import sdk
from crossroads.lab.methods.natneg import (
    expected_via,
    extra_server_args,
    negotiate,
    servers_at,
    succeeded,
)
from crossroads.lab.natneg_sdk import SdkNegotiator, read_game_data
from crossroads.lab.topology import SERVER_HTTP_PORT, SERVER_IPS, Lab
from crossroads.state import CREDENTIALS_FILE
from tests.lab.test_natneg import reset

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]

PORT, HTTP_PORT = 27950, 18093
TOKEN = "lab-insight-admin-token-0123456789"
#: Datagrams each way through the relay, and their size: 400 kB in all, so
#: the SDK's own NN pings through it (a few hundred bytes) stay far below 1 %.
DATAGRAMS, SIZE = 200, 1000


async def insight(
    lab: Lab, path: str, port: int = HTTP_PORT, token: str = TOKEN
) -> Any:
    """GET ``path`` from a lab server's HTTP port, in the server namespace."""
    loop = asyncio.get_running_loop()
    sock = netns.socket_in(lab.server_ns, socket.SOCK_STREAM)
    try:
        await loop.sock_connect(sock, (SERVER_IPS[0], port))
        request = (
            f"GET {path} HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n"
            f"Authorization: Bearer {token}\r\n\r\n"
        )
        await loop.sock_sendall(sock, request.encode())
        chunks = []
        while chunk := await loop.sock_recv(sock, 65536):
            chunks.append(chunk)
    finally:
        sock.close()
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return json.loads(body)


async def records(lab: Lab, want: int) -> list[dict[str, Any]]:
    for _ in range(100):
        found = (await insight(lab, "/v1/insight/attempts?family=natneg"))["attempts"]
        if len(found) >= want:
            return list(found)
        await asyncio.sleep(0.1)
    raise AssertionError(f"{want} natneg records expected, got {found}")


async def exchange(host: SdkNegotiator, guest: SdkNegotiator) -> tuple[int, int]:
    """DATAGRAMS each way over the negotiated path, each read by the other
    side; the payload bytes sent host->guest and guest->host."""
    sent = {"host": 0, "guest": 0}
    for n in range(DATAGRAMS):
        for name, sender, receiver in (("host", host, guest), ("guest", guest, host)):
            out, into = sender.outcome, receiver.outcome
            assert out and out.sock and out.remote and into and into.sock
            payload = bytes([n % 256]) * SIZE
            out.sock.sendto(payload, out.remote)
            data, _ = await read_game_data(into.sock, timeout=2.0)
            assert data == payload
            sent[name] += len(payload)
    return sent["host"], sent["guest"]


async def test_records_match_the_nat_kinds_prediction_and_the_bytes_sent(
    lab: Lab,
) -> None:
    args = extra_server_args(PORT, timed=True)
    args += ["--admin-token", TOKEN, "--natneg-linger", "1"]
    args += ["--natneg-relay-idle-timeout", "1"]
    args += ["--state-dir", str(lab.state_dir / "insight-server")]
    await lab.start_extra_server("insight-natneg", args, HTTP_PORT)
    try:
        # A pair the NAT kinds say punches.
        await reset(lab, "port-restricted-cone-a", "full-cone-b")
        a, b = lab.site("port-restricted-cone-a"), lab.site("full-cone-b")
        assert expected_via(a.kind, b.kind) == "punch"
        host, guest = await negotiate(lab, a, b, 0x1A2B0001, servers_at(PORT))
        try:
            assert succeeded(host, guest)
        finally:
            SdkNegotiator.close_all()
        [punched] = await records(lab, 1)
        assert (punched["winner"], punched["outcome"], punched["cause"]) == (
            "punch",
            "direct",
            "",
        )
        assert punched["session"] == f"{0x1A2B0001:08x}"
        # Sides are pseudonymous: the routers' /24, never their address.
        assert {s["prefix"] for s in punched["sides"]} == {"198.51.100.0/24"}
        assert a.public_ip not in json.dumps(punched)

        # A pair the NAT kinds say needs the relay: both mappings symmetric.
        await reset(lab, "symmetric-random-a", "symmetric-sequential-b")
        a, b = lab.site("symmetric-random-a"), lab.site("symmetric-sequential-b")
        assert expected_via(a.kind, b.kind) == "relay"
        host, guest = await negotiate(lab, a, b, 0x1A2B0002, servers_at(PORT))
        try:
            assert succeeded(host, guest)
            up, down = await exchange(host, guest)
        finally:
            SdkNegotiator.close_all()
        # The record is written when the relay pair goes (idle 1 s).
        relayed = (await records(lab, 2))[0]
        assert relayed["session"] == f"{0x1A2B0002:08x}"
        assert (relayed["winner"], relayed["outcome"], relayed["cause"]) == (
            "relay",
            "relayed",
            "both-symmetric",
        )
        assert [s["nat"] for s in relayed["sides"]] == ["symmetric", "symmetric"]
        usage = relayed["usage"]
        # natneg client 0 (the guest here) is "up".
        assert usage["bytes_up"] == pytest.approx(down, rel=0.01)
        assert usage["bytes_down"] == pytest.approx(up, rel=0.01)
        assert usage["packets_up"] >= DATAGRAMS and usage["packets_down"] >= DATAGRAMS
    finally:
        await lab.stop_extra_server("insight-natneg")


async def test_p2p_record_names_the_predicted_step(lab: Lab) -> None:
    """Two port-restricted cones: the SDK method predicts the punch step."""
    credentials = lab.state_dir / "server-state" / CREDENTIALS_FILE
    token = json.loads(credentials.read_text())["admin_token"]
    await reset(lab, "port-restricted-cone-a", "port-restricted-cone-b")
    a, b = lab.site("port-restricted-cone-a"), lab.site("port-restricted-cone-b")
    predicted = sdk.expected_via(a.kind, b.kind)
    assert predicted == "punch"
    since = int(time.time()) - 1
    outcome, mappings = await sdk.connect(lab, a, b)
    assert outcome.connected and outcome.via == predicted, outcome
    path = f"/v1/insight/attempts?family=p2p&since={since}"
    for _ in range(100):
        found = (await insight(lab, path, SERVER_HTTP_PORT, token))["attempts"]
        if found:
            break
        await asyncio.sleep(0.1)
    [record] = found
    assert (record["winner"], record["outcome"], record["cause"]) == (
        predicted,
        "direct",
        "",
    )
    steps = [(s["name"], s["outcome"]) for s in record["steps"]]
    assert steps == [
        ("prepare", "ok"),
        ("initiator:punch", "ok"),
        ("responder:punch", "ok"),
    ]
    # The mappings the rendezvous ports saw, as the SDK learned them (the
    # joiner initiates).
    assert [s["nat"] for s in record["sides"]] == [mappings[1], mappings[0]]
    assert {s["prefix"] for s in record["sides"]} == {"198.51.100.0/24"}
