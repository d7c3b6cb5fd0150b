"""RakNet message ids and the offline (connectionless) messages.

Values are from the compiled RakNet 4.081 headers (reference raknet-wire.md §7);
layouts from §1 (offline handshake, unconnected ping) and §2 (out-of-band).
Every offline message carries the 16-byte ``OFFLINE_MESSAGE_DATA_ID`` magic
(RakPeer.cpp:135) right after its id, except the unconnected ping/pong where
the magic follows the time.
"""

from __future__ import annotations

from enum import IntEnum

from crossroads.errors import DecodeError
from crossroads.proto.raknet.bitstream import UNASSIGNED_ADDRESS, BitReader, BitWriter
from crossroads.types import Address, frozen

#: ``OFFLINE_MESSAGE_DATA_ID`` (RakPeer.cpp:135).
MAGIC = bytes.fromhex("00ffff00fefefefefdfdfdfd12345678")
#: ``RAKNET_PROTOCOL_VERSION`` (RakNetVersion.h:19).
PROTOCOL_VERSION = 6
#: IP + UDP header bytes RakNet adds to a datagram's length to get its MTU
#: (``UDP_HEADER_SIZE``), and the largest MTU it tries (RakPeer.cpp:100-104).
UDP_HEADER_SIZE = 28
MAXIMUM_MTU = 1492
#: The smallest MTU a client tries (RakPeer.cpp:100-104); smaller is refused.
MINIMUM_MTU = 400


class MessageId(IntEnum):
    """First byte of a RakNet message (reference §7)."""

    CONNECTED_PING = 0x00
    UNCONNECTED_PING = 0x01
    UNCONNECTED_PING_OPEN_CONNECTIONS = 0x02
    CONNECTED_PONG = 0x03
    DETECT_LOST_CONNECTIONS = 0x04
    OPEN_CONNECTION_REQUEST_1 = 0x05
    OPEN_CONNECTION_REPLY_1 = 0x06
    OPEN_CONNECTION_REQUEST_2 = 0x07
    OPEN_CONNECTION_REPLY_2 = 0x08
    CONNECTION_REQUEST = 0x09
    OUT_OF_BAND_INTERNAL = 0x0D
    CONNECTION_REQUEST_ACCEPTED = 0x10
    ALREADY_CONNECTED = 0x12
    NEW_INCOMING_CONNECTION = 0x13
    NO_FREE_INCOMING_CONNECTIONS = 0x14
    DISCONNECTION_NOTIFICATION = 0x15
    CONNECTION_BANNED = 0x17
    INCOMPATIBLE_PROTOCOL_VERSION = 0x19
    IP_RECENTLY_CONNECTED = 0x1A
    TIMESTAMP = 0x1B
    UNCONNECTED_PONG = 0x1C
    NAT_PUNCHTHROUGH_REQUEST = 0x3A
    NAT_CONNECT_AT_TIME = 0x3B
    NAT_GET_MOST_RECENT_PORT = 0x3C
    NAT_CLIENT_READY = 0x3D
    NAT_TARGET_NOT_CONNECTED = 0x3E
    NAT_TARGET_UNRESPONSIVE = 0x3F
    NAT_CONNECTION_TO_TARGET_LOST = 0x40
    NAT_ALREADY_IN_PROGRESS = 0x41
    UDP_PROXY_GENERAL = 0x5C
    NAT_TYPE_DETECTION_REQUEST = 0x60
    NAT_TYPE_DETECTION_RESULT = 0x61
    NAT_REQUEST_BOUND_ADDRESSES = 0x7C
    NAT_RESPOND_BOUND_ADDRESSES = 0x7D
    USER_PACKET_ENUM = 0x86


#: Offline messages whose id is followed directly by the magic.
_MAGIC_AT_1 = frozenset(
    {
        MessageId.OPEN_CONNECTION_REQUEST_1,
        MessageId.OPEN_CONNECTION_REQUEST_2,
        MessageId.OUT_OF_BAND_INTERNAL,
    }
)


def is_offline(data: bytes) -> bool:
    """Whether ``data`` is an offline message this server reads (magic in place)."""
    if not data:
        return False
    first = data[0]
    if first in _MAGIC_AT_1:
        if first == MessageId.OUT_OF_BAND_INTERNAL:
            return _has_magic(data, 9)
        return _has_magic(data, 1)
    if first in (
        MessageId.UNCONNECTED_PING,
        MessageId.UNCONNECTED_PING_OPEN_CONNECTIONS,
    ):
        return _has_magic(data, 9)
    return False


