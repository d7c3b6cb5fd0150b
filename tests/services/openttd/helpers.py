"""Protocol-level OpenTTD peers for the service tests.

They follow what OpenTTD 13 does on the wire (network_coordinator.cpp,
network_stun.cpp, network_turn.cpp), packet for packet, so the tests exercise
the same sequences the interop tests run with the real binary.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from crossroads.client.openttd import GcClient, PacketStream
from crossroads.config import default_config
from crossroads.proto.openttd.coordinator import (
    ConnectionType,
    GcConnectFailed,
    GcMessage,
    GcRegisterAck,
    GcStunRequest,
    ServerRegister,
    ServerUpdate,
    StunResult,
)
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRFSerialization
from crossroads.proto.openttd.stun import StunRequest, encode_stun_packet
from crossroads.proto.openttd.turn import (
    TurnConnect,
    decode_turn_reply,
    encode_turn_packet,
)
from crossroads.runtime import Runtime, start
from crossroads.services.openttd import OpenTTDService
from tests.conftest import eventually, loopback_config

AF_INET = 2
AF_INET6 = 10  # Linux (reference section 6)


async def start_openttd(store: str = "memory", **overrides: Any) -> Runtime:
    values = loopback_config(core__only="openttd", core__store=store)
    values.update({f"openttd.{k}": v for k, v in overrides.items()})
    return await start(default_config(values))


def service(rt: Runtime) -> OpenTTDService:
    svc = rt.services["openttd"]
    assert isinstance(svc, OpenTTDService)
    return svc


def port_of(rt: Runtime, role: str) -> int:
    return service(rt).address(role)[1]


async def gc(rt: Runtime, version: int = 6) -> GcClient:
    return await GcClient.connect("127.0.0.1", port_of(rt, "coordinator"), version)


async def stun(rt: Runtime, token: str, family: int = AF_INET) -> PacketStream:
    """Open a STUN connection and send SERCLI_STUN, as OpenTTD does per family."""
    stream = await PacketStream.open("127.0.0.1", port_of(rt, "stun"))
    await stream.send(encode_stun_packet(StunRequest(6, token, family)))
    return stream


async def answer_stun_request(
    rt: Runtime, client: GcClient, token: str, *, ipv4_ok: bool = True
) -> list[PacketStream]:
    """What OpenTTD does on GC_STUN_REQUEST: IPv6 fails (no ::1 STUN), IPv4 connects."""
    streams = []
    await client.send_message(StunResult(client.version, token, AF_INET6, False))
    if ipv4_ok:
        streams.append(await stun(rt, token))
    await client.send_message(StunResult(client.version, token, AF_INET, ipv4_ok))
    return streams


async def recv_until(client: GcClient, kind: type, timeout: float = 10.0) -> Any:
    """Next message of ``kind``, skipping others (returned in ``client.skipped``)."""
    async with asyncio.timeout(timeout):
        while True:
            message = await client.recv(timeout)
            if isinstance(message, kind):
                return message


@dataclass
class Registered:
    client: GcClient
    ack: GcRegisterAck
    messages: list[GcMessage] = field(default_factory=list)
    stun_streams: list[PacketStream] = field(default_factory=list)

    @property
    def code(self) -> str:
        return self.ack.invite_code

    async def close(self) -> None:
        for stream in self.stun_streams:
            await stream.close()
        await self.client.close()


async def register(
    rt: Runtime,
    game_port: int,
    *,
    version: int = 6,
    game_type: int = 1,
    code: str = "",
    secret: str = "",
    stun_ok: bool = True,
    stun_rt: Runtime | None = None,
    client: GcClient | None = None,
) -> Registered:
    """Register like OpenTTD: REGISTER, answer the STUN request, wait for the ACK."""
    client = client or await gc(rt, version)
    await client.send_message(
        ServerRegister(version, game_type, game_port, code, secret)
    )
    registered = Registered(client, GcRegisterAck(ConnectionType.UNKNOWN))
    while True:
        message = await client.recv(15)
        registered.messages.append(message)
        if isinstance(message, GcStunRequest):
            registered.stun_streams += await answer_stun_request(
                stun_rt or rt, client, message.token, ipv4_ok=stun_ok
            )
        elif isinstance(message, GcConnectFailed):
            for stream in registered.stun_streams:
                await stream.close()
            registered.stun_streams = []
        elif isinstance(message, GcRegisterAck):
            registered.ack = message
            return registered
        else:
            raise AssertionError(f"unexpected {message}")


async def update(
    registered: Registered,
    info: GameInfo,
    nst: NewGRFSerialization = NewGRFSerialization.GRFID_MD5_NAME,
) -> None:
    await registered.client.send_message(
        ServerUpdate(registered.client.version, 6, nst, info)
    )


async def turn_connect(rt: Runtime | str, ticket: str) -> tuple[PacketStream, str]:
    """Connect to the TURN service and present a ticket; returns the stream and peer."""
    if isinstance(rt, str):
        host, _, port = rt.rpartition(":")
        stream = await PacketStream.open(host, int(port))
    else:
        stream = await PacketStream.open("127.0.0.1", port_of(rt, "turn"))
    await stream.send(encode_turn_packet(TurnConnect(6, ticket)))
    return stream, ""


async def turn_connected(stream: PacketStream) -> str:
    reply = decode_turn_reply(*await stream.recv_packet(10))
    assert hasattr(reply, "hostname"), reply
    return str(reply.hostname)


async def http_get(rt: Runtime, path: str) -> httpx.Response:
    host, port = rt.http_address
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
        return await http.get(path)


async def listed_names(rt: Runtime) -> list[str]:
    """Names in the public listing, asking for a fresh read of the store first."""
    coordinator = service(rt).coordinator
    assert coordinator is not None
    coordinator.listing.invalidate()
    return [
        entry["info"]["server_name"]
        for entry in (await http_get(rt, "/openttd/servers")).json()
    ]


async def until_listed(rt: Runtime, *names: str) -> None:
    """Wait until the public listing holds exactly ``names`` (in any order)."""

    async def check() -> bool:
        return sorted(await listed_names(rt)) == sorted(names)

    await eventually(check, f"public listing == {sorted(names)}")


async def until_named(rt: Runtime, code: str, name: str) -> None:
    """Wait until the record under ``code`` (public or not) carries ``name``."""

    async def check() -> bool:
        response = await http_get(rt, f"/openttd/servers/{code}")
        info = response.json().get("info") if response.status_code == 200 else None
        return info is not None and info["server_name"] == name

    await eventually(check, f"{code} named {name!r}")


async def until_gone(rt: Runtime, code: str) -> None:
    async def check() -> bool:
        response = await http_get(rt, f"/openttd/servers/{code}")
        return response.status_code == 404

    await eventually(check, f"{code} removed")


async def until_metric(rt: Runtime, name: str, value: float, **labels: str) -> None:
    """Wait until a metric sample equals ``value`` (a counter that overshoots
    never does, so the wait fails on it too)."""
    seen: list[float] = []

    async def check() -> bool:
        seen.append(metric_value(await metrics(rt), name, **labels))
        return seen[-1] == value

    try:
        await eventually(check, f"{name}{labels} == {value}")
    except AssertionError as error:
        raise AssertionError(f"{error}; last seen {seen[-1]}") from None


async def metrics(rt: Runtime) -> str:
    return (await http_get(rt, "/metrics")).text


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text output (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            metric, _, rest = head.partition("{")
            got = dict(
                part.split("=", 1) for part in rest.rstrip("}").split(",") if part
            )
            got = {k: v.strip('"') for k, v in got.items()}
        else:
            metric, got = head, {}
        if metric == name and got == labels:
            return float(value)
    return 0.0


async def closed_soon(stream: PacketStream, timeout: float = 10.0) -> bool:
    return await stream.at_eof(timeout)


@contextlib.asynccontextmanager
async def running(**kwargs: Any):  # type: ignore[no-untyped-def]
    rt = await start_openttd(**kwargs)
    try:
        yield rt
    finally:
        await rt.close()
