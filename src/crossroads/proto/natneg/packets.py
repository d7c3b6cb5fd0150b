"""GameSpy NAT negotiation ("natneg") packet codec: every type 0x00-0x10, versions 1-4.

Wire facts are from ``shared/reference/gamespy-natneg.md`` (cited as "ref §N"), which
describes the GameSpy SDK client (``natneg.c``, ``nninternal.h``, ``NATify.c``).

Every packet starts with a 12-byte header (ref §2)::

    0-5  magic FD FC 1E 66 6A B2
    6    protocol version (1-4)
    7    packet type
    8-11 cookie, big-endian

and the body depends on the type. Three body layouts exist in the SDK's packed
``NatNegPacket`` union, plus the v4 PREINIT:

* the *INIT body* (9 bytes at offset 12: porttype, clientindex, usegameport, an IPv4
  address and a big-endian port), used by INIT and by every short reply
  (INIT_ACK, ERT_TEST/ACK, CONNECT_ACK, ADDRESS_CHECK/REPLY, NATIFY_REQUEST,
  REPORT_ACK, BACKUP_TEST/ACK) -- 21 bytes on the wire (ref §3.2);
* the *CONNECT body* (8 bytes: IPv4, port, gotyourdata, finished) for CONNECT and
  CONNECT_PING -- 20 bytes (ref §3.3);
* the *REPORT body* (61 bytes) -- 73 bytes, with two ``int32`` fields in the
  *sender's host byte order* (ref §3.4);
* PREINIT/PREINIT_ACK: clientindex, state, clientID -- 18 bytes (ref §3.6).

Sizes are minimums, as the SDK client checks them: CONNECT and CONNECT_PING need
20 bytes, everything else 21 (ref §2). Bytes after a layout's end are kept in an
``extra`` field so that ``decode(encode(p)) == p`` holds and echoes are exact
(NATIFY_REQUEST and ADDRESS_CHECK are sent zero-filled to 73 bytes, the size of the
whole union).

Where the product seed (``seeds/002_*.txt``) disagrees with the real client, the
client wins; each such place says so:

* the seed's INIT_ACK and REPORT_ACK are 14 bytes -- the SDK drops any
  non-CONNECT packet shorter than 21 bytes (ref §2), so replies here are 21 bytes;
* the seed's REPORT has one-byte NAT type and scheme at 15/16 and a variable length
  -- the SDK sends 73 bytes with two ``int32`` in host order (ref §3.4);
* the seed calls 0x04 STATE_UPDATE "bidirectional" -- no client ever sends it; its
  layout is unknown, so it is decoded as an opaque payload.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any, ClassVar, Literal, TypeVar

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.types import frozen

#: ``NNMagicData`` (ref §2).
MAGIC = b"\xfd\xfc\x1e\x66\x6a\xb2"
#: ``BASEPACKET_SIZE``: magic, version, type, cookie.
HEADER_SIZE = 12
#: ``INITPACKET_SIZE`` = BASEPACKET_SIZE + 9: the INIT body and every short reply.
INIT_SIZE = 21
#: A version-1 INIT has no local address (ref §1, OpenSpy ``packetSizeFromType``).
INIT_V1_SIZE = 15
#: ``CONNECTPACKET_SIZE`` = BASEPACKET_SIZE + 8.
CONNECT_SIZE = 20
#: ``REPORTPACKET_SIZE`` = BASEPACKET_SIZE + 61 = ``sizeof(NatNegPacket)``.
REPORT_SIZE = 73
#: ADDRESS_CHECK and NATIFY_REQUEST are sent as a whole zero-filled NatNegPacket.
UNION_SIZE = 73
#: ``PREINITPACKET_SIZE`` = BASEPACKET_SIZE + 6 (v4).
PREINIT_SIZE = 18
#: ``__GSIACGamename`` is ``char[64]``: at most 63 characters and the NUL.
GAMENAME_MAX = 63
#: ``ReportPacket.gamename`` is ``char[50]``, a memcpy of the 64-byte name buffer.
REPORT_GAMENAME_SIZE = 50
#: ``NATIFY_COOKIE``: the cookie of every NATIFY_REQUEST (ref §3.5).
NATIFY_COOKIE = 777
#: Versions 1-4 exist (ref §1); anything else is not natneg.
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4})
#: Upper bound on a datagram we bother decoding: the SDK's own receive buffer is
#: ``NNINBUF_LEN`` = 512 bytes, so nothing legitimate is longer.
MAX_PACKET_SIZE = 512


class PacketType(IntEnum):
    """Byte 7 of every packet (``NN_*`` in nninternal.h)."""

    INIT = 0x00
    INIT_ACK = 0x01
    ERT_TEST = 0x02
    ERT_ACK = 0x03
    STATE_UPDATE = 0x04
    CONNECT = 0x05
    CONNECT_ACK = 0x06
    CONNECT_PING = 0x07
    BACKUP_TEST = 0x08
    BACKUP_ACK = 0x09
    ADDRESS_CHECK = 0x0A
    ADDRESS_REPLY = 0x0B
    NATIFY_REQUEST = 0x0C
    REPORT = 0x0D
    REPORT_ACK = 0x0E
    PREINIT = 0x0F
    PREINIT_ACK = 0x10


class PortType(IntEnum):
    """INIT porttype (``NN_PT_*``): which socket sent it to which server (ref §3.1)."""

    GP = 0  # the game's own socket, to natneg1
    NN1 = 1  # the SDK's negotiate socket, to natneg1
    NN2 = 2  # negotiate socket, to natneg2
    NN3 = 3  # negotiate socket, to natneg3 (v3+)


class Finished(IntEnum):
    """CONNECT ``finished`` byte (``FINISHED_*``, ref §3.3)."""

    NOERROR = 0
    DEADBEAT_PARTNER = 1
    INIT_PACKETS_TIMEDOUT = 2


class NegotiateResult(IntEnum):
    """The client's ``NegotiateResult`` (ref §4)."""

    SUCCESS = 0
    DEADBEAT_PARTNER = 1
    INIT_TIMEOUT = 2
    PING_TIMEOUT = 3
    UNKNOWN_ERROR = 4
    NO_RESULT = 5


