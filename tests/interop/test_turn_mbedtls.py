"""TURN over DTLS (RFC 8656 §3, UDP 5349) with a real mbedTLS 2.28 client:
mbedTLS's default suites, its own cookie exchange, and a full check of the
development certificate (chain and name). A STUN Binding request built by
crossroads' codec goes through as DTLS application data and its answer must
carry the client's own address."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crossroads.proto.stun import XorMappedAddress
from crossroads.proto.stun.constants import Class, Method
from crossroads.proto.stun.message import decode, encode, request
from tests.interop.mbedtls_support import (  # noqa: F401 (fixture)
    EXIT_HANDSHAKE,
    ca,
    client_binary,
    run_client,
)
from tests.interop.secure_turn_support import runtime_with_certificate
from tests.interop.test_turn import (  # noqa: F401 (fixtures)
    TurnRuntime,
    turn_runtime,
    turn_service,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


async def test_mbedtls_binding_over_dtls_with_a_verified_certificate(
    turn_runtime: TurnRuntime,  # noqa: F811
    client_binary: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    runtime = await runtime_with_certificate(turn_runtime, tmp_path)
    service = turn_service(runtime)
    (listener,) = service.dtls_listeners
    transaction = os.urandom(12)
    binding = encode(request(Method.BINDING, transaction), fingerprint=True)
    run = await run_client(
        client_binary,
        listener.local,
        ca(tmp_path / "dev-cert.pem", "localhost"),
        [f"w:{binding.hex()}", "r"],
    )
    assert run.returncode == 0, run.stderr
    assert "version DTLSv1.2" in run.lines, run.lines
    # mbedTLS 2.28 and the server agree on ECDHE-ECDSA-CHACHA20-POLY1305 (the
    # development key is P-256); any ECDHE-ECDSA suite is fine.
    assert run.ciphersuite.startswith("TLS-ECDHE-ECDSA-WITH-"), run.lines
    (answer,) = run.records
    reply = decode(answer)
    assert reply.msg_class == Class.SUCCESS and reply.method == Method.BINDING
    assert reply.transaction_id == transaction
    mapped = reply.get(XorMappedAddress)
    assert mapped is not None and mapped.host == "127.0.0.1"
    assert listener.handshakes == 1
    assert listener.hello_verify_requests >= 1
    # Nothing reached the plain UDP port: the request came through DTLS.
    assert service.stun.udp_endpoints[0].requests == 0


async def test_mbedtls_refuses_a_certificate_for_another_name(
    turn_runtime: TurnRuntime,  # noqa: F811
    client_binary: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The check above is real: the same certificate under a name it does not
    carry fails mbedTLS's verification."""
    runtime = await runtime_with_certificate(turn_runtime, tmp_path)
    (listener,) = turn_service(runtime).dtls_listeners
    run = await run_client(
        client_binary,
        listener.local,
        ca(tmp_path / "dev-cert.pem", "turn.example.invalid"),
        ["r"],
    )
    assert run.returncode == EXIT_HANDSHAKE, (run.returncode, run.stderr)
    assert "verif" in run.stderr.lower(), run.stderr
    assert listener.handshakes == 0
