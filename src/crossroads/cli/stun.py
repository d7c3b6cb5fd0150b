"""``crossroads stun ...``: ask a STUN server from the command line.

::

    crossroads stun binding stun.example.net            # UDP, port 3478
    crossroads stun binding 198.51.100.1:3478 --tcp
    crossroads stun nat 198.51.100.1                    # RFC 5780 NAT behaviour

Output is one JSON object on stdout, for people and scripts alike. Exit code 0
on an answer, 1 when the server did not answer or answered with an error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click

from crossroads.client.stun import (
    StunClientError,
    StunErrorResponse,
    discover_nat,
    stun_binding,
)
from crossroads.types import Address

DEFAULT_PORT = 3478


def parse_server(text: str) -> Address:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else DEFAULT_PORT
        return host, port
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        return host, int(port_text)
    return text, DEFAULT_PORT


def _emit(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2))


@click.group()
def stun() -> None:
    """Query STUN servers (RFC 8489, RFC 5780)."""


@stun.command()
@click.argument("server")
@click.option("--tcp", is_flag=True, help="Use TCP instead of UDP.")
def binding(server: str, tcp: bool) -> None:
    """Send one Binding request and print the reflexive address."""
    address = parse_server(server)
    try:
        result = asyncio.run(stun_binding(address, transport="tcp" if tcp else "udp"))
    except (StunClientError, OSError) as exc:
        _emit({"server": _fmt(address), "error": str(exc)})
        sys.exit(1)
    _emit(
        {
            "server": _fmt(result.server),
            "local": _fmt(result.local),
            "mapped": _fmt(result.mapped),
            "response_origin": _maybe(result.response_origin),
            "other_address": _maybe(result.other_address),
            "software": result.software,
            "rtt_ms": round(result.rtt * 1000, 2),
            "transmissions": result.transmissions,
        }
    )


@stun.command()
@click.argument("server")
@click.option("--no-hairpin", is_flag=True, help="Skip the hairpinning test.")
def nat(server: str, no_hairpin: bool) -> None:
    """RFC 5780 NAT behaviour discovery: mapping, filtering, hairpinning."""
    address = parse_server(server)
    try:
        behavior = asyncio.run(discover_nat(address, hairpinning=not no_hairpin))
    except StunErrorResponse as exc:
        _emit({"server": _fmt(address), "error": str(exc)})
        sys.exit(1)
    except (StunClientError, OSError) as exc:
        _emit({"server": _fmt(address), "udp": False, "error": str(exc)})
        sys.exit(1)
    _emit(
        {
            "server": _fmt(address),
            "udp": True,
            "local": _fmt(behavior.local),
            "mapped": _fmt(behavior.mapped),
            "behind_nat": behavior.behind_nat,
            "rfc5780": behavior.rfc5780_supported,
            "other_address": _maybe(behavior.other_address),
            "mapping": None if behavior.mapping is None else str(behavior.mapping),
            "filtering": None
            if behavior.filtering is None
            else str(behavior.filtering),
            "hairpinning": behavior.hairpinning,
            "notes": list(behavior.notes),
        }
    )


def _fmt(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _maybe(address: Address | None) -> str | None:
    return None if address is None else _fmt(address)
