"""Measuring regions: the SDK's QoS client (docs/qos.md).

It behaves as Unity's services runner does: every server of every region is
measured at once, :data:`REQUESTS_PER_SERVER` requests each sent back to
back with one random identifier per server and the sender's millisecond
clock as the timestamp; an answer counts when its identifier matches, its
sequence is new and below :data:`REQUESTS_PER_SERVER`, its version is 0 and
its latency is 0..60,000 ms. A region's figure is its best server's.

A host that wants the allocation in its best region::

    async with RelayApi(url, key) as api:
        allocation = await api.allocate_measured(max_connections=4)

and a player's ping location for a matchmaker::

        location = format_location(await measure_location(await api.qos_servers()))
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from crossroads.errors import DecodeError
from crossroads.proto.qos.messages import (
    UNITY_TITLE,
    QosRequest,
    decode_response,
)
from crossroads.types import Address

log = logging.getLogger("crossroads.client")
T = TypeVar("T")

#: Unity's services runner: RequestsPerEndpoint = 5.
REQUESTS_PER_SERVER = 5
#: The runner's whole measurement shares a 10 s budget; a region that has
#: not answered within 2 s is not where a game should be hosted.
DEFAULT_TIMEOUT = 2.0
#: Answers later than this are no measurement (the runner's 60,000 ms).
MAX_LATENCY_MS = 60_000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class ServerMeasurement:
    """One QoS server's answers."""

    region: str
    address: Address
    identifier: int
    latencies: list[float] = field(default_factory=list)
    #: Flow control nibbles received (non-zero: the server asks us to slow down).
    flows: list[int] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)

    @property
    def answered(self) -> bool:
        return bool(self.latencies)

    @property
    def latency_ms(self) -> float:
        """Average latency, as Unity reports it (infinite: no answer)."""
        if not self.latencies:
            return float("inf")
        return sum(self.latencies) / len(self.latencies)

    @property
    def min_latency_ms(self) -> float:
        """The smallest round trip: the least queueing (ping locations)."""
        return min(self.latencies) if self.latencies else float("inf")

    @property
    def packet_loss(self) -> float:
        return (REQUESTS_PER_SERVER - len(self.latencies)) / REQUESTS_PER_SERVER

    def accept(self, data: bytes, now_ms: int) -> None:
        try:
            response = decode_response(data)
        except DecodeError:
            return
        if (
            int.from_bytes(response.identifier, "little") != self.identifier
            or response.sequence >= REQUESTS_PER_SERVER
            or response.sequence in self._seen
            or len(response.rest) < 8
        ):
            return
        latency = now_ms - int.from_bytes(response.rest[:8], "little")
        if not 0 <= latency <= MAX_LATENCY_MS:
            return
        self._seen.add(response.sequence)
        self.latencies.append(float(latency))
        self.flows.append(response.flow)


@dataclass(frozen=True, slots=True)
class RegionResult:
    """A region's measurement: its best server's figures."""

    region: str
    latency_ms: float
    min_latency_ms: float
    packet_loss: float

    def to_json(self) -> dict[str, Any]:
        """As ``qosResults`` entries of ``POST /v1/allocate`` carry it."""
        return {
            "region": self.region,
            "latency": round(self.latency_ms, 1),
            "packetLoss": self.packet_loss,
        }


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, measurement: ServerMeasurement, done: asyncio.Event) -> None:
        self.measurement = measurement
        self.done = done

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.measurement.accept(data, _now_ms())
        if len(self.measurement.latencies) >= REQUESTS_PER_SERVER:
            self.done.set()

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error: that server does not answer; counted as loss


