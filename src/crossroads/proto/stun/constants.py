"""STUN numbers: message classes and methods, attribute types, error codes.

Sources: RFC 8489 §5, §6, §14, §18 (STUN); RFC 5780 §7 (behaviour discovery);
RFC 8656 §17-§19 (TURN); RFC 6062 §6 (TURN-TCP); RFC 8445 §16 (ICE); RFC 3489 §11
(classic STUN); the table in ``shared/reference/stun-turn.md`` §3.2.
"""

from __future__ import annotations

from enum import IntEnum

#: RFC 8489 §5: the fixed value in bytes 4-7 of every RFC 5389/8489 message. A
#: message without it comes from an RFC 3489 client.
MAGIC_COOKIE = 0x2112A442
MAGIC_COOKIE_BYTES = MAGIC_COOKIE.to_bytes(4, "big")

#: RFC 8489 §14.7: FINGERPRINT is CRC-32 of the message XOR this value ("STUN").
FINGERPRINT_XOR = 0x5354554E

#: RFC 8489 §5: 20-byte header: type (2), length (2), cookie (4), transaction id (12).
HEADER_LENGTH = 20
TRANSACTION_ID_LENGTH = 12

#: RFC 8489 §14: attributes below 0x8000 must be understood; above may be ignored.
COMPREHENSION_OPTIONAL_MIN = 0x8000


class Class(IntEnum):
    """RFC 8489 §5: the two class bits C1 C0 of the message type."""

    REQUEST = 0b00
    INDICATION = 0b01
    SUCCESS = 0b10
    ERROR = 0b11


class Method(IntEnum):
    """STUN methods (12 bits)."""

    BINDING = 0x001  # RFC 8489
    ALLOCATE = 0x003  # RFC 8656 (request/response only)
    REFRESH = 0x004  # RFC 8656
    SEND = 0x006  # RFC 8656 (indication only)
    DATA = 0x007  # RFC 8656 (indication only)
    CREATE_PERMISSION = 0x008  # RFC 8656
    CHANNEL_BIND = 0x009  # RFC 8656
    CONNECT = 0x00A  # RFC 6062
    CONNECTION_BIND = 0x00B  # RFC 6062
    CONNECTION_ATTEMPT = 0x00C  # RFC 6062 (indication)


class AttrType(IntEnum):
    """Attribute types (IANA "STUN Attributes" registry)."""

    # Comprehension-required (0x0000-0x7FFF)
    MAPPED_ADDRESS = 0x0001  # RFC 8489
    RESPONSE_ADDRESS = 0x0002  # RFC 3489 (reserved in 8489)
    CHANGE_REQUEST = 0x0003  # RFC 5780
    SOURCE_ADDRESS = 0x0004  # RFC 3489 (reserved in 8489)
    CHANGED_ADDRESS = 0x0005  # RFC 3489 (reserved in 8489)
    USERNAME = 0x0006  # RFC 8489
    MESSAGE_INTEGRITY = 0x0008  # RFC 8489
    ERROR_CODE = 0x0009  # RFC 8489
    UNKNOWN_ATTRIBUTES = 0x000A  # RFC 8489
    CHANNEL_NUMBER = 0x000C  # RFC 8656
    LIFETIME = 0x000D  # RFC 8656
    XOR_PEER_ADDRESS = 0x0012  # RFC 8656
    DATA = 0x0013  # RFC 8656
    REALM = 0x0014  # RFC 8489
    NONCE = 0x0015  # RFC 8489
    XOR_RELAYED_ADDRESS = 0x0016  # RFC 8656
    REQUESTED_ADDRESS_FAMILY = 0x0017  # RFC 8656 (RFC 6156)
    EVEN_PORT = 0x0018  # RFC 8656
    REQUESTED_TRANSPORT = 0x0019  # RFC 8656
    DONT_FRAGMENT = 0x001A  # RFC 8656
    ACCESS_TOKEN = 0x001B  # RFC 7635 (not implemented: answered with 420)
    MESSAGE_INTEGRITY_SHA256 = 0x001C  # RFC 8489
    PASSWORD_ALGORITHM = 0x001D  # RFC 8489
    USERHASH = 0x001E  # RFC 8489
    XOR_MAPPED_ADDRESS = 0x0020  # RFC 8489
    RESERVATION_TOKEN = 0x0022  # RFC 8656
    PRIORITY = 0x0024  # RFC 8445 (ICE)
    USE_CANDIDATE = 0x0025  # RFC 8445 (ICE)
    PADDING = 0x0026  # RFC 5780
    RESPONSE_PORT = 0x0027  # RFC 5780
    CONNECTION_ID = 0x002A  # RFC 6062
    # Comprehension-optional (0x8000-0xFFFF)
    ADDITIONAL_ADDRESS_FAMILY = 0x8000  # RFC 8656
    ADDRESS_ERROR_CODE = 0x8001  # RFC 8656
    PASSWORD_ALGORITHMS = 0x8002  # RFC 8489
    ALTERNATE_DOMAIN = 0x8003  # RFC 8489
    ICMP = 0x8004  # RFC 8656
    SOFTWARE = 0x8022  # RFC 8489
    ALTERNATE_SERVER = 0x8023  # RFC 8489
    CACHE_TIMEOUT = 0x8027  # RFC 5780
    FINGERPRINT = 0x8028  # RFC 8489
    ICE_CONTROLLED = 0x8029  # RFC 8445
    ICE_CONTROLLING = 0x802A  # RFC 8445
    RESPONSE_ORIGIN = 0x802B  # RFC 5780
    OTHER_ADDRESS = 0x802C  # RFC 5780
    THIRD_PARTY_AUTHORIZATION = 0x802E  # RFC 7635