def _has_magic(data: bytes, offset: int) -> bool:
    return data[offset : offset + len(MAGIC)] == MAGIC


def _expect_magic(data: bytes, offset: int, name: str, size: int = 0) -> None:
    """Raise unless ``data`` has the offline magic at ``offset`` and at least
    ``size`` bytes (what RakPeer checks before it reads an offline message)."""
    if len(data) < size or not _has_magic(data, offset):
        raise DecodeError(f"bad {name}", "bad-magic")


@frozen
class OpenConnectionRequest1:
    """``05`` magic protocol, zero-padded to the MTU being tried (§1)."""

    protocol: int
    mtu: int

    @classmethod
    def decode(cls, data: bytes) -> OpenConnectionRequest1:
        _expect_magic(data, 1, "OPEN_CONNECTION_REQUEST_1", size=18)
        return cls(protocol=data[17], mtu=len(data) + UDP_HEADER_SIZE)

    def encode(self) -> bytes:
        body = bytes([MessageId.OPEN_CONNECTION_REQUEST_1]) + MAGIC
        body += bytes([self.protocol])
        return body.ljust(self.mtu - UDP_HEADER_SIZE, b"\x00")


@frozen
class OpenConnectionRequest2:
    """``07`` magic SystemAddress(server as dialled) u16 MTU clientGUID (§1)."""

    server_address: Address
    mtu: int
    guid: int

    @classmethod
    def decode(cls, data: bytes) -> OpenConnectionRequest2:
        _expect_magic(data, 1, "OPEN_CONNECTION_REQUEST_2")
        reader = BitReader(data, start_bits=17 * 8)
        return cls(reader.read_address(), reader.read_u16(), reader.read_u64())

    def encode(self) -> bytes:
        writer = BitWriter()
        writer.write_u8(MessageId.OPEN_CONNECTION_REQUEST_2)
        writer.write_bytes(MAGIC)
        writer.write_address(self.server_address)
        writer.write_u16(self.mtu)
        writer.write_u64(self.guid)
        return writer.data()


def incompatible_protocol(server_guid: int) -> bytes:
    """``19 06 magic serverGUID`` (RakPeer.cpp:5136-5157)."""
    return (
        bytes([MessageId.INCOMPATIBLE_PROTOCOL_VERSION, PROTOCOL_VERSION])
        + MAGIC
        + server_guid.to_bytes(8, "big")
    )


def open_connection_reply_1(server_guid: int, mtu: int) -> bytes:
    """``06 magic serverGUID 00 u16 MTU``, 28 bytes (RakPeer.cpp:5163-5185)."""
    return (
        bytes([MessageId.OPEN_CONNECTION_REPLY_1])
        + MAGIC
        + server_guid.to_bytes(8, "big")
        + b"\x00"
        + mtu.to_bytes(2, "big")
    )


def open_connection_reply_2(server_guid: int, client: Address, mtu: int) -> bytes:
    """``08 magic serverGUID SystemAddress u16 MTU bool(0)``, 35 bytes."""
    writer = BitWriter()
    writer.write_u8(MessageId.OPEN_CONNECTION_REPLY_2)
    writer.write_bytes(MAGIC)
    writer.write_u64(server_guid)
    writer.write_address(client)
    writer.write_u16(mtu)
    writer.write_bool(False)  # no security
    return writer.data()


def handshake_refusal(kind: MessageId, server_guid: int) -> bytes:
    """``ALREADY_CONNECTED`` / ``NO_FREE_INCOMING_CONNECTIONS`` /
    ``IP_RECENTLY_CONNECTED``: id magic serverGUID (RakPeer.cpp:5334-5371)."""
    return bytes([kind]) + MAGIC + server_guid.to_bytes(8, "big")


@frozen
class UnconnectedPing:
    """``01``/``02`` Time magic [clientGUID] (RakPeer.cpp:4635-4680)."""

    time: int
    open_connections_only: bool

    @classmethod
    def decode(cls, data: bytes) -> UnconnectedPing:
        _expect_magic(data, 9, "UNCONNECTED_PING")
        return cls(
            int.from_bytes(data[1:9], "big"),
            data[0] == MessageId.UNCONNECTED_PING_OPEN_CONNECTIONS,
        )


def unconnected_pong(ping_time: int, server_guid: int, response: bytes) -> bytes:
    """``1c`` Time serverGUID magic [offline ping response]."""
    return (
        bytes([MessageId.UNCONNECTED_PONG])
        + ping_time.to_bytes(8, "big")
        + server_guid.to_bytes(8, "big")
        + MAGIC
        + response
    )


