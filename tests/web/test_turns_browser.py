"""Chromium with a ``turns:`` URL (TURN over TLS, RFC 8656 §3 / RFC 7065)
against crossroads: headless Debian ``chromium`` + ``chromium-driver`` in a
network namespace with a documentation address (203.0.113.2), crossroads in
another (203.0.113.1), a veth between them. Two RTCPeerConnections with
``iceTransportPolicy: "relay"`` open a data channel through crossroads' TLS
listener and move 1,000 messages each way; getStats says the local candidate is
a relay one reached over TLS. A wrong password gets no relay candidate (401).

Certificate trust: the server's certificate is issued for
``turn.crossroads.test`` by a CA the test makes; Chromium resolves the name
with ``--host-resolver-rules`` (no /etc/hosts) and trusts the server key with
``--ignore-certificate-errors-spki-list`` (its SPKI SHA-256). Chromium's
TURN-over-TLS client goes through the browser's certificate verifier: without
the flag the same run gets no relay candidate (tested below), and the broad
``--ignore-certificate-errors`` works too (checked by hand, not used: it trusts
everything)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from crossroads.lab import netns
from tests.conftest import eventually, serve_command
from tests.tls_support import write_certificates

pytestmark = [pytest.mark.interop, pytest.mark.timeout(240)]

SERVER_IP, CLIENT_IP = "203.0.113.1", "203.0.113.2"
NAME = "turn.crossroads.test"
USER, PASSWORD = "chromium", "turns-secret"
DRIVER = Path(__file__).with_name("turns_driver.py")
MESSAGES = 1000


@dataclass
class Pki:
    cert: Path
    key: Path

    @property
    def spki_sha256(self) -> str:
        """Base64 SHA-256 of the server key's SubjectPublicKeyInfo."""
        key = serialization.load_pem_private_key(self.key.read_bytes(), None)
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
        return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@dataclass
class Lab:
    server_ns: str
    client_ns: str
    log: Path
    pki: Pki

    @property
    def trust_flag(self) -> str:
        """Chromium trusts the server key (and only it) despite the unknown CA."""
        return f"--ignore-certificate-errors-spki-list={self.pki.spki_sha256}"


@pytest.fixture
async def lab(tmp_path: Path) -> AsyncIterator[Lab]:
    """Two namespaces joined by a veth, crossroads (STUN/TURN, TLS on 5349)
    running in the server one with a certificate for NAME."""
    tag = f"xr-turns-{os.getpid() % 100000}"
    server_ns, client_ns = f"{tag}-s", f"{tag}-c"
    for name in (server_ns, client_ns):
        if netns.exists(name):
            await netns.run(["ip", "netns", "del", name], check=False)
    _, cert, key = write_certificates(tmp_path, NAME)
    pki = Pki(cert, key)
    log = tmp_path / "serve.log"
    pid = 0
    try:
        await netns.ip_batch([f"netns add {server_ns}", f"netns add {client_ns}"])
        await netns.ip_batch(
            [
                f"link add xrt-s netns {server_ns} type veth peer name xrt-c"
                f" netns {client_ns}",
            ]
        )
        for name, device, address in (
            (server_ns, "xrt-s", SERVER_IP),
            (client_ns, "xrt-c", CLIENT_IP),
        ):
            await netns.ip_batch(
                [
                    f"addr add {address}/24 dev {device}",
                    f"link set {device} up",
                    "link set lo up",
                ],
                netns=name,
            )
        pid = netns.spawn(
            server_ns,
            serve_command(
                "stun,turn",
                "--tls-cert",
                str(pki.cert),
                "--tls-key",
                str(pki.key),
                "--turn-user",
                f"{USER}:{PASSWORD}",
                host=SERVER_IP,
            ),
            log=log,
            env={
                k: v for k, v in os.environ.items() if not k.startswith("CROSSROADS_")
            },
        )

        async def listening() -> bool:
            return log.exists() and f"tls {SERVER_IP}:5349" in log.read_text()

        await eventually(listening, "crossroads serving TLS on 5349", timeout=30)
        yield Lab(server_ns, client_ns, log, pki)
    finally:
        if pid:
            await netns.kill_group(pid)
        for name in (server_ns, client_ns):
            await netns.run(["ip", "netns", "del", name], check=False)


async def turns_check(
    lab: Lab, tmp_path: Path, credential: str, *flags: str
) -> dict[str, Any]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    out = await netns.run_in(
        lab.client_ns,
        [
            sys.executable,
            str(DRIVER),
            str(profile),
            f"turns:{NAME}:5349?transport=tcp",
            USER,
            credential,
            str(MESSAGES),
            f"--host-resolver-rules=MAP {NAME} {SERVER_IP}",
            *flags,
        ],  # fmt: skip
        timeout=150,
    )
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


async def test_chromium_turns_data_channel_through_crossroads(
    lab: Lab, tmp_path: Path
) -> None:
    result = await turns_check(lab, tmp_path, PASSWORD, lab.trust_flag)
    print("chromium turns: result", json.dumps(result))
    assert result.get("open"), result
    assert result["received"] == {"a": MESSAGES, "b": MESSAGES}, result
    assert "local" in result and "remote" in result, result
    assert result["local"]["candidateType"] == "relay", result
    assert result["local"]["relayProtocol"] == "tls", result
    assert result["remote"]["address"] == SERVER_IP, result


async def test_chromium_turns_wrong_password_gets_no_relay(
    lab: Lab, tmp_path: Path
) -> None:
    result = await turns_check(lab, tmp_path, "wrong", lab.trust_flag)
    assert not result.get("open"), result
    assert result["relayCandidates"] == [], result
    assert any(error["code"] == 401 for error in result["errors"]), result


async def test_chromium_checks_the_turns_certificate(lab: Lab, tmp_path: Path) -> None:
    """Without trust in the certificate, Chromium's TURN-over-TLS client gets
    no relay candidate (so the flag above is what makes the first test pass)."""
    result = await turns_check(lab, tmp_path, PASSWORD)
    assert not result.get("open"), result
    assert result["relayCandidates"] == [], result
