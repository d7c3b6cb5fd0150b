"""TURN numbers: methods, error codes, transports, lifetimes and limits.

Every timer and limit carries the reason for its value (RFC section or
``shared/reference/stun-turn.md`` section).
"""

from __future__ import annotations

from enum import IntEnum

from crossroads.proto.stun.constants import REASONS as STUN_REASONS
from crossroads.proto.stun.constants import AddressFamily, ErrorCode, Method

# TURN's methods, error codes, reason phrases and address family codes are the
# STUN codec's own tables (they cover RFC 8656 and RFC 6062); the TURN names
# stay as aliases.
TurnMethod = Method
TurnError = ErrorCode
REASONS = STUN_REASONS
#: Address family codes of REQUESTED-/ADDITIONAL-ADDRESS-FAMILY (RFC 8656
#: §18.8), the same bytes as the address attributes' family (RFC 8489 §14.1).
Family = AddressFamily


class Transport(IntEnum):
    """IP protocol numbers, as in REQUESTED-TRANSPORT (RFC 8656 §18.7)."""

    TCP = 6
    UDP = 17


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
