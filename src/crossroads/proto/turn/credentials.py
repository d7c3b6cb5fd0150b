"""The client side of the long-term credential mechanism (RFC 8489 §9.2).

:class:`LongTermSession` remembers what a TURN client learns from 401/438 answers
(REALM, NONCE, PASSWORD-ALGORITHMS) and signs requests with it. It is used by the
crossroads TURN client (:mod:`crossroads.client.turn`) and by the tests that drive
the server core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossroads.proto.stun import (
    Attribute,
    Message,
    MessageIntegrity,
    MessageIntegritySha256,
    Nonce,
    PasswordAlgorithm,
    PasswordAlgorithmId,
    PasswordAlgorithms,
    Realm,
    Username,
    check_message_integrity,
    check_message_integrity_sha256,
    encode,
    long_term_key,
)


@dataclass(slots=True)
class LongTermSession:
    """Credentials plus the realm/nonce state of one client-server session."""

    username: str
    password: str = field(repr=False)
    realm: str = ""
    nonce: str = ""
    #: Use SHA-256 keys and MESSAGE-INTEGRITY-SHA256 when the server offers them.
    prefer_sha256: bool = True
    algorithm: int = PasswordAlgorithmId.MD5
    offered: PasswordAlgorithms | None = None
    _key: bytes | None = None

    @property
    def ready(self) -> bool:
        """True once a realm and nonce are known."""
        return bool(self.realm and self.nonce)

    @property
    def key(self) -> bytes:
        """The long-term key for the current realm and algorithm."""
        if self._key is None:
            self._key = long_term_key(
                self.username, self.realm, self.password, self.algorithm
            )
        return self._key

    def renew(self, username: str, password: str) -> None:
        """Sign from now on with new credentials (fresh time-limited ones of the
        same user); the realm, nonce and algorithm stay."""
        self.username = username
        self.password = password
        self._key = None

    @property
    def sha256(self) -> bool:
        return self.algorithm == PasswordAlgorithmId.SHA256

    def learn(self, answer: Message) -> bool:
        """Take REALM / NONCE / PASSWORD-ALGORITHMS from a 401 or 438 answer.

        Returns True when something usable was learned (retry the request).
        """
        realm = answer.get(Realm)
        nonce = answer.get(Nonce)
        if nonce is None:
            return False
        if realm is not None and realm.value != self.realm:
            self.realm = realm.value
            self._key = None
        self.nonce = nonce.value
        offered = answer.get(PasswordAlgorithms)
        if offered is not None:
            self.offered = offered
            ids = [algorithm for algorithm, _ in offered.algorithms]
            wanted = (
                PasswordAlgorithmId.SHA256
                if self.prefer_sha256 and PasswordAlgorithmId.SHA256 in ids
                else PasswordAlgorithmId.MD5
            )
            if wanted != self.algorithm:
                self.algorithm = wanted
                self._key = None
        return bool(self.realm)

    def sign(self, message: Message, *, fingerprint: bool = True) -> bytes:
        """Encode ``message`` with USERNAME, REALM, NONCE and integrity."""
        kept = tuple(
            a
            for a in message.attributes
            if not isinstance(
                a,
                Username
                | Realm
                | Nonce
                | PasswordAlgorithm
                | PasswordAlgorithms
                | MessageIntegrity
                | MessageIntegritySha256,
            )
        )
        extra: list[Attribute] = [
            Username(self.username),
            Realm(self.realm),
            Nonce(self.nonce),
        ]
        if self.offered is not None:
            # RFC 8489 §9.2.4: echo the list and name the choice.
            extra.append(self.offered)
            extra.append(PasswordAlgorithm(self.algorithm))
        signed = Message(
            message.msg_class,
            message.method,
            message.transaction_id,
            kept + tuple(extra),
            message.cookie,
        )
        if self.sha256:
            return encode(
                signed, integrity_sha256_key=self.key, fingerprint=fingerprint
            )
        return encode(signed, integrity_key=self.key, fingerprint=fingerprint)

    def verify(self, raw: bytes, answer: Message) -> bool:
        """Whether a response carries valid integrity for our key."""
        if answer.get(MessageIntegritySha256) is not None:
            return check_message_integrity_sha256(raw, self.key)
        if answer.get(MessageIntegrity) is not None:
            return check_message_integrity(raw, self.key)
        return False
