"""End-to-end encryption of the peer channel: X25519 + HKDF + ChaCha20-Poly1305.

Theory of operation
-------------------
Each SDK instance makes a fresh X25519 key pair per signalling connection and
announces the public key in ``hello``. The server hands each side the other's
key in ``punch_start`` / ``join_start`` / ``member_joined``, so the keys are
authenticated by the signalling session (the same trust a client already gives
the server that introduces it to its peers; run the server behind TLS). Both
sides compute ``X25519(mine, theirs)`` and expand it with HKDF-SHA256 into two
directional keys and two 8-byte receiver ids, ordered by the public keys so that
both sides agree on who is "low" and who is "high".

Every datagram between peers — the punch probes included — is sealed::

    0xC5 | receiver id (8) | counter u64 BE (8) | ChaCha20-Poly1305(plaintext) + tag (16)

The 17-byte header is the AEAD's associated data, the nonce is four zero bytes
and the counter. A relay (TURN, Unity relay, anything in the path) sees only the
receiver id and the counter; it cannot read, forge or alter a payload. The
receiver id lets a socket find the right key before decrypting, whatever address
the datagram came from — which is what hole punching needs, since the peer's
address is not known until its first packet arrives.

Replays are refused with a 2048-counter sliding window (the size WireGuard uses;
RFC 6479 describes the technique): a counter already seen, or older than the
window, is dropped. The window moves only after a datagram authenticates, so
forged packets cannot shift it. Keys are per process run and per peer pair
(forward secrecy once the process exits); a channel refuses to send after 2^60
datagrams rather than reuse a nonce.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto import replay
from crossroads.types import frozen

PACKET_TYPE = 0xC5
HEADER = struct.Struct("!B8sQ")
HEADER_SIZE = HEADER.size  # 17
TAG_SIZE = 16
OVERHEAD = HEADER_SIZE + TAG_SIZE + 1  # + the kind byte
#: Sliding replay window, in counters (WireGuard's REJECT_AFTER... window is 2048).
REPLAY_WINDOW = 2048
#: Refuse to send long before the 64-bit counter (the nonce) could wrap.
MAX_COUNTER = 2**60
#: HKDF salt: binds the keys to this protocol and version.
KDF_SALT = b"crossroads p2p peer channel v1"


class Kind(IntEnum):
    """What a sealed datagram carries (its first plaintext byte)."""

    PROBE = 1  # ladder probe: step u8, seq u16, sent-at u32 ms
    PROBE_ACK = 2  # echo of a probe's body
    DATA = 3  # application payload
    KEEPALIVE = 4  # empty; proves the path is alive
    CLOSE = 5  # the peer is closing the link
    CONTROL = 6  # SDK control (JSON): mesh membership, host changes


@frozen
class ChannelKeys:
    send_key: bytes
    recv_key: bytes
    #: Id put in datagrams we send (the peer looks it up).
    send_id: bytes
    #: Id the peer puts in datagrams for us.
    recv_id: bytes


def derive_keys(
    private: X25519PrivateKey, their_public: bytes, context: bytes = b""
) -> ChannelKeys:
    """Directional keys for the channel between ``private``'s owner and the holder
    of ``their_public``. ``context`` (the punch attempt number) makes each
    attempt's keys fresh, so datagrams of an earlier attempt cannot be replayed
    into a later one. Raises :class:`DecodeError` on an invalid peer key."""
    mine = private.public_key().public_bytes_raw()
    if their_public == mine:
        raise DecodeError("peer key equals our own", "bad-key")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(their_public))
    except ValueError:
        # cryptography refuses low-order points (all-zero shared secret).
        raise DecodeError("peer key is not a valid X25519 key", "bad-key") from None
    low, high = sorted((mine, their_public))
    material = HKDF(
        algorithm=hashes.SHA256(), length=80, salt=KDF_SALT, info=low + high + context
    ).derive(shared)
    key_low_to_high, key_high_to_low = material[:32], material[32:64]
    id_low, id_high = material[64:72], material[72:80]
    if mine == low:
        return ChannelKeys(key_low_to_high, key_high_to_low, id_high, id_low)
    return ChannelKeys(key_high_to_low, key_low_to_high, id_low, id_high)


def receiver_id(datagram: bytes) -> bytes | None:
    """The receiver id of a sealed datagram, or None if it is not one."""
    if len(datagram) < HEADER_SIZE + TAG_SIZE + 1 or datagram[0] != PACKET_TYPE:
        return None
    return datagram[1:9]


class ReplayWindow(replay.ReplayWindow):
    """Sliding-window replay check over the 64-bit counters."""

    __slots__ = ()
    SIZE: ClassVar[int] = REPLAY_WINDOW


class SecureChannel:
    """Seal and open datagrams for one peer (sans-I/O; see module docstring)."""

    def __init__(self, keys: ChannelKeys) -> None:
        self.keys = keys
        self._send = ChaCha20Poly1305(keys.send_key)
        self._recv = ChaCha20Poly1305(keys.recv_key)
        self._counter = 0
        self._window = ReplayWindow()

    def seal(self, kind: Kind, payload: bytes = b"") -> bytes:
        if self._counter >= MAX_COUNTER:
            raise LocalProtocolError("peer channel counter exhausted; reconnect")
        counter = self._counter
        self._counter += 1
        header = HEADER.pack(PACKET_TYPE, self.keys.send_id, counter)
        nonce = b"\0\0\0\0" + counter.to_bytes(8, "big")
        return header + self._send.encrypt(nonce, bytes([kind]) + payload, header)

    def open(self, datagram: bytes) -> tuple[Kind, bytes]:
        """Authenticate and decrypt; raises :class:`DecodeError` with reason
        ``short``, ``not-sealed``, ``wrong-receiver``, ``replay``, ``auth`` or
        ``bad-kind``."""
        if len(datagram) < HEADER_SIZE + TAG_SIZE + 1:
            raise DecodeError("sealed datagram too short", "short")
        packet_type, rid, counter = HEADER.unpack_from(datagram)
        if packet_type != PACKET_TYPE:
            raise DecodeError("not a sealed datagram", "not-sealed")
        if rid != self.keys.recv_id:
            raise DecodeError("datagram is for another channel", "wrong-receiver")
        if not self._window.fresh(counter):
            raise DecodeError("replayed or too old datagram", "replay")
        nonce = b"\0\0\0\0" + counter.to_bytes(8, "big")
        try:
            plain = self._recv.decrypt(
                nonce, datagram[HEADER_SIZE:], datagram[:HEADER_SIZE]
            )
        except InvalidTag:
            raise DecodeError("datagram failed authentication", "auth") from None
        self._window.accept(counter)
        try:
            kind = Kind(plain[0])
        except ValueError:
            raise DecodeError("unknown sealed datagram kind", "bad-kind") from None
        return kind, plain[1:]
