"""asyncio STUN client: Binding requests and RFC 5780 NAT behaviour discovery.

Quick use::

    from crossroads.client.stun import stun_binding, discover_nat

    result = await stun_binding(("stun.example.net", 3478))   # UDP
    print(result.mapped)                                      # ('203.0.113.5', 40001)
    result = await stun_binding(server, transport="tcp")      # RFC 8489 over TCP

    behavior = await discover_nat(server)                     # RFC 5780 server
    behavior.mapping    # MappingBehavior.ENDPOINT_INDEPENDENT, ...
    behavior.filtering  # FilteringBehavior.ADDRESS_AND_PORT_DEPENDENT, ...
    behavior.hairpinning

For several requests from one socket (the mapping you learn is the mapping of
*that* socket), use :class:`StunClient` directly::

    async with await StunClient.open(("0.0.0.0", 0)) as client:
        first = await client.binding(server)
        other = await client.binding(first.other_address)

Retransmissions follow RFC 8489 §6.2.1 (:data:`RFC8489_TIMERS`: RTO 500 ms
doubling, Rc = 7, Rm = 16, 39.5 s to give up). NAT discovery expects some
requests to go unanswered, so by default it uses :data:`DISCOVERY_TIMERS`
(2.2 s to give up); pass ``timers=`` to change either.

Results are frozen dataclasses. Failures raise :class:`StunTimeout` (no answer)
or :class:`StunErrorResponse` (the server answered with ERROR-CODE).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import socket
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Self

from crossroads.errors import CrossroadsError, DecodeError
from crossroads.proto.stun.attributes import (
    Attribute,
    ChangeRequest,
    MappedAddress,
    OtherAddress,
    ResponseOrigin,
    Software,
    XorMappedAddress,
)
from crossroads.proto.stun.client import (
    RFC8489_TIMERS,
    RequestReceived,
    StunClientCore,
    TransactionResult,
    TransactionTimers,
)
from crossroads.proto.stun.constants import Class, Method
from crossroads.proto.stun.message import Message, decode, encode, request
from crossroads.transport.driver import DatagramDriver
from crossroads.types import Address, frozen, normalize_address

#: Shorter timers for discovery, where silence is an expected answer: sends at
#: 0, 0.2, 0.6, 1.4 s and gives up at 2.2 s (RFC 5780 §4 leaves timing to the
#: client; RFC 8489's 39.5 s would make each negative test last 40 s).
DISCOVERY_TIMERS = TransactionTimers(rto=0.2, rc=4, rm=4)

#: RFC 8489 §6.2.2: Ti, the TCP transaction timeout, "SHOULD be 39.5 seconds".
TCP_TIMEOUT = 39.5

__all__ = [
    "DISCOVERY_TIMERS",
    "RFC8489_TIMERS",
    "BindingResult",
    "FilteringBehavior",
    "MappingBehavior",
    "NatBehavior",
    "StunClient",
    "StunClientError",
    "StunErrorResponse",
    "StunTimeout",
    "TransactionTimers",
    "discover_nat",
    "stun_binding",
]


class StunClientError(CrossroadsError):
    """A STUN transaction did not produce a usable answer."""


class StunTimeout(StunClientError):
    """No response before the retransmission schedule ran out."""


class StunErrorResponse(StunClientError):
    """The server answered with an error response."""

    def __init__(self, code: int, reason: str, response: Message) -> None:
        super().__init__(f"STUN error {code}: {reason}")
        self.code = code
        self.reason = reason
        self.response = response


@frozen
class BindingResult:
    """The answer to one Binding request."""

    #: Our address as the server saw it (XOR-MAPPED-ADDRESS, or MAPPED-ADDRESS
    #: from an RFC 3489 server).
    mapped: Address
    #: The local socket address the request was sent from.
    local: Address
    #: Where the request was sent.
    server: Address
    #: Where the response came from (the packet's source address).
    source: Address
    #: RFC 5780 RESPONSE-ORIGIN / OTHER-ADDRESS, when the server sent them.
    response_origin: Address | None
    other_address: Address | None
    #: SOFTWARE of the server, if given.
    software: str | None
    #: Seconds from the first transmission to the response.
    rtt: float
    #: Transmissions needed (1 = no retransmission).
    transmissions: int
    #: The whole response, for anything else.
    response: Message


class MappingBehavior(StrEnum):
    """RFC 4787 §4.1 mapping behaviour, as tested by RFC 5780 §4.3."""

    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


class FilteringBehavior(StrEnum):
    """RFC 4787 §5 filtering behaviour, as tested by RFC 5780 §4.4."""

    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


@frozen
class NatBehavior:
    """What RFC 5780 discovery found.

    ``mapping``/``filtering`` are None when they could not be tested: the server
    sent no OTHER-ADDRESS (it has no second IP, RFC 5780 §6), or a test needed
    for the answer was not answered at all (``notes`` says which).
    """

    #: Reflexive address from the first test, and the local socket it was for.
    mapped: Address
    local: Address
    #: True when the mapped address differs from the local one (a NAT, or at
    #: least an address translation, is on the path).
    behind_nat: bool
    #: The server's OTHER-ADDRESS, None if it does not support RFC 5780.
    other_address: Address | None
    mapping: MappingBehavior | None
    filtering: FilteringBehavior | None
    #: True: a request sent to our own mapped address came back to us; False: it
    #: did not; None: not tested.
    hairpinning: bool | None
    #: Human-readable remarks on how the answers were reached.
    notes: tuple[str, ...] = ()

    @property
    def rfc5780_supported(self) -> bool:
        """Whether the server advertised an alternate address."""
        return self.other_address is not None


# ------------------------------------------------------------------ transport


class _Protocol(DatagramDriver):
    """Runs a :class:`StunClientCore` on one UDP socket (the project's driver)
    and hands its events to the waiting transactions."""

    core: StunClientCore

    def __init__(self, core: StunClientCore) -> None:
        super().__init__(core, self._dispatch)
        self.waiters: dict[bytes, asyncio.Future[TransactionResult]] = {}
        self.requests: asyncio.Queue[RequestReceived] = asyncio.Queue(maxsize=64)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and the like: the transaction will time out.
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for future in self.waiters.values():
            if not future.done():
                future.cancel()

    def _dispatch(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, TransactionResult):
                future = self.waiters.pop(event.transaction_id, None)
                if future is not None and not future.done():
                    future.set_result(event)
            elif not self.requests.full():
                self.requests.put_nowait(event)


def _address(attr: Any) -> Address | None:
    return None if attr is None else (attr.host, attr.port)


async def _resolve(server: Address, family: int = 0) -> Address:
    """Resolve a host name to one address (an IP literal is returned as is)."""
    host, port = server
    try:
        ipaddress.ip_address(host)
        return host, port
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
    if not infos:
        raise StunClientError(f"cannot resolve {host}")
    sockaddr = infos[0][4]
    return str(sockaddr[0]), int(sockaddr[1])


def _route_source(dest: Address) -> str | None:
    """The local IP the OS would use towards ``dest`` (connect() on a UDP socket
    sends nothing)."""
    family = socket.AF_INET6 if ":" in dest[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(dest)
        except OSError:
            return None
        return str(normalize_address(probe.getsockname())[0])


def _wildcard_for(host: str) -> str:
    return "::" if ipaddress.ip_address(host).version == 6 else "0.0.0.0"


@dataclass(eq=False)
class StunClient:
    """A STUN client bound to one local UDP socket.

    Open with :meth:`open`; use as an async context manager or call
    :meth:`close`. Every request made through one client shares its socket, so
    they all see the same NAT mapping.
    """

    _transport: asyncio.DatagramTransport
    _protocol: _Protocol
    local: Address

    @classmethod
    async def open(cls, local: Address = ("0.0.0.0", 0)) -> StunClient:
        """Bind a UDP socket on ``local`` (host, port; port 0 = any)."""
        loop = asyncio.get_running_loop()
        core = StunClientCore(random_bytes=os.urandom)
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _Protocol(core), local_addr=local
        )
        sockname = normalize_address(transport.get_extra_info("sockname"))
        return cls(transport, protocol, sockname)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; pending requests are cancelled."""
        self._transport.close()

    async def request(
        self,
        server: Address,
        attributes: list[Attribute] | tuple[Attribute, ...] = (),
        *,
        method: int = Method.BINDING,
        timers: TransactionTimers = RFC8489_TIMERS,
        integrity_key: bytes | None = None,
    ) -> TransactionResult:
        """Run one transaction; the result holds the response or ``None`` on
        timeout (this method does not raise on timeout or error responses)."""
        loop = asyncio.get_running_loop()
        dest = await _resolve(server)
        now = loop.time()
        txid = self._protocol.core.start_request(
            dest,
            now,
            attributes,
            method=method,
            timers=timers,
            integrity_key=integrity_key,
        )
        future: asyncio.Future[TransactionResult] = loop.create_future()
        self._protocol.waiters[txid] = future
        self._protocol.transmit(now)
        try:
            return await future
        finally:
            self._protocol.waiters.pop(txid, None)
            self._protocol.core.cancel(txid)

    async def binding(
        self,
        server: Address,
        *,
        change_ip: bool = False,
        change_port: bool = False,
        timers: TransactionTimers = RFC8489_TIMERS,
    ) -> BindingResult:
        """One Binding request; CHANGE-REQUEST flags for RFC 5780 tests.

        Raises:
            StunTimeout: no answer.
            StunErrorResponse: the server answered with an error.
        """
        attributes: list[Attribute] = []
        if change_ip or change_port:
            attributes.append(ChangeRequest(change_ip, change_port))
        dest = await _resolve(server)
        result = await self.request(dest, attributes, timers=timers)
        return _binding_result(result, self.local, dest)

    async def hairpin(self, mapped: Address, timeout: float = 2.0) -> bool:
        """Send a Binding request to our own mapped address and report whether
        it comes back to this socket (RFC 5780 §4.7 hairpinning test)."""
        loop = asyncio.get_running_loop()
        txid = self._protocol.core.start_request(
            mapped, loop.time(), timers=TransactionTimers(rto=timeout / 4, rc=2, rm=2)
        )
        self._protocol.transmit(loop.time())
        deadline = loop.time() + timeout
        try:
            while (remaining := deadline - loop.time()) > 0:
                try:
                    event = await asyncio.wait_for(
                        self._protocol.requests.get(), remaining
                    )
                except TimeoutError:
                    return False
                if event.message.transaction_id == txid:
                    return True
            return False
        finally:
            self._protocol.core.cancel(txid)


def _binding_result(
    result: TransactionResult, local: Address, server: Address
) -> BindingResult:
    response = result.response
    if response is None:
        raise StunTimeout(
            f"no STUN response from {server[0]}:{server[1]} after "
            f"{result.transmissions} transmissions"
        )
    return _binding_from_message(
        response,
        local=local,
        server=server,
        source=result.source or server,
        rtt=result.finished - result.started,
        transmissions=result.transmissions,
    )


def _binding_from_message(
    response: Message,
    *,
    local: Address,
    server: Address,
    source: Address,
    rtt: float,
    transmissions: int,
) -> BindingResult:
    if response.msg_class is Class.ERROR:
        error = response.error
        code, reason = (error.code, error.reason) if error else (0, "no ERROR-CODE")
        raise StunErrorResponse(code, reason, response)
    mapped = _address(response.get(XorMappedAddress)) or _address(
        response.get(MappedAddress)
    )
    if mapped is None:
        raise StunClientError("Binding response without (XOR-)MAPPED-ADDRESS")
    software = response.get(Software)
    return BindingResult(
        mapped=mapped,
        local=local,
        server=server,
        source=source,
        response_origin=_address(response.get(ResponseOrigin)),
        other_address=_address(response.get(OtherAddress)),
        software=software.value if software else None,
        rtt=rtt,
        transmissions=transmissions,
        response=response,
    )


async def _tcp_binding(
    server: Address, local: Address | None, timeout: float
) -> BindingResult:
    loop = asyncio.get_running_loop()
    dest = await _resolve(server)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(dest[0], dest[1], local_addr=local), timeout
    )
    try:
        sockname = normalize_address(writer.get_extra_info("sockname"))
        message = request(Method.BINDING, os.urandom(12))
        started = loop.time()
        writer.write(encode(message, fingerprint=True))
        await writer.drain()
        # RFC 8489 §6.2.2: one transmission, Ti to wait; RFC 8489 §6.2 framing:
        # read the header, then its length.
        while True:
            header = await asyncio.wait_for(reader.readexactly(20), timeout)
            body = await asyncio.wait_for(
                reader.readexactly(int.from_bytes(header[2:4], "big")), timeout
            )
            try:
                response = decode(header + body)
            except DecodeError as exc:
                raise StunClientError(f"bad response over TCP: {exc}") from None
            if response.transaction_id == message.transaction_id:
                break
        return _binding_from_message(
            response,
            local=sockname,
            server=dest,
            source=dest,
            rtt=loop.time() - started,
            transmissions=1,
        )
    except (TimeoutError, asyncio.IncompleteReadError) as exc:
        raise StunTimeout(f"no STUN response over TCP from {dest}: {exc!r}") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def stun_binding(
    server: Address,
    *,
    transport: Literal["udp", "tcp"] = "udp",
    local: Address | None = None,
    timers: TransactionTimers = RFC8489_TIMERS,
    tcp_timeout: float = TCP_TIMEOUT,
) -> BindingResult:
    """One Binding request to ``server`` over UDP (with RFC 8489 retransmissions)
    or TCP (one request on a fresh connection, Ti = 39.5 s)."""
    if transport == "tcp":
        return await _tcp_binding(server, local, tcp_timeout)
    dest = await _resolve(server)
    local = local or (_wildcard_for(dest[0]), 0)
    async with await StunClient.open(local) as client:
        result = await client.binding(dest, timers=timers)
    if ipaddress.ip_address(result.local[0]).is_unspecified:
        # Report the address the OS actually sent from, not the wildcard bind.
        routed = _route_source(dest)
        if routed is not None:
            result = dataclasses.replace(result, local=(routed, result.local[1]))
    return result


