"""An asyncio TURN client (RFC 8656) over UDP, TCP, TLS or DTLS.

Used by the NAT lab, the SDK's relay fallback and the tests; it talks to any
standard TURN server (crossroads, coturn, ...)::

    from crossroads.client.turn import TurnClient

    async with await TurnClient.connect(("203.0.113.1", 3478), "alice", "secret") as turn:
        relayed = await turn.allocate()            # our address on the relay
        await turn.create_permission("198.51.100.7")
        await turn.bind_channel(("198.51.100.7", 5000))   # optional: 4-byte framing
        await turn.send(b"hello", ("198.51.100.7", 5000))
        data, peer = await turn.receive(timeout=5)

What it does for you:

- the long-term credential dance (401 -> REALM/NONCE -> signed retry; 438 ->
  new nonce), with SHA-256 keys and MESSAGE-INTEGRITY-SHA256 when the server
  offers them (RFC 8489 PASSWORD-ALGORITHMS), MD5/SHA-1 otherwise; responses are
  checked for integrity;
- request retransmission over UDP (RFC 8489 §6.2.1 schedule, bounded by
  ``timeout``);
- refreshing in the background: the allocation before it expires, permissions
  every 4 minutes (they last 5), channel bindings every 9 minutes (they last 10);
- ``send`` uses the channel when one is bound to the peer, a Send indication
  otherwise; ``receive`` returns ChannelData and Data indications alike.

Time-limited (coturn "REST API") credentials are just a username and password:
build them with :func:`rest_credentials`.

TURN over TLS: ``transport="tcp", tls=ssl_context``; TURN over DTLS:
``transport="udp", dtls=crossroads.transport.dtls.client_context(cafile)``
(RFC 8656 §3, both on port 5349).

Not supported: RFC 6062 TCP relays (Connect / ConnectionBind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from OpenSSL import SSL

from crossroads.errors import CrossroadsError, DecodeError
from crossroads.proto.stun import (
    AdditionalAddressFamily,
    AlternateServer,
    Attribute,
    ChannelNumber,
    Class,
    Data,
    DontFragment,
    ErrorCodeAttribute,
    EvenPort,
    Lifetime,
    Message,
    Method,
    RequestedAddressFamily,
    RequestedTransport,
    ReservationToken,
    XorMappedAddress,
    XorPeerAddress,
    XorRelayedAddress,
    decode,
    encode,
)
from crossroads.proto.turn.auth import rest_password
from crossroads.proto.turn.channeldata import (
    StreamFramer,
    encode_channel_data,
    parse_channel_data,
)
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.transport.dtls import DtlsConnection, dtls_connect
from crossroads.transport.tasks import cancel_and_wait
from crossroads.types import Address

log = logging.getLogger("crossroads.client.turn")

#: RFC 8489 §6.2.1: initial RTO 500 ms, doubled each retransmission.
INITIAL_RTO = 0.5
#: Refresh a permission this long after installing it (they last 300 s).
PERMISSION_REFRESH = 240.0
#: Refresh a channel binding this long after binding it (they last 600 s).
CHANNEL_REFRESH = 540.0
#: Received datagrams kept for :meth:`TurnClient.receive`; older ones are
#: dropped when nobody reads (bounded memory).
RECEIVE_QUEUE = 4096


class TurnClientError(CrossroadsError):
    """A TURN request failed; ``code`` is the STUN error code (0: no answer)."""

    def __init__(
        self, code: int, reason: str, alternate: Address | None = None
    ) -> None:
        super().__init__(f"{code} {reason}" if code else reason)
        self.code = code
        self.reason = reason
        #: ALTERNATE-SERVER of an authenticated 300 Try Alternate (RFC 8489
        #: §10): where to send the request instead; None otherwise.
        self.alternate = alternate


class TurnTimeout(TurnClientError):
    """No answer from the server in time."""

    def __init__(self, what: str) -> None:
        super().__init__(0, f"no answer to {what}")


def rest_credentials(
    secret: str, user: str = "", ttl: float = 86400.0, separator: str = ":"
) -> tuple[str, str]:
    """coturn-compatible time-limited credentials: ``(username, password)``."""
    expiry = int(time.time() + ttl)
    username = f"{expiry}{separator}{user}" if user else str(expiry)
    return username, rest_password(secret, username)


#: Redirects one allocation follows at most (RFC 8489 §10 leaves the bound to
#: the client; a loop of servers naming each other must end).
MAX_REDIRECTS = 3


async def allocate_following(
    server: Address,
    username: str,
    password: str,
    *,
    transport: Literal["udp", "tcp"] = "udp",
    timeout: float = 10.0,
    lifetime: int | None = None,
) -> TurnClient:
    """Connect and allocate, following 300 Try Alternate to the server its
    ALTERNATE-SERVER names (RFC 8656 §7.2, RFC 8489 §10: a draining or full
    server redirects new allocations), at most :data:`MAX_REDIRECTS` times
    and never to a server already tried. Returns the client of the server
    that allocated (its :attr:`TurnClient.server`).

    Raises:
        TurnClientError: the last server's error (a 300 beyond the bound too).
    """
    tried: set[Address] = set()
    while True:
        tried.add(server)
        client = await TurnClient.connect(
            server, username, password, transport=transport, timeout=timeout
        )
        try:
            await client.allocate(lifetime=lifetime)
            return client
        except TurnClientError as exc:
            await client.close()
            alternate = exc.alternate
            if alternate is None or alternate in tried or len(tried) > MAX_REDIRECTS:
                raise
            server = alternate
        except BaseException:
            await client.close()
            raise


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, client: TurnClient) -> None:
        self.client = client

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.client._received(data)

    def error_received(self, exc: Exception) -> None:
        log.debug("TURN client socket error: %s", exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost()


class _Tcp(asyncio.Protocol):
    def __init__(self, client: TurnClient) -> None:
        self.client = client
        self.framer = StreamFramer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.framer.feed(data)
        except DecodeError:
            if self.transport is not None:
                self.transport.close()
            return
        for _is_channel, frame in frames:
            self.client._received(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost()


@dataclass(eq=False)
class TurnClient:
    """One TURN allocation's client side. Create with :meth:`connect`."""

    server: Address
    session: LongTermSession = field(repr=False)
    transport_kind: Literal["udp", "tcp"]
    #: Seconds to wait for the answer to one request (all retransmissions).
    timeout: float
    relayed: Address | None = field(default=None, init=False)
    #: Every relayed address of the allocation (two for a dual allocation).
    relayed_addresses: list[Address] = field(default_factory=list, init=False)
    mapped: Address | None = field(default=None, init=False)
    lifetime: int = field(default=0, init=False)
    reservation_token: bytes | None = field(default=None, init=False)
    channels: dict[Address, int] = field(default_factory=dict, init=False)
    _peers: dict[int, Address] = field(default_factory=dict, init=False)
    _permissions: dict[str, float] = field(default_factory=dict, init=False)
    _channel_times: dict[int, float] = field(default_factory=dict, init=False)
    _pending: dict[bytes, asyncio.Future[tuple[Message, bytes]]] = field(
        default_factory=dict, init=False
    )
    _queue: asyncio.Queue[tuple[bytes, Address]] = field(
        default_factory=lambda: asyncio.Queue(RECEIVE_QUEUE), init=False
    )
    _udp: asyncio.DatagramTransport | None = field(default=None, init=False)
    _tcp: asyncio.Transport | None = field(default=None, init=False)
    _dtls: DtlsConnection | None = field(default=None, init=False)
    _refresher: asyncio.Task[None] | None = field(default=None, init=False)
    _allocation_deadline: float = field(default=0.0, init=False)
    _closed: bool = field(default=False, init=False)
    _next_channel: int = field(default=0x4000, init=False)
    #: Datagrams dropped because nobody called :meth:`receive`.
    dropped: int = field(default=0, init=False)

    def renew_credentials(self, username: str, password: str) -> None:
        """Sign later requests (refreshes, permissions, channels) with fresh
        time-limited credentials of the same user, before the old ones expire.

        crossroads' TURN server accepts them for the allocation (see
        :meth:`crossroads.proto.turn.server.TurnServer`); an RFC 8656 server
        that does not answers 441, so renew only when the old credentials are
        about to expire anyway.
        """
        self.session.renew(username, password)

    # ------------------------------------------------------------ setup

    @classmethod
    async def connect(
        cls,
        server: Address,
        username: str,
        password: str,
        *,
        transport: Literal["udp", "tcp"] = "udp",
        local: Address | None = None,
        timeout: float = 10.0,
        prefer_sha256: bool = True,
        tls: ssl.SSLContext | None = None,
        dtls: SSL.Context | None = None,
        server_hostname: str | None = None,
    ) -> TurnClient:
        """Open the client-server connection (no allocation yet).

        With ``tls`` (and ``transport="tcp"``) the connection is TURN over TLS
        (RFC 8656 §3, port 5349), with ``dtls`` (and ``transport="udp"``) TURN
        over DTLS; ``server_hostname`` is the name the server certificate is
        checked against (default: the server's address).
        """
        loop = asyncio.get_running_loop()
        session = LongTermSession(username, password, prefer_sha256=prefer_sha256)
        client = cls(server, session, transport, timeout)
        if transport == "udp" and dtls is not None:
            client._dtls = await dtls_connect(
                server,
                dtls,
                client._received,
                client._lost,
                server_hostname=server_hostname,
                local=local,
                timeout=timeout,
            )
        elif transport == "udp":
            udp, _ = await loop.create_datagram_endpoint(
                lambda: _Udp(client), local_addr=local, remote_addr=server
            )
            client._udp = udp
        else:
            tcp, _ = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Tcp(client),
                    server[0],
                    server[1],
                    local_addr=local,
                    ssl=tls,
                    server_hostname=(server_hostname or server[0]) if tls else None,
                ),
                timeout,
            )
            client._tcp = tcp
        return client

    @classmethod
    async def on_socket(
        cls,
        sock: socket.socket,
        server: Address,
        username: str,
        password: str,
        *,
        transport: Literal["udp", "tcp"] = "udp",
        timeout: float = 10.0,
    ) -> TurnClient:
        """Like :meth:`connect`, on a socket the caller made (e.g. inside a
        network namespace): a UDP socket connected to ``server``, or a TCP
        socket already connected to it. The client owns it from then on."""
        loop = asyncio.get_running_loop()
        client = cls(server, LongTermSession(username, password), transport, timeout)
        if transport == "udp":
            client._udp, _ = await loop.create_datagram_endpoint(
                lambda: _Udp(client), sock=sock
            )
        else:
            client._tcp, _ = await loop.create_connection(
                lambda: _Tcp(client), sock=sock
            )
        return client

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def local_address(self) -> Address:
        """Our end of the client-server connection."""
        transport: asyncio.BaseTransport | None = self._udp or self._tcp
        if self._dtls is not None:
            transport = self._dtls.udp
        assert transport is not None
        sockname = transport.get_extra_info("sockname")
        return sockname[0], sockname[1]

    # ------------------------------------------------------------ wire

    def _write(self, data: bytes) -> None:
        if self._udp is not None:
            self._udp.sendto(data)
        elif self._dtls is not None:
            self._dtls.send(data)
        elif self._tcp is not None:
            self._tcp.write(data)

    def _received(self, data: bytes) -> None:
        if not data:
            return
        if 0x40 <= data[0] < 0x80:
            try:
                message = parse_channel_data(data)
            except DecodeError:
                return
            peer = self._peers.get(message.channel)
            if peer is not None:
                self._deliver(message.data, peer)
            return
        try:
            msg = decode(data)
        except DecodeError:
            return
        if msg.msg_class in (Class.SUCCESS, Class.ERROR):
            future = self._pending.pop(msg.transaction_id, None)
            if future is not None and not future.done():
                future.set_result((msg, data))
        elif msg.msg_class == Class.INDICATION and msg.method == Method.DATA:
            source = msg.get(XorPeerAddress)
            payload = msg.get(Data)
            if source is not None and payload is not None:
                self._deliver(payload.value, (source.host, source.port))

    def _deliver(self, data: bytes, peer: Address) -> None:
        try:
            self._queue.put_nowait((data, peer))
        except asyncio.QueueFull:
            self.dropped += 1

    def _lost(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(TurnClientError(0, "connection lost"))
        self._pending.clear()

    async def _transact(self, wire: bytes, txid: bytes) -> tuple[Message, bytes]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Message, bytes]] = loop.create_future()
        self._pending[txid] = future
        deadline = loop.time() + self.timeout
        rto = INITIAL_RTO
        try:
            while True:
                self._write(wire)
                wait = deadline - loop.time()
                if self._tcp is None:
                    wait = min(wait, rto)  # RFC 8489 §6.2.1: retransmit over UDP
                if wait <= 0:
                    raise TurnTimeout("request")
                try:
                    return await asyncio.wait_for(asyncio.shield(future), wait)
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise TurnTimeout("request") from None
                    rto *= 2
        finally:
            self._pending.pop(txid, None)
            if not future.done():
                future.cancel()

    async def request(
        self, method: int, attributes: Iterable[Attribute] = ()
    ) -> Message:
        """Send a request and return the success response.

        Handles 401 (learn realm/nonce, sign, retry) and 438 (new nonce, retry).

        Raises:
            TurnClientError: an error response (``code``) or no answer.
        """
        attrs = tuple(attributes)
        for _attempt in range(3):
            txid = os.urandom(12)
            message = Message(Class.REQUEST, method, txid, attrs)
            signed = self.session.ready
            if signed:
                wire = self.session.sign(message)
            else:
                wire = encode(message, fingerprint=True)
            answer, raw = await self._transact(wire, txid)
            if answer.msg_class == Class.SUCCESS:
                if self.session.ready and not self.session.verify(raw, answer):
                    raise TurnClientError(0, "response failed the integrity check")
                return answer
            error = answer.get(ErrorCodeAttribute)
            code = error.code if error else 0
            if code == 401 and signed:
                break  # a signed request was refused: wrong credentials
            if code in (401, 438) and self.session.learn(answer):
                continue
            raise TurnClientError(
                code,
                error.reason if error else "error",
                self._alternate(answer, raw) if code == 300 else None,
            )
        raise TurnClientError(401, "Unauthenticated")

    def _alternate(self, answer: Message, raw: bytes) -> Address | None:
        """The ALTERNATE-SERVER of a 300, trusted only when the answer is
        signed with our credentials (RFC 8489 §10: with authentication, a 300
        without valid MESSAGE-INTEGRITY is discarded; else anyone on the path
        could send us elsewhere)."""
        alternate = answer.get(AlternateServer)
        if alternate is None or not self.session.ready:
            return None
        if not self.session.verify(raw, answer):
            return None
        return (alternate.host, alternate.port)

    # ------------------------------------------------------------ TURN

    async def allocate(
        self,
        *,
        lifetime: int | None = None,
        family: Literal["ipv4", "ipv6"] | None = None,
        dual: bool = False,
        even_port: bool | None = None,
        reservation_token: bytes | None = None,
        dont_fragment: bool = False,
    ) -> Address:
        """Allocate a UDP relay; returns the (first) relayed address.

        ``even_port`` True/False asks for an even port (True also reserves the
        next one: see :attr:`reservation_token`); ``dual`` asks for IPv4 and
        IPv6 (RFC 8656 ADDITIONAL-ADDRESS-FAMILY).
        """
        attrs: list[Attribute] = [RequestedTransport(17)]
        if lifetime is not None:
            attrs.append(Lifetime(lifetime))
        if family is not None:
            attrs.append(RequestedAddressFamily(1 if family == "ipv4" else 2))
        if dual:
            attrs.append(AdditionalAddressFamily(2))
        if even_port is not None:
            attrs.append(EvenPort(even_port))
        if reservation_token is not None:
            attrs.append(ReservationToken(reservation_token))
        if dont_fragment:
            attrs.append(DontFragment())
        answer = await self.request(Method.ALLOCATE, attrs)
        self.relayed_addresses = [
            (a.host, a.port) for a in answer.get_all(XorRelayedAddress)
        ]
        if not self.relayed_addresses:
            raise TurnClientError(0, "Allocate success without XOR-RELAYED-ADDRESS")
        self.relayed = self.relayed_addresses[0]
        mapped = answer.get(XorMappedAddress)
        self.mapped = (mapped.host, mapped.port) if mapped else None
        granted = answer.get(Lifetime)
        self.lifetime = granted.value if granted else 600
        token = answer.get(ReservationToken)
        self.reservation_token = token.value if token else None
        self._allocation_deadline = time.monotonic() + self.lifetime
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop())
        return self.relayed

    async def refresh(self, lifetime: int | None = None) -> int:
        """Refresh the allocation; ``lifetime=0`` deletes it. Returns the lifetime."""
        attrs: list[Attribute] = [] if lifetime is None else [Lifetime(lifetime)]
        answer = await self.request(Method.REFRESH, attrs)
        granted = answer.get(Lifetime)
        self.lifetime = granted.value if granted else 0
        self._allocation_deadline = time.monotonic() + self.lifetime
        return self.lifetime

    async def create_permission(self, *peers: str | Address) -> None:
        """Allow data to and from these peer IPs (ports are ignored, RFC 8656 §9)."""
        hosts = [p if isinstance(p, str) else p[0] for p in peers]
        await self.request(
            Method.CREATE_PERMISSION, [XorPeerAddress(host, 0) for host in hosts]
        )
        now = time.monotonic()
        for host in hosts:
            self._permissions[host] = now

    async def bind_channel(self, peer: Address, number: int | None = None) -> int:
        """Bind a channel to ``peer`` (also installs its permission)."""
        peer = (peer[0], peer[1])
        if number is None:
            number = self.channels.get(peer)
        if number is None:
            number = self._next_channel
            self._next_channel += 1
        await self.request(
            Method.CHANNEL_BIND, [ChannelNumber(number), XorPeerAddress(*peer)]
        )
        self.channels[peer] = number
        self._peers[number] = peer
        now = time.monotonic()
        self._channel_times[number] = now
        self._permissions[peer[0]] = now
        return number

    async def send(self, data: bytes, peer: Address) -> None:
        """Send ``data`` to ``peer`` through the relay (no delivery guarantee)."""
        peer = (peer[0], peer[1])
        number = self.channels.get(peer)
        if number is not None:
            self._write(encode_channel_data(number, data, pad=self._tcp is not None))
            return
        message = Message(
            Class.INDICATION,
            Method.SEND,
            os.urandom(12),
            (XorPeerAddress(*peer), Data(data)),
        )
        self._write(encode(message))

    async def receive(self, timeout: float | None = None) -> tuple[bytes, Address]:
        """The next datagram from any peer: ``(data, peer address)``.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def close(self) -> None:
        """Delete the allocation (best effort) and close the connection."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            await cancel_and_wait(self._refresher)
        if self.relayed is not None:
            saved, self.timeout = self.timeout, min(self.timeout, 2.0)
            with contextlib.suppress(TurnClientError, OSError):
                await self.refresh(0)
            self.timeout = saved
        for transport in (self._udp, self._tcp):
            if transport is not None:
                transport.close()
        if self._dtls is not None:
            self._dtls.close()

    # ------------------------------------------------------------ refreshing

    async def _refresh_loop(self) -> None:
        while True:
            now = time.monotonic()
            # Refresh the allocation a minute early (or at 80 % when short).
            allocation_due = self._allocation_deadline - min(60.0, self.lifetime * 0.2)
            permission_due = min(
                (t + PERMISSION_REFRESH for t in self._permissions.values()),
                default=float("inf"),
            )
            channel_due = min(
                (t + CHANNEL_REFRESH for t in self._channel_times.values()),
                default=float("inf"),
            )
            wake = min(allocation_due, permission_due, channel_due)
            await asyncio.sleep(max(0.0, wake - now))
            now = time.monotonic()
            try:
                if allocation_due <= now:
                    await self.refresh()
                for number, stamp in list(self._channel_times.items()):
                    if stamp + CHANNEL_REFRESH <= now:
                        await self.bind_channel(self._peers[number], number)
                stale = [
                    h
                    for h, t in self._permissions.items()
                    if t + PERMISSION_REFRESH <= now
                ]
                if stale:
                    await self.create_permission(*stale)
            except TurnClientError as exc:
                log.warning("TURN refresh failed: %s", exc)
                await asyncio.sleep(5.0)
