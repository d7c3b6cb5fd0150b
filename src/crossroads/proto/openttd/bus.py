"""Typed messages between OpenTTD coordinator instances (Store pub/sub).

Each coordinator instance subscribes to its own channel ``openttd:gc:<id>``;
whoever needs something done by the instance holding a socket publishes one of
these there (services/openttd/bus.py carries them):

- :class:`ForwardToServer`: write these packet bytes to the server registered as
  ``code`` (a join handled by another instance talks to the server through the
  instance that holds it);
- :class:`PeerReport`: a server reported on attempt ``token`` to an instance
  other than the attempt's owner (the owner's id is inside the token); the
  report is one of :data:`Report`;
- :class:`StunSeen`: the STUN service saw ``token``'s packet from host:port;
- :class:`DropSession`: a newer registration of ``code`` replaced session
  ``session``; close it.

On the wire each is one flat JSON object tagged by ``"t"`` (``send``,
``event``, ``seen``, ``drop``), the format instances of earlier versions
publish, so a rolling upgrade keeps working. :func:`decode_bus_message` is the
one decoder: any input either decodes or raises :class:`DecodeError` with a
reason label (the bus drops and counts it); nothing else escapes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from crossroads.errors import DecodeError
from crossroads.proto import busjson
from crossroads.proto.openttd.wire import TCP_MTU
from crossroads.types import frozen

#: Largest bus message accepted: a packet is at most :data:`TCP_MTU` bytes
#: (32 KiB), ~44 KiB in base64, plus the envelope.
MAX_MESSAGE = 64 * 1024
#: Largest base64 text of a packet (4 characters per 3 bytes, padded).
MAX_PACKET_BASE64 = 4 * ((TCP_MTU + 2) // 3)
#: Address families, STUN results and tracking numbers are u8 on the OpenTTD
#: wire (reference ``openttd-coordinator.md`` sections 5-6).
U8_MAX = 255


@frozen
class ConnectFailedReport:
    """SERCLI_CONNECT_FAILED: the method ``tracking_number`` failed."""

    tracking_number: int


@frozen
class ConnectedReport:
    """SERCLI_CLIENT_CONNECTED: the client reached the server."""


@frozen
class StunReport:
    """SERCLI_STUN_RESULT: whether the STUN packet of ``family`` went out."""

    family: int
    ok: bool


Report = ConnectFailedReport | ConnectedReport | StunReport


@frozen
class ForwardToServer:
    code: str
    data: bytes

    def encode(self) -> bytes:
        data = base64.b64encode(self.data).decode()
        return busjson.dump_object({"t": "send", "code": self.code, "data": data})


@frozen
class PeerReport:
    token: str
    code: str
    report: Report

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"t": "event", "token": self.token, "code": self.code}
        match self.report:
            case ConnectFailedReport(tracking_number):
                fields |= {"ev": "failed", "n": tracking_number}
            case ConnectedReport():
                fields["ev"] = "connected"
            case StunReport(family, ok):
                fields |= {"ev": "stun", "family": family, "ok": ok}
        return busjson.dump_object(fields)


@frozen
class StunSeen:
    token: str
    family: int
    host: str
    port: int

    def encode(self) -> bytes:
        return busjson.dump_object(
            {
                "t": "seen",
                "token": self.token,
                "family": self.family,
                "host": self.host,
                "port": self.port,
            }
        )


@frozen
class DropSession:
    code: str
    session: str

    def encode(self) -> bytes:
        return busjson.dump_object(
            {"t": "drop", "code": self.code, "session": self.session}
        )


BusMessage = ForwardToServer | PeerReport | StunSeen | DropSession


def _send(message: dict[str, Any]) -> ForwardToServer:
    text = busjson.text(message, "data", "bad-send", MAX_PACKET_BASE64)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise DecodeError("packet is not base64", "bad-send") from None
    if len(data) > TCP_MTU:
        raise DecodeError("packet larger than TCP_MTU", "bad-send")
    return ForwardToServer(busjson.text(message, "code", "bad-send"), data)


def _report(message: dict[str, Any]) -> Report:
    match message.get("ev"):
        case "failed":
            return ConnectFailedReport(
                busjson.integer(message, "n", "bad-event", 0, U8_MAX)
            )
        case "connected":
            return ConnectedReport()
        case "stun":
            return StunReport(
                busjson.integer(message, "family", "bad-event", 0, U8_MAX),
                busjson.boolean(message, "ok", "bad-event"),
            )
        case _:
            raise DecodeError("unknown report", "bad-event")


def _event(message: dict[str, Any]) -> PeerReport:
    return PeerReport(
        busjson.text(message, "token", "bad-event"),
        busjson.text(message, "code", "bad-event"),
        _report(message),
    )


def _seen(message: dict[str, Any]) -> StunSeen:
    return StunSeen(
        busjson.text(message, "token", "bad-seen"),
        busjson.integer(message, "family", "bad-seen", 0, U8_MAX),
        busjson.text(message, "host", "bad-seen"),
        busjson.integer(message, "port", "bad-seen", 0, 65535),
    )


def _drop(message: dict[str, Any]) -> DropSession:
    return DropSession(
        busjson.text(message, "code", "bad-drop"),
        busjson.text(message, "session", "bad-drop"),
    )


_DECODERS: dict[str, Callable[[dict[str, Any]], BusMessage]] = {
    "send": _send,
    "event": _event,
    "seen": _seen,
    "drop": _drop,
}


def decode_bus_message(raw: bytes) -> BusMessage:
    """One message from the bus; raises :class:`DecodeError` and nothing else."""
    message = busjson.load_object(raw, MAX_MESSAGE)
    tag = message.get("t")
    decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
    if decoder is None:
        raise DecodeError("unknown bus message", "unknown-message")
    return decoder(message)