class NatType(IntEnum):
    """``NatType`` as NATify determines it and REPORT carries it (ref §4)."""

    NO_NAT = 0
    FIREWALL_ONLY = 1
    FULL_CONE = 2
    RESTRICTED_CONE = 3
    PORT_RESTRICTED_CONE = 4
    SYMMETRIC = 5
    UNKNOWN = 6


class MappingScheme(IntEnum):
    """``NatMappingScheme`` (ref §4)."""

    UNRECOGNIZED = 0
    PRIVATE_AS_PUBLIC = 1
    CONSISTENT_PORT = 2
    INCREMENTAL = 3
    MIXED = 4


class NatifyMapping(IntEnum):
    """ADDRESS_CHECK cookie: which mapping probe this is (``NatifyPacket``, ref §3.5)."""

    MAP1A = 0
    MAP2 = 1
    MAP3 = 2
    MAP1B = 3


class PreinitState(IntEnum):
    """PREINIT/PREINIT_ACK state byte (``NN_PREINIT_*``, ref §3.6)."""

    WAITING_FOR_CLIENT = 0
    WAITING_FOR_MATCHUP = 1
    READY = 2


# ----------------------------------------------------------------- byte helpers


def ip_to_bytes(ip: str) -> bytes:
    """Dotted IPv4 to 4 network-order bytes; ``ValueError`` if it is not one."""
    parts = ip.split(".")
    if len(parts) != 4:
        raise ValueError(f"{ip!r} is not an IPv4 address")
    return bytes(map(int, parts))


