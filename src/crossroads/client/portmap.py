"""Port mapping on the home gateway: PCP, NAT-PMP, then UPnP-IGD.

:class:`PortMapper` asks the default gateway to forward a UDP port to the peer
socket, in Tailscale's order (reference §3.4): PCP (RFC 6887), NAT-PMP
(RFC 6886), then UPnP-IGD through async-upnp-client. A mapping is renewed at half
its lifetime (RFC 6886 §3.3, RFC 6887 §11.2.1) and deleted on :meth:`close`
(lifetime 0 for PCP/NAT-PMP, DeletePortMapping for UPnP). The external address
becomes the ``mapped`` candidate of the connection ladder's ``mapping`` step.

Port mapping works on one NAT; behind a carrier-grade NAT the gateway's
"external" address is itself private and the mapping does not help (the ladder
then simply moves on to punching).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from crossroads.errors import DecodeError
from crossroads.proto.portmap import natpmp, pcp
from crossroads.transport.tasks import cancel_and_wait
from crossroads.types import Address, frozen

log = logging.getLogger("crossroads.client.portmap")

#: Requested lifetime. RFC 6886 §3.3 recommends 7200 s; a shorter lease means a
#: crashed client's mapping disappears sooner, and we renew at half-life anyway.
DEFAULT_LIFETIME = 3600
#: Retransmissions for PCP / NAT-PMP: 250 ms doubling (RFC 6886 §3.1), 3 tries
#: (1.75 s) before trying the next protocol. RFC 6887's 3 s initial timer is
#: for a client with no alternative; we have two.
FIRST_RETRANSMIT = 0.25
TRIES = 3
#: SSDP discovery wait (RakNet's sample uses 2000 ms, reference §2.7).
UPNP_DISCOVERY = 2


SocketFactory = Callable[[], socket.socket]
#: What a request's ``accept`` callback makes of the answer it takes.
Answer = TypeVar("Answer")


@frozen
class Mapping:
    """A port mapping held on the gateway."""

    method: str  # "pcp", "natpmp" or "upnp"
    external_ip: str
    external_port: int
    internal_ip: str
    internal_port: int
    lifetime: int


def default_gateway() -> str | None:
    """The IPv4 default gateway from ``/proc/net/route`` (Linux)."""
    try:
        with open("/proc/net/route") as routes:
            next(routes)
            for line in routes:
                fields = line.split()
                if (
                    len(fields) > 2
                    and fields[1] == "00000000"
                    and int(fields[3], 16) & 2
                ):
                    return socket.inet_ntoa(int(fields[2], 16).to_bytes(4, "little"))
    except (OSError, ValueError, StopIteration):
        return None
    return None


def _any_answer(data: bytes) -> bytes:
    """Take whatever comes back (a delete's answer is not looked at)."""
    return data


def local_ip_towards(host: str) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, ...]) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(data)

    def error_received(self, exc: Exception) -> None:
        pass


async def _request(
    gateway: Address,
    local_ip: str,
    payload: bytes,
    accept: Callable[[bytes], Answer | None],
    factory: SocketFactory | None = None,
) -> Answer | None:
    """Send ``payload`` with retransmissions; the first answer ``accept`` takes."""
    loop = asyncio.get_running_loop()
    if factory is not None:
        sock = factory()
        sock.setblocking(False)
        sock.connect(gateway)
        transport, protocol = await loop.create_datagram_endpoint(_Exchange, sock=sock)
    else:
        transport, protocol = await loop.create_datagram_endpoint(
            _Exchange, local_addr=(local_ip, 0), remote_addr=gateway
        )
    exchange = protocol
    try:
        wait = FIRST_RETRANSMIT
        for _ in range(TRIES):
            transport.sendto(payload)
            deadline = loop.time() + wait
            while (left := deadline - loop.time()) > 0:
                try:
                    data = await asyncio.wait_for(exchange.queue.get(), left)
                except TimeoutError:
                    break
                result = accept(data)
                if result is not None:
                    return result
            wait *= 2
        return None
    finally:
        transport.close()


