"""STUN credentials: key derivation and integrity checks on raw messages.

Keys (RFC 8489 §9):

- short-term: ``key = OpaqueString(password)``;
- long-term: ``key = H(username ":" OpaqueString(realm) ":" OpaqueString(password))``
  with H = MD5, or SHA-256 when PASSWORD-ALGORITHM says so (§18.5);
- USERHASH: ``SHA-256(OpaqueString(username) ":" OpaqueString(realm))`` (§14.4).

String preparation uses SASLprep (RFC 4013), as RFC 5389 did: the RFC 5769 §2.4
and RFC 8489 Appendix B.1 vectors map ``"The\\u00adM\\u00aatr\\u2168"`` to
``"TheMatrIX"``, which SASLprep does (soft hyphen removed, NFKC) and PRECIS
OpaqueString would reject. For ASCII passwords both give the same bytes.

Checks work on the raw datagram because the HMAC covers the bytes as received
(padding included): encode with :func:`crossroads.proto.stun.message.encode`,
verify with :func:`check_message_integrity` / :func:`check_message_integrity_sha256`.
Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import stringprep
import struct
import unicodedata
import zlib

from crossroads.errors import LocalProtocolError
from crossroads.proto.stun.constants import (
    FINGERPRINT_XOR,
    HEADER_LENGTH,
    AttrType,
    PasswordAlgorithmId,
)

_U16 = struct.Struct("!H")
_ATTR_HEADER = struct.Struct("!HH")


def saslprep(text: str) -> str:
    """RFC 4013 SASLprep (stored-string profile).

    Raises:
        LocalProtocolError: the string has prohibited or unassigned characters
            or breaks the bidirectional rules.
    """
    if text.isascii() and text.isprintable():
        return text  # fast path: printable ASCII maps to itself
    # RFC 4013 §2.1: map non-ASCII spaces to SPACE, "commonly mapped to nothing"
    # characters (RFC 3454 table B.1) to nothing.
    mapped = "".join(
        " " if stringprep.in_table_c12(c) else c
        for c in text
        if not stringprep.in_table_b1(c)
    )
    # §2.2: normalisation form KC.
    prepared = unicodedata.normalize("NFKC", mapped)
    # §2.3 prohibited output, §2.5 unassigned code points.
    for c in prepared:
        if (
            stringprep.in_table_c12(c)
            or stringprep.in_table_c21_c22(c)
            or stringprep.in_table_c3(c)
            or stringprep.in_table_c4(c)
            or stringprep.in_table_c5(c)
            or stringprep.in_table_c6(c)
            or stringprep.in_table_c7(c)
            or stringprep.in_table_c8(c)
            or stringprep.in_table_c9(c)
            or stringprep.in_table_a1(c)
        ):
            raise LocalProtocolError(f"SASLprep: prohibited character {c!r}")
    # §2.4 bidirectional characters (RFC 3454 §6).
    if any(stringprep.in_table_d1(c) for c in prepared):
        if any(stringprep.in_table_d2(c) for c in prepared):
            raise LocalProtocolError("SASLprep: mixed bidirectional text")
        if not (
            stringprep.in_table_d1(prepared[0]) and stringprep.in_table_d1(prepared[-1])
        ):
            raise LocalProtocolError("SASLprep: RandAL text must start and end RandAL")
    return prepared


def short_term_key(password: str) -> bytes:
    """RFC 8489 §9.1.1: the short-term credential key."""
    return saslprep(password).encode("utf-8")


def long_term_key(
    username: str,
    realm: str,
    password: str,
    algorithm: int = PasswordAlgorithmId.MD5,
) -> bytes:
    """RFC 8489 §9.2.2: the long-term credential key (MD5 or SHA-256)."""
    material = f"{username}:{saslprep(realm)}:{saslprep(password)}".encode()
    if algorithm == PasswordAlgorithmId.MD5:
        return hashlib.md5(material, usedforsecurity=False).digest()
    if algorithm == PasswordAlgorithmId.SHA256:
        return hashlib.sha256(material).digest()
    raise LocalProtocolError(f"unknown password algorithm {algorithm}")


def userhash(username: str, realm: str) -> bytes:
    """RFC 8489 §14.4: USERHASH value."""
    return hashlib.sha256(f"{saslprep(username)}:{saslprep(realm)}".encode()).digest()


def find_attribute(data: bytes, attr_type: int) -> tuple[int, int] | None:
    """``(offset of the attribute header, value length)`` of the first attribute
    of ``attr_type`` in a raw message, or None. Stops at malformed input."""
    size = len(data)
    offset = HEADER_LENGTH
    while offset + 4 <= size:
        atype, alen = _ATTR_HEADER.unpack_from(data, offset)
        if offset + 4 + alen > size:
            return None
        if atype == attr_type:
            return offset, alen
        offset += 4 + alen + (-alen & 3)
    return None


def _hmac_prefix(
    data: bytes, offset: int, covered_length: int, key: bytes, digest: str
) -> bytes:
    # RFC 8489 §14.5: the HMAC input is the message up to the attribute, with the
    # header length field set as if the attribute ended the message.
    mac = hmac.new(key, data[:2], digest)
    mac.update(_U16.pack(covered_length))
    mac.update(data[4:offset])
    return mac.digest()


def check_message_integrity(data: bytes, key: bytes) -> bool:
    """Whether the raw message carries a valid MESSAGE-INTEGRITY for ``key``."""
    found = find_attribute(data, AttrType.MESSAGE_INTEGRITY)
    if found is None or found[1] != 20:
        return False
    offset, _ = found
    expected = _hmac_prefix(data, offset, offset + 24 - HEADER_LENGTH, key, "sha1")
    return hmac.compare_digest(expected, data[offset + 4 : offset + 24])


def check_message_integrity_sha256(data: bytes, key: bytes) -> bool:
    """Whether the raw message carries a valid MESSAGE-INTEGRITY-SHA256."""
    found = find_attribute(data, AttrType.MESSAGE_INTEGRITY_SHA256)
    if found is None:
        return False
    offset, length = found
    if length not in (16, 20, 24, 28, 32):
        return False
    expected = _hmac_prefix(
        data, offset, offset + 4 + length - HEADER_LENGTH, key, "sha256"
    )
    return hmac.compare_digest(
        expected[:length], data[offset + 4 : offset + 4 + length]
    )


def check_fingerprint(data: bytes) -> bool:
    """Whether the raw message ends with a correct FINGERPRINT."""
    if len(data) < HEADER_LENGTH + 8:
        return False
    offset = len(data) - 8
    atype, alen = _ATTR_HEADER.unpack_from(data, offset)
    if atype != AttrType.FINGERPRINT or alen != 4:
        return False
    return int.from_bytes(data[offset + 4 :], "big") == fingerprint_value(data, offset)


def fingerprint_value(data: bytes | bytearray, fp_offset: int) -> int:
    """FINGERPRINT for a FINGERPRINT attribute at ``fp_offset``: CRC-32 of the
    message before it, with the length field covering it, XOR 0x5354554e
    (RFC 8489 §14.7)."""
    crc = zlib.crc32(data[:2] + _U16.pack(fp_offset + 8 - HEADER_LENGTH))
    crc = zlib.crc32(memoryview(data)[4:fp_offset], crc)
    return crc ^ FINGERPRINT_XOR
