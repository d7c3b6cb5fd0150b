"""TLS certificates, reload and bounded handshakes (crossroads.transport.tls),
with real TLS connections on loopback."""

from __future__ import annotations

import datetime
import shutil
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from crossroads.errors import ConfigError
from crossroads.transport.tls import (
    DEV_CERT_LIFETIME,
    Certificates,
    certificates_for,
    development_certificate,
)
from tests.tls_support import (  # noqa: F401 (fixture)
    MakeServer,
    Server,
    echo_once,
    make_server_fixture,
    serial,
)

NOW = datetime.datetime.now(datetime.UTC)


# ------------------------------------------------------------ certificates


def test_development_certificate_is_made_once_and_renewed_near_expiry(
    tmp_path: Path,
) -> None:
    cert, key = development_certificate(tmp_path, now=NOW)
    assert key.stat().st_mode & 0o777 == 0o600
    first = serial(cert)
    names = (
        x509.load_pem_x509_certificate(cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "::1",
    }
    assert development_certificate(tmp_path, now=NOW)[0] == cert
    assert serial(cert) == first  # reused
    near_expiry = NOW + DEV_CERT_LIFETIME - datetime.timedelta(days=1)
    development_certificate(tmp_path, now=near_expiry)
    assert serial(cert) != first  # made anew


def test_certificates_for_chooses_given_then_dev_on_loopback_only(
    tmp_path: Path,
) -> None:
    assert certificates_for("", "", host="127.0.0.1", dev_dir="") is None
    assert certificates_for("", "", host="0.0.0.0", dev_dir=str(tmp_path)) is None
    assert certificates_for("", "", host="192.0.2.1", dev_dir=str(tmp_path)) is None
    dev = certificates_for("", "", host="::1", dev_dir=str(tmp_path))
    assert dev is not None and dev.cert == tmp_path / "dev-cert.pem"
    given = certificates_for(str(dev.cert), str(dev.key), host="0.0.0.0", dev_dir="")
    assert given is not None and given.cert == dev.cert


def test_expired_or_broken_certificate_is_refused(tmp_path: Path) -> None:
    old = NOW - DEV_CERT_LIFETIME - datetime.timedelta(days=2)
    cert, key = development_certificate(tmp_path, now=old)
    with pytest.raises(ConfigError, match="expired"):
        Certificates(cert, key)
    cert.write_text("not a certificate")
    with pytest.raises(ConfigError, match="tls_cert"):
        Certificates(cert, key)


async def test_reload_serves_new_chain_and_keeps_live_connections(
    tmp_path: Path, make_server: MakeServer
) -> None:
    first_cert, first_key = development_certificate(tmp_path / "a")
    second_cert, second_key = development_certificate(tmp_path / "b")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(first_cert, cert)
    shutil.copy(first_key, key)
    certificates = Certificates(cert, key)
    server = await make_server(certificates)
    reader, writer, served = await echo_once(server.port, first_cert)
    assert served == serial(first_cert)

    shutil.copy(second_cert, cert)
    shutil.copy(second_key, key)
    assert certificates.reload()
    _, writer2, served2 = await echo_once(server.port, second_cert)
    assert served2 == serial(second_cert)
    # The connection made before the reload is still up and working.
    writer.write(b"still here")
    assert await reader.readexactly(10) == b"still here"

    # An expired replacement is refused and the current chain stays.
    expired_cert, expired_key = development_certificate(
        tmp_path / "c", now=NOW - DEV_CERT_LIFETIME - datetime.timedelta(days=2)
    )
    shutil.copy(expired_cert, cert)
    shutil.copy(expired_key, key)
    assert not certificates.reload()
    assert certificates.failed_reloads == 1
    _, writer3, served3 = await echo_once(server.port, second_cert)
    assert served3 == serial(second_cert)
    for w in (writer, writer2, writer3):
        w.close()


def test_server_context_refuses_old_versions_and_renegotiation(
    tmp_path: Path,
) -> None:
    """Set by crossroads itself, not left to the system's OpenSSL configuration
    (Debian's already refuses both, so the end-to-end checks in
    tests/adversarial/test_tls_handshakes.py would pass without these)."""
    context = Certificates(*development_certificate(tmp_path)).context
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_RENEGOTIATION
