"""Automatic certificates (``--acme-domain``) against a real ACME CA: Debian's
``pebble``, Let's Encrypt's test server, on loopback.

Pebble validates the HTTP-01 challenges for real: it connects to
``localhost:httpPort``, which is crossroads' ``--acme-http-port``. Its own
HTTPS is served with a certificate from a CA the test makes, given to
crossroads as ``--acme-ca-bundle``. Nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossroads.acme import (
    ACCOUNT_KEY,
    CERT_FILE,
    KEY_FILE,
    Challenges,
    acme_dir,
    listen_challenges,
    renewal_reason,
    write_placeholder,
)
from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.runtime import Runtime, start
from crossroads.transport.admission import ResourceBudget
from tests.conftest import eventually, free_port, loopback_config, serve_command

pytestmark = pytest.mark.timeout(60)

PEBBLE = shutil.which("pebble")
needs_pebble = pytest.mark.skipif(PEBBLE is None, reason="pebble is not installed")


# ------------------------------------------------------------------ a test CA


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_test_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A CA certificate, and a certificate and key for ``localhost`` signed by
    it (pebble's HTTPS listener): (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("crossroads test ACME CA"))
        .issuer_name(_name("crossroads test ACME CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (
        directory / "ca.pem",
        directory / "pebble-cert.pem",
        directory / "pebble-key.pem",
    )
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


def trust(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


@dataclass
class Pebble:
    directory_url: str
    management_url: str
    ca_bundle: Path
    #: The port pebble validates HTTP-01 on: crossroads' --acme-http-port.
    http_port: int

    def root(self) -> x509.Certificate:
        """Pebble's issuing root (made anew at each start)."""
        pem = httpx.get(f"{self.management_url}/roots/0", verify=trust(self.ca_bundle))
        return x509.load_pem_x509_certificate(pem.content)


