"""``crossroads host`` / ``crossroads join CODE``: a peer-to-peer chat over the SDK.

Both ends print every line the other types, with the connection step that won
(``lan``, ``direct``, ``mapping``, ``punch`` or ``relay``) and how long it took.
Lines go peer to peer, sealed end to end; the server only introduced the peers.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from crossroads.cli.loop import run_async
from crossroads.client.p2p import (
    HostChanged,
    LinkDown,
    LinkUp,
    MemberJoined,
    MemberLeft,
    P2PClient,
)
from crossroads.proto.punch import signalling as sig
from crossroads.transport.tasks import cancel_and_wait
from crossroads.types import frozen

DEFAULT_SERVER = "ws://127.0.0.1:8080/p2p/v1/ws"


def _out(text: str) -> None:
    click.echo(text)
    sys.stdout.flush()


def _short(peer: str) -> str:
    return peer[:8]


def _where(client: P2PClient, peer: str) -> str:
    """`` (IPv6 [2001:db8::7]:5000)``: where the link runs, when over UDP."""
    link = client.links.get(peer)
    if link is None or link.addr[0].startswith("relay:"):
        return ""
    host, port = link.addr
    if ":" in host:
        return f" (IPv6 [{host}]:{port})"
    return f" ({host}:{port})"


async def _chat(client: P2PClient) -> None:
    async def show_events() -> None:
        while True:
            event = await client.events.get()
            match event:
                case LinkUp(peer=peer, step=step, seconds=seconds):
                    _out(
                        f"* connected to {_short(peer)} via {step}"
                        f"{_where(client, peer)} in {seconds * 1000:.0f} ms"
                    )
                case LinkDown(peer=peer, reason=reason):
                    _out(f"* link to {_short(peer)} down: {reason}")
                case MemberJoined(peer=peer):
                    _out(f"* {_short(peer)} joined")
                case MemberLeft(peer=peer):
                    _out(f"* {_short(peer)} left")
                case HostChanged(new=new):
                    who = "you are" if new == client.peer_id else f"{_short(new)} is"
                    _out(f"* {who} the host now")
                case _:
                    pass

    async def show_data() -> None:
        while True:
            peer, data = await client.recv()
            link = client.links.get(peer)
            via = f"{link.step}" if link else "?"
            _out(f"<{_short(peer)} via {via}> {data.decode('utf-8', 'replace')}")

    tasks = [asyncio.create_task(show_events()), asyncio.create_task(show_data())]
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            text = line.rstrip("\n")
            if text:
                sent = client.broadcast(text.encode()[:1200])
                if not sent:
                    _out("* nobody to send to yet")
        # Give the last lines a moment to leave before the links close.
        await asyncio.sleep(0.5)
    finally:
        await asyncio.gather(*(cancel_and_wait(task) for task in tasks))


def _address(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    host, _, port = text.rpartition(":")
    try:
        return (host.strip("[]"), int(port))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not HOST:PORT") from None


def _show_nat(client: P2PClient) -> None:
    if client.nat is not None:
        n = client.nat
        _out(
            f"* NAT type: {n.name} ({n.friendly}); mapping {n.mapping or '?'}, "
            f"filtering {n.filtering or '?'}"
        )


@frozen
class _ClientSettings:
    """The options ``host`` and ``join`` share: how this peer's client is made."""

    server: str
    relay: str
    portmap: bool
    stun: tuple[str, int] | None
    bind: str

    def client(self) -> P2PClient:
        return P2PClient(
            self.server,
            relay=self.relay,
            portmap=self.portmap,
            stun=self.stun,
            bind=(self.bind, 0),
        )


async def _host(settings: _ClientSettings, max_members: int) -> None:
    async with settings.client() as client:
        _show_nat(client)
        code = await client.host(max_members)
        _out(f"invite code: {code}")
        _out(
            f"(you are {_short(client.peer_id)}; public UDP {client.public}, NAT mapping {client.mapping})"
        )
        await _chat(client)


async def _join(settings: _ClientSettings, code: str) -> None:
    async with settings.client() as client:
        _show_nat(client)
        await client.join(code)
        for peer, link in client.links.items():
            _out(
                f"* connected to {_short(peer)} via {link.step}"
                f"{_where(client, peer)} in {link.seconds * 1000:.0f} ms"
            )
        _out(
            f"* joined {client.code}; host is {_short(client.host_peer)}. Type lines to chat."
        )
        await _chat(client)


def _options(command: Any) -> Any:
    command = click.option(
        "--server",
        envvar="CROSSROADS_P2P_SERVER",
        default=DEFAULT_SERVER,
        show_default=True,
        help="Signalling WebSocket URL of a crossroads p2p service.",
    )(command)
    command = click.option(
        "--relay",
        type=click.Choice(["allow", "force", "never"]),
        default="allow",
        show_default=True,
        help="Relay control: try direct steps first, relay only, or never relay.",
    )(command)
    command = click.option(
        "--stun",
        default=None,
        metavar="HOST:PORT",
        help="Detect the NAT type (RFC 5780) against this STUN server first.",
    )(command)
    command = click.option(
        "--bind",
        default="0.0.0.0",
        show_default=True,
        metavar="IPV4",
        help="Local IPv4 address of the peer socket. The IPv6 socket follows it: "
        ":: beside 0.0.0.0, ::1 beside a loopback address, none otherwise.",
    )(command)
    command = click.option(
        "--portmap/--no-portmap",
        default=False,
        help="Ask the home gateway for a port mapping (PCP, NAT-PMP, UPnP-IGD).",
    )(command)
    return command


@click.command("host")
@_options
@click.option("--max-members", default=sig.MAX_MEMBERS, show_default=True, type=int)
def host(
    server: str,
    relay: str,
    stun: str | None,
    portmap: bool,
    max_members: int,
    bind: str,
) -> None:
    """Create a p2p session, print its invite code, chat with whoever joins."""
    run_async(
        _host(
            _ClientSettings(server, relay, portmap, _address(stun), bind), max_members
        )
    )


@click.command("join")
@click.argument("code")
@_options
def join(
    code: str, server: str, relay: str, stun: str | None, portmap: bool, bind: str
) -> None:
    """Join the p2p session behind CODE and chat with its members."""
    try:
        run_async(
            _join(_ClientSettings(server, relay, portmap, _address(stun), bind), code)
        )
    except Exception as exc:  # noqa: BLE001 - one line for the user, exit 1
        click.echo(f"crossroads join: {exc}", err=True)
        sys.exit(1)
