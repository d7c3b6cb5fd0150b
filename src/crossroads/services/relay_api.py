"""The allocations REST API, in the shapes of Unity's Relay Allocations service.

Paths, JSON field names, the ``{"meta": …, "data": {…}}`` envelope and the error
body follow ``reference/unity-relay-and-raknet.md`` §1.3 (RSDK models), so a
client written for Unity's service needs only a new base URL and an API key:

- ``POST /v1/allocate``  ``{"maxConnections": int, "region": str?}`` → ``data.allocation``
- ``POST /v1/joincode``  ``{"allocationId": uuid}`` → ``data.joinCode``
- ``POST /v1/join``      ``{"joinCode": str}`` → ``data.allocation`` (+ ``hostConnectionData``)
- ``GET  /v1/regions``   → ``data.regions`` (no ``meta``, as Unity's)
- ``GET  /v1/services/relay/servers[?region=…]`` and
  ``GET  /v1/servers?service=relay[&region=…]`` → ``data.servers``, the paths and
  shapes of Unity's QoS discovery service (docs/qos.md)
- ``POST /v1/ping/estimate`` ``{"locations": [str, …]}`` → relayed round trips
  per region, the best one, direct bounds (docs/qos.md, "Ping locations")

Every request needs ``Authorization: Bearer <API key>``. Errors use Unity's
error body ``{"status", "title", "detail", "type", "code"}`` (plus crossroads'
``message``, the same text as ``detail``).
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from crossroads.errors import DecodeError, StoreError
from crossroads.proto import jsontext
from crossroads.proto.bounded import BoundedMap
from crossroads.proto.budget import BudgetConfig, FailureBudget
from crossroads.proto.counting import spend_token
from crossroads.proto.qos.location import (
    MAX_REGIONS,
    MAX_RTT_MS,
    estimate,
    parse_location,
)
from crossroads.ratelog import RateLimitedLog
from crossroads.services.relay_allocations import (
    AllocationError,
    Allocator,
    QosResult,
    encode_grant,
)
from crossroads.transport.httpapi import log_client_error

log = logging.getLogger("crossroads.relay")

# ------------------------------------------------------------------ JSON models


#: Regions a QoS report or an estimate may name (proto/qos/location.py).
MAX_QOS_RESULTS = MAX_REGIONS
#: Locations one estimate may compare: a match of 64 players; each pair costs
#: one line of the answer, so 2,016 lines at most.
MAX_LOCATIONS = 64


class QosResultModel(BaseModel):
    model_config = ConfigDict(extra="ignore")
    region: str = Field(max_length=64)
    latency: float = Field(ge=0, le=MAX_RTT_MS, description="Average round trip, ms.")
    packetLoss: float = Field(default=0.0, ge=0, le=1, description="0 to 1.")


class EstimateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    locations: list[str] = Field(
        min_length=2,
        max_length=MAX_LOCATIONS,
        description="Ping locations (region=rtt,...), one per player.",
    )


class AllocateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    maxConnections: StrictInt = Field(
        description="Joiners the host accepts (1-150 by default)."
    )
    region: str | None = Field(
        default=None,
        description="Region id from /v1/regions; default: the best of qosResults "
        "with room, else the least loaded.",
    )
    qosResults: list[QosResultModel] | None = Field(
        default=None,
        max_length=MAX_QOS_RESULTS,
        description="The client's QoS measurements (GET /v1/services/relay/servers), used "
        "when region is null: the allocation lands in the best measured region "
        "that has room (latency and packet loss).",
    )


class JoinCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    allocationId: uuid.UUID = Field(description="The host's allocationId.")


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    joinCode: str = Field(
        description="6-12 characters of 6789BCDFGHJKLMNPQRTW, any case."
    )


class RelayServerEndpoint(BaseModel):
    connectionType: str
    network: str
    reliable: bool
    secure: bool
    host: str
    port: int


class RelayServerModel(BaseModel):
    ipV4: str
    port: int


class AllocationModel(BaseModel):
    allocationId: uuid.UUID
    allocationIdBytes: str = Field(
        description="base64 of the 16 bytes used on the wire"
    )
    key: str = Field(description="base64 of the 64-byte BIND HMAC key")
    connectionData: str = Field(description="base64, at most 255 bytes, opaque")
    serverEndpoints: list[RelayServerEndpoint]
    relayServer: RelayServerModel
    region: str


class JoinAllocationModel(AllocationModel):
    hostConnectionData: str = Field(description="base64 of the host's connectionData")


class Meta(BaseModel):
    requestId: str
    status: int


class AllocateData(BaseModel):
    allocation: AllocationModel


class AllocateResponse(BaseModel):
    meta: Meta
    data: AllocateData


class JoinCodeData(BaseModel):
    joinCode: str


class JoinCodeResponse(BaseModel):
    meta: Meta
    data: JoinCodeData


class JoinData(BaseModel):
    allocation: JoinAllocationModel


class JoinResponse(BaseModel):
    meta: Meta
    data: JoinData


class Region(BaseModel):
    id: str
    description: str


class RegionsData(BaseModel):
    regions: list[Region]


class RegionsResponse(BaseModel):
    data: RegionsData


class ErrorBody(BaseModel):
    status: int
    title: str
    detail: str
    type: str
    code: int
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (400, "Invalid request (15001) or unknown region (15007)"),
        (401, "Missing or wrong API key (15401)"),
        (404, "Unknown allocation (15008) or join code (15009)"),
        (409, "Session full (15409)"),
        (413, "Body larger than 16 KiB (15413)"),
        (429, "Too many allocate/join calls from this address (15429)"),
        (503, "No relay node has room (15010), or the store is down (15503)"),
    )
}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def error_response(status: int, code: int, title: str, detail: str) -> JSONResponse:
    body = {
        "status": status,
        "title": title,
        "detail": detail,
        "type": f"urn:crossroads:relay:error:{code}",
        "code": code,
        "message": detail,
    }
    return JSONResponse(body, status_code=status)


def _envelope(status: int, data: dict[str, Any]) -> JSONResponse:
    meta = {"requestId": str(uuid.uuid4()), "status": status}
    return JSONResponse({"meta": meta, "data": data}, status_code=status)


#: Request bodies are a few dozen bytes; anything near this is not a client of ours.
MAX_BODY = 16 * 1024
#: Unity's error code for an unknown or expired join code (reference §1.3); the
#: one failure a join-code guesser pays for.
JOIN_CODE_NOT_FOUND = 15009
#: Client IPs tracked by the rate limiter before the least recently seen one
#: is forgotten (its bucket refills): memory bounded whatever the number of
#: addresses, ~100 bytes an entry.
MAX_TRACKED_CLIENTS = 65_536

#: A route handler of the allocations API.
Handler = Callable[[Request], Awaitable[JSONResponse]]
#: The request body model :func:`_parse` validates against.
Model = TypeVar("Model", bound=BaseModel)
#: A POST route handler, given the request and its validated JSON body.
BodyHandler = Callable[[Request, Model], Awaitable[JSONResponse]]


async def _read_body(request: Request) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise AllocationError(
                413, 15413, "PayloadTooLarge", f"bodies are at most {MAX_BODY} bytes"
            )
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(eq=False)
class RateLimiter:
    """A token bucket per client IP, for the calls that create allocations.
    A full table forgets the least recently *seen* client, so one that keeps
    calling (and keeps being refused) stays refused while new addresses
    arrive: forgetting the oldest *inserted* one handed it a fresh bucket."""

    rate: float
    burst: float
    clock: Callable[[], float]
    max_clients: InitVar[int] = MAX_TRACKED_CLIENTS
    _buckets: BoundedMap[str, list[float]] = field(init=False)

    def __post_init__(self, max_clients: int) -> None:
        self._buckets = BoundedMap(max_clients)

    @property
    def forgotten(self) -> int:
        """Clients whose bucket was dropped to make room (a full table)."""
        return self._buckets.evicted

    def allow(self, client: str) -> bool:
        if self.rate <= 0:
            return True
        now = self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = [self.burst, now]
            self._buckets.put(client, bucket)
        return spend_token(bucket, now, self.rate, self.burst)


async def _parse(request: Request, model: type[Model]) -> Model:
    raw = await _read_body(request)
    try:
        data = jsontext.loads(raw) if raw else None
    except DecodeError as exc:
        raise AllocationError(
            400, 15001, "InvalidRequest", f"the body is not JSON ({exc})"
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors()
        )
        raise AllocationError(400, 15001, "InvalidRequest", problems) from None


class ApiKeys:
    """The accepted API keys; replaced as a whole on reload (SIGHUP)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.replace(keys)

    def replace(self, keys: Sequence[str]) -> None:
        self.encoded: tuple[bytes, ...] = tuple(key.encode() for key in keys)


