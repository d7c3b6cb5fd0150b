"""Python client for crossroads relays (and any Unity-Relay-compatible service).

Two halves, as in Unity's SDK:

- :class:`RelayApi` talks to the allocations REST API: :meth:`~RelayApi.allocate`
  a seat for a host, get its :meth:`~RelayApi.join_code`, :meth:`~RelayApi.join`
  with a code, list :meth:`~RelayApi.regions`.
- :class:`RelayConnection` speaks the relay's UDP protocol for one allocation:
  bind, connect (joiners), send and receive, keep-alive and re-bind, driven by the
  sans-I/O :class:`crossroads.proto.relay.client.RelayClient`.

A host::

    async with RelayApi("http://relay.example:8080", api_key) as api:
        allocation = await api.allocate(max_connections=4)
        code = await api.join_code(allocation.allocation_id)
        host = await RelayConnection.open(allocation)
        await host.bind()
        sender, data = await host.recv()          # from any joiner
        host.send(sender, b"welcome")

A joining player::

        allocation = await api.join(code)
        player = await RelayConnection.open(allocation)
        await player.bind()
        host_id = await player.connect()
        player.send(host_id, b"hello")

``RelayConnection.open(allocation, secure=True)`` speaks the same protocol
inside DTLS 1.2 (PSK) to the allocation's ``dtls`` endpoint, as Unity Transport
does with ``RelayServerData(allocation, "dtls")``: the handshake (identity = the
16 raw allocation ID bytes, PSK = the key) runs before the BIND, then each relay
message is one DTLS record (:class:`crossroads.proto.dtls.client.PskDtlsClient`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import field
from typing import Any, cast

import httpx

from crossroads.client.qos import (
    DEFAULT_TIMEOUT,
    RegionResult,
    measure_regions,
    parse_endpoint,
)
from crossroads.errors import CrossroadsError
from crossroads.proto.dtls.client import ClientState as DtlsState
from crossroads.proto.dtls.client import PskDtlsClient
from crossroads.proto.dtls.handshake import ApplicationData, HandshakeFailed
from crossroads.proto.dtls.handshake import Event as DtlsEvent
from crossroads.proto.relay import client as core
from crossroads.transport.driver import CoreTimer
from crossroads.transport.sockets import make_udp_socket
from crossroads.types import Address, frozen

#: Received frames waiting for :meth:`RelayConnection.recv`; beyond this the oldest
#: is dropped (UDP semantics) so a slow reader cannot grow memory without end.
MAX_QUEUED_FRAMES = 4096


class RelayApiError(CrossroadsError):
    """The allocations API answered with an error (Unity's error body)."""

    def __init__(self, status: int, code: int, title: str, detail: str) -> None:
        super().__init__(f"{status} {title} ({code}): {detail}")
        self.status = status
        self.code = code
        self.title = title
        self.detail = detail


class RelayConnectionError(CrossroadsError):
    """The relay refused or dropped this allocation."""


class RelayRejected(RelayConnectionError):
    """The host already has its maximum number of connections."""


@frozen
class Allocation:
    """An allocation as the API returns it (Unity's Allocation / JoinAllocation)."""

    allocation_id: uuid.UUID
    allocation_id_bytes: bytes
    key: bytes = field(repr=False)
    connection_data: bytes
    server: Address
    region: str
    #: Only for joiners: the host's connection data, for CONNECT_REQUEST.
    host_connection_data: bytes | None = None
    #: The ``dtls`` endpoint, when the relay lists one.
    dtls_server: Address | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Allocation:
        """Parse an ``allocation`` object; the first ``udp`` endpoint is used."""
        endpoints = [
            e
            for e in data.get("serverEndpoints", [])
            if e.get("connectionType") == "udp"
        ]
        dtls = [
            (str(e["host"]), int(e["port"]))
            for e in data.get("serverEndpoints", [])
            if e.get("connectionType") == "dtls"
        ]
        if endpoints:
            server = (str(endpoints[0]["host"]), int(endpoints[0]["port"]))
        else:
            server = (
                str(data["relayServer"]["ipV4"]),
                int(data["relayServer"]["port"]),
            )
        host_data = data.get("hostConnectionData")
        return cls(
            allocation_id=uuid.UUID(data["allocationId"]),
            allocation_id_bytes=base64.b64decode(data["allocationIdBytes"]),
            key=base64.b64decode(data["key"]),
            connection_data=base64.b64decode(data["connectionData"]),
            server=server,
            region=str(data.get("region", "")),
            host_connection_data=base64.b64decode(host_data) if host_data else None,
            dtls_server=dtls[0] if dtls else None,
        )


class RelayApi:
    """Async client of the allocations API (``/v1/...``) with an API key."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 10.0) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    async def __aenter__(self) -> RelayApi:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> Any:
        response = await self._http.request(method, path, json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        if response.status_code >= 400:
            raise RelayApiError(
                response.status_code,
                int(payload.get("code", 0)),
                str(payload.get("title", "")),
                str(payload.get("detail", response.text)),
            )
        return payload["data"]

    async def allocate(
        self,
        max_connections: int,
        region: str | None = None,
        qos_results: Sequence[RegionResult] = (),
    ) -> Allocation:
        body: dict[str, Any] = {"maxConnections": max_connections}
        if region is not None:
            body["region"] = region
        if qos_results:
            body["qosResults"] = [r.to_json() for r in qos_results]
        data = await self._call("POST", "/v1/allocate", body)
        return Allocation.from_json(data["allocation"])

    async def qos_servers(self, region: str | None = None) -> list[tuple[str, Address]]:
        """(region, QoS server address) of the relay service (discovery)."""
        path = "/v1/services/relay/servers"
        if region is not None:
            path += f"?region={region}"
        data = await self._call("GET", path)
        return [
            (str(s["region"]), parse_endpoint(str(s["endpoints"][0])))
            for s in data["servers"]
            if s.get("endpoints")
        ]

    async def measure(self, timeout: float = DEFAULT_TIMEOUT) -> list[RegionResult]:
        """A QoS round over every region's servers, best region first."""
        return await measure_regions(await self.qos_servers(), timeout)

    async def allocate_measured(
        self, max_connections: int, timeout: float = DEFAULT_TIMEOUT
    ) -> Allocation:
        """Unity's ``CreateAllocationAsync(n)`` without a region: measure every
        region, then allocate with ``region`` null and the measurements, so
        the allocation lands in the best measured region that has room."""
        return await self.allocate(
            max_connections, qos_results=await self.measure(timeout)
        )

    async def estimate(self, locations: Sequence[str]) -> dict[str, Any]:
        """``POST /v1/ping/estimate`` (docs/qos.md, "Ping locations")."""
        data = await self._call(
            "POST", "/v1/ping/estimate", {"locations": list(locations)}
        )
        return cast(dict[str, Any], data)

    async def join_code(self, allocation_id: uuid.UUID) -> str:
        data = await self._call(
            "POST", "/v1/joincode", {"allocationId": str(allocation_id)}
        )
        return str(data["joinCode"])

    async def join(self, join_code: str) -> Allocation:
        data = await self._call("POST", "/v1/join", {"joinCode": join_code})
        return Allocation.from_json(data["allocation"])

    async def regions(self) -> list[tuple[str, str]]:
        data = await self._call("GET", "/v1/regions")
        return [(str(r["id"]), str(r["description"])) for r in data["regions"]]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, owner: RelayConnection) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.owner._received(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP unreachable: the keep-alive and re-bind logic copes.


class RelayConnection:
    """One allocation's UDP session with a relay server."""

    def __init__(
        self,
        allocation: Allocation,
        config: core.RelayClientConfig | None,
        secure: bool = False,
    ) -> None:
        self.allocation = allocation
        server = allocation.server
        if secure:
            if allocation.dtls_server is None:
                raise RelayConnectionError("the allocation lists no dtls endpoint")
            server = allocation.dtls_server
        self.server = server
        self.secure = secure
        self.core = core.RelayClient(
            allocation.allocation_id_bytes,
            allocation.key,
            allocation.connection_data,
            server,
            host_connection_data=allocation.host_connection_data,
            config=config,
        )
        #: The DTLS session (``secure``); a new one per local socket.
        self.dtls: PskDtlsClient | None = None
        #: DTLS events other than data (established, failed, closed), in order.
        self.dtls_history: list[DtlsEvent] = []
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.DatagramTransport | None = None
        self._frames: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self._changed = asyncio.Event()
        self._timer = CoreTimer(self._loop, self._deadline, self._on_timer)
        self.frames_dropped = 0
        #: Every non-data event, in order (for callers that want the details).
        self.history: list[core.ClientEvent] = []

    @classmethod
    async def open(
        cls,
        allocation: Allocation,
        *,
        local_host: str | None = None,
        config: core.RelayClientConfig | None = None,
        sock: socket.socket | None = None,
        secure: bool = False,
    ) -> RelayConnection:
        """Open a UDP socket for ``allocation`` (nothing is sent until :meth:`bind`).

        ``sock`` uses a socket the caller already has (bound, non-blocking; e.g. the
        game's own, or one made in another network namespace); it is closed with
        the connection. ``secure``: DTLS to the allocation's ``dtls`` endpoint.
        """
        connection = cls(allocation, config, secure)
        await connection._open_socket(local_host, sock)
        return connection

    async def _open_socket(
        self, local_host: str | None, sock: socket.socket | None = None
    ) -> None:
        if sock is None:
            server_host = self.server[0]
            if local_host is None:
                local_host = "::" if ":" in server_host else "0.0.0.0"
            sock = make_udp_socket(local_host, 0)
        transport, _ = await self._loop.create_datagram_endpoint(
            lambda: _Protocol(self), sock=sock
        )
        self._transport = transport

    @property
    def local_address(self) -> Address:
        assert self._transport is not None
        sock: socket.socket = self._transport.get_extra_info("socket")
        host, port = sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def allocation_id(self) -> bytes:
        return self.allocation.allocation_id_bytes

    @property
    def state(self) -> core.ClientState:
        return self.core.state

    @property
    def peers(self) -> set[bytes]:
        return set(self.core.peers)

    # ------------------------------------------------------------- commands

    async def bind(self, timeout: float = 10.0) -> None:
        """BIND (retried every second) until BIND_RECEIVED (after the DTLS
        handshake when ``secure``)."""
        if self.secure and self.dtls is None:
            await self._handshake(timeout)
        if self.core.state is core.ClientState.BINDING:
            self.core.start(self._loop.time())
            self._flush()
        await self._wait(
            lambda: self.core.state is not core.ClientState.BINDING, timeout, "BIND"
        )

    async def connect(self, timeout: float = 10.0) -> bytes:
        """Joiner: CONNECT_REQUEST until ACCEPTED; returns the host's allocation ID.

        Raises:
            RelayRejected: the host is full.
            RelayConnectionError: the allocation is invalid.
        """
        self.core.connect(self._loop.time())
        self._flush()
        await self._wait(
            lambda: self.core.state is not core.ClientState.CONNECTING,
            timeout,
            "CONNECT",
        )
        if self.core.state is core.ClientState.BOUND:
            raise RelayRejected(
                "the host has reached its maximum number of connections"
            )
        assert self.core.host_allocation_id is not None
        return self.core.host_allocation_id

    def send(self, to_allocation_id: bytes, payload: bytes) -> None:
        """Relay ``payload`` to another allocation of the session (unreliable)."""
        self.core.send(to_allocation_id, payload, self._loop.time())
        self._flush()

    async def recv(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """The next (sender allocation ID, payload).

        Raises:
            TimeoutError: nothing within ``timeout`` seconds.
        """
        return await asyncio.wait_for(self._frames.get(), timeout)

    def disconnect(self, peer: bytes) -> None:
        self.core.disconnect(peer, self._loop.time())
        self._flush()

    async def migrate(self, local_host: str | None = None) -> None:
        """Move to a new local socket, as a NAT rebinding would.

        The relay answers the next frame from the new address with ERROR 3 and
        the client re-BINDs; call :meth:`rebind` to do it straight away.
        """
        old = self._transport
        await self._open_socket(local_host)
        if old is not None:
            old.close()
        if self.secure:
            # A DTLS session belongs to one address: a new one from the new socket.
            await self._handshake(10.0)

    def rebind(self) -> None:
        """BIND again now with the next nonce."""
        self.core.rebind(self._loop.time())
        self._flush()

    async def close(self) -> None:
        """CLOSE the allocation on the relay and release the socket."""
        self.core.close(self._loop.time())
        self._flush()
        if self.dtls is not None and self._transport is not None:
            self.dtls.close(self._loop.time())
            for data, addr in self.dtls.datagrams_to_send(self._loop.time()):
                self._transport.sendto(data, addr)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._timer.rearm()
        self._changed.set()

    # ------------------------------------------------------------- plumbing

    async def _handshake(self, timeout: float) -> None:
        self.dtls = PskDtlsClient(
            self.server,
            self.allocation.allocation_id_bytes,
            self.allocation.key,
            os.urandom,
        )
        self.dtls.start(self._loop.time())
        self._flush()
        dtls = self.dtls
        async with asyncio.timeout(timeout):
            while dtls.state not in (
                DtlsState.ESTABLISHED,
                DtlsState.FAILED,
                DtlsState.CLOSED,
            ):
                self._changed.clear()
                await self._changed.wait()
        self.dtls_history.extend(dtls.pop_events())
        if dtls.state is not DtlsState.ESTABLISHED:
            reasons = [
                e.reason for e in self.dtls_history if isinstance(e, HandshakeFailed)
            ]
            raise RelayConnectionError(
                f"DTLS handshake failed: {', '.join(reasons) or 'closed'}"
            )

    async def _wait(self, done: Any, timeout: float, what: str) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                if self.core.state is core.ClientState.INVALID:
                    break
                self._changed.clear()
                await self._changed.wait()
        if self.core.state in (core.ClientState.INVALID, core.ClientState.CLOSED):
            reasons = [e.reason for e in self.history if isinstance(e, core.Invalid)]
            raise RelayConnectionError(
                f"{what} failed: allocation {', '.join(reasons) or 'closed'}"
            )

    def _received(self, data: bytes, addr: Address) -> None:
        now = self._loop.time()
        if self.dtls is None:
            self.core.receive_datagram(data, addr, now)
        else:
            state = self.dtls.state
            self.dtls.receive_datagram(data, addr, now)
            for event in self.dtls.pop_events():
                if isinstance(event, ApplicationData):
                    self.core.receive_datagram(event.data, addr, now)
                else:
                    self.dtls_history.append(event)
            if self.dtls.state is not state:
                self._changed.set()
        self._flush()

    def _flush(self) -> None:
        now = self._loop.time()
        if self._transport is not None:
            dtls = self.dtls
            for data, addr in self.core.datagrams_to_send(now):
                if dtls is None:
                    self._transport.sendto(data, addr)
                elif not dtls.send(data, now):
                    self.frames_dropped += 1  # no session yet: lost, as on UDP
            if dtls is not None:
                for data, addr in dtls.datagrams_to_send(now):
                    self._transport.sendto(data, addr)
        changed = False
        for event in self.core.pop_events():
            if isinstance(event, core.Data):
                if self._frames.qsize() >= MAX_QUEUED_FRAMES:
                    self._frames.get_nowait()
                    self.frames_dropped += 1
                self._frames.put_nowait((event.from_allocation_id, event.payload))
            else:
                self.history.append(event)
                changed = True
        if changed:
            self._changed.set()
        self._timer.rearm()

    def _deadline(self) -> float | None:
        # No timer without a socket: nothing could be sent when it fires.
        if self._transport is None:
            return None
        deadline = self.core.get_timer()
        if self.dtls is not None:
            handshake = self.dtls.get_timer()
            if handshake is not None:
                deadline = handshake if deadline is None else min(deadline, handshake)
        return deadline

    def _on_timer(self, now: float) -> None:
        self.core.handle_timer(now)
        if self.dtls is not None:
            state = self.dtls.state
            self.dtls.handle_timer(now)
            if self.dtls.state is not state:
                self._changed.set()
        self._flush()
