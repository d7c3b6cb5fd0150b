"""``crossroads stun ...``: ask a STUN server from the command line.

::

    crossroads stun binding stun.example.net            # UDP, port 3478
    crossroads stun binding 198.51.100.1:3478 --tcp
    crossroads stun nat 198.51.100.1                    # RFC 5780 NAT behaviour

Output is one JSON object on stdout, for people and scripts alike. Exit code 0
on an answer, 1 when the server did not answer or answered with an error, 2
when SERVER is not an address (click's usage error, on stderr).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, NoReturn

import click

from crossroads.client.stun import (
    StunClientError,
    StunErrorResponse,
    discover_nat,
    stun_binding,
)
from crossroads.types import Address, show_address

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


def _server(ctx: click.Context, param: click.Parameter, value: str) -> Address:
    """The SERVER argument as an address (:func:`parse_server`); anything
    else is a usage error (exit 2), not a traceback."""
    try:
        host, port = parse_server(value)
    except ValueError:
        host, port = "", 0
    if not host or not 0 < port < 65536:
        raise click.BadParameter(f"{value!r} is not HOST, HOST:PORT or [IPv6]:PORT")
    return host, port


def _emit(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2))


def _fail(address: Address, exc: Exception, **known: Any) -> NoReturn:
    """Print the server, what is ``known`` so far and the error; exit 1."""
    _emit({"server": show_address(address), **known, "error": str(exc)})
    sys.exit(1)


@click.group()
def stun() -> None:
    """Query STUN servers (RFC 8489, RFC 5780)."""


@stun.command()
@click.argument("address", metavar="SERVER", callback=_server)
@click.option("--tcp", is_flag=True, help="Use TCP instead of UDP.")
def binding(address: Address, tcp: bool) -> None:
    """Send one Binding request and print the reflexive address."""
    try:
        result = asyncio.run(stun_binding(address, transport="tcp" if tcp else "udp"))
    except (StunClientError, OSError) as exc:
        _fail(address, exc)
    _emit(
        {
            "server": show_address(result.server),
            "local": show_address(result.local),
            "mapped": show_address(result.mapped),
            "response_origin": _maybe(result.response_origin),
            "other_address": _maybe(result.other_address),
            "software": result.software,
            "rtt_ms": round(result.rtt * 1000, 2),
            "transmissions": result.transmissions,
        }
    )


@stun.command()
@click.argument("address", metavar="SERVER", callback=_server)
@click.option("--no-hairpin", is_flag=True, help="Skip the hairpinning test.")
def nat(address: Address, no_hairpin: bool) -> None:
    """RFC 5780 NAT behaviour discovery: mapping, filtering, hairpinning."""
    try:
        behavior = asyncio.run(discover_nat(address, hairpinning=not no_hairpin))
    except StunErrorResponse as exc:
        _fail(address, exc)
    except (StunClientError, OSError) as exc:
        _fail(address, exc, udp=False)
    _emit(
        {
            "server": show_address(address),
            "udp": True,
            "local": show_address(behavior.local),
            "mapped": show_address(behavior.mapped),
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


def _maybe(address: Address | None) -> str | None:
    return None if address is None else show_address(address)
