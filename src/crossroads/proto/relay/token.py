"""Allocation secrets: the sealed ``connectionData`` token and the BIND HMAC key.

Unity describes ``connectionData`` as an "encrypted connection data blob" that
the client echoes in BIND and, for the host's, in CONNECT_REQUEST; its content is
the relay's business. crossroads makes it a self-contained AES-256-GCM token
(reference §4.1: "crossroads' own AEAD-sealed ≤255-byte token"), sealed with a
secret shared by the allocation API and the relay nodes, so that a relay node
validates a BIND with no lookup and no prior message from the API:

=====  ======  ==============================================================
bytes  field   meaning
=====  ======  ==============================================================
1      0x01    token format version
12     nonce   AES-GCM nonce (random, from the injected source)
16     id      this allocation's ID (``allocationIdBytes``)
16     host    the host allocation's ID (== ``id`` for a host)
1      role    0 host, 1 joiner
2      maxc    host's ``maxConnections`` (big-endian)
8      dl      bind deadline, Unix milliseconds (big-endian): the first BIND
               must arrive before it (seed 003: "within 10 seconds")
16     tag     GCM tag; associated data = the relay node ID, so a token made
               for one node does not open on another
=====  ======  ==============================================================

72 bytes in all; clients zero-pad it to 255 on the wire and trailing bytes are
ignored. The 64-byte HMAC ``key`` is HMAC-SHA512(secret, "relay-key" || id): the
node derives it from the allocation ID and the secret, so it never travels
between API and node.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from crossroads.errors import DecodeError, LocalProtocolError
from crossroads.proto.relay.messages import (
    ALLOCATION_ID_SIZE,
    BIND_SIGNED_SIZE,
    KEY_SIZE,
)
from crossroads.types import frozen

TOKEN_VERSION: Final = 1
_NONCE_SIZE: Final = 12
_TAG_SIZE: Final = 16
_PLAIN_SIZE: Final = ALLOCATION_ID_SIZE * 2 + 1 + 2 + 8
TOKEN_SIZE: Final = 1 + _NONCE_SIZE + _PLAIN_SIZE + _TAG_SIZE  # 72
_AAD_PREFIX: Final = b"crossroads-relay-token-v1:"


class Role(IntEnum):
    HOST = 0
    JOINER = 1


@frozen
class AllocationClaims:
    """What a ``connectionData`` token says about its allocation."""

    allocation_id: bytes
    host_allocation_id: bytes
    role: Role
    max_connections: int
    #: Unix time (seconds) before which the first BIND must arrive.
    bind_deadline: float

    @property
    def is_host(self) -> bool:
        return self.role is Role.HOST


class TokenSealer:
    """Seals and opens ``connectionData`` tokens, and derives allocation keys.

    Args:
        secret: the cluster secret shared by the allocation API and relay nodes.
        random_bytes: the randomness source (``os.urandom`` in production).
    """

    def __init__(
        self,
        secret: bytes,
        random_bytes: Callable[[int], bytes],
        previous: Sequence[bytes] = (),
    ) -> None:
        """``previous``: secrets this node held before it adopted ``secret``
        (store/shared_secret.py); tokens they sealed still open, with their
        keys. New tokens and keys always use ``secret``."""
        for candidate in (secret, *previous):
            if len(candidate) < 16:
                raise LocalProtocolError("relay secret must be at least 16 bytes")
        self._secret = secret
        self._secrets = (secret, *previous)
        self._aeads = [
            AESGCM(hmac.new(s, b"relay-token-aead", hashlib.sha256).digest())
            for s in self._secrets
        ]
        self._aead = self._aeads[0]
        self._random = random_bytes

    def key_for(self, allocation_id: bytes) -> bytes:
        """The 64-byte HMAC key of an allocation (the API's base64 ``key``)."""
        return _allocation_key(self._secret, allocation_id)

    def keys_for(self, allocation_id: bytes) -> tuple[bytes, ...]:
        """The allocation's key under the current secret, then under each
        previous one (tokens sealed before an adoption still open)."""
        return tuple(_allocation_key(s, allocation_id) for s in self._secrets)

    def open_with_key(
        self, data: bytes, node_id: str
    ) -> tuple[AllocationClaims, bytes]:
        """:meth:`open`, plus the allocation's HMAC key under the secret that
        sealed the token (the current one or a previous one)."""
        claims, index = self._open(data, node_id)
        return claims, _allocation_key(self._secrets[index], claims.allocation_id)

    def seal(self, claims: AllocationClaims, node_id: str) -> bytes:
        """The token for ``claims``, valid on relay node ``node_id`` only."""
        if len(claims.allocation_id) != ALLOCATION_ID_SIZE:
            raise LocalProtocolError("allocation_id must be 16 bytes")
        if len(claims.host_allocation_id) != ALLOCATION_ID_SIZE:
            raise LocalProtocolError("host_allocation_id must be 16 bytes")
        if not 0 <= claims.max_connections <= 0xFFFF:
            raise LocalProtocolError("max_connections must fit in 16 bits")
        plain = (
            claims.allocation_id
            + claims.host_allocation_id
            + bytes((claims.role,))
            + claims.max_connections.to_bytes(2, "big")
            + max(0, int(claims.bind_deadline * 1000)).to_bytes(8, "big")
        )
        nonce = self._random(_NONCE_SIZE)
        sealed = self._aead.encrypt(nonce, plain, _AAD_PREFIX + node_id.encode())
        return bytes((TOKEN_VERSION,)) + nonce + sealed

    def open(self, data: bytes, node_id: str) -> AllocationClaims:
        """Verify and read a token (trailing zero padding is ignored).

        Raises:
            DecodeError: not a token sealed by this secret for this node.
        """
        return self._open(data, node_id)[0]

    def _open(self, data: bytes, node_id: str) -> tuple[AllocationClaims, int]:
        if len(data) < TOKEN_SIZE or data[0] != TOKEN_VERSION:
            raise DecodeError("not a crossroads relay token", reason="bad-token")
        nonce = bytes(data[1 : 1 + _NONCE_SIZE])
        sealed = bytes(data[1 + _NONCE_SIZE : TOKEN_SIZE])
        aad = _AAD_PREFIX + node_id.encode()
        plain, index = self._decrypt(nonce, sealed, aad)
        try:
            role = Role(plain[32])
        except ValueError:
            raise DecodeError(
                "relay token has an unknown role", reason="bad-token"
            ) from None
        claims = AllocationClaims(
            allocation_id=plain[0:16],
            host_allocation_id=plain[16:32],
            role=role,
            max_connections=int.from_bytes(plain[33:35], "big"),
            bind_deadline=int.from_bytes(plain[35:43], "big") / 1000,
        )
        return claims, index

    def _decrypt(self, nonce: bytes, sealed: bytes, aad: bytes) -> tuple[bytes, int]:
        """The plaintext and the index of the secret that sealed it."""
        for index, aead in enumerate(self._aeads):
            try:
                return aead.decrypt(nonce, sealed, aad), index
            except InvalidTag:
                continue
        raise DecodeError("relay token does not verify", reason="bad-token")


def _allocation_key(secret: bytes, allocation_id: bytes) -> bytes:
    return hmac.new(secret, b"relay-key" + allocation_id, hashlib.sha512).digest()


def bind_hmac(key: bytes, signed_bytes: bytes) -> bytes:
    """HMAC-SHA256 of the first 263 bytes of a BIND (UTP ``ComputeBindHMAC``)."""
    if len(key) != KEY_SIZE:
        raise LocalProtocolError(f"HMAC key must be {KEY_SIZE} bytes")
    return hmac.new(key, signed_bytes[:BIND_SIGNED_SIZE], hashlib.sha256).digest()


def verify_bind_hmac(key: bytes, bind: bytes) -> bool:
    """Whether a raw 295-byte BIND carries the right HMAC (constant-time compare)."""
    expected = hmac.new(key, bind[:BIND_SIGNED_SIZE], hashlib.sha256).digest()
    return hmac.compare_digest(expected, bind[BIND_SIGNED_SIZE:])
