"""Typed messages between RakNet relay nodes (Store pub/sub).

services/raknet_nodes.py carries them on each node's channel
``raknet:node:<id>``. A coordinator on instance A asks node B to forward::

    {"t": "forward", "from": A, "source": [ip, port], "target": [ip, port],
     "timeout_ms": n}

and B answers on A's channel::

    {"t": "forwarded", "from": B, "source": [...], "target": [...],
     "ip": public IP or "", "result": UDPForwarderResult, "port": n}

:func:`decode_node_message` is the one decoder: any input decodes or raises
:class:`DecodeError` with a reason label (the service drops and counts it).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from crossroads.errors import DecodeError
from crossroads.proto import busjson
from crossroads.proto.raknet.udpproxy import UDP_FORWARDER_MAXIMUM_TIMEOUT_MS
from crossroads.types import Address, frozen

#: Largest registration or command accepted (both are ~200 bytes).
MAX_MESSAGE = 4096
#: Largest ``timeoutOnNoDataMS`` a node accepts from another: what a stock
#: forwarder accepts (``UDP_FORWARDER_MAXIMUM_TIMEOUT``, UDPProxyCommon.h).
MAX_TIMEOUT_MS = UDP_FORWARDER_MAXIMUM_TIMEOUT_MS
#: UDPForwarderResult is one byte on RakNet's wire (UDPForwarder.h).
MAX_RESULT = 255


def decode_address(value: Any) -> Address:
    """``[ip, port]`` from a message, checked."""
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not isinstance(value[1], int)
        or isinstance(value[1], bool)
        or not 0 < value[1] < 65536
    ):
        raise DecodeError("not an [ip, port] pair", "bad-address")
    try:
        ip = str(ipaddress.ip_address(value[0]))
    except ValueError:
        raise DecodeError("not an IP address", "bad-address") from None
    return (ip, value[1])


def _header(kind: str, sender: str, source: Address, target: Address) -> dict[str, Any]:
    """The fields every node message starts with (the module docstring's layout;
    :func:`decode_node_message` reads them before the kind)."""
    return {"t": kind, "from": sender, "source": list(source), "target": list(target)}


@frozen
class Forward:
    """Node ``sender`` asks for a forwarder between ``source`` and ``target``."""

    sender: str
    source: Address
    target: Address
    timeout_ms: int

    def encode(self) -> bytes:
        return busjson.dump_object(
            _header("forward", self.sender, self.source, self.target)
            | {"timeout_ms": self.timeout_ms}
        )


@frozen
class Forwarded:
    """Node ``sender``'s answer: ``result`` and the forwarder's ``ip``:``port``."""

    sender: str
    source: Address
    target: Address
    ip: str
    result: int
    port: int

    def encode(self) -> bytes:
        return busjson.dump_object(
            _header("forwarded", self.sender, self.source, self.target)
            | {"ip": self.ip, "result": self.result, "port": self.port}
        )


NodeMessage = Forward | Forwarded


def decode_node_message(raw: bytes) -> NodeMessage:
    """One command from another node; raises :class:`DecodeError` and nothing else."""
    message = busjson.load_object(raw, MAX_MESSAGE, "bad-command")
    sender = busjson.text(message, "from", "bad-command")
    source = decode_address(message.get("source"))
    target = decode_address(message.get("target"))
    match message.get("t"):
        case "forward":
            timeout = busjson.integer(
                message, "timeout_ms", "bad-timeout", 0, MAX_TIMEOUT_MS
            )
            return Forward(sender, source, target, timeout)
        case "forwarded":
            return Forwarded(
                sender,
                source,
                target,
                busjson.text(message, "ip", "bad-answer"),
                busjson.integer(message, "result", "bad-answer", 0, MAX_RESULT),
                busjson.integer(message, "port", "bad-answer", 0, 65535),
            )
        case _:
            raise DecodeError("unknown command", "unknown-command")
