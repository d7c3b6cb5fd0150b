"""Automatic certificates: obtain and renew the TLS certificate with ACME.

Theory of operation
-------------------
``--acme-domain NAME`` (repeatable) makes the process its own ACME client
(RFC 8555) against ``--acme-directory`` (Let's Encrypt production unless told
otherwise). The protocol itself is the ``acme`` library of the certbot project
(with ``josepy`` for JWS): the client most certificates on the Internet are
issued through, maintained with the CA's own changes; this module only decides
*when* to ask and *where* the result goes.

Files, all in ``--state-dir``/``acme`` (directory 0700, files 0600):

- ``account.pem``: the ACME account key (P-256, ES256), made once; the account
  is found again from it on every start (``onlyReturnExisting``, RFC 8555
  §7.3.1), so no account URL needs keeping;
- ``cert.pem`` / ``key.pem``: the certificate chain (leaf first) and its key,
  which :class:`~crossroads.transport.tls.Certificates` serves exactly as it
  serves ``--tls-cert``/``--tls-key``.

At start, when those files are missing, unreadable or expired, a self-signed
placeholder for the domains is written there so that every TLS listener
(TURN over TLS and DTLS, HTTPS, the relay's wss) binds at once; no client is
expected to trust it, and it is replaced within seconds.

:class:`AcmeManager` runs one task: it checks the certificate now and every
``--acme-check-interval`` seconds (12 h: certbot's twice a day); when it is
the placeholder, names other domains, or has fewer than ``--acme-renew-days``
left (30: Let's Encrypt's advice for 90-day certificates), it orders a new one
in a worker thread (the library is synchronous), with a fresh key, answers the
HTTP-01 challenges (RFC 8555 §8.3) from :class:`Challenges`, writes the files
(each by a rename) and calls ``Certificates.reload()`` — the code path SIGHUP
takes — so new TLS handshakes present the new chain and live connections keep
theirs. A failed attempt is retried after :data:`RETRY_FIRST` seconds,
doubling up to the check interval (Let's Encrypt allows 5 failed validations
per account and host name an hour: 5, 10, 20, 40 minutes stays under it).

The HTTP-01 answers are served at ``/.well-known/acme-challenge/TOKEN`` by the
HTTP port's app and, when ``--acme-http-port`` is set (80 by default: the CA
connects to port 80 of the name), by a small listener that answers nothing
else, behind its own connection table ``acme-http`` of the resource budget
and the same admission and request deadline as the HTTP port
(:mod:`crossroads.web.guard`). Only the tokens of orders in progress are
known; anything else is a 404.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from acme import challenges, client, crypto_util, errors, messages
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from josepy.jwa import ES256
from josepy.jwk import JWKEC
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossroads.transport.admission import Pool, ResourceBudget
from crossroads.transport.sockets import bound_address, make_tcp_listener
from crossroads.types import Address
from crossroads.web.app import EmbeddedServer, make_http_server
from crossroads.web.guard import HttpGuard

log = logging.getLogger("crossroads.acme")

#: Where the files live under the state directory.
ACME_DIR = "acme"
ACCOUNT_KEY = "account.pem"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
#: The subject of the placeholder, so that it is never mistaken for an issued
#: certificate (an issued one is always due once it is found to be this).
PLACEHOLDER_CN = "crossroads ACME placeholder"
#: Lifetime of the placeholder: it only lets the listeners start.
PLACEHOLDER_LIFETIME = datetime.timedelta(days=7)
#: Seconds before the first retry of a failed attempt, doubled each time up to
#: the check interval (module docstring: Let's Encrypt's failed-validation
#: limit is 5 per account and host name per hour).
RETRY_FIRST = 300.0
#: Seconds one order may take from its creation to the certificate (pending
#: validation and finalisation); the CA usually needs a few.
ORDER_TIMEOUT = 90.0
#: Seconds of one HTTP request to the CA (acme's default is 45).
NETWORK_TIMEOUT = 30
#: Challenges (tokens) known at once: one per domain of the orders in
#: progress; a bound so that a CA answering with many cannot grow the table.
MAX_CHALLENGES = 100
#: The HTTP-01 path prefix (RFC 8555 §8.3).
CHALLENGE_PREFIX = "/.well-known/acme-challenge/"
USER_AGENT = "crossroads-acme"


@dataclass(eq=False)
class Challenges:
    """The HTTP-01 key authorizations of the orders in progress, by token."""

    answers: dict[str, str] = field(default_factory=dict)

    def add(self, token: str, key_authorization: str) -> None:
        if len(self.answers) >= MAX_CHALLENGES:
            raise errors.Error("too many ACME challenges in progress")
        self.answers[token] = key_authorization

    def remove(self, token: str) -> None:
        self.answers.pop(token, None)

    def router(self) -> APIRouter:
        """``GET /.well-known/acme-challenge/{token}``: the key authorization
        as text/plain (RFC 8555 §8.3), 404 for an unknown token."""
        router = APIRouter()

        @router.get(CHALLENGE_PREFIX + "{token}", include_in_schema=False)
        async def challenge(token: str) -> Response:
            answer = self.answers.get(token)
            if answer is None:
                return JSONResponse(
                    {"code": "not_found", "message": "no such ACME challenge"},
                    status_code=404,
                )
            return PlainTextResponse(answer)

        return router


# ------------------------------------------------------------------ files


def acme_dir(state_dir: Path) -> Path:
    return state_dir / ACME_DIR


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only, by a rename (a
    reader sees the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _private_dir(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def account_key(directory: Path) -> ec.EllipticCurvePrivateKey:
    """The ACME account key in ``directory``, made (P-256) if there is none."""
    path = directory / ACCOUNT_KEY
    if path.exists():
        loaded = serialization.load_pem_private_key(path.read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{path}: not an EC key")
        return loaded
    _private_dir(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    _write_private(path, _key_pem(key))
    return key


def write_placeholder(directory: Path, domains: Sequence[str]) -> None:
    """A self-signed certificate for ``domains`` in ``directory``'s cert and key
    files, so the TLS listeners can start before the first order completes."""
    _private_dir(directory)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PLACEHOLDER_CN)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + PLACEHOLDER_LIFETIME)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(d) for d in domains]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(directory / KEY_FILE, _key_pem(key))
    _write_private(
        directory / CERT_FILE, certificate.public_bytes(serialization.Encoding.PEM)
    )


def _leaf(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def renewal_reason(
    cert_path: Path,
    domains: Sequence[str],
    renew_before: datetime.timedelta,
    now: datetime.datetime | None = None,
) -> str | None:
    """Why the certificate at ``cert_path`` must be ordered anew, or None when
    it is an issued certificate for exactly ``domains`` with more than
    ``renew_before`` left."""
    now = now or datetime.datetime.now(datetime.UTC)
    leaf = _leaf(cert_path)
    if leaf is None:
        return "no certificate"
    if leaf.subject == leaf.issuer and any(
        a.value == PLACEHOLDER_CN
        for a in leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ):
        return "placeholder"
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names = set(san.value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = set()
    if names != {d.lower() for d in domains}:
        return "other names"
    left = leaf.not_valid_after_utc - now
    if left < renew_before:
        return f"{left.days} day(s) left"
    return None


def prepare_files(state_dir: Path, domains: Sequence[str]) -> tuple[Path, Path]:
    """The cert and key paths to serve; a placeholder is written first when
    they hold nothing that loads and is still valid."""
    directory = acme_dir(state_dir)
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    leaf = _leaf(cert)
    now = datetime.datetime.now(datetime.UTC)
    if leaf is None or leaf.not_valid_after_utc <= now or not key.exists():
        write_placeholder(directory, domains)
    return cert, key


# ------------------------------------------------------------------ ordering


@dataclass(eq=False)
class AcmeOrder:
    """One certificate order, synchronous (run in a thread): account, order,
    HTTP-01 answers, finalisation, files."""

    directory_url: str
    domains: tuple[str, ...]
    files: Path
    challenges: Challenges
    email: str = ""
    ca_bundle: str = ""

    def _network(self) -> client.ClientNetwork:
        key = JWKEC(key=account_key(self.files))
        # requests takes a CA bundle path where acme's signature says bool.
        verify = cast(bool, self.ca_bundle) if self.ca_bundle else True
        return client.ClientNetwork(
            key,
            alg=ES256,
            verify_ssl=verify,
            user_agent=USER_AGENT,
            timeout=NETWORK_TIMEOUT,
        )

    def _account(self, acme: client.ClientV2) -> None:
        registration = messages.NewRegistration.from_data(
            email=self.email or None, terms_of_service_agreed=True
        )
        try:
            acme.new_account(registration)
        except errors.ConflictError as exists:
            # The key has an account already (RFC 8555 §7.3.1): use it.
            acme.query_registration(
                messages.RegistrationResource(uri=exists.location, body=registration)
            )

    def run(self) -> None:
        """Order, validate and store a certificate for the domains.

        Raises:
            acme.errors.Error, requests.RequestException, OSError: the order
                failed; the files are unchanged.
        """
        net = self._network()
        acme = client.ClientV2(
            client.ClientV2.get_directory(self.directory_url, net), net
        )
        self._account(acme)
        key = ec.generate_private_key(ec.SECP256R1())
        key_pem = _key_pem(key)
        order = acme.new_order(crypto_util.make_csr(key_pem, list(self.domains)))
        tokens: list[str] = []
        try:
            for authz in order.authorizations:
                if authz.body.status == messages.STATUS_VALID:
                    continue  # proved recently; the CA reuses it
                http01 = next(
                    (
                        c
                        for c in authz.body.challenges
                        if isinstance(c.chall, challenges.HTTP01)
                    ),
                    None,
                )
                if http01 is None:
                    raise errors.Error(
                        f"{authz.body.identifier.value}: the CA offers no http-01"
                    )
                response, validation = http01.response_and_validation(net.key)
                token = http01.chall.encode("token")
                self.challenges.add(token, validation)
                tokens.append(token)
                acme.answer_challenge(http01, response)
            deadline = datetime.datetime.now() + datetime.timedelta(
                seconds=ORDER_TIMEOUT
            )
            order = acme.poll_and_finalize(order, deadline)
        finally:
            for token in tokens:
                self.challenges.remove(token)
        chain = order.fullchain_pem.encode()
        # Key first: until the chain follows, a reload sees a pair that does
        # not match, is refused, and the old certificate stays.
        _write_private(self.files / KEY_FILE, key_pem)
        _write_private(self.files / CERT_FILE, chain)


# ------------------------------------------------------------------ manager


async def _in_daemon_thread(work: Callable[[], None]) -> None:
    """Run ``work`` in a daemon thread and wait for it. Not the default
    executor: a process that stops (SIGTERM, the end of a drain) must not wait
    for an order stuck on a slow CA; its files are written by renames, so
    stopping mid-order leaves the old ones whole."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    def run() -> None:
        error: BaseException | None = None
        try:
            work()
        except Exception as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    threading.Thread(target=run, name="acme-order", daemon=True).start()
    await done


