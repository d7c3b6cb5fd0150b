"""A sans-I/O DTLS 1.2 client that checks the server's certificate: TURN over
DTLS (RFC 8656 §3, RFC 7350), as coturn and WebRTC stacks serve it.

Theory of operation
-------------------
The handshake and the record layer are OpenSSL's (pyOpenSSL), run on memory
BIOs: OpenSSL never touches a socket, the core hands it each datagram
(:meth:`DtlsClient.receive_datagram`) and reads back what it wrote, cut into
records and packed into datagrams of at most :data:`HANDSHAKE_MTU` bytes
(:meth:`DtlsClient.datagrams_to_send`). Certificate DTLS (ECDHE, X.509 chains)
is not ours to write again; the PSK client the Unity Relay needs is
(:mod:`crossroads.proto.dtls.client`, no certificate, our own record layer).

:meth:`start` sends the ClientHello (with SNI when the server is named by a
DNS name). OpenSSL answers a HelloVerifyRequest itself; when the handshake
completes, the certificate chain was verified by the context
(``SSL.VERIFY_PEER``) and the core checks that the certificate names the
server (RFC 6125, :func:`certificate_names_match`) before it reports
:class:`Connected`. Then :meth:`send` protects one datagram as one record
(RFC 8656 §3.1: one TURN message per record) and received records come out
as :class:`~crossroads.proto.dtls.handshake.ApplicationData` events. A fatal
alert or a failed check ends the handshake
(:class:`~crossroads.proto.dtls.handshake.HandshakeFailed`); the server's
close_notify, an error after the handshake or :meth:`close` end the
association (:class:`~crossroads.proto.dtls.handshake.Closed`).

Time: OpenSSL keeps the RFC 6347 §4.2.4.1 retransmission timer (1 s,
doubling) and tells how long is left (``DTLSv1_get_timeout``); the core turns
that into a deadline in the caller's ``now`` clock after every input, which is
:meth:`get_timer`. When it has passed, :meth:`handle_timer` lets OpenSSL
retransmit its flight. The client of a handshake that never completes is
stopped by its owner (``dtls_connect``'s timeout).
"""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import KW_ONLY, dataclass, field
from enum import IntEnum
from typing import Final

from cryptography import x509
from OpenSSL import SSL

from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.dtls.handshake import ApplicationData, Closed, HandshakeFailed
from crossroads.proto.dtls.wire import RECORD_HEADER_SIZE
from crossroads.types import Address, frozen

#: RFC 6347 §4.1 version number of DTLS 1.2 (OpenSSL's DTLS1_2_VERSION): DTLS
#: 1.0 is deprecated by RFC 8996, and every WebRTC stack and coturn speak 1.2.
DTLS_1_2: Final = 0xFEFD
#: Ciphertext MTU for the handshake flights: OpenSSL fragments the certificate
#: to fit. 1200 bytes fits IPv6's minimum MTU (1280) less the IP/UDP headers
#: with room for tunnels (the same choice as QUIC, RFC 9000 §14).
HANDSHAKE_MTU: Final = 1200
#: What one read from OpenSSL's memory BIO or record layer may return: a whole
#: datagram's worth (UDP's 64 KiB).
READ_SIZE: Final = 65536


def split_records(data: bytes) -> list[bytes]:
    """``data`` (what OpenSSL wrote to its memory BIO: whole records back to
    back) cut into records."""
    records = []
    at = 0
    while at + RECORD_HEADER_SIZE <= len(data):
        end = at + RECORD_HEADER_SIZE + int.from_bytes(data[at + 11 : at + 13], "big")
        records.append(data[at:end])
        at = end
    return records


def pack_datagrams(records: list[bytes], mtu: int = HANDSHAKE_MTU) -> list[bytes]:
    """Records packed into datagrams of at most ``mtu`` bytes (RFC 6347 §4.1.1:
    several records may share a datagram; a record is never split)."""
    datagrams: list[bytes] = []
    current = b""
    for record in records:
        if current and len(current) + len(record) > mtu:
            datagrams.append(current)
            current = b""
        current += record
    if current:
        datagrams.append(current)
    return datagrams


def certificate_names_match(certificate: x509.Certificate, name: str) -> bool:
    """RFC 6125: ``name`` (a DNS name or an IP address) is in the certificate's
    subjectAltName (a left-most ``*`` label matches one label)."""
    try:
        names = certificate.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value
    except x509.ExtensionNotFound:
        return False
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        ip = None
    if ip is not None:
        return ip in names.get_values_for_type(x509.IPAddress)
    wanted = name.lower().rstrip(".")
    for dns in names.get_values_for_type(x509.DNSName):
        pattern = dns.lower().rstrip(".")
        if pattern == wanted:
            return True
        if pattern.startswith("*.") and "." in wanted:
            if wanted.split(".", 1)[1] == pattern[2:]:
                return True
    return False


