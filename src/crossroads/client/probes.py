"""One-datagram probes of crossroads' UDP services, for ``crossroads doctor``.

Each probe sends what a real client of that protocol sends and waits for the
server's protocol answer, so an OK means the service itself answered, not only
that a port is open (UDP has no handshake to tell):

- Unity relay: a PING naming a random allocation ID is answered with ERROR 4
  (ALLOCATION_ID_NOT_FOUND) echoing that ID (reference unity-relay-and-raknet.md
  §1.1). 22 bytes in, 21 out: within every reflection budget.
- natneg: ADDRESS_CHECK, what NATify sends to learn its public address; the
  answer is ADDRESS_REPLY with the address the server saw (reference
  gamespy-natneg.md §3.2, §3.5). 73 bytes in, 21 out.
- RakNet: UNCONNECTED_PING, what ``RakPeer::Ping`` sends, answered with
  UNCONNECTED_PONG carrying the server's GUID (raknet-wire.md §1). 33 in, 33 out.
  Its port-stride socket gets the out-of-band ``ID_NAT_PING`` a client sends
  there, answered with ``ID_NAT_PONG`` from the main socket (§2). 30 in, 30 out.
- p2p rendezvous: a Probe with the token of a signalling ``welcome``, answered
  with Observed (docs/p2p-protocol.md §3); an unknown token gets no answer by
  design, so :func:`p2p_rendezvous` opens the WebSocket first.

Every answer is smaller than (or as large as) its question, so the doctor never
spends a server's reflection allowance. Each probe but the port-stride one uses
a *connected* UDP socket: the kernel then reports an ICMP port unreachable as an
error, so a port nobody listens on fails at once instead of after the timeout.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from crossroads.errors import CrossroadsError, DecodeError
from crossroads.proto.natneg import packets as nn
from crossroads.proto.punch import rendezvous as rv
from crossroads.proto.raknet import messages as rak
from crossroads.proto.raknet.punchthrough import NAT_PING, NAT_PONG
from crossroads.proto.relay import messages as relay
from crossroads.types import Address, frozen

T = TypeVar("T")

#: Tries per probe and seconds between them: three tries ride out a lost
#: datagram or two (what STUN's RFC 8489 §6.2.1 retransmissions are for) while a
#: dead service is reported within a few seconds.
TRIES = 3
INTERVAL = 1.0
#: natneg ADDRESS_CHECK mapping ids and port types by endpoint role, as NATify
#: sends them: map1a to natneg1 from port type 1, map2 to natneg2, map3 to
#: natneg3 (reference gamespy-natneg.md §3.5).
NATNEG_CHECKS: dict[str, tuple[nn.NatifyMapping, nn.PortType]] = {
    "natneg1": (nn.NatifyMapping.MAP1A, nn.PortType.NN1),
    "natneg2": (nn.NatifyMapping.MAP2, nn.PortType.NN2),
    "natneg3": (nn.NatifyMapping.MAP3, nn.PortType.NN3),
}


class ProbeError(CrossroadsError):
    """The service gave no (valid) answer; the message says what happened."""


class _Exchange(asyncio.DatagramProtocol, Generic[T]):
    def __init__(self, parse: Callable[[bytes], T | None]) -> None:
        self.parse = parse
        self.done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: Address) -> None:
        try:
            answer = self.parse(data)
        except DecodeError:
            return  # not the answer: keep waiting
        if answer is not None and not self.done.done():
            self.done.set_result(answer)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def exchange(
    server: Address,
    request: bytes,
    parse: Callable[[bytes], T | None],
    *,
    family: int = 0,
    tries: int = TRIES,
    interval: float = INTERVAL,
    connected: bool = True,
) -> tuple[T, Address]:
    """Send ``request`` to ``server`` up to ``tries`` times until ``parse``
    accepts an answer (returns non-None); (answer, local address) or
    :class:`ProbeError`. ``connected=False`` hears answers from any source
    (a service that answers from another port), at the price of no ICMP
    errors: a dead port then fails only after the tries."""
    loop = asyncio.get_running_loop()
    try:
        if connected:
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _Exchange(parse), remote_addr=server, family=family
            )
            destination = None
        else:
            found = await loop.getaddrinfo(
                *server, family=family, type=socket.SOCK_DGRAM
            )
            destination = found[0][4][:2]
            wildcard = "::" if found[0][0] == socket.AF_INET6 else "0.0.0.0"
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _Exchange(parse), local_addr=(wildcard, 0)
            )
    except OSError as exc:
        raise ProbeError(f"cannot send to {server[0]}:{server[1]}: {exc}") from None
    try:
        for _ in range(tries):
            transport.sendto(request, destination)
            try:
                answer = await asyncio.wait_for(asyncio.shield(protocol.done), interval)
            except TimeoutError:
                continue
            except ConnectionRefusedError:
                raise ProbeError("port unreachable (nothing listens)") from None
            except OSError as exc:
                raise ProbeError(str(exc)) from None
            local = transport.get_extra_info("sockname")
            return answer, (str(local[0]), int(local[1]))
        raise ProbeError(f"no answer to {tries} tries in {tries * interval:.0f} s")
    finally:
        transport.close()


@frozen
class Probe(Generic[T]):
    """One probe: the datagram to send and the parser of its answer (None: not
    the answer to this request; DecodeError: not this protocol)."""

    request: bytes
    parse: Callable[[bytes], T | None]


def relay_probe() -> Probe[int]:
    """A Unity Relay PING for a random (so unknown) allocation; the answer is
    the ERROR code that echoes that allocation ID (4 from a healthy relay)."""
    allocation_id = secrets.token_bytes(relay.ALLOCATION_ID_SIZE)

    def parse(data: bytes) -> int | None:
        match relay.decode(data):
            case relay.Error(allocation_id=echoed, code=code) if (
                echoed == allocation_id
            ):
                return code
            case _:
                return None

    return Probe(relay.Ping(allocation_id).encode(), parse)


def natneg_probe(role: str = "natneg1") -> Probe[Address]:
    """A v3 ADDRESS_CHECK as NATify sends it to endpoint ``role`` (natneg1-3),
    zero-filled to 73 bytes; the answer is the public address the server saw."""
    mapping, port_type = NATNEG_CHECKS[role]
    check = nn.AddressCheck(
        3, mapping, port_type, extra=bytes(nn.UNION_SIZE - nn.INIT_SIZE)
    )

    def parse(data: bytes) -> Address | None:
        reply = nn.decode(data)
        if isinstance(reply, nn.AddressReply) and reply.cookie == mapping:
            return (reply.ip, reply.port)
        return None

    return Probe(check.encode(), parse)


def raknet_probe() -> Probe[int]:
    """A RakNet UNCONNECTED_PING; the answer is the server GUID of the pong
    that echoes the ping's time."""
    ping_time = secrets.randbits(63)

    def parse(data: bytes) -> int | None:
        pong = rak.UnconnectedPong.decode(data)
        return pong.guid if pong.time == ping_time else None

    return Probe(rak.unconnected_ping(ping_time, secrets.randbits(64)), parse)


