"""DTLS 1.2 PSK key schedule and record protection on ``cryptography``'s primitives.

- PRF: TLS 1.2 P_hash (RFC 5246 §5) with the suite's hash.
- Premaster from a PSK alone (RFC 4279 §2): ``uint16 N, N zero bytes, uint16 N, psk``.
- Master secret (RFC 5246 §8.1), or the extended master secret over the session
  hash when both sides offered it (RFC 7627 §4).
- AEAD records (RFC 5288 §3, RFC 6655 §3, RFC 6347 §4.1.2.1): nonce = 4-byte
  implicit salt from the key block + 8-byte explicit part sent in the record
  (we send epoch||sequence, which never repeats); additional data =
  epoch||sequence||type||version||plaintext length.
- A 64-record anti-replay window (RFC 6347 §4.1.2.6).

Only AEAD suites: Unity Transport reserves 37 bytes per record for DTLS
(reference unity-secure-transports.md §1.2): 13 header + 8 nonce + 16 tag fits
AES-GCM and AES-CCM, not CBC.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import field
from typing import ClassVar, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESCCM, AESGCM

from crossroads.errors import DecodeError
from crossroads.proto import replay
from crossroads.proto.dtls import wire as w
from crossroads.types import frozen

#: RFC 5288 §3 / RFC 6655 §3: 8 explicit nonce bytes in every record.
EXPLICIT_NONCE_SIZE: Final = 8
#: RFC 5288 §3: 4 implicit bytes (client_write_IV / server_write_IV).
FIXED_IV_SIZE: Final = 4
#: RFC 5246 §8.1: the master secret is 48 bytes.
MASTER_SECRET_SIZE: Final = 48
#: RFC 6347 §4.1.2.6: "a window size of 64 is preferred".
REPLAY_WINDOW: Final = 64

Aead = AESGCM | AESCCM
#: RFC 5246 §6.2.3.3 additional data: epoch, 48-bit sequence (16 + 32 bits),
#: type, version, plaintext length.
_AAD: Final = struct.Struct("!HHIBHH")


@frozen
class CipherSuite:
    """One AEAD PSK cipher suite."""

    code: int
    name: str
    hash_name: str
    key_size: int
    tag_size: int
    make_aead: Callable[[bytes], Aead]

    @property
    def overhead(self) -> int:
        """Record bytes beyond the plaintext: header, explicit nonce, tag."""
        return 13 + EXPLICIT_NONCE_SIZE + self.tag_size


def _gcm(key: bytes) -> Aead:
    return AESGCM(key)


def _ccm16(key: bytes) -> Aead:
    return AESCCM(key, tag_length=16)


def _ccm8(key: bytes) -> Aead:
    return AESCCM(key, tag_length=8)


#: Server preference order. Codes: RFC 5487 §3.1 (0x00A8, 0x00A9), RFC 6655 §4
#: (0xC0A4, 0xC0A8).
SUITES: Final[dict[int, CipherSuite]] = {
    s.code: s
    for s in (
        CipherSuite(0x00A8, "PSK-AES128-GCM-SHA256", "sha256", 16, 16, _gcm),
        CipherSuite(0x00A9, "PSK-AES256-GCM-SHA384", "sha384", 32, 16, _gcm),
        CipherSuite(0xC0A4, "PSK-AES128-CCM", "sha256", 16, 16, _ccm16),
        CipherSuite(0xC0A8, "PSK-AES128-CCM8", "sha256", 16, 8, _ccm8),
    )
}


def prf(hash_name: str, secret: bytes, label: bytes, seed: bytes, size: int) -> bytes:
    """TLS 1.2 PRF (RFC 5246 §5): P_hash(secret, label + seed)."""
    seed = label + seed
    out = b""
    a = seed
    while len(out) < size:
        a = hmac.new(secret, a, hash_name).digest()
        out += hmac.new(secret, a + seed, hash_name).digest()
    return out[:size]


def psk_premaster(psk: bytes) -> bytes:
    """RFC 4279 §2: the premaster secret of a plain PSK key exchange."""
    size = len(psk).to_bytes(2, "big")
    return size + bytes(len(psk)) + size + psk


def master_secret(
    suite: CipherSuite,
    premaster: bytes,
    client_random: bytes,
    server_random: bytes,
    session_hash: bytes | None,
) -> bytes:
    """RFC 5246 §8.1, or RFC 7627 §4 when ``session_hash`` is given."""
    if session_hash is not None:
        return prf(
            suite.hash_name,
            premaster,
            b"extended master secret",
            session_hash,
            MASTER_SECRET_SIZE,
        )
    return prf(
        suite.hash_name,
        premaster,
        b"master secret",
        client_random + server_random,
        MASTER_SECRET_SIZE,
    )


def transcript_hash(suite: CipherSuite, messages: list[bytes]) -> bytes:
    """The hash of the handshake messages so far (RFC 5246 §7.4.9, and the
    session hash of RFC 7627 §3)."""
    return hashlib.new(suite.hash_name, b"".join(messages)).digest()


def verify_data(
    suite: CipherSuite, master: bytes, from_client: bool, transcript: list[bytes]
) -> bytes:
    """RFC 5246 §7.4.9: the Finished message body after the handshake
    messages ``transcript``."""
    label = b"client finished" if from_client else b"server finished"
    digest = transcript_hash(suite, transcript)
    return prf(suite.hash_name, master, label, digest, w.VERIFY_DATA_SIZE)


@frozen
class KeyBlock:
    client_key: bytes
    server_key: bytes
    client_iv: bytes
    server_iv: bytes


def key_block(
    suite: CipherSuite, master: bytes, client_random: bytes, server_random: bytes
) -> KeyBlock:
    """RFC 5246 §6.3 (AEAD suites have no MAC keys)."""
    size = 2 * suite.key_size + 2 * FIXED_IV_SIZE
    block = prf(
        suite.hash_name, master, b"key expansion", server_random + client_random, size
    )
    k = suite.key_size
    return KeyBlock(
        client_key=block[:k],
        server_key=block[k : 2 * k],
        client_iv=block[2 * k : 2 * k + FIXED_IV_SIZE],
        server_iv=block[2 * k + FIXED_IV_SIZE :],
    )


class RecordProtection:
    """One direction's AEAD state for one epoch."""

    __slots__ = ("suite", "epoch", "_aead", "_salt")

    def __init__(self, suite: CipherSuite, key: bytes, salt: bytes, epoch: int) -> None:
        self.suite = suite
        self.epoch = epoch
        self._aead = suite.make_aead(key)
        self._salt = salt

    def seal(self, content_type: int, sequence: int, plaintext: bytes) -> bytes:
        """The whole protected record."""
        high, low = sequence >> 32, sequence & 0xFFFFFFFF
        size = len(plaintext)
        header = w.RECORD_HEADER.pack(
            content_type,
            w.DTLS1_2,
            self.epoch,
            high,
            low,
            size + EXPLICIT_NONCE_SIZE + self.suite.tag_size,
        )
        explicit = header[3:11]
        aad = _AAD.pack(self.epoch, high, low, content_type, w.DTLS1_2, size)
        sealed = self._aead.encrypt(self._salt + explicit, plaintext, aad)
        return header + explicit + sealed

    def seal_warning(self, sequence: int, description: int) -> bytes:
        """A warning-level alert (RFC 5246 §7.2: close_notify, no_renegotiation)
        protected as record ``sequence``."""
        alert = w.Alert(w.AlertLevel.WARNING, description)
        return self.seal(w.ContentType.ALERT, sequence, alert.encode())

    def open(self, record: w.Record) -> bytes:
        """The plaintext of ``record``; DecodeError when it does not authenticate."""
        fragment = record.fragment
        plain_size = len(fragment) - EXPLICIT_NONCE_SIZE - self.suite.tag_size
        if plain_size < 0:
            raise DecodeError("record shorter than its AEAD overhead", "truncated")
        sequence = record.sequence
        aad = _AAD.pack(
            record.epoch,
            sequence >> 32,
            sequence & 0xFFFFFFFF,
            record.content_type,
            record.version,
            plain_size,
        )
        nonce = self._salt + fragment[:EXPLICIT_NONCE_SIZE]
        try:
            return self._aead.decrypt(nonce, fragment[EXPLICIT_NONCE_SIZE:], aad)
        except InvalidTag:
            raise DecodeError("record does not authenticate", "bad-mac") from None


