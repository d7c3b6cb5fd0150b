"""The ``p2p`` service: signalling, punch-through coordination, game listing.

- ``GET /p2p/v1/ws`` (WebSocket, on the HTTP port): the signalling protocol of
  ``docs/p2p-protocol.md``, driven by :class:`~crossroads.proto.punch.coordinator.Coordinator`.
  We mount it on the shared HTTP port rather than a port of its own: one port to
  open in firewalls, TLS and load balancing handled once by whatever fronts the
  HTTP API, and the same origin as the listing API a game already talks to.
- three UDP rendezvous ports (``--p2p-port``, ``--p2p-alt-port``,
  ``--p2p-alt-port2``): where clients' public UDP endpoints and NAT mapping
  behaviour are observed (:mod:`crossroads.proto.punch.rendezvous`).
- ``/testServer``: a RakNet MasterServer2-compatible game listing
  (:mod:`crossroads.services.p2p_master`).

Scale-out: a session lives on the instance its host is connected to; its
members' WebSockets must reach that instance, since punch coordination needs
their live RTTs and rendezvous observations in one place. Invite codes are
claimed in the Store (``SET NX`` with a TTL, refreshed while the session lives),
so codes are unique across instances, and a ``join`` reaching another instance
gets ``redirect`` with the holder's signalling URL (``--p2p-public-url``); the
client reconnects there. Listing rows live in the Store and work everywhere.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import time
from collections.abc import Callable
from typing import cast

from fastapi import APIRouter, WebSocket
from prometheus_client import Counter, Gauge
from starlette.websockets import WebSocketState

from crossroads.config import check_positive, setting
from crossroads.errors import ConfigError, StoreError
from crossroads.insight import InsightRecorder
from crossroads.proto.insight import Attempt, Side, Step
from crossroads.proto.punch import signalling as sig
from crossroads.proto.punch.coordinator import (
    CodeClaim,
    CodeLookup,
    CodeReleased,
    Coordinator,
    CoordinatorConfig,
    FrameRejected,
    LadderConcluded,
    LadderSide,
    ProbeDropped,
    PunchFinished,
)
from crossroads.services.base import Service, ServiceContext, SessionInfo, stop_tasks
from crossroads.services.p2p_master import MasterServer, make_master_router
from crossroads.transport.admission import Pool
from crossroads.transport.driver import CoreTimer
from crossroads.transport.pktinfo import open_datagram_endpoint
from crossroads.transport.sockets import bound_address, make_udp_socket
from crossroads.types import Address, frozen, normalize_address, show_address

NAME = "p2p"
#: The table that admits the state a rendezvous probe can touch: the
#: signalling WebSocket of the peer its token names (the HTTP port's).
RENDEZVOUS_TABLE = "http"

log = logging.getLogger(__name__)

#: Invite-code claims in the Store: ``p2p:code:<CODE>`` -> the holder's
#: signalling URL. The TTL bounds how long a crashed instance's codes linger;
#: live ones are refreshed every third of it.
CODE_KEY = "p2p:code:"
CODE_TTL = 30.0
#: Pause before a directory operation is retried after a Store error (Redis
#: restarting): the operations wait in order rather than being lost.
STORE_RETRY = 0.5

#: Frames queued towards one slow WebSocket client before it is dropped: a client
#: that does not read cannot make the server buffer without bound.
MAX_OUTBOUND_FRAMES = 256
#: Memory one hosted session holds: ~580 bytes in the coordinator (session,
#: host member and code records; tracemalloc over 1,000 ``host`` frames), plus
#: its claim in the code directory (``owned_codes`` and, with the in-memory
#: store, the key and URL), rounded up. The budget table's per-item cost.
SESSION_BYTES = 1024
#: Name of the hosted sessions' table in the resource budget.
SESSION_TABLE = "p2p-sessions"


def _check_timeout(value: int) -> None:
    if not 15 <= value <= 900:
        raise ValueError("must be in 15..900 (MasterServer2's private-server range)")


@frozen
class Config:
    """Settings of the p2p service."""

    port: int = setting(3490, kind="port", help="UDP rendezvous port (primary).")
    alt_port: int = setting(
        3491, kind="port", help="UDP rendezvous port (first alternate)."
    )
    alt_port2: int = setting(
        3492, kind="port", help="UDP rendezvous port (second alternate)."
    )
    max_connections: int = setting(
        10_000,
        check=check_positive,
        help="Signalling WebSocket connections, in total.",
    )
    max_connections_per_ip: int = setting(
        64,
        check=check_positive,
        help="Signalling WebSocket connections from one IP.",
    )
    max_sessions: int = setting(
        10_000,
        check=check_positive,
        help="Hosted mesh sessions open at once on this instance.",
    )
    max_sessions_per_ip: int = setting(
        16,
        check=check_positive,
        help="Hosted mesh sessions opened from one IP (or IPv6 /64) at once; "
        "never more than an eighth of --p2p-max-sessions. A session's members "
        "get TURN credentials, so this also bounds the relay one address can "
        "reach without an account.",
    )
    relay_bytes_per_second: int = setting(
        256 * 1024,
        check=check_positive,
        help="WebSocket relay budget per connection, bytes/s (the relay is the last resort).",
    )
    turn_secret: str = setting(
        "",
        help="Shared secret of a TURN server (coturn use-auth-secret / --turn-secret): "
        "peers of a session with somebody to relay to get time-limited TURN "
        "credentials (join_start, a pushed turn, turn_refresh). Empty: the TURN "
        "service's first secret when it runs in this process.",
    )
    turn_server: str = setting(
        "",
        help="TURN server for those credentials, HOST:PORT. Empty: this host's "
        "STUN/TURN port when the TURN service runs here.",
    )
    turn_ttl: int = setting(
        3600,
        check=check_positive,
        help="Lifetime of the TURN credentials handed out, seconds; a session "
        "member asks for fresh ones (turn_refresh) before they expire.",
    )
    public_url: str = setting(
        "",
        help="Signalling URL other instances redirect joiners to "
        "(ws://HOST:PORT/p2p/v1/ws, or wss:// behind TLS). Empty: built from "
        "--public-host (else --host, else this machine's name) and the HTTP port.",
    )
    master_path: str = setting(
        "/testServer",
        help="Path of the MasterServer2-compatible listing (RakNet's samples use /testServer).",
    )
    master_max_timeout: int = setting(
        300,
        check=_check_timeout,
        help="Largest __timeoutSec a listing row may ask for (300 public, 900 private).",
    )
    master_rows_per_ip: int = setting(
        10,
        check=check_positive,
        help="Listing rows one IP may hold at once (MasterServer2: 10).",
    )

    def __post_init__(self) -> None:
        if not self.master_path.startswith("/"):
            raise ValueError("master_path: must start with '/'")
        if self.public_url and not self.public_url.startswith(("ws://", "wss://")):
            raise ValueError("public_url: must start with ws:// or wss://")
        ports = [p for p in (self.port, self.alt_port, self.alt_port2) if p]
        if len(set(ports)) != len(ports):
            raise ValueError("alt_port: the three rendezvous ports must differ")


class _Rendezvous(asyncio.DatagramProtocol):
    def __init__(self, service: P2PService, index: int) -> None:
        self.service = service
        self.index = index
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: on 3.11 the selector loop's datagram transport
        # does not derive from asyncio.DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        service = self.service
        source = normalize_address(addr)
        reply = service.core.receive_rendezvous(
            data, source, self.index, service.loop.time()
        )
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
        service.flush()

    def error_received(self, exc: Exception) -> None:
        pass


class P2PService:
    """The running service (see module docstring)."""

    name = NAME

    def __init__(self, ctx: ServiceContext, config: Config) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.store = ctx.store
        self.resources = ctx.resources
        #: Where each concluded punch attempt's record goes (crossroads.insight).
        self.insight = ctx.insight
        self.url = config.public_url or signalling_url(
            ctx.config.core.public_host or ctx.host, ctx.http_address[1]
        )
        self._resources = ctx.resources
        #: Hosted sessions, per source and in total: a fraction of the total
        #: per source, as every table of the budget (transport/admission.py).
        self.session_table = ctx.resources.table(
            SESSION_TABLE,
            max_items=config.max_sessions,
            max_per_source=config.max_sessions_per_ip,
            pool=Pool.NONE,
            bytes_per_item=SESSION_BYTES,
        )
        self.core = Coordinator(
            CoordinatorConfig(
                max_connections=config.max_connections,
                max_connections_per_ip=config.max_connections_per_ip,
                relay_bytes_per_second=config.relay_bytes_per_second,
            ),
            secrets.token_bytes,
            directory=True,
            reflection=ctx.reflection_budget(),
            guesses=ctx.guess_budget(),
            sessions=self.session_table,
        )
        #: Codes this instance holds in the Store (claimed, not yet released).
        self.owned_codes: set[str] = set()
        #: Claims and releases, applied in order by one task (a release never
        #: overtakes its claim).
        self._directory_ops: asyncio.Queue[CodeClaim | CodeReleased] = asyncio.Queue()
        self._directory_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._lookups: set[asyncio.Task[None]] = set()
        self._conn_ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[tuple[str, int, str | bytes]]] = {}
        self._transports: list[asyncio.DatagramTransport] = []
        self._udp: list[Address] = []
        self._timer = CoreTimer(self.loop, self.core.get_timer, self._on_timer)
        self._closed = False
        registry = ctx.metrics
        self.rejected = Counter(
            "crossroads_p2p_frames_rejected",
            "Signalling frames refused, by reason.",
            ["reason"],
            registry=registry,
        )
        self.probes_dropped = Counter(
            "crossroads_p2p_rendezvous_dropped",
            "Rendezvous datagrams dropped, by reason.",
            ["reason"],
            registry=registry,
        )
        self.punches = Counter(
            "crossroads_p2p_punch_results",
            "Connection ladder outcomes reported by clients (and server failures).",
            ["side", "ok", "step"],
            registry=registry,
        )
        peers = Gauge(
            "crossroads_p2p_peers", "Signalling peers connected.", registry=registry
        )
        peers.set_function(lambda: self.core.peer_count)
        sessions = Gauge(
            "crossroads_p2p_sessions", "Mesh sessions open.", registry=registry
        )
        sessions.set_function(lambda: self.core.session_count)
        self.redirects = Counter(
            "crossroads_p2p_redirects",
            "Joins sent to the instance holding the session's code.",
            registry=registry,
        )
        self.master = MasterServer(
            ctx.store,
            max_timeout=config.master_max_timeout,
            rows_per_ip=config.master_rows_per_ip,
            registry=registry,
        )

    async def start(self, host: str, public_host: str) -> None:
        for index, port in enumerate(
            (self.config.port, self.config.alt_port, self.config.alt_port2)
        ):
            sock = make_udp_socket(host, port)
            # Replies from the address the client sent to, on a wildcard bind.
            transport = await open_datagram_endpoint(_Rendezvous(self, index), sock)
            self._transports.append(transport)
            self._udp.append(bound_address(sock))
            # A probe keeps state only for a peer its token names (observed
            # addresses, three per attempt): peers are signalling WebSockets,
            # admitted by the HTTP port's table until they close.
            self.resources.listen(
                NAME, "p2p-rendezvous", "udp", self._udp[-1], RENDEZVOUS_TABLE
            )
        advertised = public_host or host
        self.core.config = CoordinatorConfig(
            max_connections=self.config.max_connections,
            max_connections_per_ip=self.config.max_connections_per_ip,
            relay_bytes_per_second=self.config.relay_bytes_per_second,
            udp=tuple(sig.TransportAddress(advertised, port) for _, port in self._udp),
        )
        self._directory_task = asyncio.create_task(self._apply_directory_ops())
        self._heartbeat_task = asyncio.create_task(self._refresh_codes())

    def describe(self) -> list[str]:
        lines = [f"udp {show_address(address)}" for address in self._udp]
        lines.append(f"ws /p2p/v1/ws (advertised as {self.url})")
        lines.append(f"http {self.config.master_path} (MasterServer2)")
        return lines

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.close()
        self._resources.forget(SESSION_TABLE)
        for transport in self._transports:
            transport.close()
        for queue in self._queues.values():
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(("close", 1001, "server shutting down"))
        await stop_tasks([self._directory_task, self._heartbeat_task, *self._lookups])
        # Free our codes at once rather than after their TTL; a Store that is
        # down by now lets them expire.
        if self.owned_codes:
            mine = self.url.encode()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    for code in self.owned_codes:
                        await self.store.delete_if_equal(CODE_KEY + code, mine)
            self.owned_codes.clear()

    # ------------------------------------------------------- code directory

    async def _apply_directory_ops(self) -> None:
        failing = False
        while True:
            op = await self._directory_ops.get()
            while True:
                try:
                    await self._apply(op)
                except Exception as exc:  # noqa: BLE001 - Store down: retry in order
                    if not failing:  # once per outage, not every retry
                        log.warning(
                            "p2p code directory: %s; hosting waits, retrying every "
                            "%.1f s",
                            exc,
                            STORE_RETRY,
                        )
                        failing = True
                    await asyncio.sleep(STORE_RETRY)
                    continue
                if failing:
                    log.warning("p2p code directory: the Store answers again")
                    failing = False
                break

    async def _apply(self, op: CodeClaim | CodeReleased) -> None:
        key = CODE_KEY + op.code
        if isinstance(op, CodeClaim):
            ok = await self.store.set(
                key, self.url.encode(), ttl=CODE_TTL, only_if_absent=True
            )
            if ok:
                self.owned_codes.add(op.code)
            self.core.code_claimed(op.session, ok)
            self.flush()
        elif op.code in self.owned_codes:
            self.owned_codes.discard(op.code)
            # Only our own claim: if ours expired (a stall past the TTL) and
            # another instance claimed the code since, its claim stays.
            await self.store.delete_if_equal(key, self.url.encode())

    async def _lookup(self, lookup: CodeLookup) -> None:
        try:
            raw = await self.store.get(CODE_KEY + lookup.code)
        except StoreError as exc:  # answered as unknown, not hung
            log.debug("p2p code lookup failed: %r", exc)  # the store logs outages
            raw = None
        except Exception as exc:  # noqa: BLE001 - answered as unknown, not hung
            log.warning("p2p code lookup failed: %r", exc)
            raw = None
        url = raw.decode("utf-8", "replace") if raw is not None else None
        if url == self.url:
            url = None  # a stale claim of our own: the session is gone
        if url is not None:
            self.redirects.inc()
        self.core.code_located(lookup.peer, lookup.code, url)
        self.flush()

    async def _refresh_codes(self) -> None:
        """Keep live codes' claims alive; re-claim any the Store lost (a Redis
        restart without persistence) so joins keep finding them."""
        mine = self.url.encode()
        while True:
            await asyncio.sleep(CODE_TTL / 3)
            for code in [c for c in self.core.live_codes() if c in self.owned_codes]:
                key = CODE_KEY + code
                try:
                    holder = await self.store.get(key)
                    if holder == mine:
                        await self.store.expire(key, CODE_TTL)
                    elif holder is None and await self.store.set(
                        key, mine, ttl=CODE_TTL, only_if_absent=True
                    ):
                        pass  # re-claimed
                    else:
                        # Another instance claimed it in a gap (our claim had
                        # expired): our members stay; new joiners go there, and
                        # we must never delete its claim.
                        log.warning("p2p code %s is claimed elsewhere now", code)
                        self.owned_codes.discard(code)
                except StoreError as exc:  # logged once per outage by the store
                    log.debug("p2p code refresh failed: %r", exc)
                    break
                except Exception as exc:  # noqa: BLE001 - next round retries
                    log.warning("p2p code refresh failed: %r", exc)
                    break

    # ---------------------------------------------------------------- admin

    def sessions(self) -> list[SessionInfo]:
        """Mesh sessions hosted on this instance."""
        return [
            SessionInfo(
                id=summary.session,
                client=summary.host_ip,
                detail=f"code {summary.code}, "
                f"{summary.members}/{summary.max_members} members",
            )
            for summary in self.core.session_summaries()
        ]

    def revoke(self, session_id: str) -> bool:
        """Disconnect every member of a session."""
        ended = self.core.end_session(session_id)
        self.flush()
        return ended

    # ---------------------------------------------------------------- plumbing

    def flush(self) -> None:
        """Move the core's output to the connections, count its events, re-arm."""
        for conn, text in self.core.data_to_send():
            if not self._enqueue(conn, "text", text):
                # Signalling is never dropped: a client that does not read
                # it is closed.
                self.rejected.labels("slow-consumer").inc()
                self._force_close(conn, 1008, "not reading")
        for conn, code, reason in self.core.connections_to_close():
            self._force_close(conn, code, reason)
        for event in self.core.pop_events():
            match event:
                case FrameRejected(reason=reason):
                    self.rejected.labels(reason).inc()
                case ProbeDropped(reason=reason):
                    self.probes_dropped.labels(reason).inc()
                case PunchFinished(ok=ok, step=step, side=side):
                    self.punches.labels(side, str(ok).lower(), step or "none").inc()
                case LadderConcluded():
                    self.insight.record(ladder_record(self.insight, event))
                case CodeClaim() | CodeReleased():
                    self._directory_ops.put_nowait(event)
                case CodeLookup():
                    task = asyncio.create_task(self._lookup(event))
                    self._lookups.add(task)
                    task.add_done_callback(self._lookups.discard)
        self._timer.rearm()

    def _enqueue(self, conn: int, kind: str, payload: str | bytes) -> bool:
        """Queue a frame towards ``conn``; False when its queue is full (the
        caller's policy decides). A connection already gone takes nothing."""
        queue = self._queues.get(conn)
        if queue is None:
            return True
        try:
            queue.put_nowait((kind, 0, payload))
        except asyncio.QueueFull:
            return False
        return True

    def _force_close(self, conn: int, code: int, reason: str) -> None:
        queue = self._queues.get(conn)
        if queue is None:
            return
        # Replace whatever is queued with the close, so it is not stuck behind
        # frames a slow client will never read.
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(("close", code, reason))

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        self.flush()

    async def handle_websocket(self, ws: WebSocket) -> None:
        await ws.accept()
        conn = next(self._conn_ids)
        queue: asyncio.Queue[tuple[str, int, str | bytes]] = asyncio.Queue(
            MAX_OUTBOUND_FRAMES
        )
        self._queues[conn] = queue
        ip = ws.client.host if ws.client else ""
        self.core.connection_made(conn, ip, self.loop.time())
        writer = asyncio.create_task(self._writer(ws, queue))
        self.flush()
        try:
            while not writer.done():
                receive = asyncio.ensure_future(ws.receive())
                done, _ = await asyncio.wait(
                    {receive, writer}, return_when=asyncio.FIRST_COMPLETED
                )
                if receive not in done:
                    receive.cancel()
                    break
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None:
                    data = message.get("bytes") or b""
                    if data[:1] == b"\x01":
                        self._relay(conn, data)
                        continue
                    # Other binary frames are accepted when they hold UTF-8 JSON.
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError:
                        text = "\x00"
                self.core.receive_data(conn, text, self.loop.time())
                self.flush()
        except Exception:  # noqa: BLE001 - a broken socket ends one connection only
            pass
        finally:
            self.core.connection_lost(conn, self.loop.time())
            self._queues.pop(conn, None)
            self.flush()
            if not writer.done():
                writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
            if ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await ws.close(1000)

    def _relay(self, conn: int, frame: bytes) -> None:
        route = self.core.relay_route(conn, frame, self.loop.time())
        if route is None:
            self.flush()
            return
        target, out = route
        if not self._enqueue(target, "bytes", out):
            # A datagram relay may drop: the receiver is behind, as a full UDP
            # socket buffer would drop.
            self.rejected.labels("relay-queue-full").inc()

    async def _writer(
        self, ws: WebSocket, queue: asyncio.Queue[tuple[str, int, str | bytes]]
    ) -> None:
        while True:
            kind, code, payload = await queue.get()
            if kind == "close":
                with contextlib.suppress(Exception):
                    await ws.close(code, str(payload)[:120])
                return
            if isinstance(payload, bytes):
                await ws.send_bytes(payload)
            else:
                await ws.send_text(payload)