async def measure_servers(
    servers: Sequence[tuple[str, Address]], timeout: float = DEFAULT_TIMEOUT
) -> list[ServerMeasurement]:
    """Measure every ``(region, (host, port))`` at once."""
    loop = asyncio.get_running_loop()
    measurements = []
    transports = []
    waits = []
    try:
        for region, address in servers:
            identifier = int.from_bytes(os.urandom(2), "little")
            measurement = ServerMeasurement(region, address, identifier)
            done = asyncio.Event()
            transport, _ = await loop.create_datagram_endpoint(
                lambda m=measurement, d=done: _Socket(m, d),  # type: ignore[misc]
                remote_addr=address,
            )
            transports.append(transport)
            measurements.append(measurement)
            waits.append(done.wait())
            for sequence in range(REQUESTS_PER_SERVER):
                request = QosRequest(
                    UNITY_TITLE,
                    sequence,
                    identifier.to_bytes(2, "little"),
                    _now_ms().to_bytes(8, "little"),
                )
                transport.sendto(request.encode())
        if waits:
            await asyncio.wait(
                [asyncio.ensure_future(w) for w in waits], timeout=timeout
            )
    finally:
        for transport in transports:
            transport.close()
    return measurements


def by_region(measurements: Sequence[ServerMeasurement]) -> list[RegionResult]:
    """Each region's best server (lowest loss-inflated latency), best region
    first; regions with no answer at all are left out."""
    best: dict[str, ServerMeasurement] = {}
    for m in measurements:
        if not m.answered:
            continue
        held = best.get(m.region)
        if held is None or _score(m) < _score(held):
            best[m.region] = m
    results = [
        RegionResult(r, m.latency_ms, m.min_latency_ms, m.packet_loss)
        for r, m in best.items()
    ]
    results.sort(key=lambda r: (r.latency_ms / (1.0 - r.packet_loss), r.region))
    return results


def _score(m: ServerMeasurement) -> float:
    return m.latency_ms / max(0.01, 1.0 - m.packet_loss)


async def measure_regions(
    servers: Sequence[tuple[str, Address]], timeout: float = DEFAULT_TIMEOUT
) -> list[RegionResult]:
    """:func:`measure_servers` then :func:`by_region`."""
    return by_region(await measure_servers(servers, timeout))


async def measure_location(
    servers: Sequence[tuple[str, Address]], timeout: float = DEFAULT_TIMEOUT
) -> dict[str, float]:
    """Region -> smallest round trip (ms): what a ping location publishes."""
    return {r.region: r.min_latency_ms for r in await measure_regions(servers, timeout)}


def parse_endpoint(text: str) -> Address:
    """``host:port`` or ``[v6]:port`` (a discovery endpoint) as an address."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"not host:port: {text!r}")
    return host.strip("[]"), int(port)


class MeasuredChoice(Generic[T]):
    """A factory that picks its region by measurement: called, it measures
    every region's QoS servers once (the result is kept: Unity's SDK caches
    its measurement too), then calls the best region's factory. The p2p SDK
    takes one as its TURN factory::

        turn = MeasuredChoice({
            "eu": ([("203.0.113.10", 7700)], lambda: TurnClientRelay.open(eu, u, p)),
            "us": ([("198.51.100.7", 7700)], lambda: TurnClientRelay.open(us, u, p)),
        })
        client = P2PClient(url, turn=turn)

    With no answer from any region, the first region's factory is used.
    """

    def __init__(
        self,
        regions: Mapping[str, tuple[Sequence[Address], Callable[[], Awaitable[T]]]],
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if not regions:
            raise ValueError("MeasuredChoice needs at least one region")
        self.regions = dict(regions)
        self.timeout = timeout
        #: The measurement, best region first (None: not measured yet).
        self.results: list[RegionResult] | None = None
        self._lock = asyncio.Lock()

    async def region(self) -> str:
        """The best measured region (measuring on the first call)."""
        async with self._lock:
            if self.results is None:
                servers = [
                    (region, address)
                    for region, (addresses, _) in self.regions.items()
                    for address in addresses
                ]
                self.results = await measure_regions(servers, self.timeout)
        if self.results:
            return self.results[0].region
        first = next(iter(self.regions))
        log.info("no QoS server answered; using region %s", first)
        return first

    async def __call__(self) -> T:
        return await self.regions[await self.region()][1]()