class ErrorCode(IntEnum):
    """ERROR-CODE values (RFC 8489 §14.8, RFC 8656 §19, RFC 6062 §6.3)."""

    TRY_ALTERNATE = 300
    BAD_REQUEST = 400
    UNAUTHENTICATED = 401
    FORBIDDEN = 403
    UNKNOWN_ATTRIBUTE = 420
    ALLOCATION_MISMATCH = 437
    STALE_NONCE = 438
    ADDRESS_FAMILY_NOT_SUPPORTED = 440
    WRONG_CREDENTIALS = 441
    UNSUPPORTED_TRANSPORT_PROTOCOL = 442
    PEER_ADDRESS_FAMILY_MISMATCH = 443
    CONNECTION_ALREADY_EXISTS = 446
    CONNECTION_TIMEOUT_OR_FAILURE = 447
    ALLOCATION_QUOTA_REACHED = 486
    ROLE_CONFLICT = 487  # RFC 8445
    SERVER_ERROR = 500
    INSUFFICIENT_CAPACITY = 508


#: Recommended reason phrases (RFC 8489 §14.8, RFC 8656 §19, RFC 6062 §6.3).
REASONS: dict[int, str] = {
    300: "Try Alternate",
    400: "Bad Request",
    401: "Unauthenticated",
    403: "Forbidden",
    420: "Unknown Attribute",
    437: "Allocation Mismatch",
    438: "Stale Nonce",
    440: "Address Family not Supported",
    441: "Wrong Credentials",
    442: "Unsupported Transport Protocol",
    443: "Peer Address Family Mismatch",
    446: "Connection Already Exists",
    447: "Connection Timeout or Failure",
    486: "Allocation Quota Reached",
    487: "Role Conflict",
    500: "Server Error",
    508: "Insufficient Capacity",
}


def reason_phrase(code: int) -> str:
    """The recommended reason phrase for ``code`` (or a generic one)."""
    return REASONS.get(code, "Error")


class AddressFamily(IntEnum):
    """Address family byte of address attributes and REQUESTED-ADDRESS-FAMILY."""

    IPV4 = 0x01
    IPV6 = 0x02


class PasswordAlgorithmId(IntEnum):
    """RFC 8489 §18.5: PASSWORD-ALGORITHM numbers."""

    MD5 = 0x0001
    SHA256 = 0x0002


class TransportProtocol(IntEnum):
    """REQUESTED-TRANSPORT values: IANA protocol numbers (RFC 8656, RFC 6062)."""

    TCP = 6
    UDP = 17


def message_type(method: int, msg_class: int) -> int:
    """RFC 8489 §5: interleave the 12 method bits with the two class bits."""
    return (
        (method & 0x000F)
        | ((method & 0x0070) << 1)
        | ((method & 0x0F80) << 2)
        | ((msg_class & 0b01) << 4)
        | ((msg_class & 0b10) << 7)
    )


def split_message_type(mtype: int) -> tuple[int, int]:
    """Inverse of :func:`message_type`: ``(method, class)``."""
    method = (mtype & 0x000F) | ((mtype & 0x00E0) >> 1) | ((mtype & 0x3E00) >> 2)
    msg_class = ((mtype & 0x0010) >> 4) | ((mtype & 0x0100) >> 7)
    return method, msg_class


#: Wire message types used on hot paths.
BINDING_REQUEST = message_type(Method.BINDING, Class.REQUEST)  # 0x0001
BINDING_INDICATION = message_type(Method.BINDING, Class.INDICATION)  # 0x0011
BINDING_SUCCESS = message_type(Method.BINDING, Class.SUCCESS)  # 0x0101
BINDING_ERROR = message_type(Method.BINDING, Class.ERROR)  # 0x0111