def signalling_url(host: str, port: int) -> str:
    """This instance's signalling URL as other instances hand it out."""
    if not host or host in ("0.0.0.0", "::"):
        host = socket.gethostname()  # no DNS lookup at start-up
    if ":" in host:
        host = f"[{host}]"
    return f"ws://{host}:{port}/p2p/v1/ws"


def turn_credentials(
    secret: str,
    server: sig.TransportAddress,
    ttl: int,
    clock: Callable[[], float] = time.time,
) -> Callable[[str], sig.TurnInfo]:
    """coturn's REST-API credentials (draft-uberti-behave-turn-rest-00):
    username ``<expiry>:<peer id>``, password ``base64(HMAC-SHA1(secret, username))``."""

    def make(peer_id: str) -> sig.TurnInfo:
        expires = int(clock()) + ttl
        username = f"{expires}:{peer_id}"
        digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
        return sig.TurnInfo(
            (server,), username, base64.b64encode(digest).decode("ascii"), expires
        )

    return make


def _turn_settings(ctx: ServiceContext, config: Config) -> tuple[str, str]:
    """(secret, HOST:PORT) from the p2p settings, else from a TURN service that
    runs in this process (its first ``secret`` and STUN's port)."""
    secret, server = config.turn_secret, config.turn_server
    turn = ctx.config.sections.get("turn") if ctx.config.enabled("turn") else None
    if not secret and turn is not None:
        secrets_ = getattr(turn, "secret", ())
        secret = secrets_[0] if secrets_ else ""
    if secret and not server and turn is not None:
        stun = ctx.config.sections.get("stun")
        port = getattr(stun, "port", 3478) if stun is not None else 3478
        running = ctx.running.get("stun")
        if running is not None:
            # The bound port (the configured one may be 0 in tests).
            for line in running.describe():
                if line.startswith("udp "):
                    port = int(line.rsplit(":", 1)[1].split()[0])
                    break
        host = ctx.config.core.public_host or ctx.host
        server = f"{host}:{port}"
    return secret, server


