"""The FastAPI application shared by all services of one runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import crossroads
from crossroads.errors import DecodeError, StoreError
from crossroads.store.base import Store
from crossroads.transport.httpapi import ApiError, log_client_error
from crossroads.web.guard import HttpGuard

log = logging.getLogger("crossroads.http")


#: ``Strict-Transport-Security`` on every answer sent over HTTPS (RFC 6797):
#: a browser that reached the console over TLS keeps to TLS for a year. Not
#: ``includeSubDomains`` (other hosts of the domain are not ours to pin) and
#: never over plain HTTP, where a browser ignores it (RFC 6797 §7.2).
HSTS = b"max-age=31536000"


class StrictTransportSecurity:
    """ASGI middleware: :data:`HSTS` on HTTP answers whose scope's scheme is
    https (the HTTPS port; or a trusted proxy's ``X-Forwarded-Proto``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("scheme") != "https":
            await self.app(scope, receive, send)
            return

        async def send_with_hsts(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"strict-transport-security", HSTS))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_hsts)


def create_app(
    *,
    metrics: CollectorRegistry,
    store: Store,
    routers: Sequence[APIRouter] = (),
    services: Callable[[], list[str]] = lambda: [],
    ready: Callable[[], bool] = lambda: True,
    api_docs: bool = False,
) -> FastAPI:
    # The interactive docs list every route and schema to anyone, and the
    # pages load scripts from a CDN: off unless the operator asks
    # (--api-docs); the README documents the APIs.
    app = FastAPI(
        title="crossroads",
        version=crossroads.__version__,
        description="Connectivity for multiplayer games.",
        docs_url="/docs" if api_docs else None,
        redoc_url="/redoc" if api_docs else None,
        openapi_url="/openapi.json" if api_docs else None,
    )
    app.add_middleware(StrictTransportSecurity)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            {"code": exc.code, "message": exc.message}, status_code=exc.status
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(
        request: Request, exc: RequestValidationError
    ) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}"
            for err in exc.errors()
        )
        return JSONResponse(
            {"code": "invalid_request", "message": problems}, status_code=400
        )

    @app.exception_handler(DecodeError)
    async def _decode_error(request: Request, exc: DecodeError) -> JSONResponse:
        # A body a route decoded itself and found malformed: the client's fault,
        # one line in the log (no traceback), the error envelope in the answer.
        log_client_error(request, 400, str(exc))
        return JSONResponse(
            {"code": "invalid_request", "message": str(exc)}, status_code=400
        )

    @app.exception_handler(StoreError)
    async def _store_error(request: Request, exc: StoreError) -> JSONResponse:
        # The store logs the outage once (store/redis.py); a request that meets
        # it gets 503 and is told to come back, never a 500 with a traceback.
        return JSONResponse(
            {"code": "store_unavailable", "message": "the shared store is unreachable"},
            status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(
        request: Request, exc: StarletteHTTPException
    ) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(
            {"code": code, "message": str(exc.detail)}, status_code=exc.status_code
        )

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> JSONResponse:
        store_ok = await store.ping()
        body = {
            "status": "ok" if store_ok else "degraded",
            "store": store_ok,
            "services": services(),
        }
        return JSONResponse(body, status_code=200 if store_ok else 503)

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> JSONResponse:
        # Readiness, for load balancers and Kubernetes: 503 while the instance
        # drains (it takes no new sessions) or cannot reach the store;
        # /healthz stays the liveness answer (a draining process is alive).
        if not ready():
            return JSONResponse({"status": "draining"}, status_code=503)
        if not await store.ping():
            return JSONResponse({"status": "store-unreachable"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    for router in routers:
        app.include_router(router)
    return app


#: Largest WebSocket message uvicorn reads for any endpoint on the HTTP port;
#: above it the protocol layer closes the connection with 1009 ("message too
#: big") without buffering the rest. uvicorn's default is 16 MiB, which let one
#: client make the server hold 16 MiB per connection. The only WebSocket is the
#: p2p signalling one: its JSON frames are refused above 16 KiB with the
#: protocol's own ``too_large`` error (this cap leaves four times that, so a frame
#: a little too large gets that clear answer, not a closed connection), and its
#: relay frames are at most 1473 bytes.
WS_MAX_MESSAGE_BYTES = 64 * 1024


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside our event loop; signals stay with the crossroads runtime."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """A new HTTP connection protocol of this server, as uvicorn makes for
        its own sockets (call once it has started): for a listener uvicorn does
        not own, such as HTTPS behind a TLS acceptor or a port shared with
        TURN over TLS. Its connections are the server's (shut down with it)."""
        config = self.config

        def create() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
            )

        return create


def make_http_server(
    app: FastAPI,
    guard: HttpGuard | None = None,
    trusted_proxies: Sequence[str] = (),
) -> EmbeddedServer:
    """An uvicorn server for ``app``; start it with ``serve(sockets=[sock])``.

    With ``guard``, connections go through its admission and request deadline
    (:mod:`crossroads.web.guard`). uvicorn's ``limit_concurrency`` is not used:
    it counts the same connections (one request task each at most, h11 reads
    no further request while one runs) but answers 503 to a request on an
    admitted connection once the count reaches it, where the guard refuses the
    connection that would exceed the cap.

    ``X-Forwarded-For`` is believed only from ``trusted_proxies`` (addresses or
    CIDRs): uvicorn's proxy-headers middleware then puts the rightmost address
    that is not a trusted proxy in the request's ``client``, which every per-IP
    limit and log line reads. Without them the header is ignored (uvicorn's own
    default would trust 127.0.0.1, so a local client could pick its address)."""
    kwargs: dict[str, Any] = {}
    if guard is not None:
        http, ws = guard.protocols()
        kwargs = {"http": http, "ws": ws}
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        server_header=False,
        ws_max_size=WS_MAX_MESSAGE_BYTES,
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=list(trusted_proxies) or None,
        **kwargs,
    )
    return EmbeddedServer(config)