def bytes_to_ip(data: bytes, offset: int) -> str:
    """4 network-order bytes at ``offset`` to dotted IPv4."""
    return f"{data[offset]}.{data[offset + 1]}.{data[offset + 2]}.{data[offset + 3]}"


def _header(version: int, ptype: int, cookie: int) -> bytes:
    if version not in SUPPORTED_VERSIONS:
        raise LocalProtocolError(f"natneg version {version} does not exist")
    if not 0 <= cookie <= 0xFFFFFFFF:
        raise LocalProtocolError(f"cookie {cookie} does not fit 32 bits")
    return MAGIC + bytes((version, ptype)) + cookie.to_bytes(4, "big")


def _u8(value: int, name: str) -> int:
    if not 0 <= value <= 0xFF:
        raise LocalProtocolError(f"{name} {value} does not fit a byte")
    return value


def _port_bytes(port: int) -> bytes:
    if not 0 <= port <= 0xFFFF:
        raise LocalProtocolError(f"port {port} out of range")
    return port.to_bytes(2, "big")


def _ip(ip: str) -> bytes:
    try:
        return ip_to_bytes(ip)
    except ValueError as exc:
        raise LocalProtocolError(str(exc)) from None


# ---------------------------------------------------------------------- packets

_B = TypeVar("_B", bound="_InitBody")


def _init_head(packet: Init | _InitBody) -> bytes:
    """Header, porttype, clientindex and usegameport: how INIT and every
    INIT-body packet start (ref §3.1-3.2)."""
    return _header(packet.version, packet.TYPE, packet.cookie) + bytes(
        (
            _u8(packet.port_type, "porttype"),
            _u8(packet.client_index, "clientindex"),
            _u8(packet.use_game_port, "usegameport"),
        )
    )


@frozen
class Init:
    """INIT (0x00), client to server (ref §3.1).

    ``local_port`` is 0 in the GP and NN1 INITs (the SDK fills it only after the
    first ``sendto``). ``game_name`` is None when the packet ends at byte 21 (early
    v2 clients) and for version 1, whose INIT stops at byte 15 and has no local
    address at all.
    """

    TYPE: ClassVar[PacketType] = PacketType.INIT

    version: int
    cookie: int
    port_type: int
    client_index: int
    use_game_port: int
    local_ip: str = "0.0.0.0"
    local_port: int = 0
    game_name: str | None = None

    def encode(self) -> bytes:
        head = _init_head(self)
        if self.version == 1:
            if self.local_ip != "0.0.0.0" or self.local_port or self.game_name:
                raise LocalProtocolError("a version 1 INIT has no address or name")
            return head
        body = head + _ip(self.local_ip) + _port_bytes(self.local_port)
        if self.game_name is None:
            return body
        name = self.game_name.encode("latin-1")
        if b"\0" in name or len(name) > GAMENAME_MAX:
            raise LocalProtocolError("game name must be 0-63 characters without NUL")
        return body + name + b"\0"


@frozen
class _InitBody:
    """The 21-byte INIT-body layout shared by every short packet (ref §3.2).

    Which fields mean something depends on the type; see each subclass.
    """

    TYPE: ClassVar[PacketType]

    version: int
    cookie: int
    port_type: int = 0
    client_index: int = 0
    use_game_port: int = 0
    ip: str = "0.0.0.0"
    port: int = 0
    #: Bytes after offset 21 (zero fill of 73-byte packets, or anything a sender added).
    extra: bytes = b""

    def encode(self) -> bytes:
        return _init_head(self) + _ip(self.ip) + _port_bytes(self.port) + self.extra

    def echo_as(self, cls: type[_B]) -> _B:
        """These fields as a packet of another INIT-body type: the echoes
        (ERT_TEST from NATIFY_REQUEST, BACKUP_ACK from BACKUP_TEST)."""
        return cls(
            self.version,
            self.cookie,
            self.port_type,
            self.client_index,
            self.use_game_port,
            self.ip,
            self.port,
            self.extra,
        )


