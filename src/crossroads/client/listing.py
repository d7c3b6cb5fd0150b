"""A client for MasterServer2-style game listings, and session advertising.

:class:`ListingClient` speaks the REST API (``POST``/``GET``/``DELETE`` on
``/testServer``, reference §2.3) to crossroads or to any compatible server.

:func:`advertise` follows RakNet's recipe (seed 001, steps 6–8): the session host
posts a row with the invite code, re-posts every ``__timeoutSec - 1`` s while it
is host, and when the host leaves, the member that becomes host posts at once —
the row id and row password come from the session id, which only members know,
so the new host updates the same row and strangers cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import httpx

from crossroads.client.p2p import HostChanged, P2PClient

#: RakNet's samples post with __timeoutSec 30 and refresh 1 s before it runs out.
DEFAULT_TIMEOUT = 30
REFRESH_MARGIN = 1.0


class ListingError(Exception):
    """The listing answered with an error (``status``, ``code``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code


class ListingClient:
    """``POST``/``GET``/``DELETE`` against a MasterServer2-compatible listing."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        #: Full URL of the resource, e.g. ``http://host:8080/testServer``.
        self.url = url
        self._http = httpx.AsyncClient(timeout=timeout)

    async def close(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _check(response: httpx.Response) -> None:
        if response.status_code != 200:
            try:
                body = response.json()
                code, message = str(body.get("code")), str(body.get("message"))
            except ValueError:
                code, message = "http_error", response.text[:200]
            raise ListingError(response.status_code, code, message)

    async def post(
        self,
        game_id: str,
        columns: dict[str, Any],
        *,
        row_id: int | None = None,
        timeout: int = DEFAULT_TIMEOUT,
        row_pw: str = "",
    ) -> int:
        """Add or refresh a row; returns its ``__rowId``."""
        body: dict[str, Any] = {
            "__gameId": game_id,
            "__clientReqId": "0",
            "__timeoutSec": timeout,
            **columns,
        }
        if row_id is not None:
            body["__rowId"] = row_id
        if row_pw:
            body["__rowPW"] = row_pw
        response = await self._http.post(self.url, json=body)
        self._check(response)
        return int(response.json()["POST"]["__rowId"])

    async def get(self, game_id: str, **params: str) -> list[dict[str, Any]]:
        response = await self._http.get(
            self.url, params={"__gameId": game_id, **params}
        )
        self._check(response)
        return list(response.json()["GET"])

    async def delete(self, game_id: str, row_id: int, *, row_pw: str = "") -> None:
        params = {"__gameId": game_id, "__rowId": str(row_id)}
        if row_pw:
            params["__rowPW"] = row_pw
        self._check(await self._http.delete(self.url, params=params))


def session_row(session: str) -> tuple[int, str]:
    """Row id and row password for a session (stable across host migration)."""
    digest = hashlib.sha256(b"crossroads listing " + session.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1, digest[8:24].hex()


async def advertise(
    client: P2PClient,
    listing: ListingClient,
    game_id: str,
    columns: dict[str, Any] | None = None,
    *,
    timeout: int = DEFAULT_TIMEOUT,
    stop: asyncio.Event | None = None,
) -> None:
    """Keep ``client``'s session listed while it is host (run as a task; cancel
    or set ``stop`` to end). At the end the row is deleted only if we are the
    last member: otherwise the session lives on and the next host re-posts."""
    row_id, row_pw = session_row(client.session)
    stop = stop or asyncio.Event()
    watcher = client.subscribe()
    try:
        while not stop.is_set():
            if client.is_host:
                row = {"code": client.code, "members": len(client.members)}
                row.update(columns or {})
                with contextlib.suppress(ListingError, httpx.HTTPError):
                    await listing.post(
                        game_id, row, row_id=row_id, timeout=timeout, row_pw=row_pw
                    )
            # Wake up to refresh, or at once when we become host.
            wait = asyncio.ensure_future(watcher.get())
            stopped = asyncio.ensure_future(stop.wait())
            done, pending = await asyncio.wait(
                {wait, stopped},
                timeout=max(1.0, timeout - REFRESH_MARGIN),
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in pending:
                task.cancel()
            if wait in done and not isinstance(wait.result(), HostChanged):
                continue
    finally:
        client.unsubscribe(watcher)
        if client.is_host and len(client.members) <= 1:
            with contextlib.suppress(ListingError, httpx.HTTPError):
                await listing.delete(game_id, row_id, row_pw=row_pw)
