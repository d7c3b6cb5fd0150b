"""``/v1/insight/*``: connection attempt records and relayed usage (admin token).

- ``GET /v1/insight/attempts?family=&code=&outcome=&since=&limit=``: recent
  records, newest first (``since``: Unix seconds);
- ``GET /v1/insight/usage?days=``: totals per game per UTC day, and per code;
- ``GET /v1/insight/export?since=``: the records as JSON lines, for billing;
- ``GET /v1/insight/summary``: attempts by family and outcome, why relayed,
  why failed, top codes by bytes (what the console's insight page draws).

Every route needs ``Authorization: Bearer <admin token>`` (the console's
check, with its guessing budget): records name games and networks.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from crossroads.insight import MAX_SCAN, AttemptFilter, InsightRecorder
from crossroads.proto.insight import FAMILIES, OUTCOMES

#: Most records one ``attempts`` answer holds.
MAX_LIMIT = 1000


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"code": "invalid_request", "message": message}, 400)


def _selection(request: Request) -> AttemptFilter | JSONResponse:
    query = request.query_params
    family = query.get("family", "")
    outcome = query.get("outcome", "")
    if family and family not in FAMILIES:
        return _bad(f"family: one of {', '.join(FAMILIES)}")
    if outcome and outcome not in OUTCOMES:
        return _bad(f"outcome: one of {', '.join(OUTCOMES)}")
    try:
        since = float(query.get("since", "0"))
        limit = int(query.get("limit", "100"))
    except ValueError:
        return _bad("since and limit are numbers")
    if since != since or not 1 <= limit <= MAX_LIMIT:  # NaN, or out of range
        return _bad(f"limit: 1-{MAX_LIMIT}")
    code = query.get("code", "")[:64]
    return AttemptFilter(
        family=family, code=code, outcome=outcome, since=since, limit=limit
    )


def insight_router(
    recorder: InsightRecorder,
    refusal: Callable[[Request], JSONResponse | None],
) -> APIRouter:
    router = APIRouter(tags=["insight"])

    @router.get("/v1/insight/attempts")
    async def attempts(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        selection = _selection(request)
        if isinstance(selection, JSONResponse):
            return selection
        found = await recorder.attempts(selection)
        return JSONResponse({"attempts": [a.to_json() for a in found]})

    @router.get("/v1/insight/usage")
    async def usage(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        try:
            days = int(request.query_params.get("days", "1"))
        except ValueError:
            return _bad("days is a number")
        return JSONResponse(await recorder.usage(days))

    @router.get("/v1/insight/summary")
    async def summary(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        return JSONResponse(await recorder.summary())

    @router.get("/v1/insight/export")
    async def export(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        selection = _selection(request)
        if isinstance(selection, JSONResponse):
            return selection
        selection = AttemptFilter(
            family=selection.family,
            code=selection.code,
            outcome=selection.outcome,
            since=selection.since,
            limit=MAX_SCAN,
        )
        lines = [
            json.dumps(a.to_json(), separators=(",", ":"))
            for a in await recorder.attempts(selection)
        ]
        body = "".join(line + "\n" for line in reversed(lines))  # oldest first
        return Response(body, media_type="application/x-ndjson")

    return router