@frozen
class InitAck(_InitBody):
    """INIT_ACK (0x01). The client reads only ``port_type`` (ref §3.2)."""

    TYPE: ClassVar[PacketType] = PacketType.INIT_ACK


@frozen
class ErtTest(_InitBody):
    """ERT_TEST (0x02): reachability probe. In NATify the client reads only
    ``port_type`` (1 solicited, 2 unsolicited IP, 3 unsolicited port; ref §5)."""

    TYPE: ClassVar[PacketType] = PacketType.ERT_TEST


@frozen
class ErtAck(_InitBody):
    """ERT_ACK (0x03): the first 21 bytes of an ERT_TEST with the type changed."""

    TYPE: ClassVar[PacketType] = PacketType.ERT_ACK


@frozen
class ConnectAck(_InitBody):
    """CONNECT_ACK (0x06). Only the cookie and ``client_index`` are meaningful;
    bytes 12 and 14-20 are uninitialised stack in the SDK client (ref §3.2)."""

    TYPE: ClassVar[PacketType] = PacketType.CONNECT_ACK


@frozen
class BackupTest(_InitBody):
    """BACKUP_TEST (0x08): defined by the SDK, sent by no known client (ref §2)."""

    TYPE: ClassVar[PacketType] = PacketType.BACKUP_TEST


@frozen
class BackupAck(_InitBody):
    """BACKUP_ACK (0x09): the answer to BACKUP_TEST (an echo, as DWC does)."""

    TYPE: ClassVar[PacketType] = PacketType.BACKUP_ACK


@frozen
class AddressCheck(_InitBody):
    """ADDRESS_CHECK (0x0A), 73 bytes: cookie = mapping id 0-3 (ref §3.5)."""

    TYPE: ClassVar[PacketType] = PacketType.ADDRESS_CHECK


@frozen
class AddressReply(_InitBody):
    """ADDRESS_REPLY (0x0B): ``ip``/``port`` = the sender's public address as the
    server saw it; the cookie must echo the ADDRESS_CHECK's (ref §3.2)."""

    TYPE: ClassVar[PacketType] = PacketType.ADDRESS_REPLY


@frozen
class NatifyRequest(_InitBody):
    """NATIFY_REQUEST (0x0C), 73 bytes, cookie 777, ``port_type`` 1-3 (ref §3.5)."""

    TYPE: ClassVar[PacketType] = PacketType.NATIFY_REQUEST


@frozen
class ReportAck(_InitBody):
    """REPORT_ACK (0x0E). The client checks only type and cookie (ref §3.2)."""

    TYPE: ClassVar[PacketType] = PacketType.REPORT_ACK


@frozen
class StateUpdate:
    """STATE_UPDATE (0x04): defined, never sent by any client seen (ref §2).

    Its layout is unknown, so the body is kept as opaque bytes.
    """

    TYPE: ClassVar[PacketType] = PacketType.STATE_UPDATE

    version: int
    cookie: int
    payload: bytes = b""

    def encode(self) -> bytes:
        return _header(self.version, self.TYPE, self.cookie) + self.payload


@frozen
class _ConnectBody:
    """The 20-byte CONNECT layout (ref §3.3)."""

    TYPE: ClassVar[PacketType]

    version: int
    cookie: int
    remote_ip: str = "0.0.0.0"
    remote_port: int = 0
    got_your_data: int = 0
    finished: int = 0
    extra: bytes = b""

    def encode(self) -> bytes:
        return (
            _header(self.version, self.TYPE, self.cookie)
            + _ip(self.remote_ip)
            + _port_bytes(self.remote_port)
            + bytes(
                (_u8(self.got_your_data, "gotyourdata"), _u8(self.finished, "finished"))
            )
            + self.extra
        )


@frozen
class Connect(_ConnectBody):
    """CONNECT (0x05), server to client: the peer address to ping, or an error in
    ``finished`` (:class:`Finished`). The client ignores ``got_your_data``."""

    TYPE: ClassVar[PacketType] = PacketType.CONNECT