@dataclass(eq=False)
class PortMapper:
    """Hold a UDP port mapping for ``internal_port`` (see module docstring)."""

    internal_port: int
    _: KW_ONLY
    gateway: str | None = None
    internal_ip: str | None = None
    lifetime: int = DEFAULT_LIFETIME
    methods: tuple[str, ...] = ("pcp", "natpmp", "upnp")
    upnp_timeout: int = UPNP_DISCOVERY
    #: Makes the UDP sockets for PCP / NAT-PMP (e.g. inside a namespace).
    socket_factory: SocketFactory | None = None
    mapping: Mapping | None = field(default=None, init=False)
    _nonce: bytes = field(
        default_factory=lambda: secrets.token_bytes(12), init=False, repr=False
    )
    _refresh: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _igd: Any = field(default=None, init=False, repr=False)
    _requester: Any = field(default=None, init=False, repr=False)

    async def start(self) -> Mapping | None:
        """Try each method in turn; returns the mapping, or None if none worked."""
        self.gateway = self.gateway or default_gateway()
        if self.gateway is None:
            return None
        if self.internal_ip is None and self.socket_factory is not None:
            with self.socket_factory() as probe:
                probe.connect((self.gateway, 9))
                self.internal_ip = str(probe.getsockname()[0])
        self.internal_ip = self.internal_ip or local_ip_towards(self.gateway)
        if self.internal_ip is None:
            return None
        for method in self.methods:
            try:
                mapping = await self._map(method, self.lifetime)
            except (OSError, DecodeError, TimeoutError) as exc:
                log.debug("%s mapping failed: %s", method, exc)
                mapping = None
            except Exception as exc:  # noqa: BLE001 - UPnP devices answer anything
                log.debug("%s mapping failed: %r", method, exc)
                mapping = None
            if mapping is not None:
                self.mapping = mapping
                self._refresh = asyncio.create_task(self._refresh_loop())
                return mapping
        return None

    async def _map(self, method: str, lifetime: int) -> Mapping | None:
        match method:
            case "pcp":
                return await self._pcp(lifetime)
            case "natpmp":
                return await self._natpmp(lifetime)
            case "upnp":
                return await self._upnp(lifetime)
        raise ValueError(f"unknown port mapping method {method!r}")

    async def _pcp(self, lifetime: int) -> Mapping | None:
        assert self.gateway and self.internal_ip
        previous = (
            self.mapping if self.mapping and self.mapping.method == "pcp" else None
        )
        request = pcp.MapRequest(
            nonce=self._nonce,
            protocol=pcp.PROTOCOL_UDP,
            internal_port=self.internal_port,
            external_port=previous.external_port if previous else self.internal_port,
            external_ip=previous.external_ip if previous else "0.0.0.0",
            lifetime=lifetime,
            client_ip=self.internal_ip,
        )

        def accept(data: bytes) -> pcp.MapResponse | pcp.ErrorResponse | None:
            try:
                response = pcp.decode_response(data)
            except DecodeError:
                return None  # e.g. a NAT-PMP gateway's version-0 refusal
            if isinstance(response, pcp.MapResponse) and response.nonce != self._nonce:
                return None
            return response

        response = await self._ask(pcp.PORT, request.encode(), accept)
        if (
            not isinstance(response, pcp.MapResponse)
            or response.result != pcp.Result.SUCCESS
        ):
            return None
        return self._mapped(
            "pcp", response.external_ip, response.external_port, response.lifetime
        )

    async def _natpmp(self, lifetime: int) -> Mapping | None:
        def accept_address(data: bytes) -> natpmp.Response | None:
            try:
                return natpmp.decode_response(data)
            except DecodeError:
                return None

        address = await self._ask(
            natpmp.PORT, natpmp.ExternalAddressRequest().encode(), accept_address
        )
        if not isinstance(address, natpmp.ExternalAddressResponse) or address.result:
            return None
        request = natpmp.MapRequest(
            natpmp.Opcode.MAP_UDP, self.internal_port, self._previous_port(), lifetime
        )
        response = await self._ask(natpmp.PORT, request.encode(), accept_address)
        if not isinstance(response, natpmp.MapResponse) or response.result:
            return None
        return self._mapped(
            "natpmp", address.address, response.external_port, response.lifetime
        )

    async def _upnp(self, lifetime: int) -> Mapping | None:
        from async_upnp_client.aiohttp import AiohttpRequester
        from async_upnp_client.client_factory import UpnpFactory
        from async_upnp_client.profiles.igd import IgdDevice
        from async_upnp_client.search import async_search

        assert self.gateway and self.internal_ip
        if self._igd is None:
            locations: list[str] = []

            async def found(headers: Any) -> None:
                location = headers.get("location")
                if location and location not in locations:
                    locations.append(location)

            for target in IgdDevice.DEVICE_TYPES:
                await async_search(
                    found,
                    timeout=self.upnp_timeout,
                    search_target=target,
                    source=(self.internal_ip, 0),
                )
                if locations:
                    break
            if not locations:
                return None
            self._requester = AiohttpRequester(timeout=5)
            device = await UpnpFactory(self._requester).async_create_device(
                locations[0]
            )
            self._igd = IgdDevice(device, None)
        igd = self._igd
        external_port = self._previous_port()
        await igd.async_add_port_mapping(
            remote_host=ipaddress.IPv4Address("0.0.0.0"),
            external_port=external_port,
            protocol="UDP",
            internal_port=self.internal_port,
            internal_client=ipaddress.IPv4Address(self.internal_ip),
            enabled=True,
            description="crossroads p2p",
            lease_duration=timedelta(seconds=lifetime),
        )
        external_ip = await igd.async_get_external_ip_address()
        if not external_ip:
            return None
        return self._mapped("upnp", external_ip, external_port, lifetime)

    async def _ask(
        self, port: int, payload: bytes, accept: Callable[[bytes], Answer | None]
    ) -> Answer | None:
        """Send ``payload`` to the gateway's ``port`` from our internal address
        (with retransmissions); the first answer ``accept`` takes, or None."""
        assert self.gateway and self.internal_ip
        return await _request(
            (self.gateway, port), self.internal_ip, payload, accept, self.socket_factory
        )

    def _previous_port(self) -> int:
        """The external port to ask for: the one held (a renewal keeps it),
        else the internal port."""
        return self.mapping.external_port if self.mapping else self.internal_port

    def _mapped(
        self, method: str, external_ip: str, external_port: int, lifetime: int
    ) -> Mapping:
        """The mapping a gateway granted to our internal address and port."""
        assert self.internal_ip
        return Mapping(
            method,
            external_ip,
            external_port,
            self.internal_ip,
            self.internal_port,
            lifetime,
        )

    async def _refresh_loop(self) -> None:
        while self.mapping is not None:
            # Renew at half the granted lifetime (RFC 6886 §3.3); a gateway that
            # grants 0 or absurdly short lifetimes is renewed every 30 s.
            await asyncio.sleep(max(30.0, self.mapping.lifetime / 2))
            try:
                renewed = await self._map(self.mapping.method, self.lifetime)
            except Exception as exc:  # noqa: BLE001 - keep the old mapping, retry later
                log.debug("renewing the port mapping failed: %r", exc)
                continue
            if renewed is not None:
                self.mapping = renewed

    async def close(self) -> None:
        """Delete the mapping from the gateway."""
        if self._refresh is not None:
            await cancel_and_wait(self._refresh)
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        assert self.gateway and self.internal_ip
        try:
            if mapping.method == "pcp":
                request = pcp.MapRequest(
                    self._nonce,
                    pcp.PROTOCOL_UDP,
                    self.internal_port,
                    0,
                    "0.0.0.0",
                    0,
                    self.internal_ip,
                )
                await self._ask(pcp.PORT, request.encode(), _any_answer)
            elif mapping.method == "natpmp":
                delete = natpmp.MapRequest(
                    natpmp.Opcode.MAP_UDP, self.internal_port, 0, 0
                )
                await self._ask(natpmp.PORT, delete.encode(), _any_answer)
            elif self._igd is not None:
                await self._igd.async_delete_port_mapping(
                    remote_host=ipaddress.IPv4Address("0.0.0.0"),
                    external_port=mapping.external_port,
                    protocol="UDP",
                )
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.debug("deleting the port mapping failed: %r", exc)
