"""The crossroads error tree.

::

    CrossroadsError
    ├── ConfigError                  bad configuration; the CLI prints it and exits 2
    ├── StoreError                   the shared store failed (Redis down, ...)
    └── ProtocolError
        ├── LocalProtocolError       we were asked to send something the protocol forbids
        └── RemoteProtocolError      the peer sent something the protocol forbids
            └── DecodeError          bytes that do not decode (also a ValueError)

Server cores never let a ``RemoteProtocolError`` escape to the transport: they drop
the input and count it, or answer with the protocol's own error.
"""

from __future__ import annotations


class CrossroadsError(Exception):
    """Base class of every error raised by crossroads."""


class ConfigError(CrossroadsError):
    """Invalid configuration. The message is one line naming the offending key."""


class StoreError(CrossroadsError):
    """The shared store could not complete an operation."""


class ProtocolError(CrossroadsError):
    """Base class of protocol violations."""


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer did something the protocol does not allow."""


class DecodeError(RemoteProtocolError, ValueError):
    """Bytes from the network that are not a valid message.

    ``reason`` is a short, stable, metric-label-friendly token (``"short"``,
    ``"bad-magic"``, ...); the message text is for humans.
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason
