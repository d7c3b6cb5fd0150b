"""Game Coordinator packets (TCP 3976): ids, messages, encoders and decoders.

Source of every layout: reference ``openttd-coordinator.md`` sections 3 and 4
(OpenTTD ``src/network/core/tcp_coordinator.h`` and ``network_coordinator.cpp``).

Two directions, two rules:

- Packets *to* the coordinator start with the sender's protocol version (u8), so
  they decode on their own: :func:`decode_peer_packet`.
- Packets *from* the coordinator carry no version: their layout follows the
  version of the peer they are sent to (no invite fields below 2, ...), so both
  :func:`encode_gc_packet` and :func:`decode_gc_packet` take that version.

Versions 1 to 6 are accepted; each packet type also has a minimum version (the
protocol version that introduced it), and a packet below it is a decode error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import IntEnum

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.openttd.gameinfo import (
    MAX_GAME_INFO_VERSION,
    GameInfo,
    NewGRF,
    NewGRFSerialization,
    decode_game_info,
    encode_game_info,
)
from crossroads.proto.openttd.wire import (
    COMPAT_MTU,
    ERROR_DETAIL_LENGTH,
    GRF_NAME_LENGTH,
    HEADER_SIZE,
    HOSTNAME_LENGTH,
    HOSTNAME_PORT_LENGTH,
    INVITE_CODE_LENGTH,
    INVITE_CODE_SECRET_LENGTH,
    REVISION_LENGTH,
    TCP_MTU,
    TOKEN_LENGTH,
    Reader,
    Writer,
    packet,
)
from crossroads.types import frozen

#: ``NETWORK_COORDINATOR_VERSION`` in OpenTTD 12.x-15.x.
COORDINATOR_VERSION = 6
#: Oldest coordinator protocol (OpenTTD 12.0-beta1, PR #9411).
MIN_COORDINATOR_VERSION = 1


class PacketType(IntEnum):
    """``PacketCoordinatorType``."""

    GC_ERROR = 0
    SERVER_REGISTER = 1
    GC_REGISTER_ACK = 2
    SERVER_UPDATE = 3
    CLIENT_LISTING = 4
    GC_LISTING = 5
    CLIENT_CONNECT = 6
    GC_CONNECTING = 7
    SERCLI_CONNECT_FAILED = 8
    GC_CONNECT_FAILED = 9
    CLIENT_CONNECTED = 10
    GC_DIRECT_CONNECT = 11
    GC_STUN_REQUEST = 12
    SERCLI_STUN_RESULT = 13
    GC_STUN_CONNECT = 14
    GC_NEWGRF_LOOKUP = 15
    GC_TURN_CONNECT = 16


class ServerGameType(IntEnum):
    """``ServerGameType``; config strings ``local``, ``public``, ``invite-only``."""

    LOCAL = 0
    PUBLIC = 1
    INVITE_ONLY = 2


class ConnectionType(IntEnum):
    """How a registered server can be reached (``ConnectionType``)."""

    UNKNOWN = 0
    ISOLATED = 1
    DIRECT = 2
    STUN = 3
    TURN = 4


class ErrorType(IntEnum):
    """``NetworkCoordinatorErrorType``."""

    UNKNOWN = 0
    REGISTRATION_FAILED = 1
    INVALID_INVITE_CODE = 2
    REUSE_OF_INVITE_CODE = 3


#: Protocol version that introduced each packet (reference section 3).
MIN_VERSION: dict[PacketType, int] = {
    PacketType.GC_ERROR: 1,
    PacketType.SERVER_REGISTER: 1,
    PacketType.GC_REGISTER_ACK: 1,
    PacketType.SERVER_UPDATE: 1,
    PacketType.CLIENT_LISTING: 1,
    PacketType.GC_LISTING: 1,
    PacketType.CLIENT_CONNECT: 2,
    PacketType.GC_CONNECTING: 2,
    PacketType.SERCLI_CONNECT_FAILED: 2,
    PacketType.GC_CONNECT_FAILED: 2,
    PacketType.CLIENT_CONNECTED: 2,
    PacketType.GC_DIRECT_CONNECT: 2,
    PacketType.GC_STUN_REQUEST: 3,
    PacketType.SERCLI_STUN_RESULT: 3,
    PacketType.GC_STUN_CONNECT: 3,
    PacketType.GC_NEWGRF_LOOKUP: 4,
    PacketType.GC_TURN_CONNECT: 5,
}

#: First version with invite codes (PR #9432).
VERSION_INVITE_CODES = 2
#: First version with STUN (PR #9443).
VERSION_STUN = 3
#: First version with the NewGRF lookup table (PR #9449).
VERSION_NEWGRF_LOOKUP = 4
#: First version with TURN (PR #9447).
VERSION_TURN = 5
#: First version that knows ``REUSE_OF_INVITE_CODE`` (PR #9487).
VERSION_REUSE_ERROR = 6


def open_service_packet(
    packet_type: int,
    payload: bytes,
    expected: IntEnum,
    first_version: int,
    service: str,
) -> tuple[Reader, int]:
    """Open the one packet the STUN or TURN service receives: it must be of type
    ``expected`` and lead with a coordinator protocol version from
    ``first_version`` (the one that brought the service) to ours. Returns the
    reader after the version, and the version; ``service`` names it in errors."""
    if packet_type != expected:
        raise DecodeError(f"{service} packet type {packet_type}", "bad-type")
    r = Reader(payload)
    version = r.u8()
    if not first_version <= version <= COORDINATOR_VERSION:
        raise DecodeError(f"{service} protocol version {version}", "version")
    return r, version


# ----------------------------------------------------------- peer -> coordinator


@frozen
class ServerRegister:
    """A game server asks to be registered (and to re-use its invite code)."""

    protocol: int
    game_type: int
    server_port: int
    invite_code: str = ""
    invite_code_secret: str = ""


@frozen
class ServerUpdate:
    """A registered server's current game info."""

    protocol: int
    game_info_version: int
    serialization: NewGRFSerialization
    info: GameInfo


@frozen
class ClientListing:
    """A client asks for the public server list."""

    protocol: int
    game_info_version: int
    revision: str
    newgrf_cursor: int = 0


@frozen
class ClientConnect:
    """A client asks to be connected to the server behind an invite code."""

    protocol: int
    invite_code: str


@frozen
class ConnectFailed:
    """SERCLI_CONNECT_FAILED: the method with ``tracking_number`` failed (0: give up)."""

    protocol: int
    token: str
    tracking_number: int


@frozen
class ClientConnected:
    """The client reached the server; the attempt ``token`` succeeded."""

    protocol: int
    token: str


@frozen
class StunResult:
    """SERCLI_STUN_RESULT: whether the STUN packet of ``family`` went out."""

    protocol: int
    token: str
    family: int
    result: bool


PeerMessage = (
    ServerRegister
    | ServerUpdate
    | ClientListing
    | ClientConnect
    | ConnectFailed
    | ClientConnected
    | StunResult
)


# ----------------------------------------------------------- coordinator -> peer


@frozen
class GcError:
    error: ErrorType
    detail: str = ""


@frozen
class GcRegisterAck:
    connection_type: ConnectionType
    invite_code: str = ""
    invite_code_secret: str = ""


@frozen
class ListingEntry:
    """One server in a GC_LISTING: how to reach it and its game info."""

    connection_string: str
    info: GameInfo


@frozen
class GcListing:
    """Servers in ``game_info_version``; an empty listing ends the list.

    NewGRFs are written with ``serialization`` (lookup ids for clients that keep
    the GC_NEWGRF_LOOKUP table).
    """

    game_info_version: int
    serialization: NewGRFSerialization
    entries: tuple[ListingEntry, ...] = ()


@frozen
class GcConnecting:
    token: str
    invite_code: str


@frozen
class GcConnectFailed:
    token: str


@frozen
class GcDirectConnect:
    token: str
    tracking_number: int
    hostname: str
    port: int


@frozen
class GcStunRequest:
    token: str


@frozen
class GcStunConnect:
    token: str
    tracking_number: int
    family: int
    host: str
    port: int


@frozen
class GcNewgrfLookup:
    """Part of the NewGRF lookup table: entries up to index ``cursor``."""

    cursor: int
    entries: tuple[tuple[int, NewGRF], ...] = ()


@frozen
class GcTurnConnect:
    token: str
    tracking_number: int
    ticket: str
    connection_string: str


GcMessage = (
    GcError
    | GcRegisterAck
    | GcListing
    | GcConnecting
    | GcConnectFailed
    | GcDirectConnect
    | GcStunRequest
    | GcStunConnect
    | GcNewgrfLookup
    | GcTurnConnect
)

GC_TYPES: dict[type[GcMessage], PacketType] = {
    GcError: PacketType.GC_ERROR,
    GcRegisterAck: PacketType.GC_REGISTER_ACK,
    GcListing: PacketType.GC_LISTING,
    GcConnecting: PacketType.GC_CONNECTING,
    GcConnectFailed: PacketType.GC_CONNECT_FAILED,
    GcDirectConnect: PacketType.GC_DIRECT_CONNECT,
    GcStunRequest: PacketType.GC_STUN_REQUEST,
    GcStunConnect: PacketType.GC_STUN_CONNECT,
    GcNewgrfLookup: PacketType.GC_NEWGRF_LOOKUP,
    GcTurnConnect: PacketType.GC_TURN_CONNECT,
}

PEER_TYPES: dict[type[PeerMessage], PacketType] = {
    ServerRegister: PacketType.SERVER_REGISTER,
    ServerUpdate: PacketType.SERVER_UPDATE,
    ClientListing: PacketType.CLIENT_LISTING,
    ClientConnect: PacketType.CLIENT_CONNECT,
    ConnectFailed: PacketType.SERCLI_CONNECT_FAILED,
    ClientConnected: PacketType.CLIENT_CONNECTED,
    StunResult: PacketType.SERCLI_STUN_RESULT,
}


# -------------------------------------------------------------------- decoding


def _protocol(r: Reader, packet_type: PacketType) -> int:
    version = r.u8()
    if not MIN_COORDINATOR_VERSION <= version <= COORDINATOR_VERSION:
        raise DecodeError(f"coordinator protocol version {version}", "version")
    if version < MIN_VERSION[packet_type]:
        raise DecodeError(
            f"{packet_type.name} needs protocol {MIN_VERSION[packet_type]}",
            "version",
        )
    return version


def _server_register(r: Reader) -> ServerRegister:
    version = _protocol(r, PacketType.SERVER_REGISTER)
    game_type = r.u8()
    port = r.u16()
    code = secret = ""
    if version >= VERSION_INVITE_CODES:
        code = r.string(INVITE_CODE_LENGTH)
        secret = r.string(INVITE_CODE_SECRET_LENGTH)
    return ServerRegister(version, game_type, port, code, secret)


def _server_update(r: Reader) -> ServerUpdate:
    version = _protocol(r, PacketType.SERVER_UPDATE)
    decoded = decode_game_info(r)
    if decoded.serialization is NewGRFSerialization.LOOKUP_ID:
        # Lookup ids only make sense from the coordinator to a client.
        raise DecodeError("server sent NewGRF lookup ids", "bad-nst")
    return ServerUpdate(version, decoded.version, decoded.serialization, decoded.info)


def _client_listing(r: Reader) -> ClientListing:
    version = _protocol(r, PacketType.CLIENT_LISTING)
    info_version = r.u8()
    if info_version < 1:
        raise DecodeError("game info version 0", "game-info-version")
    revision = r.string(REVISION_LENGTH)
    cursor = r.u32() if version >= VERSION_NEWGRF_LOOKUP else 0
    return ClientListing(version, info_version, revision, cursor)


def _client_connect(r: Reader) -> ClientConnect:
    version = _protocol(r, PacketType.CLIENT_CONNECT)
    return ClientConnect(version, r.string(INVITE_CODE_LENGTH))


def _connect_failed(r: Reader) -> ConnectFailed:
    version = _protocol(r, PacketType.SERCLI_CONNECT_FAILED)
    return ConnectFailed(version, r.string(TOKEN_LENGTH), r.u8())


def _client_connected(r: Reader) -> ClientConnected:
    version = _protocol(r, PacketType.CLIENT_CONNECTED)
    return ClientConnected(version, r.string(TOKEN_LENGTH))


def _stun_result(r: Reader) -> StunResult:
    version = _protocol(r, PacketType.SERCLI_STUN_RESULT)
    return StunResult(version, r.string(TOKEN_LENGTH), r.u8(), r.boolean())


_PEER_DECODERS: dict[int, Callable[[Reader], PeerMessage]] = {
    PacketType.SERVER_REGISTER: _server_register,
    PacketType.SERVER_UPDATE: _server_update,
    PacketType.CLIENT_LISTING: _client_listing,
    PacketType.CLIENT_CONNECT: _client_connect,
    PacketType.SERCLI_CONNECT_FAILED: _connect_failed,
    PacketType.CLIENT_CONNECTED: _client_connected,
    PacketType.SERCLI_STUN_RESULT: _stun_result,
}


