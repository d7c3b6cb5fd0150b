"""A RakNet MasterServer2-compatible game listing on the HTTP port (reference §2.3).

``POST``/``PUT`` add or refresh a row, ``GET`` lists a game's rows, ``DELETE``
removes one. Each ``__gameId`` is a table; each row is one game instance, stored
in the Store under ``ms2:row:<game>:<rowId>`` with TTL ``__timeoutSec``, so rows
vanish by themselves when their host stops refreshing (RakNet's hosts re-POST
every ``__timeoutSec - 1`` s). ``ms2:game:<game>`` marks the game as known for as
long as any of its rows could live. Each IP may hold at most 10 rows
(``ms2:ip:<ip>`` maps each row to its expiry time).

Passwords belong to rows, not to the game id (otherwise the first poster of a
game id used to set ``__updatePW``/``__readPW`` for the whole game and so lock
everyone else out of it): ``__updatePW`` and ``__rowPW`` given when a row is
created guard updating and deleting *that row*; ``__readPW`` hides *that row*
from a GET that does not give the same ``__readPW``. Anyone may add rows to any
game id; nobody can change, delete or read another poster's protected rows.

GeoIP: RakNet's server filtered and annotated results by location. crossroads
ships no GeoIP database, so ``__geoIP``, ``__includeDist`` and
``__includeDistSq`` are accepted and ignored, and no ``__city*``/``__dist``
columns are returned.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter

from crossroads.proto.masterserver.rows import (
    MAX_ROW_ID,
    ListingError,
    PostRequest,
    parse_int,
    parse_post,
    results_hint,
)
from crossroads.store.base import Store
from crossroads.transport.httpapi import log_client_error

#: Bodies larger than this are refused with 413 before parsing (64 columns of
#: 1 KiB values fit).
MAX_BODY_BYTES = 96 * 1024
#: MasterServer2 returned "at most 10 000 bytes of results per request".
MAX_RESULT_BYTES = 10_000
#: A game record outlives its newest row by this much, so passwords survive a
#: host re-POSTing a little late.
GAME_GRACE = 60


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(eq=False)
class MasterServer:
    """The listing's logic over a Store."""

    store: Store
    _: KW_ONLY
    max_timeout: int
    rows_per_ip: int
    registry: InitVar[CollectorRegistry]
    clock: Any = time.time
    requests: Counter = field(init=False)

    def __post_init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "crossroads_p2p_master_requests",
            "MasterServer2 requests, by method and status.",
            ["method", "status"],
            registry=registry,
        )

    @staticmethod
    def _row_key(game: str, row: int) -> str:
        return f"ms2:row:{game}:{row}"

    async def _game_known(self, game: str) -> bool:
        return await self.store.get(f"ms2:game:{game}") is not None

    @staticmethod
    def _check_row_passwords(
        stored: dict[str, Any], update_pw: str, row_pw: str
    ) -> None:
        """401 unless the caller knows the row's update and row passwords."""
        if stored.get("updatePW") and not _same(stored["updatePW"], update_pw):
            raise ListingError(401, "wrong_password", "wrong __updatePW for this row")
        if stored.get("rowPW") and not _same(stored["rowPW"], row_pw):
            raise ListingError(401, "wrong_password", "wrong __rowPW for this row")

    async def post(self, body: bytes, addr: str) -> dict[str, Any] | None:
        request = parse_post(body, self.max_timeout)
        now = self.clock()
        row_id = request.row_id
        existing = None
        if row_id is not None:
            raw = await self.store.get(self._row_key(request.game_id, row_id))
            existing = None if raw is None else json.loads(raw)
        if existing is not None:
            self._check_row_passwords(existing, request.update_pw, request.row_pw)
        ip_key = f"ms2:ip:{addr}"
        if existing is None:
            live = await self._live_rows(ip_key, now)
            if live >= self.rows_per_ip:
                raise ListingError(
                    403,
                    "too_many_rows",
                    f"at most {self.rows_per_ip} rows from one IP",
                )
        if row_id is None:
            row_id = await self._new_row_id(request.game_id)
        await self._store_row(request, row_id, addr, existing)
        await self.store.hset(
            ip_key,
            {f"{request.game_id}\x00{row_id}": str(now + request.timeout).encode()},
        )
        await self._extend(ip_key, request.timeout)
        if not request.has_client_req_id:
            return None
        return {
            "POST": {
                "__rowId": row_id,
                "__clientReqId": request.client_req_id,
                "__gameId": request.game_id,
            }
        }

    async def _live_rows(self, ip_key: str, now: float) -> int:
        entries = await self.store.hgetall(ip_key)
        dead = [f for f, exp in entries.items() if float(exp) <= now]
        if dead:
            await self.store.hdel(ip_key, *dead)
        return len(entries) - len(dead)

    async def _new_row_id(self, game: str) -> int:
        while True:
            row_id = (await self.store.incr(f"ms2:next:{game}")) - 1
            if row_id > MAX_ROW_ID:  # pragma: no cover - 2^64 posts
                raise ListingError(500, "internal", "row ids exhausted")
            if await self.store.get(self._row_key(game, row_id)) is None:
                return row_id

    async def _extend(self, key: str, ttl: float) -> None:
        left = await self.store.ttl(key)
        if left is None or left < ttl:
            await self.store.expire(key, ttl)

    async def _store_row(
        self,
        request: PostRequest,
        row_id: int,
        addr: str,
        existing: dict[str, Any] | None,
    ) -> None:
        # The passwords are the ones the row was created with: an update (by
        # someone who knew them) does not change who may touch the row.
        origin: dict[str, Any] = existing or {
            "rowPW": request.row_pw,
            "updatePW": request.update_pw,
            "readPW": request.read_pw,
        }
        row = {
            "cols": dict(request.columns),
            "addr": addr,
            "timeoutSec": request.timeout,
            "rowPW": origin.get("rowPW", ""),
            "updatePW": origin.get("updatePW", ""),
            "readPW": origin.get("readPW", ""),
        }
        await self.store.set(
            self._row_key(request.game_id, row_id),
            json.dumps(row).encode(),
            ttl=request.timeout,
        )
        game_key = f"ms2:game:{request.game_id}"
        left = await self.store.ttl(game_key)
        ttl = max(left or 0.0, request.timeout + GAME_GRACE)
        await self.store.set(game_key, b"{}", ttl=ttl)
        await self._extend(f"ms2:next:{request.game_id}", ttl)

    async def get(self, params: dict[str, str], url: str) -> dict[str, Any]:
        game_id = params.get("__gameId", "")
        if not game_id:
            raise ListingError(400, "missing_field", "__gameId is required")
        if not await self._game_known(game_id):
            # A game nobody has posted to (or whose rows all expired) is an
            # empty table, not an error: ComprehensivePCGame shows its
            # "(C)reate room" menu only after a response with a "GET" key.
            return {"GET": [], "requestURL": url}
        read_pw = params.get("__readPW", "")
        limit = results_hint(params.get("__minResultsHint"))
        exclude = {c for c in params.get("__excludeCols", "").split(",") if c}
        prefix = f"ms2:row:{game_id}:"
        keys = await self.store.keys(prefix)
        ids = sorted(int(k[len(prefix) :]) for k in keys if k[len(prefix) :].isdigit())
        rows: list[dict[str, Any]] = []
        size = 0
        for row_id in ids:
            if len(rows) >= limit:
                break
            raw = await self.store.get(self._row_key(game_id, row_id))
            if raw is None:
                continue
            stored = json.loads(raw)
            if stored.get("readPW") and not _same(stored["readPW"], read_pw):
                continue  # a row only its __readPW lists
            row: dict[str, Any] = {
                "__rowId": row_id,
                "__timeoutSec": stored["timeoutSec"],
                "__addr": stored["addr"],
                "__gameId": game_id,
            }
            row.update(stored["cols"])
            for column in exclude:
                row.pop(column, None)
            encoded = len(json.dumps(row)) + 1
            if size + encoded > MAX_RESULT_BYTES:
                break
            size += encoded
            rows.append(row)
        return {"GET": rows, "requestURL": url}

    async def delete(self, params: dict[str, str], addr: str) -> None:
        game_id = params.get("__gameId", "")
        if not game_id:
            raise ListingError(400, "missing_field", "__gameId is required")
        if "__rowId" not in params or params["__rowId"] == "":
            raise ListingError(400, "missing_field", "__rowId is required")
        row_id = parse_int(params["__rowId"], "__rowId", 0, MAX_ROW_ID)
        raw = await self.store.get(self._row_key(game_id, row_id))
        if raw is None:
            return  # 200 even when nothing was there (reference §2.3)
        stored = json.loads(raw)
        self._check_row_passwords(
            stored, params.get("__updatePW", ""), params.get("__rowPW", "")
        )
        await self.store.delete(self._row_key(game_id, row_id))
        await self.store.hdel(f"ms2:ip:{stored['addr']}", f"{game_id}\x00{row_id}")


