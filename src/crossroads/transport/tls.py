"""TLS for the stream listeners: certificates, reload, and bounded handshakes.

Certificates
------------
:class:`Certificates` owns the one server :class:`ssl.SSLContext` every TLS
listener of a process shares. ``--tls-cert`` is a PEM chain (leaf first) and
``--tls-key`` its private key. :meth:`Certificates.reload` (the runtime calls it
on SIGHUP) loads the files again *into the same context*: OpenSSL copies the
certificate into each connection when it is accepted, so connections already up
(and the TURN allocations made over them) keep going, and the next handshake
presents the new chain. A chain that does not load, or whose leaf has expired,
is refused and the old one stays.

Without a certificate, and only on a loopback bind, :func:`development_certificate`
makes (once) a self-signed certificate for ``localhost``, ``127.0.0.1`` and
``::1`` in a directory it is given, so ``make run`` has ``turns:`` to try.

Handshakes and connections
--------------------------
:class:`TlsAcceptor` is the protocol of an accepted TCP connection that must
speak TLS. The application protocol sees the connection only once the
handshake is done (``connection_made`` with the TLS transport, whose
``peername`` is the real client address, so per-source limits apply to it).
Every TLS listener registers its own tables with the process's one
:class:`~crossroads.transport.admission.ResourceBudget` (:func:`tls_tables`),
so a flood of one TLS port cannot take another's handshakes:

- the TCP listener's connection table (its descriptor share) admits the
  connection at accept and holds it until the handshake is done; then the
  application protocol (TURN's connection, the HTTP guard, the relay's
  WebSocket listener) admits it itself, as on a plain port;
- ``tls-connections:NAME`` counts every TLS connection from accept to close
  with its measured memory (:data:`CONNECTION_BYTES`), so the memory share
  caps how many there can be;
- ``tls-handshakes:NAME`` counts the handshakes in progress (and what a
  handshake costs beyond an established connection, :data:`HANDSHAKE_BYTES`);
  each must finish within its pre-auth deadline (:data:`HANDSHAKE_TIMEOUT`,
  a slow-loris client is cut).

Each table's per-source cap is at most an eighth of its total, the source
being the IPv4 address or the IPv6 /64. Every refusal and failure is counted
through the ``drop(reason)`` callback: ``tls-connection-limit``,
``tls-connection-ip-limit``, ``tls-handshake-limit``,
``tls-handshake-ip-limit``, ``tls-handshake-timeout``,
``tls-handshake-failed``. Renegotiation is off (``OP_NO_RENEGOTIATION``;
TLS 1.3 has none), and TLS below 1.2 is refused (RFC 8996).

The TLS layer is asyncio's, with one change (:class:`LeanSSLProtocol`): its
socket read buffer is one TLS record (:data:`READ_BUFFER`) instead of
256 KiB, which was most of an idle connection's memory.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import ssl
from asyncio import sslproto
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crossroads.errors import ConfigError
from crossroads.proto.admission import REFUSED_OVER_IP_LIMIT, REFUSED_OVER_LIMIT
from crossroads.transport.admission import (
    Admission,
    Pool,
    ResourceBudget,
)

log = logging.getLogger("crossroads.tls")

#: Seconds a client has to finish its TLS handshake once connected. A real
#: client needs one or two round trips; 10 s leaves room for a slow mobile link
#: and still frees a slot held by a client that sends nothing (asyncio's own
#: default is 60 s).
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress at once on one TLS listener (each has its own
#: table). A handshake costs one asymmetric signature (~0.1 ms for P-256,
#: ~1 ms for RSA-2048); 256 in flight is more than two cores can complete
#: within HANDSHAKE_TIMEOUT under a flood.
MAX_HANDSHAKES = 256
#: Handshakes in progress at once from one source (IPv4 address or IPv6 /64):
#: a browser opens a few connections at once; more are a flood. The budget
#: caps it at an eighth of the table's total anyway.
MAX_HANDSHAKES_PER_SOURCE = 8
#: Bytes of asyncio's socket read buffer per TLS connection: one TLS record
#: (2^14 bytes of plaintext, RFC 8446 §5.1) is what one read needs; asyncio's
#: own 256 KiB was allocated per connection, idle or not.
READ_BUFFER = 16 * 1024
#: Resident memory of one established, idle TLS connection (TLS layer,
#: OpenSSL connection, the application protocol), with a margin: measured
#: as RSS growth of a ``crossroads serve`` child over 200 connections that
#: each sent one STUN Binding, 40 KB each (285 KB with asyncio's 256 KiB read
#: buffer). Python 3.11, OpenSSL 3.0, P-256 certificate;
#: tests/adversarial/test_tls_budget.py checks the growth stays within it.
CONNECTION_BYTES = 48 * 1024
#: What a connection costs beyond :data:`CONNECTION_BYTES` until its
#: handshake is done (OpenSSL's record buffers and handshake state, released
#: after it): 68-71 KB in all measured per connection that sent nothing or
#: only its ClientHello.
HANDSHAKE_BYTES = 32 * 1024
#: A development certificate is made anew when it has less than this left.
DEV_CERT_MIN_REMAINING = datetime.timedelta(days=7)
#: Lifetime of a development certificate (a loopback convenience, never public).
DEV_CERT_LIFETIME = datetime.timedelta(days=90)
DEV_CERT_NAME = "dev-cert.pem"
DEV_KEY_NAME = "dev-key.pem"


def _leaf_not_after(chain: Path) -> datetime.datetime:
    """The expiry of the first certificate in the PEM file ``chain``."""
    try:
        leaf = x509.load_pem_x509_certificate(chain.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tls_cert: {chain}: {exc}") from None
    return leaf.not_valid_after_utc


def certificate_dns_names(chain: Path) -> tuple[str, ...]:
    """The DNS names in the subjectAltName of the first certificate of ``chain``
    (wildcards included), in certificate order.

    What a ``turns:`` URL may name: Firefox refuses ``turns:`` with an IP literal,
    and every WebRTC stack checks the name against these (RFC 6125); IP SANs and
    the subject CN are not offered.
    """
    try:
        leaf = x509.load_pem_x509_certificate(chain.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tls_cert: {chain}: {exc}") from None
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return ()
    return tuple(san.value.get_values_for_type(x509.DNSName))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context for TLS 1.2+ without renegotiation, holding ``cert``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # RFC 8996: TLS 1.0 and 1.1 are deprecated; coturn's uclient and every
    # WebRTC stack speak 1.2 or 1.3.
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # Renegotiation lets a client make the server repeat the expensive part of
    # a handshake on an established connection (CVE-2011-1473 class).
    context.options |= ssl.OP_NO_RENEGOTIATION
    _load(context, cert, key)
    return context


def _load(context: ssl.SSLContext, cert: Path, key: Path) -> None:
    not_after = _leaf_not_after(cert)
    if not_after <= datetime.datetime.now(datetime.UTC):
        raise ConfigError(f"tls_cert: {cert} expired on {not_after:%Y-%m-%d %H:%M} UTC")
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key: {cert}, {key}: {exc}") from None


class Certificates:
    """The process's server certificate and the shared TLS context."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        self.context = server_context(cert, key)
        self.not_after = _leaf_not_after(cert)
        #: The leaf's DNS names (for ``turns:`` URLs), read again on reload.
        self.dns_names = certificate_dns_names(cert)
        #: Reloads that were refused (the old certificate stayed).
        self.failed_reloads = 0
        #: Counts the loads that took effect.
        self.generation = 0
        #: Contexts with other settings (ALPN) holding the same certificate.
        self._others: list[ssl.SSLContext] = []
        #: Called after each reload that loaded: listeners that build their own
        #: contexts from the files (DTLS) rebuild them then, from the files
        #: this reload checked.
        self.on_reload: list[Callable[[], None]] = []

    def context_with_alpn(self, protocols: list[str]) -> ssl.SSLContext:
        """A second server context with the same certificate (reloaded with
        it) that selects one of ``protocols`` by ALPN (RFC 7301), in this
        order of preference, when the client offers it."""
        context = server_context(self.cert, self.key)
        context.set_alpn_protocols(protocols)
        self._others.append(context)
        return context

    def reload(self) -> bool:
        """Load the files again into the same context; True if they loaded.

        Live connections are untouched; new handshakes get the new chain. On
        failure the previous certificate stays and the reason is logged.
        """
        try:
            for context in (self.context, *self._others):
                _load(context, self.cert, self.key)
        except ConfigError as exc:
            self.failed_reloads += 1
            log.error("TLS certificate not reloaded, keeping the old one: %s", exc)
            return False
        self.not_after = _leaf_not_after(self.cert)
        self.dns_names = certificate_dns_names(self.cert)
        self.generation += 1
        for callback in list(self.on_reload):
            callback()
        log.info(
            "TLS certificate reloaded from %s (valid until %s UTC)",
            self.cert,
            f"{self.not_after:%Y-%m-%d %H:%M}",
        )
        return True