@frozen
class SessionKeys:
    """What a PSK key exchange yields: the master secret and the epoch-1
    protection of each direction (the client writes with ``client_write``, the
    server reads with it, and the other way round)."""

    master: bytes = field(repr=False)
    client_write: RecordProtection
    server_write: RecordProtection


def psk_session_keys(
    suite: CipherSuite,
    psk: bytes,
    client_random: bytes,
    server_random: bytes,
    session_hash: bytes | None,
) -> SessionKeys:
    """The key schedule of a plain PSK handshake, the same on both ends:
    RFC 4279 §2 premaster, RFC 5246 §8.1 (or RFC 7627 §4 with
    ``session_hash``) master secret, RFC 5246 §6.3 key block; epoch 1 is the
    first protected epoch (RFC 6347 §4.1)."""
    master = master_secret(
        suite, psk_premaster(psk), client_random, server_random, session_hash
    )
    keys = key_block(suite, master, client_random, server_random)
    return SessionKeys(
        master,
        RecordProtection(suite, keys.client_key, keys.client_iv, 1),
        RecordProtection(suite, keys.server_key, keys.server_iv, 1),
    )


class ReplayWindow(replay.ReplayWindow):
    """RFC 6347 §4.1.2.6 sliding window over received sequence numbers."""

    __slots__ = ()
    SIZE: ClassVar[int] = REPLAY_WINDOW


def open_fresh(read: RecordProtection, window: ReplayWindow, record: w.Record) -> bytes:
    """The plaintext of a record not seen before: RFC 6347 §4.1.2.6 checks the
    replay window first and marks the record seen only once it authenticated.

    Raises:
        DecodeError: ``replayed``, or ``bad-mac`` when it does not authenticate
            (a record too short for its AEAD overhead included).
    """
    if not window.fresh(record.sequence):
        raise DecodeError("record already received or too old", "replayed")
    try:
        plain = read.open(record)
    except DecodeError as exc:
        raise DecodeError(str(exc), "bad-mac") from None
    window.accept(record.sequence)
    return plain