@pytest.fixture
def pebble(tmp_path: Path) -> Iterator[Pebble]:
    assert PEBBLE is not None
    ca, cert, key = make_test_ca(tmp_path)
    port, management, http_port = free_port(), free_port(), free_port()
    config = tmp_path / "pebble.json"
    config.write_text(
        json.dumps(
            {
                "pebble": {
                    "listenAddress": f"127.0.0.1:{port}",
                    "managementListenAddress": f"127.0.0.1:{management}",
                    "certificate": str(cert),
                    "privateKey": str(key),
                    "httpPort": http_port,
                    "tlsPort": free_port(),
                    "ocspResponderURL": "",
                    "externalAccountBindingRequired": False,
                }
            }
        )
    )
    env = {
        **os.environ,
        # Validate at once, never reject a good nonce, never reuse a proven
        # authorization: every order goes through crossroads' HTTP-01 answer.
        "PEBBLE_VA_NOSLEEP": "1",
        "PEBBLE_WFE_NONCEREJECT": "0",
        "PEBBLE_AUTHZREUSE": "0",
    }
    log = (tmp_path / "pebble.log").open("wb")
    process = subprocess.Popen(
        [PEBBLE, "-config", str(config), "-strict"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"https://127.0.0.1:{port}/dir"
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError((tmp_path / "pebble.log").read_text())
            try:
                if httpx.get(url, verify=trust(ca)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("pebble did not answer within 15 s")
            time.sleep(0.1)
        yield Pebble(url, f"https://127.0.0.1:{management}", ca, http_port)
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# ------------------------------------------------------------------ helpers


def acme_values(pebble: Pebble, state: Path, **extra: Any) -> dict[str, Any]:
    return {
        "core__acme_domain": ["localhost"],
        "core__acme_directory": pebble.directory_url,
        "core__acme_ca_bundle": str(pebble.ca_bundle),
        "core__acme_http_port": pebble.http_port,
        "core__https_port": free_port(),
        "core__state_dir": str(state),
        "core__only": ["stun"],
        **extra,
    }


@asynccontextmanager
async def acme_runtime(values: dict[str, Any]) -> AsyncIterator[Runtime]:
    runtime = await start(default_config(loopback_config(**values)))
    try:
        yield runtime
    finally:
        await runtime.close()


async def served_certificate(port: int) -> x509.Certificate:
    """The leaf a new TLS handshake on ``port`` presents (not verified)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der)
    finally:
        writer.close()


def issued_by(leaf: x509.Certificate, pebble: Pebble) -> bool:
    """True when ``leaf`` is a certificate pebble issued (not the placeholder)."""
    return leaf.issuer != leaf.subject and any(
        "Pebble" in a.value for a in leaf.issuer if isinstance(a.value, str)
    )


# ------------------------------------------------------------------ tests


@needs_pebble
async def test_obtains_serves_and_renews_without_restart(
    tmp_path: Path, pebble: Pebble
) -> None:
    # Renew at every check (a 100-year threshold), checked every second: the
    # first order replaces the placeholder, the next ones are renewals.
    turn_tls = free_port()
    values = acme_values(
        pebble,
        tmp_path / "state",
        core__acme_renew_days=36500.0,
        core__acme_check_interval=1.0,
        core__only=["stun", "turn"],
        turn__tls_port=turn_tls,
        turn__user=["u:p"],
    )
    async with acme_runtime(values) as runtime:
        assert runtime.acme is not None and runtime.https_address is not None
        port = runtime.https_address[1]
        first: list[x509.Certificate] = []

        async def issued() -> bool:
            leaf = await served_certificate(port)
            if issued_by(leaf, pebble):
                first.append(leaf)
                return True
            return False

        await eventually(issued, "a certificate issued by pebble is served", 30)
        leaf = first[0]
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert names.value.get_values_for_type(x509.DNSName) == ["localhost"]
        # It chains to pebble's root, as a client checks it (chain from the file).
        chain = (acme_dir(tmp_path / "state") / CERT_FILE).read_bytes()
        assert chain.count(b"BEGIN CERTIFICATE") >= 2
        # A TLS connection opened now survives the renewal below.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1",
            port,
            ssl=_unverified(),
            server_hostname="localhost",
        )
        generation = runtime.certificates.generation  # type: ignore[union-attr]

        async def renewed() -> bool:
            leaf2 = await served_certificate(port)
            return (
                issued_by(leaf2, pebble) and leaf2.serial_number != leaf.serial_number
            )

        await eventually(renewed, "a renewed certificate is served", 30)
        assert runtime.certificates is not None
        assert runtime.certificates.generation > generation
        assert runtime.acme.issued >= 2
        # TURN over TLS presents the same certificate (one reload for all).
        turn_leaf = await served_certificate(turn_tls)
        assert issued_by(turn_leaf, pebble)
        assert turn_leaf.serial_number != leaf.serial_number
        # The connection from before the renewal still speaks HTTP.
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(
            b"HTTP/1.1 200"
        )
        writer.close()
    files = acme_dir(tmp_path / "state")
    for name in (ACCOUNT_KEY, CERT_FILE, KEY_FILE):
        assert stat.S_IMODE((files / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(files.stat().st_mode) == 0o700


def _unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@needs_pebble
async def test_a_fresh_certificate_is_kept_and_reused_after_restart(
    tmp_path: Path, pebble: Pebble
) -> None:
    values = acme_values(pebble, tmp_path / "state")
    async with acme_runtime(values) as runtime:
        assert runtime.acme is not None and runtime.https_address is not None
        acme = runtime.acme

        async def done() -> bool:
            return acme.issued == 1 and acme.failures == 0

        await eventually(done, "one certificate ordered", 30)
        # 30 days is far: a check orders nothing.
        assert await acme.check() is False
        served = await served_certificate(runtime.https_address[1])
        assert issued_by(served, pebble)
        host, http_port = runtime.http_address
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"http://{host}:{http_port}/metrics")).text
        assert 'crossroads_acme_orders_total{result="issued"} 1.0' in metrics
        expiry = served.not_valid_after_utc.timestamp()
        (exported,) = (
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("crossroads_acme_certificate_expiry_seconds ")
        )
        assert exported == expiry
    # A restart serves the stored certificate from the start and orders none.
    async with acme_runtime(acme_values(pebble, tmp_path / "state")) as runtime:
        assert runtime.acme is not None and runtime.https_address is not None
        again = await served_certificate(runtime.https_address[1])
        assert again.serial_number == served.serial_number
        assert await runtime.acme.check() is False
        assert runtime.acme.issued == 0


async def test_challenge_listener_answers_only_known_tokens(tmp_path: Path) -> None:
    budget = ResourceBudget(1024)
    challenges = Challenges()
    challenges.add("tok-1", "tok-1.thumbprint")
    listener = await listen_challenges(
        budget,
        "127.0.0.1",
        0,
        challenges,
        max_connections=64,
        max_per_ip=8,
        request_timeout=5.0,
    )
    try:
        base = f"http://127.0.0.1:{listener.address[1]}"
        async with httpx.AsyncClient(base_url=base) as client:
            ok = await client.get("/.well-known/acme-challenge/tok-1")
            assert ok.status_code == 200
            assert ok.text == "tok-1.thumbprint"
            assert ok.headers["content-type"].startswith("text/plain")
            assert (
                await client.get("/.well-known/acme-challenge/nope")
            ).status_code == 404
            for path in ("/", "/healthz", "/metrics", "/console/api/admin/resources"):
                answer = await client.get(path)
                assert answer.status_code == 404, path
                assert answer.json()["code"] == "not_found"
            challenges.remove("tok-1")
            gone = await client.get("/.well-known/acme-challenge/tok-1")
            assert gone.status_code == 404
        assert any(
            entry.kind == "acme-http" and entry.table == "acme-http"
            for entry in budget.listeners
        )
    finally:
        await listener.close()


def test_renewal_reason(tmp_path: Path) -> None:
    directory = tmp_path / "acme"
    thirty = datetime.timedelta(days=30)
    assert renewal_reason(directory / CERT_FILE, ["example.org"], thirty) == (
        "no certificate"
    )
    write_placeholder(directory, ["example.org"])
    assert renewal_reason(directory / CERT_FILE, ["example.org"], thirty) == (
        "placeholder"
    )
    # An issued certificate: by another issuer, for the names, 90 days.
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("example.org"))
        .issuer_name(_name("Some CA"))
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=90))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("example.org")]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    (directory / CERT_FILE).write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    path = directory / CERT_FILE
    assert renewal_reason(path, ["example.org"], thirty, now) is None
    assert renewal_reason(path, ["example.org", "www.example.org"], thirty, now) == (
        "other names"
    )
    later = now + datetime.timedelta(days=61)
    assert renewal_reason(path, ["example.org"], thirty, later) == "28 day(s) left"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"core.acme_domain": ["*.example.org"]}, "wildcard"),
        ({"core.acme_domain": ["exa mple.org"]}, "not a DNS name"),
        ({"core.acme_domain": ["192.0.2.1"]}, "not a DNS name"),
        (
            {"core.acme_domain": ["example.org"], "core.acme_directory": "http://ca"},
            "https://",
        ),
        (
            {
                "core.acme_domain": ["example.org"],
                "core.tls_cert": "c.pem",
                "core.tls_key": "k.pem",
            },
            "--acme-domain",
        ),
    ],
)
def test_acme_settings_are_checked(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        default_config(overrides)


@needs_pebble
async def test_serve_orders_at_start_and_sighup_checks_at_once(
    tmp_path: Path, pebble: Pebble
) -> None:
    """The real command line: ``crossroads serve --acme-domain`` orders at
    start; SIGHUP (``crossroads reload``) checks at once and, the certificate
    being due (a 100-year threshold), renews it without a restart."""
    https = free_port()
    command = serve_command(
        "stun",
        "--state-dir", str(tmp_path / "state"),
        "--https-port", str(https),
        "--acme-domain", "localhost",
        "--acme-directory", pebble.directory_url,
        "--acme-ca-bundle", str(pebble.ca_bundle),
        "--acme-http-port", str(pebble.http_port),
        "--acme-renew-days", "36500",
        # Never by the clock in this test: only at start and on SIGHUP.
        "--acme-check-interval", "3600",
    )  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        seen: list[int] = []

        async def served_by_pebble() -> bool:
            if process.poll() is not None:
                raise AssertionError(log.read_text())
            try:
                leaf = await served_certificate(https)
            except OSError:
                return False
            if issued_by(leaf, pebble):
                seen.append(leaf.serial_number)
                return True
            return False

        await eventually(served_by_pebble, "the first certificate", 30)
        first = seen[-1]
        process.send_signal(signal.SIGHUP)

        async def renewed() -> bool:
            return await served_by_pebble() and seen[-1] != first

        await eventually(renewed, "a new certificate after SIGHUP", 30)
        assert process.poll() is None
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "TLS certificate reloaded" in text, text