def make_router(
    allocator: Allocator,
    api_keys: ApiKeys,
    requests: Counter,
    *,
    rate: float = 0.0,
    burst: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    key_budget: FailureBudget | None = None,
    join_budget: FailureBudget | None = None,
) -> APIRouter:
    """The ``/v1`` allocations router for one allocator and set of API keys.

    ``rate`` and ``burst`` limit allocate and join calls per client IP (0: none).
    ``key_budget`` bounds wrong API keys and ``join_budget`` unknown join codes,
    per source and in total (:mod:`crossroads.proto.budget`; None: no bound).
    """
    router = APIRouter(prefix="/v1", tags=["relay"])
    limiter = RateLimiter(rate, burst, clock)
    unbounded = FailureBudget(BudgetConfig(0.0, 1.0, 0.0, 1.0))
    keys_tried = key_budget or unbounded
    codes_tried = join_budget or unbounded
    auth_log = RateLimitedLog(log)

    def authorized(request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode()
        # Compare with every key, in constant time each, so timing says nothing.
        matches = [hmac.compare_digest(presented, key) for key in api_keys.encoded]
        return any(matches)

    def refusal(request: Request, client: str) -> JSONResponse | None:
        """The answer when the request may not go on: no key configured, the
        source's (or everyone's) wrong-key budget spent, or a wrong key."""
        if not api_keys.encoded:
            return error_response(
                401,
                15401,
                "Unauthorized",
                "this server has no API key configured (--api-key)",
            )
        if not keys_tried.try_spend(client, clock()):
            # Checked before the key is: while the budget is spent even the
            # right key is refused, so the answer says nothing about the key.
            return error_response(
                429, 15429, "RateLimited", "too many wrong API keys; retry later"
            )
        if not authorized(request):
            # Who, never what: the presented key stays out of the log.
            auth_log.log(
                "bad-api-key",
                "relay API: missing or unknown API key from %s",
                client,
            )
            return error_response(
                401,
                15401,
                "Unauthorized",
                "missing or unknown API key (Authorization: Bearer …)",
            )
        keys_tried.refund(client)  # the key was right: its try costs nothing
        return None

    def guarded(endpoint: str) -> Callable[[Handler], Handler]:
        """Wrap a route handler: the API key and its guessing budget, the rate
        limit of the calls that create allocations, errors as Unity's JSON
        envelope, the request counter and the retry headers."""

        def wrap(handler: Handler) -> Handler:
            @functools.wraps(handler)
            async def route(request: Request) -> JSONResponse:
                return await answer(endpoint, request, handler)

            return route

        return wrap

    async def answer(endpoint: str, request: Request, handler: Handler) -> JSONResponse:
        client = request.client.host if request.client else ""
        refused = refusal(request, client)
        if refused is not None:
            response = refused
        elif endpoint in ("allocate", "join") and not limiter.allow(client):
            response = error_response(
                429, 15429, "RateLimited", "too many allocations from this address"
            )
        else:
            try:
                response = await handler(request)
            except AllocationError as exc:
                if exc.status in (400, 413):
                    log_client_error(request, exc.status, exc.detail)
                response = error_response(exc.status, exc.code, exc.title, exc.detail)
            except StoreError as exc:
                response = error_response(
                    503, 15503, "ServiceUnavailable", f"store: {exc}"
                )
        requests.labels(endpoint, str(response.status_code)).inc()
        if response.status_code == 429:
            response.headers["Retry-After"] = "1"
        if response.status_code == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def posted(
        path: str,
        body_model: type[Model],
        response_model: type[BaseModel],
        summary: str,
        status_code: int = 200,
    ) -> Callable[[BodyHandler[Model]], Handler]:
        """Register a POST route at ``path`` whose JSON body is ``body_model``:
        documented, :func:`guarded` under the path's name, and the handler
        given the parsed body (an invalid one is answered 400 before it)."""

        def wrap(handler: BodyHandler[Model]) -> Handler:
            async def parsed(request: Request) -> JSONResponse:
                return await handler(request, await _parse(request, body_model))

            # The handler's name, not "parsed", makes the route's operationId;
            # no __wrapped__, or FastAPI would read the body parameter as its own.
            parsed.__name__ = handler.__name__
            parsed.__qualname__ = handler.__qualname__
            parsed.__doc__ = handler.__doc__
            route = guarded(path.removeprefix("/"))(parsed)
            router.post(
                path,
                status_code=status_code,
                response_model=response_model,
                responses=_ERRORS,
                openapi_extra=_body_schema(body_model),
                summary=summary,
            )(route)
            return route

        return wrap

    @posted(
        "/allocate",
        AllocateRequest,
        AllocateResponse,
        "Allocate a seat for a host on the least-loaded relay of a region",
        status_code=201,
    )
    async def allocate(request: Request, body: AllocateRequest) -> JSONResponse:
        measured = [
            QosResult(r.region, r.latency, r.packetLoss) for r in body.qosResults or ()
        ]
        grant = await allocator.allocate(body.maxConnections, body.region, measured)
        return _envelope(201, {"allocation": encode_grant(grant)})

    @posted(
        "/joincode",
        JoinCodeRequest,
        JoinCodeResponse,
        "Get the join code of a host allocation (the same one each time)",
    )
    async def create_join_code(request: Request, body: JoinCodeRequest) -> JSONResponse:
        code = await allocator.join_code(body.allocationId)
        return _envelope(200, {"joinCode": code})

    @posted(
        "/join", JoinRequest, JoinResponse, "Join a host's session with its join code"
    )
    async def join(request: Request, body: JoinRequest) -> JSONResponse:
        client = request.client.host if request.client else ""
        if not codes_tried.try_spend(client, clock()):
            raise AllocationError(
                429,
                15429,
                "RateLimited",
                "too many unknown join codes; retry later",
            )
        try:
            grant = await allocator.join(body.joinCode)
        except AllocationError as exc:
            if exc.code != JOIN_CODE_NOT_FOUND:
                codes_tried.refund(client)
            raise
        except BaseException:
            codes_tried.refund(client)
            raise
        codes_tried.refund(client)
        return _envelope(200, {"allocation": encode_grant(grant)})

    @router.get(
        "/regions",
        response_model=RegionsResponse,
        responses=_ERRORS,
        summary="Regions with at least one live relay node",
    )
    @guarded("regions")
    async def regions(request: Request) -> JSONResponse:
        found = await allocator.regions()
        body = {"data": {"regions": [{"id": i, "description": d} for i, d in found]}}
        return JSONResponse(body)

    async def qos_listing(
        request: Request, service: str, extra: str
    ) -> list[dict[str, Any]]:
        # Only the relay's QoS servers are known here; Unity's discovery also
        # lists Multiplay fleets' (service "multiplay", filtered by ``fleet``).
        if service != "relay":
            raise AllocationError(
                400,
                15001,
                "InvalidRequest",
                f"service must be 'relay', not {service!r}",
            )
        wanted = request.query_params.getlist("region") or None
        return [
            {"endpoints": [endpoint], "region": region, extra: ["relay"]}
            if extra
            else {"endpoints": [endpoint], "region": region}
            for region, endpoint in await allocator.qos_servers(wanted)
        ]

    @router.get(
        "/services/{service}/servers",
        responses=_ERRORS,
        summary="QoS servers of one service per region (Unity's "
        "QosDiscovery GetServiceServers: what the QoS SDK asks for the relay)",
    )
    @guarded("qos-servers")
    async def qos_service_servers(request: Request) -> JSONResponse:
        servers = await qos_listing(request, request.path_params["service"], "")
        return JSONResponse({"data": {"servers": servers}})

    @router.get(
        "/servers",
        responses=_ERRORS,
        summary="QoS servers per region, filtered by ?service= (Unity's "
        "QosDiscovery GetServers)",
    )
    @guarded("qos-servers")
    async def qos_servers(request: Request) -> JSONResponse:
        service = request.query_params.get("service", "relay")
        servers = await qos_listing(request, service, "services")
        return JSONResponse({"data": {"servers": servers}})

    @posted(
        "/ping/estimate",
        EstimateRequest,
        BaseModel,
        "Relayed round trip through each region for two or more ping locations",
    )
    async def ping_estimate(request: Request, body: EstimateRequest) -> JSONResponse:
        try:
            locations = [parse_location(text) for text in body.locations]
        except DecodeError as exc:
            raise AllocationError(
                400, 15001, "InvalidRequest", f"locations: {exc}"
            ) from None
        live = frozenset(region for region, _ in await allocator.regions())
        result = estimate(locations, live_regions=live)
        return JSONResponse(
            {
                "data": {
                    "bestRegion": result.best,
                    "regions": [
                        {
                            "region": r.region,
                            "worstRttMs": round(r.worst_ms, 1),
                            "pairs": [
                                {"a": a, "b": b, "rttMs": round(ms, 1)}
                                for a, b, ms in r.pairs
                            ],
                        }
                        for r in result.regions
                    ],
                    "direct": [
                        {
                            "a": d.a,
                            "b": d.b,
                            "lowMs": round(d.low_ms, 1),
                            "highMs": round(d.high_ms, 1),
                            "estimateMs": None
                            if d.estimate_ms is None
                            else round(d.estimate_ms, 1),
                            "errorMs": round(d.error_ms, 1),
                        }
                        for d in result.direct
                    ],
                }
            }
        )

    return router
