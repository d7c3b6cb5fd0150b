"""TURN numbers: methods, error codes, transports, lifetimes and limits.

Every timer and limit carries the reason for its value (RFC section or
``shared/reference/stun-turn.md`` section).
"""

from __future__ import annotations

from enum import IntEnum


class TurnMethod(IntEnum):
    """STUN methods defined by TURN (RFC 8656 §18, RFC 6062 §6.1)."""

    ALLOCATE = 0x003
    REFRESH = 0x004
    SEND = 0x006
    DATA = 0x007
    CREATE_PERMISSION = 0x008
    CHANNEL_BIND = 0x009
    CONNECT = 0x00A
    CONNECTION_BIND = 0x00B
    CONNECTION_ATTEMPT = 0x00C


class TurnError(IntEnum):
    """Error codes a TURN server sends (RFC 8489 §14.8, RFC 8656 §19, RFC 6062 §6.3)."""

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
    SERVER_ERROR = 500
    INSUFFICIENT_CAPACITY = 508


#: Reason phrases. Kept short on purpose: a 401 answers an unauthenticated
#: request, and DESIGN.md forbids replies much larger than the request.
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
    500: "Server Error",
    508: "Insufficient Capacity",
}


class Transport(IntEnum):
    """IP protocol numbers, as in REQUESTED-TRANSPORT (RFC 8656 §18.7)."""

    TCP = 6
    UDP = 17


class Family(IntEnum):
    """Address family codes of REQUESTED-/ADDITIONAL-ADDRESS-FAMILY (RFC 8656 §18.8)."""

    IPV4 = 0x01
    IPV6 = 0x02


# ------------------------------------------------------------------ lifetimes

#: RFC 8656 §7.2: "the server ... uses the default lifetime of 10 minutes"
#: when the request has no LIFETIME or asks for less.
DEFAULT_ALLOCATION_LIFETIME = 600.0
#: RFC 8656 §7.2 lets the server cap the lifetime; coturn and pion use 1 hour
#: (reference §3.3), so does crossroads unless configured otherwise.
DEFAULT_MAX_ALLOCATION_LIFETIME = 3600.0
#: RFC 8656 §9: "The Permission Lifetime MUST be 300 seconds (= 5 minutes)."
PERMISSION_LIFETIME = 300.0
#: RFC 8656 §12: a channel binding lasts 10 minutes unless refreshed.
CHANNEL_LIFETIME = 600.0
#: RFC 8656 §12: after a binding expires the client must wait 5 minutes before
#: binding the number or the peer to something else; the server enforces it by
#: keeping the expired pair reserved that long.
CHANNEL_QUARANTINE = 300.0
#: RFC 8656 §7.2 (EVEN-PORT R bit): "the server ... reserve[s] the port for
#: approximately 30 seconds".
RESERVATION_LIFETIME = 30.0
#: RFC 6062 §5.3: a peer connection not bound by ConnectionBind within 30 s
#: is closed.
CONNECTION_BIND_TIMEOUT = 30.0
#: RFC 6062 §4.3: the server gives up connecting to a peer after this long
#: (the RFC leaves it open; browsers use ~30 s as well).
CONNECT_TIMEOUT = 30.0
#: How long a nonce stays fresh before 438 (coturn's --stale-nonce default is
#: 600 s; RFC 8489 §9.2 leaves it to the server).
NONCE_LIFETIME = 600.0

# ------------------------------------------------------------------ numbers

#: RFC 8656 §12: channel numbers 0x4000-0x4FFF; 0x5000-0x7FFF is reserved for
#: RFC 7983 demultiplexing. RFC 5766 allowed up to 0x7FFF and many deployed
#: clients (coturn's uclient, libre, aioice) still pick from that range.
CHANNEL_MIN = 0x4000
CHANNEL_MAX_RFC8656 = 0x4FFF
CHANNEL_MAX_RFC5766 = 0x7FFF
#: Datagrams larger than this never fit a UDP payload over IPv4/IPv6 anyway.
MAX_DATAGRAM = 65507
#: RFC 6062 §5.2: the server buffers peer data until ConnectionBind; bounded.
MAX_PENDING_PEER_BYTES = 64 * 1024