def decode_peer_packet(packet_type: int, payload: bytes) -> PeerMessage:
    """Decode a packet a server or client sent to the coordinator."""
    decoder = _PEER_DECODERS.get(packet_type)
    if decoder is None:
        raise DecodeError(f"packet type {packet_type} is not for the GC", "bad-type")
    r = Reader(payload)
    message = decoder(r)
    r.end()
    return message


def _gc_error(r: Reader, version: int, lookup: Mapping[int, NewGRF]) -> GcMessage:
    error = r.u8_enum(ErrorType, "bad-error")
    return GcError(error, r.string(ERROR_DETAIL_LENGTH))


def _gc_register_ack(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    code = secret = ""
    if version >= VERSION_INVITE_CODES:
        code = r.string(INVITE_CODE_LENGTH)
        secret = r.string(INVITE_CODE_SECRET_LENGTH)
    connection_type = r.u8_enum(ConnectionType, "bad-connection-type")
    return GcRegisterAck(connection_type, code, secret)


def _gc_listing(r: Reader, version: int, lookup: Mapping[int, NewGRF]) -> GcMessage:
    count = r.u16()
    entries = []
    info_version = 0
    nst = NewGRFSerialization.GRFID_MD5
    for _ in range(count):
        connection_string = r.string(HOSTNAME_PORT_LENGTH)
        decoded = decode_game_info(r, lookup)
        if info_version and (decoded.version, decoded.serialization) != (
            info_version,
            nst,
        ):
            raise DecodeError("mixed game info versions in a listing", "malformed")
        info_version, nst = decoded.version, decoded.serialization
        entries.append(ListingEntry(connection_string, decoded.info))
    return GcListing(info_version, nst, tuple(entries))


def _gc_connecting(r: Reader, version: int, lookup: Mapping[int, NewGRF]) -> GcMessage:
    return GcConnecting(r.string(TOKEN_LENGTH), r.string(INVITE_CODE_LENGTH))


def _gc_connect_failed(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    return GcConnectFailed(r.string(TOKEN_LENGTH))


def _gc_direct_connect(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    return GcDirectConnect(
        r.string(TOKEN_LENGTH), r.u8(), r.string(HOSTNAME_LENGTH), r.u16()
    )


def _gc_stun_request(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    return GcStunRequest(r.string(TOKEN_LENGTH))


def _gc_stun_connect(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    return GcStunConnect(
        r.string(TOKEN_LENGTH), r.u8(), r.u8(), r.string(HOSTNAME_PORT_LENGTH), r.u16()
    )


def _gc_newgrf_lookup(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    cursor = r.u32()
    count = r.u16()
    entries = []
    for _ in range(count):
        index = r.u32()
        grfid = r.u32()
        md5 = r.raw(16)
        name = r.string(GRF_NAME_LENGTH)
        entries.append((index, NewGRF(grfid, md5, name)))
    return GcNewgrfLookup(cursor, tuple(entries))


def _gc_turn_connect(
    r: Reader, version: int, lookup: Mapping[int, NewGRF]
) -> GcMessage:
    return GcTurnConnect(
        r.string(TOKEN_LENGTH),
        r.u8(),
        r.string(TOKEN_LENGTH),
        r.string(HOSTNAME_PORT_LENGTH),
    )


_GC_DECODERS: dict[int, Callable[[Reader, int, Mapping[int, NewGRF]], GcMessage]] = {
    PacketType.GC_ERROR: _gc_error,
    PacketType.GC_REGISTER_ACK: _gc_register_ack,
    PacketType.GC_LISTING: _gc_listing,
    PacketType.GC_CONNECTING: _gc_connecting,
    PacketType.GC_CONNECT_FAILED: _gc_connect_failed,
    PacketType.GC_DIRECT_CONNECT: _gc_direct_connect,
    PacketType.GC_STUN_REQUEST: _gc_stun_request,
    PacketType.GC_STUN_CONNECT: _gc_stun_connect,
    PacketType.GC_NEWGRF_LOOKUP: _gc_newgrf_lookup,
    PacketType.GC_TURN_CONNECT: _gc_turn_connect,
}


def decode_gc_packet(
    packet_type: int,
    payload: bytes,
    version: int = COORDINATOR_VERSION,
    lookup: Mapping[int, NewGRF] | None = None,
) -> GcMessage:
    """Decode a coordinator packet as a peer speaking ``version`` reads it.

    ``lookup`` is the peer's NewGRF lookup table (for GC_LISTING with NST 2).
    """
    decoder = _GC_DECODERS.get(packet_type)
    if decoder is None:
        raise DecodeError(f"packet type {packet_type} is not from the GC", "bad-type")
    if version < MIN_VERSION[PacketType(packet_type)]:
        raise DecodeError(f"type {packet_type} needs a newer protocol", "version")
    r = Reader(payload)
    message = decoder(r, version, lookup if lookup is not None else {})
    r.end()
    return message


# -------------------------------------------------------------------- encoding


def encode_peer_packet(message: PeerMessage) -> bytes:
    """Encode a packet a server or client sends to the coordinator."""
    w = Writer(PEER_TYPES[type(message)])
    match message:
        case ServerRegister():
            w.u8(message.protocol).u8(message.game_type).u16(message.server_port)
            if message.protocol >= VERSION_INVITE_CODES:
                w.string(message.invite_code, INVITE_CODE_LENGTH)
                w.string(message.invite_code_secret, INVITE_CODE_SECRET_LENGTH)
        case ServerUpdate():
            w.u8(message.protocol)
            encode_game_info(
                w, message.info, message.game_info_version, message.serialization
            )
        case ClientListing():
            w.u8(message.protocol).u8(message.game_info_version)
            w.string(message.revision, REVISION_LENGTH)
            if message.protocol >= VERSION_NEWGRF_LOOKUP:
                w.u32(message.newgrf_cursor)
        case ClientConnect():
            w.u8(message.protocol).string(message.invite_code, INVITE_CODE_LENGTH)
        case ConnectFailed():
            w.u8(message.protocol).string(message.token, TOKEN_LENGTH)
            w.u8(message.tracking_number)
        case ClientConnected():
            w.u8(message.protocol).string(message.token, TOKEN_LENGTH)
        case StunResult():
            w.u8(message.protocol).string(message.token, TOKEN_LENGTH)
            w.u8(message.family).boolean(message.result)
    return w.finish(TCP_MTU)


def encode_gc_packet(
    message: GcMessage,
    version: int = COORDINATOR_VERSION,
    lookup_ids: Mapping[tuple[int, bytes], int] | None = None,
) -> bytes:
    """Encode a coordinator packet for a peer speaking ``version``.

    Raises :class:`LocalProtocolError` when the peer's version cannot carry the
    message (the caller shapes its replies so that never happens).
    """
    packet_type = GC_TYPES[type(message)]
    if version < MIN_VERSION[packet_type]:
        raise LocalProtocolError(f"{packet_type.name} needs a newer protocol")
    w = Writer(packet_type)
    match message:
        case GcError():
            w.u8(message.error).string(message.detail, ERROR_DETAIL_LENGTH)
        case GcRegisterAck():
            if version >= VERSION_INVITE_CODES:
                w.string(message.invite_code, INVITE_CODE_LENGTH)
                w.string(message.invite_code_secret, INVITE_CODE_SECRET_LENGTH)
            w.u8(message.connection_type)
        case GcListing():
            w.u16(len(message.entries))
            for entry in message.entries:
                w.string(entry.connection_string, HOSTNAME_PORT_LENGTH)
                encode_game_info(
                    w,
                    entry.info,
                    message.game_info_version,
                    message.serialization,
                    lookup_ids,
                )
        case GcConnecting():
            w.string(message.token, TOKEN_LENGTH)
            w.string(message.invite_code, INVITE_CODE_LENGTH)
        case GcConnectFailed():
            w.string(message.token, TOKEN_LENGTH)
        case GcDirectConnect():
            w.string(message.token, TOKEN_LENGTH).u8(message.tracking_number)
            w.string(message.hostname, HOSTNAME_LENGTH).u16(message.port)
        case GcStunRequest():
            w.string(message.token, TOKEN_LENGTH)
        case GcStunConnect():
            w.string(message.token, TOKEN_LENGTH).u8(message.tracking_number)
            w.u8(message.family).string(message.host, HOSTNAME_PORT_LENGTH)
            w.u16(message.port)
        case GcNewgrfLookup():
            w.u32(message.cursor).u16(len(message.entries))
            for index, grf in message.entries:
                w.u32(index).u32(grf.grfid).raw(grf.md5)
                w.string(grf.name or "", GRF_NAME_LENGTH)
        case GcTurnConnect():
            w.string(message.token, TOKEN_LENGTH).u8(message.tracking_number)
            w.string(message.ticket, TOKEN_LENGTH)
            w.string(message.connection_string, HOSTNAME_PORT_LENGTH)
    return w.finish(TCP_MTU)


def error_for_version(error: ErrorType, version: int) -> ErrorType:
    """Shape an error for an older peer: REUSE_OF_INVITE_CODE arrived in 6."""
    if error is ErrorType.REUSE_OF_INVITE_CODE and version < VERSION_REUSE_ERROR:
        return ErrorType.REGISTRATION_FAILED
    return error


def listing_shape(
    client_version: int, wanted_info_version: int
) -> tuple[int, NewGRFSerialization]:
    """The game-info version and NST a GC_LISTING for this client uses.

    The client names the game-info version it reads; a newer one than ours is
    answered in ours. Clients with the lookup table (protocol 4+) get NewGRFs as
    lookup ids; older ones get them with names.
    """
    version = max(1, min(wanted_info_version, MAX_GAME_INFO_VERSION))
    if client_version >= VERSION_NEWGRF_LOOKUP:
        return version, NewGRFSerialization.LOOKUP_ID
    return version, NewGRFSerialization.GRFID_MD5_NAME


#: Target size of one GC_LISTING packet. Several servers share a packet up to
#: the compatible MTU; a server whose info alone is larger gets its own packet
#: (every OpenTTD with a coordinator receives up to TCP_MTU).
LISTING_PACKET_TARGET = COMPAT_MTU
#: The 13.0 client reads the GC_LISTING count into a uint8
#: (``Receive_GC_LISTING``), so never put more than 255 servers in one packet.
LISTING_MAX_PER_PACKET = 255


def encode_listing_entry(
    entry: ListingEntry,
    game_info_version: int,
    serialization: NewGRFSerialization,
    lookup_ids: Mapping[tuple[int, bytes], int] | None = None,
) -> bytes:
    """One server's bytes inside a GC_LISTING (cacheable per listing shape)."""
    w = Writer(PacketType.GC_LISTING)
    w.string(entry.connection_string, HOSTNAME_PORT_LENGTH)
    encode_game_info(w, entry.info, game_info_version, serialization, lookup_ids)
    return w.payload()


def pack_listing(entries: list[bytes]) -> list[bytes]:
    """GC_LISTING packets holding ``entries``, then the empty end-of-list packet."""
    packets: list[bytes] = []
    batch: list[bytes] = []
    size = HEADER_SIZE + 2
    for entry in entries:
        if batch and (
            size + len(entry) > LISTING_PACKET_TARGET
            or len(batch) == LISTING_MAX_PER_PACKET
        ):
            packets.append(_listing_packet(batch))
            batch, size = [], HEADER_SIZE + 2
        if HEADER_SIZE + 2 + len(entry) > TCP_MTU:
            continue  # cannot happen for valid game info (255 NewGRFs fit)
        batch.append(entry)
        size += len(entry)
    if batch:
        packets.append(_listing_packet(batch))
    packets.append(_listing_packet([]))
    return packets


def _listing_packet(batch: list[bytes]) -> bytes:
    body = len(batch).to_bytes(2, "little") + b"".join(batch)
    return packet(PacketType.GC_LISTING, body)


def newgrf_lookup_packets(
    entries: list[tuple[int, NewGRF]], cursor: int
) -> list[bytes]:
    """GC_NEWGRF_LOOKUP packets for ``entries`` (sorted by index), each under the
    compatible MTU; every packet carries the final ``cursor``."""
    packets: list[bytes] = []
    batch: list[bytes] = []
    size = HEADER_SIZE + 6
    for index, grf in entries:
        w = Writer(PacketType.GC_NEWGRF_LOOKUP)
        w.u32(index).u32(grf.grfid).raw(grf.md5).string(grf.name or "", GRF_NAME_LENGTH)
        item = w.payload()
        if batch and size + len(item) > COMPAT_MTU:
            packets.append(_lookup_packet(batch, cursor))
            batch, size = [], HEADER_SIZE + 6
        batch.append(item)
        size += len(item)
    if batch:
        packets.append(_lookup_packet(batch, cursor))
    return packets


def _lookup_packet(batch: list[bytes], cursor: int) -> bytes:
    body = cursor.to_bytes(4, "little") + len(batch).to_bytes(2, "little")
    return packet(PacketType.GC_NEWGRF_LOOKUP, body + b"".join(batch))