def raknet_stride_probe() -> Probe[int]:
    """RakNet's port-stride ``ID_NAT_PING`` (out of band, to the second
    socket; raknet-wire.md §2); the answer is the ``ID_NAT_PONG`` the server
    sends from its main socket, with the source port it saw. Padded by two
    bytes so that the pong (which adds that port) is no larger."""
    guid = secrets.randbits(64)
    reported = secrets.randbits(16)
    ping = bytes([NAT_PING]) + reported.to_bytes(2, "big") + bytes(2)

    def parse(data: bytes) -> int | None:
        if data[:1] != bytes([rak.MessageId.OUT_OF_BAND_INTERNAL]):
            return None
        pong = rak.OutOfBand.decode(data).payload
        if len(pong) < 5 or pong[0] != NAT_PONG or pong[1:3] != ping[1:3]:
            return None
        return int.from_bytes(pong[3:5], "big")

    return Probe(rak.OutOfBand(guid, ping).encode(), parse)


async def raknet_stride_ping(server: Address) -> int:
    """The source port the RakNet server saw a port-stride ping come from (its
    answer comes from the main port, so the socket is not connected)."""
    probe = raknet_stride_probe()
    port, _ = await exchange(server, probe.request, probe.parse, connected=False)
    return port


async def relay_ping(server: Address) -> int:
    """The ERROR code a Unity Relay answers :func:`relay_probe` with."""
    probe = relay_probe()
    code, _ = await exchange(server, probe.request, probe.parse)
    return code


async def natneg_address_check(server: Address, role: str = "natneg1") -> Address:
    """The public address a natneg endpoint (``role``: natneg1-3) saw."""
    probe = natneg_probe(role)
    # Every natneg address field is 4 bytes: the service speaks IPv4 only.
    seen, _ = await exchange(server, probe.request, probe.parse, family=socket.AF_INET)
    return seen


async def raknet_ping(server: Address) -> int:
    """The GUID of the RakNet server that answered :func:`raknet_probe`."""
    probe = raknet_probe()
    guid, _ = await exchange(server, probe.request, probe.parse)
    return guid


async def p2p_rendezvous(
    http_url: str, host: str = "", timeout: float = 10.0
) -> list[tuple[Address, Address | ProbeError]]:
    """Open the p2p signalling WebSocket under ``http_url``, then probe each
    rendezvous port the ``welcome`` lists with its token: per port, (where it
    was probed, the address the server saw or why not). A port listed on an
    unspecified address is probed on ``host`` (default: the URL's host).
    Signalling failures raise :class:`ProbeError`."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from crossroads.client.signalling import SignallingClient

    parts = urlsplit(http_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    client = SignallingClient(f"{scheme}://{parts.netloc}/p2p/v1/ws", lambda _: None)
    key = X25519PrivateKey.generate().public_key().public_bytes_raw()
    try:
        try:
            welcome = await client.connect(key, "crossroads doctor", timeout)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            raise ProbeError(f"signalling: {exc!r}") from None
        token = bytes.fromhex(welcome.token)
        results: list[tuple[Address, Address | ProbeError]] = []
        for index, endpoint in enumerate(welcome.udp):
            # An unspecified address means "where you reached the WebSocket".
            if endpoint.host in ("0.0.0.0", "::"):
                where = (host or parts.hostname or "127.0.0.1", endpoint.port)
            else:
                where = (endpoint.host, endpoint.port)

            def parse(data: bytes, index: int = index) -> Address | None:
                seen = rv.Observed.decode(data)
                return (seen.host, seen.port) if seen.index == index else None

            probe = rv.Probe(token, 0, index).encode()
            try:
                seen, _ = await exchange(where, probe, parse)
            except ProbeError as exc:
                results.append((where, exc))
                continue
            results.append((where, seen))
        return results
    finally:
        await client.close()