@frozen
class ConnectPing(_ConnectBody):
    """CONNECT_PING (0x07), client to client: ``remote_*`` is where the sender
    thinks it is sending, ``got_your_data`` 1 once it heard from the peer."""

    TYPE: ClassVar[PacketType] = PacketType.CONNECT_PING


def _host_int32(raw: bytes) -> int | None:
    """Decode a host-order ``int32`` enum whose byte order is unknown.

    The field is a C enum written in the *sender's* byte order (x86 PC: little
    endian ``02 00 00 00``; Wii: big endian ``00 00 00 06``, ref §3.4). Every valid
    value is 0-6, so whichever order gives a small value is the right one.
    """
    little = int.from_bytes(raw, "little")
    if little <= 0xFF:
        return little
    big = int.from_bytes(raw, "big")
    if big <= 0xFF:
        return big
    return None


@frozen
class Report:
    """REPORT (0x0D), 73 bytes, client to natneg1 after a negotiation (ref §3.4).

    ``port_type`` is never set by the SDK (stack garbage). The two enums are kept as
    their raw 4 bytes because their byte order is the sender's; use
    :attr:`nat_type` / :attr:`mapping_scheme` for the values.
    """

    TYPE: ClassVar[PacketType] = PacketType.REPORT

    version: int
    cookie: int
    port_type: int
    client_index: int
    neg_result: int
    nat_type_raw: bytes
    mapping_scheme_raw: bytes
    game_name_raw: bytes
    extra: bytes = b""

    @classmethod
    def build(
        cls,
        *,
        version: int,
        cookie: int,
        client_index: int,
        success: bool,
        nat_type: int,
        mapping_scheme: int,
        game_name: str,
        port_type: int = 0,
        byteorder: Literal["little", "big"] = "little",
    ) -> Report:
        """A REPORT as the SDK fills it (``byteorder`` = the client CPU's)."""
        name = game_name.encode("latin-1")[:REPORT_GAMENAME_SIZE]
        return cls(
            version=version,
            cookie=cookie,
            port_type=port_type,
            client_index=client_index,
            neg_result=1 if success else 0,
            nat_type_raw=nat_type.to_bytes(4, byteorder),
            mapping_scheme_raw=mapping_scheme.to_bytes(4, byteorder),
            game_name_raw=name.ljust(REPORT_GAMENAME_SIZE, b"\0"),
        )

    @property
    def nat_type(self) -> int | None:
        """The NAT type (0-6 when valid) in either byte order, None if garbage."""
        return _host_int32(self.nat_type_raw)

    @property
    def mapping_scheme(self) -> int | None:
        """The mapping scheme in either byte order, None if garbage."""
        return _host_int32(self.mapping_scheme_raw)

    @property
    def game_name(self) -> str:
        """The game name up to its NUL (it is unterminated at 50+ characters)."""
        return self.game_name_raw.split(b"\0", 1)[0].decode("latin-1")

    def encode(self) -> bytes:
        if (
            len(self.nat_type_raw) != 4
            or len(self.mapping_scheme_raw) != 4
            or len(self.game_name_raw) != REPORT_GAMENAME_SIZE
        ):
            raise LocalProtocolError("REPORT fields have fixed sizes 4, 4 and 50")
        return (
            _header(self.version, self.TYPE, self.cookie)
            + bytes(
                (
                    _u8(self.port_type, "porttype"),
                    _u8(self.client_index, "clientindex"),
                    _u8(self.neg_result, "negResult"),
                )
            )
            + self.nat_type_raw
            + self.mapping_scheme_raw
            + self.game_name_raw
            + self.extra
        )