async def serve(ctx: ServiceContext) -> Service:
    config = ctx.section(NAME, Config)
    service = P2PService(ctx, config)
    secret, server = _turn_settings(ctx, config)
    if secret and server:
        host, _, port = server.rpartition(":")
        try:
            endpoint = sig.TransportAddress(host.strip("[]"), int(port))
        except ValueError:
            raise ConfigError(f"p2p.turn_server: {server!r} is not HOST:PORT") from None
        turn = ctx.config.sections.get("turn") if ctx.config.enabled("turn") else None
        cap = int(getattr(turn, "max_credential_ttl", 0) or 0)
        if cap and config.turn_ttl > cap:
            raise ConfigError(
                f"p2p.turn_ttl: {config.turn_ttl} s is longer than "
                f"turn.max_credential_ttl ({cap} s): the TURN service would refuse "
                "the credentials"
            )
        service.core.set_turn_credentials(
            turn_credentials(secret, endpoint, config.turn_ttl)
        )
    await service.start(ctx.host, ctx.config.core.public_host)
    router = APIRouter(tags=["p2p"])

    @router.websocket("/p2p/v1/ws")
    async def signalling(ws: WebSocket) -> None:
        await service.handle_websocket(ws)

    ctx.add_router(router)
    ctx.add_router(make_master_router(service.master, config.master_path))
    return service