def unconnected_ping(ping_time: int, client_guid: int) -> bytes:
    """``01`` Time magic clientGUID, 33 bytes: what ``RakPeer::Ping`` sends
    (RakPeer.cpp:4635-4680); the pong is no larger (no response data fits)."""
    return (
        bytes([MessageId.UNCONNECTED_PING])
        + ping_time.to_bytes(8, "big")
        + MAGIC
        + client_guid.to_bytes(8, "big")
    )


@frozen
class UnconnectedPong:
    """``1c`` Time serverGUID magic [offline ping response]: a ping's answer."""

    time: int
    guid: int
    response: bytes

    @classmethod
    def decode(cls, data: bytes) -> UnconnectedPong:
        if len(data) < 33 or data[0] != MessageId.UNCONNECTED_PONG:
            raise DecodeError("not an UNCONNECTED_PONG", "bad-id")
        _expect_magic(data, 17, "UNCONNECTED_PONG")
        return cls(
            int.from_bytes(data[1:9], "big"),
            int.from_bytes(data[9:17], "big"),
            bytes(data[33:]),
        )


@frozen
class OutOfBand:
    """``0d`` senderGUID magic payload (RakPeer.cpp:2979-2984, 4706-4735)."""

    guid: int
    payload: bytes

    @classmethod
    def decode(cls, data: bytes) -> OutOfBand:
        _expect_magic(data, 9, "OUT_OF_BAND_INTERNAL")
        return cls(int.from_bytes(data[1:9], "big"), data[25:])

    def encode(self) -> bytes:
        return (
            bytes([MessageId.OUT_OF_BAND_INTERNAL])
            + self.guid.to_bytes(8, "big")
            + MAGIC
            + self.payload
        )


@frozen
class ConnectionRequest:
    """``09`` clientGUID Time bool(doSecurity) [password] (RakPeer.cpp:5004-5030)."""

    guid: int
    time: int
    secure: bool

    @classmethod
    def decode(cls, data: bytes) -> ConnectionRequest:
        reader = BitReader(data, start_bits=8)
        return cls(reader.read_u64(), reader.read_u64(), reader.read_bool())


def connection_request_accepted(
    client: Address,
    system_index: int,
    server_addresses: list[Address],
    request_time: int,
    now_ms: int,
) -> bytes:
    """``10`` client-as-seen u16 index 10×SystemAddress Time Time (96 bytes)."""
    writer = BitWriter()
    writer.write_u8(MessageId.CONNECTION_REQUEST_ACCEPTED)
    writer.write_address(client)
    writer.write_u16(system_index)
    padded = (server_addresses + [UNASSIGNED_ADDRESS] * MAXIMUM_NUMBER_OF_INTERNAL_IDS)[
        :MAXIMUM_NUMBER_OF_INTERNAL_IDS
    ]
    for addr in padded:
        writer.write_address(addr)
    writer.write_u64(request_time)
    writer.write_u64(now_ms)
    return writer.data()


#: ``MAXIMUM_NUMBER_OF_INTERNAL_IDS`` (RakNetDefines.h): the address lists of
#: CONNECTION_REQUEST_ACCEPTED and NEW_INCOMING_CONNECTION hold 10 entries.
MAXIMUM_NUMBER_OF_INTERNAL_IDS = 10


@frozen
class NewIncomingConnection:
    """``13`` SystemAddress(server) 10×SystemAddress(client's LAN IPs) Time Time."""

    server_address: Address
    internal_addresses: tuple[Address, ...]

    @classmethod
    def decode(cls, data: bytes) -> NewIncomingConnection:
        reader = BitReader(data, start_bits=8)
        server = reader.read_address()
        internal = tuple(
            reader.read_address() for _ in range(MAXIMUM_NUMBER_OF_INTERNAL_IDS)
        )
        return cls(server, internal)


def connected_ping(now_ms: int) -> bytes:
    return bytes([MessageId.CONNECTED_PING]) + now_ms.to_bytes(8, "big")


def connected_pong(ping_time: int, now_ms: int) -> bytes:
    """``03`` pingTime pongTime (RakPeer.cpp:6060-6094)."""
    return (
        bytes([MessageId.CONNECTED_PONG])
        + ping_time.to_bytes(8, "big")
        + now_ms.to_bytes(8, "big")
    )