@frozen
class _PreinitBody:
    """The 18-byte PREINIT layout (ref §3.6); ``client_id`` is opaque (BE here)."""

    TYPE: ClassVar[PacketType]

    version: int
    cookie: int
    client_index: int = 0
    state: int = 0
    client_id: int = 0
    extra: bytes = b""

    def encode(self) -> bytes:
        if not 0 <= self.client_id <= 0xFFFFFFFF:
            raise LocalProtocolError("clientID does not fit 32 bits")
        return (
            _header(self.version, self.TYPE, self.cookie)
            + bytes((_u8(self.client_index, "clientindex"), _u8(self.state, "state")))
            + self.client_id.to_bytes(4, "big")
            + self.extra
        )


@frozen
class Preinit(_PreinitBody):
    """PREINIT (0x0F), v4 (only Nintendo DWC titles send it, ref §1)."""

    TYPE: ClassVar[PacketType] = PacketType.PREINIT


@frozen
class PreinitAck(_PreinitBody):
    """PREINIT_ACK (0x10): ``state`` is a :class:`PreinitState`."""

    TYPE: ClassVar[PacketType] = PacketType.PREINIT_ACK


Packet = (
    Init
    | InitAck
    | ErtTest
    | ErtAck
    | StateUpdate
    | Connect
    | ConnectAck
    | ConnectPing
    | BackupTest
    | BackupAck
    | AddressCheck
    | AddressReply
    | NatifyRequest
    | Report
    | ReportAck
    | Preinit
    | PreinitAck
)


# ---------------------------------------------------------------------- decoding


def _short(data: bytes, need: int, name: str) -> DecodeError:
    return DecodeError(f"{name} needs {need} bytes, got {len(data)}", "short")


def _init_fields(data: bytes) -> tuple[int, int, int, str, int]:
    """porttype, clientindex, usegameport, IPv4 and port of an INIT body at
    offset 12 (ref §3.1-3.2; the caller checked the size)."""
    port = int.from_bytes(data[19:21], "big")
    return data[12], data[13], data[14], bytes_to_ip(data, 15), port


def _decode_init(data: bytes, version: int, cookie: int) -> Init:
    if version == 1:
        if len(data) < INIT_V1_SIZE:
            raise _short(data, INIT_V1_SIZE, "INIT v1")
        return Init(version, cookie, data[12], data[13], data[14])
    if len(data) < INIT_SIZE:
        raise _short(data, INIT_SIZE, "INIT")
    name: str | None = None
    if len(data) > INIT_SIZE:
        raw = data[INIT_SIZE:].split(b"\0", 1)[0]
        if len(raw) > GAMENAME_MAX:
            raise DecodeError("INIT game name longer than 63 bytes", "bad-gamename")
        name = raw.decode("latin-1")
    return Init(version, cookie, *_init_fields(data), name)


_C = TypeVar("_C", bound=_ConnectBody)
_P = TypeVar("_P", bound=_PreinitBody)


def _connect_fields(data: bytes) -> tuple[str, int, int, int]:
    """remote IPv4, remote port, gotyourdata and finished of a CONNECT body at
    offset 12 (ref §3.3; the caller checked the size)."""
    port = int.from_bytes(data[16:18], "big")
    return bytes_to_ip(data, 12), port, data[18], data[19]


def _preinit_fields(data: bytes) -> tuple[int, int, int]:
    """clientindex, state and clientID of a PREINIT body at offset 12 (ref §3.6;
    the caller checked the size)."""
    return data[12], data[13], int.from_bytes(data[14:18], "big")


#: A packet class with a fixed body after the header and a kept tail.
_Body = TypeVar("_Body", bound=_InitBody | _ConnectBody | _PreinitBody)


def _tail_decoder(
    cls: type[_Body], size: int, read: Callable[[bytes], tuple[Any, ...]]
) -> Callable[[bytes, int, int], _Body]:
    """The decoder of ``cls``: at least ``size`` bytes, the fixed fields
    ``read`` takes from them, and the bytes after ``size`` kept as the tail."""

    def decode_body(data: bytes, version: int, cookie: int) -> _Body:
        if len(data) < size:
            raise _short(data, size, cls.TYPE.name)
        values: tuple[Any, ...] = (version, cookie, *read(data), data[size:])
        return cls(*values)

    return decode_body