def is_ip(name: str) -> bool:
    """Whether ``name`` is an IP address (no SNI for those, RFC 6066 §3)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@frozen
class Connected:
    """The handshake completed and the server's certificate was accepted."""

    address: Address
    #: OpenSSL's name of the negotiated cipher suite (for logs).
    cipher: str


Event = Connected | ApplicationData | HandshakeFailed | Closed


class ClientState(IntEnum):
    HANDSHAKING = 0
    CONNECTED = 1
    FAILED = 2
    CLOSED = 3


@dataclass(eq=False)
class DtlsClient(Outbox[Datagram], EventQueue[Event]):
    """The client end of one DTLS association with certificates (module
    docstring): the one core API, its input and output in datagrams."""

    context: SSL.Context = field(repr=False)
    server: Address
    _: KW_ONLY
    #: The name the certificate must carry (a DNS name or an IP address; sent
    #: as SNI when a DNS name). None: any certificate the context accepts.
    server_hostname: str | None = None
    state: ClientState = field(default=ClientState.HANDSHAKING, init=False)
    connection: SSL.Connection = field(init=False, repr=False)
    _deadline: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        super().__init__()
        connection = self.connection = SSL.Connection(self.context)
        connection.set_ciphertext_mtu(HANDSHAKE_MTU)
        connection.set_connect_state()
        name = self.server_hostname
        if name and not is_ip(name):
            connection.set_tlsext_host_name(name.encode("idna"))

    # ------------------------------------------------------------- input

    def start(self, now: float) -> None:
        """Send the ClientHello."""
        self._advance(now)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        if self.state in (ClientState.FAILED, ClientState.CLOSED):
            return
        self.connection.bio_write(data)
        self._advance(now)

    def send(self, data: bytes, now: float) -> bool:
        """Protect ``data`` as one record; False before the handshake or after
        the end."""
        if self.state is not ClientState.CONNECTED:
            return False
        try:
            self.connection.send(data)
        except SSL.Error as exc:
            self._end(ClientState.CLOSED, f"send-failed: {exc!r}")
        self._flush()
        return self.state is ClientState.CONNECTED

    def close(self, now: float) -> None:
        """Send close_notify (when connected) and end the association."""
        if self.state is ClientState.CONNECTED:
            with contextlib.suppress(SSL.Error):
                self.connection.shutdown()
            self._flush()
        if self.state is ClientState.HANDSHAKING:
            self._end(ClientState.FAILED, "closed")
        elif self.state is ClientState.CONNECTED:
            self._end(ClientState.CLOSED, "closed")

    # ------------------------------------------------------------- timer

    def get_timer(self) -> float | None:
        return self._deadline

    def handle_timer(self, now: float) -> None:
        self._deadline = None
        if self.state is not ClientState.HANDSHAKING:
            return
        with contextlib.suppress(SSL.Error):
            self.connection.DTLSv1_handle_timeout()
        self._flush()
        self._arm(now)

    # ------------------------------------------------------------- inside

    def _advance(self, now: float) -> None:
        connection = self.connection
        try:
            if self.state is ClientState.HANDSHAKING:
                try:
                    connection.do_handshake()
                except SSL.WantReadError:
                    self._flush()
                    self._arm(now)
                    return
                self._deadline = None
                failed = self._name_mismatch()
                if failed is not None:
                    self._flush()
                    self._end(ClientState.FAILED, failed)
                    return
                self.state = ClientState.CONNECTED
                self._events.append(
                    Connected(self.server, connection.get_cipher_name() or "")
                )
            while True:
                try:
                    data = connection.recv(READ_SIZE)
                except SSL.WantReadError:
                    break
                if data:
                    self._events.append(ApplicationData(self.server, data))
        except SSL.ZeroReturnError:
            # The server's close_notify: answer with ours (RFC 5246 §7.2.1).
            with contextlib.suppress(SSL.Error):
                connection.shutdown()
            self._flush()
            self._end(ClientState.CLOSED, "close-notify")
            return
        except SSL.Error as exc:
            self._flush()
            handshaking = self.state is ClientState.HANDSHAKING
            self._end(
                ClientState.FAILED if handshaking else ClientState.CLOSED, repr(exc)
            )
            return
        self._flush()

    def _name_mismatch(self) -> str | None:
        name = self.server_hostname
        if name is None:
            return None
        peer = self.connection.get_peer_certificate()
        if peer is None or not certificate_names_match(peer.to_cryptography(), name):
            return f"certificate does not name {name}"
        return None

    def _arm(self, now: float) -> None:
        left = self.connection.DTLSv1_get_timeout()
        self._deadline = None if left is None else now + left

    def _flush(self) -> None:
        try:
            data = self.connection.bio_read(READ_SIZE)
        except SSL.WantReadError:
            return
        for datagram in pack_datagrams(split_records(data)):
            self._outbox.append((datagram, self.server))

    def _end(self, state: ClientState, reason: str) -> None:
        handshaking = self.state is ClientState.HANDSHAKING
        self.state = state
        self._deadline = None
        if handshaking:
            self._events.append(HandshakeFailed(self.server, reason))
        else:
            self._events.append(Closed(self.server, reason))