class RakNetResponse(Response):
    """A response whose length header reads exactly ``Content-Length: ``.

    RakNet 4's HTTPConnection2 (the client of every MasterServer2 sample) finds
    the body length with a case-sensitive ``strstr(.., "Content-Length: ")``;
    without a match it completes the request as soon as it has seen the blank
    line after the headers, so a body arriving in a later TCP segment is lost.
    Starlette writes the name in lower case (HTTP names are case-insensitive,
    RFC 9110 §5.1) and uvicorn passes names through as given, so the name is
    rewritten here, for the listing's responses only.
    """

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        super().init_headers(headers)
        self.raw_headers = [
            (b"Content-Length", value) if name == b"content-length" else (name, value)
            for name, value in self.raw_headers
        ]


class RakNetJSONResponse(RakNetResponse, JSONResponse):
    """:class:`RakNetResponse`'s header casing for a JSON body."""


def make_master_router(master: MasterServer, path: str) -> APIRouter:
    """The HTTP routes of the listing at ``path``."""
    router = APIRouter(tags=["masterserver2"])

    def error(method: str, exc: ListingError, request: Request) -> JSONResponse:
        master.requests.labels(method, str(exc.status)).inc()
        if exc.status == 400:
            log_client_error(request, exc.status, exc.message)
        return RakNetJSONResponse(
            {"code": exc.code, "message": exc.message}, exc.status
        )

    async def post_or_put(request: Request) -> Response:
        method = request.method
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                master.requests.labels(method, "413").inc()
                return RakNetJSONResponse(
                    {"code": "too_large", "message": "the body is too large"}, 413
                )
        addr = request.client.host if request.client else ""
        try:
            result = await master.post(body, addr)
        except ListingError as exc:
            return error(method, exc, request)
        master.requests.labels(method, "200").inc()
        if result is None:
            return RakNetResponse(status_code=200)
        return RakNetJSONResponse(result)

    async def get(request: Request) -> Response:
        try:
            result = await master.get(dict(request.query_params), str(request.url))
        except ListingError as exc:
            return error("GET", exc, request)
        master.requests.labels("GET", "200").inc()
        return RakNetJSONResponse(result)

    async def delete(request: Request) -> Response:
        addr = request.client.host if request.client else ""
        try:
            await master.delete(dict(request.query_params), addr)
        except ListingError as exc:
            return error("DELETE", exc, request)
        master.requests.labels("DELETE", "200").inc()
        return RakNetResponse(status_code=200)

    router.add_api_route(
        path, post_or_put, methods=["POST", "PUT"], include_in_schema=True
    )
    router.add_api_route(path, get, methods=["GET"])
    router.add_api_route(path, delete, methods=["DELETE"])
    return router