def _init_body_decoder(cls: type[_Body]) -> Callable[[bytes, int, int], _Body]:
    return _tail_decoder(cls, INIT_SIZE, _init_fields)


def _connect_decoder(cls: type[_Body]) -> Callable[[bytes, int, int], _Body]:
    return _tail_decoder(cls, CONNECT_SIZE, _connect_fields)


def _preinit_decoder(cls: type[_Body]) -> Callable[[bytes, int, int], _Body]:
    return _tail_decoder(cls, PREINIT_SIZE, _preinit_fields)


def _decode_report(data: bytes, version: int, cookie: int) -> Report:
    if len(data) < REPORT_SIZE:
        raise _short(data, REPORT_SIZE, "REPORT")
    return Report(
        version,
        cookie,
        data[12],
        data[13],
        data[14],
        data[15:19],
        data[19:23],
        data[23:73],
        data[REPORT_SIZE:],
    )


def _decode_state_update(data: bytes, version: int, cookie: int) -> StateUpdate:
    return StateUpdate(version, cookie, data[HEADER_SIZE:])


_DECODERS: dict[PacketType, Callable[[bytes, int, int], Packet]] = {
    PacketType.INIT: _decode_init,
    PacketType.INIT_ACK: _init_body_decoder(InitAck),
    PacketType.ERT_TEST: _init_body_decoder(ErtTest),
    PacketType.ERT_ACK: _init_body_decoder(ErtAck),
    PacketType.STATE_UPDATE: _decode_state_update,
    PacketType.CONNECT: _connect_decoder(Connect),
    PacketType.CONNECT_ACK: _init_body_decoder(ConnectAck),
    PacketType.CONNECT_PING: _connect_decoder(ConnectPing),
    PacketType.BACKUP_TEST: _init_body_decoder(BackupTest),
    PacketType.BACKUP_ACK: _init_body_decoder(BackupAck),
    PacketType.ADDRESS_CHECK: _init_body_decoder(AddressCheck),
    PacketType.ADDRESS_REPLY: _init_body_decoder(AddressReply),
    PacketType.NATIFY_REQUEST: _init_body_decoder(NatifyRequest),
    PacketType.REPORT: _decode_report,
    PacketType.REPORT_ACK: _init_body_decoder(ReportAck),
    PacketType.PREINIT: _preinit_decoder(Preinit),
    PacketType.PREINIT_ACK: _preinit_decoder(PreinitAck),
}


#: Type byte -> PacketType without the Enum call (it is on every datagram's path).
_TYPES = tuple(PacketType)


def decode(data: bytes) -> Packet:
    """Decode one datagram.

    Raises:
        DecodeError: with ``reason`` one of ``short``, ``too-long``, ``bad-magic``,
            ``bad-version``, ``bad-type``, ``bad-gamename``.
    """
    if len(data) < HEADER_SIZE:
        raise DecodeError(f"{len(data)} bytes is shorter than a header", "short")
    if len(data) > MAX_PACKET_SIZE:
        raise DecodeError(
            f"{len(data)} bytes is longer than any natneg packet", "too-long"
        )
    if data[:6] != MAGIC:
        raise DecodeError("not natneg magic", "bad-magic")
    version = data[6]
    if version not in SUPPORTED_VERSIONS:
        raise DecodeError(f"unknown natneg version {version}", "bad-version")
    if data[7] >= len(_TYPES):
        raise DecodeError(f"unknown natneg packet type {data[7]}", "bad-type")
    ptype = _TYPES[data[7]]
    cookie = int.from_bytes(data[8:12], "big")
    return _DECODERS[ptype](data, version, cookie)


def encode(packet: Packet) -> bytes:
    """The wire bytes of ``packet``."""
    return packet.encode()