async def _try_binding(
    client: StunClient, server: Address, timers: TransactionTimers, **flags: bool
) -> BindingResult | None:
    try:
        return await client.binding(server, timers=timers, **flags)
    except StunTimeout:
        return None


async def discover_nat(
    server: Address,
    *,
    local_host: str | None = None,
    timers: TransactionTimers = DISCOVERY_TIMERS,
    hairpinning: bool = True,
) -> NatBehavior:
    """RFC 5780 §4 NAT behaviour discovery against one RFC 5780 server.

    Filtering tests run first, on a fresh socket, because they are sensitive to
    earlier traffic (§4.4, §4.1); mapping tests then use a second fresh socket.

    - Filtering (§4.4): test I Binding to the primary address; test II with
      CHANGE-REQUEST change-IP + change-port: an answer means endpoint-
      independent filtering; else test III with change-port only: an answer
      means address-dependent, silence address-and-port-dependent.
    - Mapping (§4.3): test I to the primary address gives M1 and OTHER-ADDRESS
      (A2:P2); test II to A2:P1: same mapping as M1 means endpoint-independent;
      else test III to A2:P2: same as test II means address-dependent, else
      address-and-port-dependent.
    - Hairpinning (§4.7 idea): a Binding request to our own mapped address
      arriving back on the socket.

    Raises:
        StunTimeout: the server did not answer test I (no UDP connectivity).
    """
    dest = await _resolve(server)
    host = local_host or _wildcard_for(dest[0])
    notes: list[str] = []

    async with await StunClient.open((host, 0)) as client:
        first = await client.binding(dest, timers=timers)
        other = first.other_address
        filtering: FilteringBehavior | None = None
        if other is None:
            notes.append("server sent no OTHER-ADDRESS: it does not support RFC 5780")
        else:
            both = await _try_binding(
                client, dest, timers, change_ip=True, change_port=True
            )
            if both is not None:
                filtering = FilteringBehavior.ENDPOINT_INDEPENDENT
            else:
                port_only = await _try_binding(client, dest, timers, change_port=True)
                filtering = (
                    FilteringBehavior.ADDRESS_DEPENDENT
                    if port_only is not None
                    else FilteringBehavior.ADDRESS_AND_PORT_DEPENDENT
                )

    mapping: MappingBehavior | None = None
    hairpin: bool | None = None
    async with await StunClient.open((host, 0)) as client:
        one = await client.binding(dest, timers=timers)
        if other is not None:
            alt_ip_primary_port = (other[0], dest[1])
            two = await _try_binding(client, alt_ip_primary_port, timers)
            if two is None:
                notes.append("no answer from the alternate IP: mapping unknown")
            elif two.mapped == one.mapped:
                mapping = MappingBehavior.ENDPOINT_INDEPENDENT
            else:
                three = await _try_binding(client, other, timers)
                if three is None:
                    notes.append(
                        "no answer from the alternate address: mapping unknown"
                    )
                elif three.mapped == two.mapped:
                    mapping = MappingBehavior.ADDRESS_DEPENDENT
                else:
                    mapping = MappingBehavior.ADDRESS_AND_PORT_DEPENDENT
        if hairpinning:
            hairpin = await client.hairpin(one.mapped, timeout=timers.total)

    local = first.local
    if ipaddress.ip_address(local[0]).is_unspecified:
        routed = _route_source(dest)
        if routed is not None:
            local = (routed, local[1])
    return NatBehavior(
        mapped=first.mapped,
        local=local,
        behind_nat=first.mapped != local,
        other_address=other,
        mapping=mapping,
        filtering=filtering,
        hairpinning=hairpin,
        notes=tuple(notes),
    )
