"""Unity Relay over DTLS with a real mbedTLS client, UnityTLS's library.

Unity Transport's DTLS is UnityTLS, a closed wrapper around mbedTLS (reference
unity-secure-transports.md §1). ``mbedtls_dtls_client.c``, compiled here
against Debian's libmbedtls, does what UnityTLS does for Relay+DTLS: the 16
raw allocation-id bytes as PSK identity, the 64-byte decoded key as PSK,
mbedTLS's default ciphersuites and its own HelloVerifyRequest handling. It
sends relay messages built by crossroads' codec as DTLS application data and
prints the records it receives as hex lines.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from crossroads.proto.dtls.handshake import Established
from crossroads.proto.relay.messages import (
    HMAC_SIZE,
    Accepted,
    Bind,
    BindReceived,
    ConnectRequest,
    Relay,
)
from crossroads.proto.relay.token import bind_hmac
from tests.conftest import eventually
from tests.dtls_psk_support import DtlsPeer
from tests.e2e.relay_support import (
    allocate,
    allocate_pair,
    allocation_id,
    api,
    base_url,
    endpoint_address,
    metric,
    relay_runtime,
)
from tests.interop.mbedtls_support import (  # noqa: F401 (fixture)
    EXIT_HANDSHAKE,
    client_binary,
    mbedtls_client,
    psk,
    run_client,
)

pytestmark = pytest.mark.timeout(60)

#: What mbedTLS 2.28's default list and the relay agree on: the relay picks
#: by its own preference among what the client offers (crypto.SUITES, 0x00A8
#: first), and mbedTLS's defaults offer TLS_PSK_WITH_AES_128_GCM_SHA256.
NEGOTIATED_SUITE = "TLS-PSK-WITH-AES-128-GCM-SHA256"


def signed_bind(allocation: dict[str, Any], key: bytes | None = None) -> bytes:
    """A BIND from crossroads' codec, HMAC'd with the allocation's key as the
    client does (reference §1.1)."""
    data = base64.b64decode(allocation["connectionData"])
    unsigned = Bind(nonce=0, connection_data=data, hmac=bytes(HMAC_SIZE))
    mac = bind_hmac(
        key if key is not None else base64.b64decode(allocation["key"]),
        unsigned.signed_bytes(),
    )
    return Bind(nonce=0, connection_data=data, hmac=mac).encode()


async def dtls_metrics(rt: Any) -> str:
    async with httpx.AsyncClient(base_url=base_url(rt)) as http:
        return (await http.get("/metrics")).text


async def test_mbedtls_binds_with_the_raw_allocation_id(client_binary: Path) -> None:  # noqa: F811
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        key = base64.b64decode(allocation["key"])
        run = await run_client(
            client_binary,
            endpoint_address(allocation, "dtls"),
            psk(allocation_id(allocation), key),
            [f"w:{signed_bind(allocation).hex()}", "r"],
        )
        assert run.returncode == 0, run.stderr
        assert run.records == [BindReceived().encode()]
        assert run.ciphersuite == NEGOTIATED_SUITE, run.lines
        assert "version DTLSv1.2" in run.lines
        page = await dtls_metrics(rt)
        # mbedTLS went through our cookie exchange, as UnityTLS does.
        assert metric(page, "crossroads_relay_dtls_hello_verify_requests_total") >= 1
        assert metric(page, "crossroads_relay_dtls_handshakes_completed_total") == 1

        async def session_closed() -> bool:
            page = await dtls_metrics(rt)
            return metric(page, "crossroads_relay_dtls_sessions") == 0

        # Its close_notify ends the session and the allocation, and nothing is
        # sent to (or dropped for) the gone session.
        await eventually(session_closed, "close_notify ended the DTLS session")
        page = await dtls_metrics(rt)
        dropped = "crossroads_relay_dtls_dropped_records_total"
        assert metric(page, dropped, reason="send-no-session") == 0, [
            line for line in page.splitlines() if line.startswith(dropped)
        ]


async def test_mbedtls_with_the_uuid_text_identity(client_binary: Path) -> None:  # noqa: F811
    """Unity's docs name the allocation ID's canonical text as identity; the
    relay accepts both (reference §1.3, the safe server rule)."""
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        assert len(allocation["allocationId"]) == 36
        run = await run_client(
            client_binary,
            endpoint_address(allocation, "dtls"),
            psk(
                allocation["allocationId"].encode(), base64.b64decode(allocation["key"])
            ),
            [f"w:{signed_bind(allocation).hex()}", "r"],
        )
        assert run.returncode == 0, run.stderr
        assert run.records == [BindReceived().encode()]


async def test_mbedtls_with_a_wrong_key_fails_the_handshake(
    client_binary: Path,  # noqa: F811
) -> None:
    async with relay_runtime() as rt, api(rt) as http:
        allocation = await allocate(http, 1)
        key = base64.b64decode(allocation["key"])
        wrong = bytes(b ^ 1 for b in key)
        run = await run_client(
            client_binary,
            endpoint_address(allocation, "dtls"),
            psk(allocation_id(allocation), wrong),
            [f"w:{signed_bind(allocation).hex()}", "r"],
        )
        assert run.returncode == EXIT_HANDSHAKE, (run.returncode, run.stderr)
        # The relay cannot decrypt the client's Finished and says so with a
        # fatal bad_record_mac alert (RFC 5246 §7.4.9), which mbedTLS reports.
        assert "fatal alert message was received" in run.stderr, run.stderr
        assert run.records == []
        page = await dtls_metrics(rt)
        assert metric(page, "crossroads_relay_dtls_handshakes_completed_total") == 0
        failures = "crossroads_relay_dtls_handshake_failures_total"
        assert metric(page, failures, reason="bad-psk") == 1, [
            line for line in page.splitlines() if line.startswith(failures)
        ]


async def test_mbedtls_joiner_and_crossroads_host_relay_both_ways(
    client_binary: Path,  # noqa: F811
) -> None:
    async with relay_runtime() as rt, api(rt) as http:
        host_alloc, join_alloc = await allocate_pair(http)
        hid, jid = allocation_id(host_alloc), allocation_id(join_alloc)
        server = endpoint_address(host_alloc, "dtls")
        host = DtlsPeer(server, hid, base64.b64decode(host_alloc["key"]))
        try:
            assert isinstance(await host.handshake(), Established)
            host.send(signed_bind(host_alloc))
            assert await host.recv() == BindReceived().encode()
            to_host = os.urandom(100)
            to_joiner = os.urandom(1200)
            connect = ConnectRequest(
                jid, base64.b64decode(join_alloc["hostConnectionData"])
            )
            steps = [
                f"w:{signed_bind(join_alloc).hex()}",
                "r",
                f"w:{connect.encode().hex()}",
                "r",
                "r",
                f"w:{Relay(jid, hid, to_host).encode().hex()}",
            ]
            async with mbedtls_client(
                client_binary,
                server,
                psk(jid, base64.b64decode(join_alloc["key"])),
                steps,
            ) as joiner:
                assert (await joiner.line()).startswith("ciphersuite ")
                assert (await joiner.line()).startswith("version ")
                assert bytes.fromhex(await joiner.line()) == BindReceived().encode()
                accepted = bytes.fromhex(await joiner.line())
                assert accepted == Accepted(hid, jid).encode()
                host.send(Relay(hid, jid, to_joiner).encode())
                assert bytes.fromhex(await joiner.line()) == (
                    Relay(hid, jid, to_joiner).encode()
                )
                assert await host.recv() == Relay(jid, hid, to_host).encode()
                run = await joiner.finish()
                assert run.returncode == 0, run.stderr
        finally:
            host.close()