@dataclass(eq=False)
class AcmeManager:
    """The task that keeps the certificate issued and fresh (module docstring)."""

    order: AcmeOrder
    renew_before: datetime.timedelta
    check_interval: float
    #: Called after new files were written: ``Certificates.reload`` (SIGHUP's
    #: path); returns whether they loaded.
    reload: Callable[[], bool]
    #: Counts, for metrics and tests.
    issued: int = 0
    failures: int = 0
    last_error: str = ""
    _task: asyncio.Task[None] | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def cert_path(self) -> Path:
        return self.order.files / CERT_FILE

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="acme")

    def check_now(self) -> None:
        """Check the certificate at once (SIGHUP)."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def check(self) -> bool:
        """Order a certificate if one is due; True if a new one was loaded.

        Raises:
            Exception: from the order (the caller retries).
        """
        reason = renewal_reason(self.cert_path, self.order.domains, self.renew_before)
        if reason is None:
            return False
        log.info(
            "ACME: ordering a certificate for %s (%s) from %s",
            ", ".join(self.order.domains),
            reason,
            self.order.directory_url,
        )
        await _in_daemon_thread(self.order.run)
        self.issued += 1
        if not self.reload():
            raise errors.Error("the new certificate did not load")
        return True

    async def _run(self) -> None:
        retry = RETRY_FIRST
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: log, keep serving, retry
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "ACME: no certificate this time (retry in %.0f s): %s",
                    min(retry, self.check_interval),
                    self.last_error,
                )
                wait = min(retry, self.check_interval)
                retry *= 2
            else:
                retry = RETRY_FIRST
                # A little jitter, so a fleet restarted together does not ask
                # the CA all at once (Let's Encrypt's integration guide).
                wait = self.check_interval * random.uniform(0.95, 1.0)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass


class AcmeCollector(Collector):
    """``crossroads_acme_orders_total{result}`` (issued, failed) and
    ``crossroads_acme_certificate_expiry_seconds`` (the served leaf's
    notAfter, Unix time: alert well before it, e.g. under 14 days)."""

    def __init__(self, manager: AcmeManager, not_after: Callable[[], float]) -> None:
        self.manager = manager
        self.not_after = not_after

    def collect(self) -> Iterator[Any]:
        orders = CounterMetricFamily(
            "crossroads_acme_orders",
            "ACME certificate orders by result (--acme-domain).",
            labels=["result"],
        )
        orders.add_metric(["issued"], self.manager.issued)
        orders.add_metric(["failed"], self.manager.failures)
        yield orders
        yield GaugeMetricFamily(
            "crossroads_acme_certificate_expiry_seconds",
            "notAfter of the certificate the TLS listeners serve (Unix time).",
            value=self.not_after(),
        )


# ------------------------------------------------------------------ listener


@dataclass(eq=False)
class ChallengeListener:
    """The HTTP-01 listener (``--acme-http-port``): an HTTP server answering
    only ``/.well-known/acme-challenge/``, behind the connection table
    ``acme-http`` and the request deadline of :class:`HttpGuard`."""

    server: EmbeddedServer
    guard: HttpGuard
    task: asyncio.Task[None]
    address: Address

    async def close(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, 5)
        except (TimeoutError, asyncio.CancelledError):
            self.task.cancel()
        await self.guard.close()


#: The table of the HTTP-01 listener's connections.
LISTENER_TABLE = "acme-http"
#: Connections at once on the HTTP-01 listener: a CA validates each name with
#: one request from each of its vantage points (Let's Encrypt: the primary
#: and a few remote perspectives) and retries a few times; 64 leaves room for
#: several orders at once.
LISTENER_MAX = 64
#: Its weight in the connection pool, against 1.0 for a listener that serves
#: clients: it needs a handful of descriptors, not an equal share.
LISTENER_WEIGHT = 0.25


async def listen_challenges(
    budget: ResourceBudget,
    host: str,
    port: int,
    challenges_: Challenges,
    *,
    max_connections: int,
    max_per_ip: int,
    request_timeout: float,
) -> ChallengeListener:
    """Bind the HTTP-01 listener and serve until closed."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(challenges_.router())

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            {"code": "not_found", "message": "only ACME challenges are served here"},
            status_code=404,
        )

    # The CA is one client among strangers here: the HTTP port's per-IP cap
    # and request deadline, and its own small share of the connection
    # descriptors (LISTENER_MAX, LISTENER_WEIGHT), so a flood of port 80
    # takes nothing from the other listeners.
    admission = budget.table(
        LISTENER_TABLE,
        max_items=min(max_connections, LISTENER_MAX),
        max_per_source=max_per_ip,
        pool=Pool.CONNECTIONS,
        descriptors_per_item=1,
        weight=LISTENER_WEIGHT,
    )
    guard = HttpGuard(admission, request_timeout)
    sock = make_tcp_listener(host, port)
    address = bound_address(sock)
    server = make_http_server(app, guard)
    guard.start()
    task = asyncio.create_task(server.serve(sockets=[sock]), name="acme-http")
    while not server.started:
        if task.done():
            await guard.close()
            sock.close()
            budget.forget(LISTENER_TABLE)
            task.result()
            raise RuntimeError("ACME challenge listener stopped during start-up")
        await asyncio.sleep(0.01)
    budget.listen("http", LISTENER_TABLE, "tcp", address, LISTENER_TABLE)
    return ChallengeListener(server, guard, task, address)