def development_certificate(
    directory: Path, *, now: datetime.datetime | None = None
) -> tuple[Path, Path]:
    """The self-signed loopback certificate and key in ``directory``, made (or
    made anew when it expires within a week) on demand.

    The certificate names ``localhost``, ``127.0.0.1`` and ``::1``; clients
    must be told to trust it (coturn's uclient does not check; a browser
    needs it added). The key file is readable by its owner only.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    cert_path, key_path = directory / DEV_CERT_NAME, directory / DEV_KEY_NAME
    if cert_path.exists() and key_path.exists():
        try:
            if _leaf_not_after(cert_path) - now > DEV_CERT_MIN_REMAINING:
                return cert_path, key_path
        except ConfigError:
            pass  # unreadable: make a new one
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, "crossroads development")]
    )
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdated a little: a client whose clock is slightly behind would
        # otherwise see a certificate that is "not yet valid".
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + DEV_CERT_LIFETIME)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key_path.touch(mode=0o600, exist_ok=True)
    key_path.chmod(0o600)
    key_path.write_bytes(key_bytes)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    log.warning(
        "made a self-signed development certificate %s (localhost, 127.0.0.1, ::1);"
        " clients must be told to trust it",
        cert_path,
    )
    return cert_path, key_path


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (where a development certificate may be
    made); False for wildcards and public addresses."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def certificates_for(
    cert: str, key: str, *, host: str, dev_dir: str
) -> Certificates | None:
    """The certificates a process should serve with: ``cert``/``key`` when
    given; else a development certificate in ``dev_dir`` when it is set and
    ``host`` is loopback; else None (no TLS listener)."""
    if cert and key:
        return Certificates(Path(cert), Path(key))
    if dev_dir and is_loopback(host):
        return Certificates(*development_certificate(Path(dev_dir)))
    return None


# ------------------------------------------------------------------ handshakes


def _nobody(host: str) -> bool:
    return False


@dataclass(eq=False)
class TlsTables:
    """The tables of the process's resource budget a TLS listener admits its
    connections to (see the module docstring): ``listener``, the TCP
    listener's own connection table (its descriptor share), held until the
    handshake is done; ``connections``, every TLS connection from accept to
    close (its memory); ``handshakes``, the handshakes in progress (their
    count and deadline). ``trusted(host)`` names sources exempt from the
    per-source caps (a reverse proxy speaks for many clients)."""

    handshakes: Admission
    connections: Admission
    listener: Admission | None = None
    trusted: Callable[[str], bool] = _nobody
    #: Handshakes that completed.
    completed: int = 0

    @property
    def handshake_timeout(self) -> float:
        """Seconds a client has to finish its handshake (the handshake
        table's pre-auth deadline)."""
        return self.handshakes.preauth_deadline or HANDSHAKE_TIMEOUT

    def forget(self) -> None:
        """The listener stopped: its TLS tables leave the budget."""
        budget = self.handshakes.budget
        budget.forget(self.handshakes.name)
        budget.forget(self.connections.name)


def tls_tables(
    budget: ResourceBudget,
    name: str,
    *,
    listener: Admission | None,
    max_connections: int,
    max_per_source: int,
    trusted: Callable[[str], bool] = _nobody,
    max_handshakes: int = MAX_HANDSHAKES,
    max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
) -> TlsTables:
    """Register the TLS tables of listener ``name`` (``tls-handshakes:NAME``,
    ``tls-connections:NAME``) with ``budget``. Neither holds a descriptor of
    its own (Pool.NONE): a TLS connection's descriptor is counted by
    ``listener``, the TCP listener's connection table."""
    handshakes = budget.table(
        f"tls-handshakes:{name}",
        max_items=max_handshakes,
        max_per_source=max_handshakes_per_source,
        pool=Pool.NONE,
        bytes_per_item=HANDSHAKE_BYTES,
        preauth_deadline=handshake_timeout,
    )
    try:
        connections = budget.table(
            f"tls-connections:{name}",
            max_items=max_connections,
            max_per_source=max_per_source,
            pool=Pool.NONE,
            bytes_per_item=CONNECTION_BYTES,
        )
    except BaseException:
        budget.forget(handshakes.name)
        raise
    return TlsTables(handshakes, connections, listener, trusted)


class LeanSSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS layer with a read buffer sized for one TLS record, not
    256 KiB, and a callback when the connection is gone.

    asyncio allocates ``max_size`` bytes per connection up front for the
    socket reads that feed the TLS engine (``SSLProtocol.__init__``); at
    256 KiB that is most of an idle TLS connection's memory (~285 KB each,
    measured). A smaller buffer only means more ``recv`` calls for a bulk
    transfer; OpenSSL's memory BIO reassembles records of any size.
    """

    max_size = READ_BUFFER

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        app_protocol: asyncio.BaseProtocol,
        context: ssl.SSLContext,
        waiter: asyncio.Future[None],
        on_lost: Callable[[], None],
        handshake_timeout: int,
    ) -> None:
        super().__init__(
            loop,
            app_protocol,
            context,
            waiter,
            server_side=True,
            ssl_handshake_timeout=handshake_timeout,
        )
        self._on_lost: Callable[[], None] | None = on_lost

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            on_lost, self._on_lost = self._on_lost, None
            if on_lost is not None:
                on_lost()


@dataclass(eq=False)
class _Handover(asyncio.Protocol):
    """The application protocol the TLS layer first sees: at the end of the
    handshake it hands the TLS transport to ``factory()``'s protocol, after
    ``ready()`` gave back the listener admission the application protocol
    takes again itself (so a client at its per-source cap is not refused by
    its own connection)."""

    factory: Callable[[], asyncio.BaseProtocol]
    ready: Callable[[], None]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.ready()
        protocol = self.factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """Never called: the application protocol replaced this one."""


#: Refusal reasons of the three tables, as counted by ``drop``.
_LISTENER_REFUSALS = {
    REFUSED_OVER_LIMIT: "tls-connection-limit",
    REFUSED_OVER_IP_LIMIT: "tls-connection-ip-limit",
}
_HANDSHAKE_REFUSALS = {
    REFUSED_OVER_LIMIT: "tls-handshake-limit",
    REFUSED_OVER_IP_LIMIT: "tls-handshake-ip-limit",
}


@dataclass(eq=False)
class TlsAcceptor(asyncio.Protocol):
    """An accepted TCP connection that must speak TLS: ``factory()``'s protocol
    gets the TLS transport once the server-side handshake is done.

    The TLS layer (:class:`LeanSSLProtocol`) is put on the stream
    *synchronously* in :meth:`connection_made`, so no byte of the ClientHello
    can reach a plaintext protocol whatever the event loop (uvloop starts
    reading before a ``start_tls`` task would run), and the application
    protocol takes over inside the handshake-complete callback, before any
    application data a TLS 1.3 client sends right behind its Finished.
    """

    context: ssl.SSLContext
    factory: Callable[[], asyncio.BaseProtocol]
    tables: TlsTables
    drop: Callable[[str], None]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        tables = self.tables
        capped = not tables.trusted(host)
        listener = tables.listener
        refused: str | None = None
        admitted: list[Admission] = []
        for table, reasons in (
            (listener, _LISTENER_REFUSALS),
            (tables.connections, _LISTENER_REFUSALS),
            (tables.handshakes, _HANDSHAKE_REFUSALS),
        ):
            if table is None:
                continue
            reason = table.admit(host, per_ip_cap=capped)
            if reason is not None:
                refused = reasons[reason]
                break
            admitted.append(table)
        if refused is not None:
            for table in admitted:
                table.release(host)
            self.drop(refused)
            stream.abort()
            return
        # What this connection holds: the listener slot until the handshake
        # is done, the TLS connection item until the stream is gone.
        holding = {"listener": listener is not None}

        def give_back_listener() -> None:
            if holding["listener"]:
                holding["listener"] = False
                assert listener is not None
                listener.release(host)

        def lost() -> None:
            give_back_listener()
            tables.connections.release(host)

        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        timeout = tables.handshake_timeout
        layer = LeanSSLProtocol(
            loop,
            _Handover(self.factory, give_back_listener),
            self.context,
            done,
            lost,
            # Backstop only: our own timer below cuts first and counts it.
            handshake_timeout=int(timeout * 2) + 1,
        )
        timed_out = False

        def expired() -> None:
            nonlocal timed_out
            if not done.done():
                # Cancelled, not failed: the TLS layer then leaves it alone
                # when the abort below reaches it.
                timed_out = True
                done.cancel()
                stream.abort()

        timer = loop.call_later(timeout, expired)

        def finished(future: asyncio.Future[None]) -> None:
            timer.cancel()
            tables.handshakes.release(host)
            if future.cancelled():
                if timed_out:
                    tables.handshakes.closed("handshake-timeout")
                    self.drop("tls-handshake-timeout")
                return
            exc = future.exception()
            if exc is None:
                tables.completed += 1
            else:
                log.debug("TLS handshake from %s failed: %r", host, exc)
                tables.handshakes.closed("handshake-failed")
                self.drop("tls-handshake-failed")

        done.add_done_callback(finished)
        stream.set_protocol(layer)
        layer.connection_made(stream)

    def data_received(self, data: bytes) -> None:
        """Never called: the TLS layer replaced this protocol on connect."""

    def connection_lost(self, exc: Exception | None) -> None:
        """Only for a connection refused by the limits (the TLS layer owns the rest)."""