def ladder_record(insight: InsightRecorder, event: LadderConcluded) -> Attempt:
    """A concluded punch attempt as an insight record. The server sees each
    side's ``punch_result`` (ok, the step that connected it, its time), not
    the rungs below it, so the steps are: preparing (queued until both sent
    ``punch_ready``), then one per side with its reported step. A "relay"
    win is relayed by TURN: its bytes are in the TURN allocation's record
    (billed to the credentials' user)."""
    begin = event.created
    steps: list[Step] = []
    if event.started is not None:
        steps.append(Step("prepare", 0.0, max(0.0, event.started - begin), "ok"))
    offset = (event.started or event.ended) - begin
    for role, seen in (("initiator", event.initiator), ("responder", event.responder)):
        if seen.result is None:
            steps.append(
                Step(role, offset, max(0.0, event.ended - begin - offset), "unreported")
            )
            continue
        ok, step, ms = seen.result
        steps.append(
            Step(
                f"{role}:{step or 'none'}", offset, ms / 1000, "ok" if ok else "failed"
            )
        )
    results = [s.result for s in (event.initiator, event.responder)]
    winner = ""
    if all(r is not None and r[0] for r in results):
        winner = results[0][1] if results[0] is not None else ""
    mappings = f"mappings {event.initiator.mapping}/{event.responder.mapping}"
    if winner == "relay":
        outcome, cause = "relayed", f"punch failed ({mappings})"
    elif winner:
        outcome, cause = "direct", ""
    else:
        outcome = "failed"
        cause = f"{event.reason or 'ladder failed'} ({mappings})"

    def side(s: LadderSide) -> Side:
        rtt = None if s.rtt is None else s.rtt * 1000
        if not s.host:  # never probed: nothing to name it by
            return Side(id="", nat=s.mapping, rtt_ms=rtt)
        return insight.side(s.host, s.mapping, rtt)

    duration = max(0.0, event.ended - begin)
    return Attempt(
        family="p2p",
        session=f"attempt-{event.attempt}",
        started=insight.now() - duration,
        duration=duration,
        sides=(side(event.initiator), side(event.responder)),
        steps=tuple(steps),
        winner=winner,
        outcome=outcome,
        cause=cause,
    )
