"""OpenTTD-compatible Game Coordinator (TCP 3976), STUN (3975) and TURN (3974).

Point a real OpenTTD 12-15 at it with ``OTTD_COORDINATOR_CS=host:3976`` and
``OTTD_STUN_CS=host:3975``; the TURN address is handed out by the coordinator.
One service, three listeners (``roles``); with ``--store redis://...`` any number
of processes share registrations, tickets and routing (see :mod:`.registry` and
:mod:`.bus`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random

from crossroads.config import check_non_negative, check_positive, setting
from crossroads.errors import StoreError
from crossroads.proto.openttd.duties import Duty
from crossroads.proto.openttd.record import ServerRecord
from crossroads.proto.openttd.update import Beat, InstanceBeat
from crossroads.services.base import (
    ServiceContext,
    SessionInfo,
    show_address,
)
from crossroads.services.openttd.bounded import BoundedStore
from crossroads.services.openttd.bus import Bus
from crossroads.services.openttd.conn import (
    Limits,
    Listener,
    PacketConnection,
    PacketHandler,
)
from crossroads.services.openttd.coordinator import (
    Coordinator,
    CoordinatorSettings,
)
from crossroads.services.openttd.listing import ListingCache
from crossroads.services.openttd.metrics import counter, gauge
from crossroads.services.openttd.registry import (
    INSTANCE_EVERY,
    NEWGRF_COUNTER_KEY,
    SECRET_KEY,
    TURN_ANNOUNCE_EVERY,
    Registry,
)
from crossroads.services.openttd.runners import DutyRunner, run_store_flow
from crossroads.services.openttd.stun import StunHandler
from crossroads.services.openttd.turn import TurnHandler, relay_table
from crossroads.services.openttd.web import make_router
from crossroads.store.shared_secret import SharedSecret
from crossroads.types import Address, frozen

NAME = "openttd"
ROLES = ("coordinator", "stun", "turn")
#: How often each coordinator sweeps expired server records out of the store
#: (a server updates every 30 s; its record lives ``server_ttl`` = 90 s).
SWEEP_EVERY = 30.0

log = logging.getLogger("crossroads.openttd")


def _check_roles(roles: tuple[str, ...]) -> None:
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise ValueError(
            f"{', '.join(unknown) or 'nothing'} is not one of {', '.join(ROLES)}"
        )


@frozen
class Config:
    """The ``[openttd]`` section."""

    coordinator_port: int = setting(
        3976,
        kind="port",
        help="Game Coordinator TCP port (OpenTTD's OTTD_COORDINATOR_CS).",
    )
    stun_port: int = setting(
        3975, kind="port", help="OpenTTD STUN TCP port (OTTD_STUN_CS)."
    )
    turn_port: int = setting(
        3974,
        kind="port",
        help="OpenTTD TURN relay TCP port (the coordinator tells peers).",
    )
    roles: tuple[str, ...] = setting(
        ROLES,
        check=_check_roles,
        help="Listeners this process runs: coordinator, stun, turn.",
    )
    secret: str = setting(
        "",
        help="Key that signs invite-code secrets, so servers keep their codes across "
        "restarts. Empty: a random key, shared through the store.",
    )
    turn_address: str = setting(
        "",
        help="host[:port] of the TURN relay told to OpenTTD peers. Empty: this process's "
        "relay at --public-host (or the address the peer reached us on).",
    )
    connect_timeout: float = setting(
        20.0,
        check=check_positive,
        help="Seconds one join may take in total.",
    )
    stun_wait: float = setting(
        5.0,
        check=check_positive,
        help="Seconds to wait for both peers' STUN results.",
    )
    verify_timeout: float = setting(
        7.0,
        check=check_positive,
        help="Seconds a registration check may take.",
    )
    probe_timeout: float = setting(
        3.0,
        check=check_positive,
        help="Seconds for one direct game-protocol probe.",
    )
    packet_timeout: float = setting(
        10.0,
        check=check_positive,
        help="Seconds to send the first packet, or to finish any started packet.",
    )
    idle_timeout: float = setting(
        90.0,
        check=check_positive,
        help="Seconds without a packet before a coordinator connection is closed "
        "(servers update every 30 s).",
    )
    stun_hold: float = setting(
        60.0,
        check=check_positive,
        help="Seconds a STUN connection is kept open.",
    )
    turn_wait: float = setting(
        20.0,
        check=check_positive,
        help="Seconds a TURN side waits for its peer.",
    )
    relay_idle_timeout: float = setting(
        300.0,
        check=check_positive,
        help="Seconds a silent TURN relay is kept.",
    )
    max_connections: int = setting(
        50000, check=check_positive, help="Open connections per listener."
    )
    max_connections_per_address: int = setting(
        256,
        check=check_positive,
        help="Open connections per listener and source IP.",
    )
    registrations_per_minute: int = setting(
        30,
        check=check_positive,
        help="Registrations per source IP (IPv6: per /64) and minute.",
    )
    max_servers_per_address: int = setting(
        64,
        check=check_positive,
        help="Registered servers per source IP (IPv6: per /64), per instance.",
    )
    max_invite_codes: int = setting(
        250_000,
        check=check_non_negative,
        help="Invite codes reserved at once across the deployment (each for 30 days "
        "after its server was last seen); a new server beyond it is refused. "
        "0: no cap.",
    )
    listing_cache: float = setting(
        2.0,
        check=check_positive,
        help="Seconds a server listing is reused.",
    )
    instance_heartbeat: float = setting(
        INSTANCE_EVERY,
        check=check_positive,
        help="Seconds between this coordinator's liveness beats; another instance "
        "stops advertising its servers three beats after it dies.",
    )
    server_ttl: float = setting(
        90.0,
        check=check_positive,
        help="Seconds a server record lives without an update (servers update every 30 s).",
    )

    def __post_init__(self) -> None:
        if self.server_ttl <= 30.0:
            raise ValueError("server_ttl: must exceed the 30 s server update period")


def _specific(host: str) -> bool:
    return bool(host) and not ipaddress.ip_address(host).is_unspecified


class OpenTTDService:
    """The running listeners and their background tasks."""

    name = NAME

    def __init__(self) -> None:
        self.listeners: dict[str, Listener] = {}
        self.coordinator: Coordinator | None = None
        self.turn: TurnHandler | None = None
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.instance = ""
        self.duties: DutyRunner | None = None
        self.turn_public: str | None = None
        #: Draining (:meth:`drain`): no new connection, no TURN announcement.
        self.draining = False
        self._closed = False

    def describe(self) -> list[str]:
        return [
            f"tcp {show_address(listener.address)} ({role})"
            for role, listener in self.listeners.items()
        ]

    async def drain(self) -> None:
        """Refuse new connections on every listener (OpenTTD has no redirect:
        its clients and servers reconnect, through DNS or a load balancer, to
        an instance that listens; registrations and invite codes live in the
        shared store) and stop announcing this TURN relay to the other
        coordinators; live connections and TURN streams go on."""
        self.draining = True
        for listener in self.listeners.values():
            listener.stop_accepting()
        if self.registry is not None and self.turn_public:
            with contextlib.suppress(StoreError):
                await self.registry.withdraw_turn(self.turn_public)

    def live_sessions(self) -> int:
        """Relayed TURN streams (game connections through this instance)."""
        return 0 if self.turn is None else len(self.turn.pairs)

    def address(self, role: str) -> Address:
        return self.listeners[role].address

    def sessions(self) -> list[SessionInfo]:
        """Game servers registered on this instance (by invite code)."""
        if self.coordinator is None:
            return []
        listed = []
        for code, conn, state in self.coordinator.local_server_list():
            info = state.record.info if state.record is not None else None
            name = info.server_name if info is not None else "(no game info yet)"
            players = f", {info.clients_on}/{info.clients_max} players" if info else ""
            listed.append(
                SessionInfo(
                    id=code,
                    client=show_address(conn.peer),
                    detail=f"{name}{players}, game port {state.server_port}",
                )
            )
        return listed

    def revoke(self, session_id: str) -> bool:
        """Unregister the server with this invite code."""
        return self.coordinator is not None and self.coordinator.kick_server(session_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.duties is not None:
            await self.duties.close()
        if self.registry is not None:
            with contextlib.suppress(StoreError):
                if self.turn_public:
                    await self.registry.withdraw_turn(self.turn_public)
                if self.coordinator is not None:
                    await self.registry.withdraw_instance(self.instance)
        if self.coordinator is not None:
            await self.coordinator.close()
        if self.turn is not None:
            self.turn.cancel_all()
        for listener in self.listeners.values():
            await listener.close()
        if self.bus is not None:
            await self.bus.close()


async def _heartbeat(
    registry: Registry,
    coordinator: Coordinator,
    instance: str,
    shared_secret: SharedSecret | None,
) -> None:
    """One liveness beat; when the store had lost our liveness key (a Redis
    restarted empty), put back everything this instance holds: its servers'
    records and codes. The shared key is re-published on every beat."""
    if shared_secret is not None:
        adopted = await shared_secret.republish()
        if adopted is not None:
            coordinator.adopt_secret_key(adopted, shared_secret.previous)
    beat = await run_store_flow(
        registry, InstanceBeat(instance, coordinator.local_records())
    )
    if isinstance(beat, Beat) and beat.restored:
        coordinator.listing.invalidate()
        log.warning(
            "openttd: the store had lost this instance's records; re-created %d "
            "server(s)",
            beat.restored,
        )
    elif not isinstance(beat, Beat):
        # The store logs the outage once (store/redis.py).
        log.debug("openttd: heartbeat failed: the store did not answer")


async def serve(ctx: ServiceContext) -> OpenTTDService:
    cfg = ctx.section(NAME, Config)
    service = OpenTTDService()
    service.instance = os.urandom(4).hex()
    service.duties = duties = DutyRunner()
    store = BoundedStore(ctx.store)
    registry = Registry(
        store,
        os.urandom,
        instance=service.instance,
        instance_every=cfg.instance_heartbeat,
        max_codes=cfg.max_invite_codes,
    )
    service.registry = registry
    bus = Bus(store, service.instance, ctx.metrics)
    service.bus = bus
    dropped = counter(
        ctx.metrics,
        "dropped",
        "OpenTTD connections closed for bad input or limits, by listener and reason.",
        "listener",
        "reason",
    )
    connections = gauge(
        ctx.metrics, "connections", "Open OpenTTD connections, by listener.", "listener"
    )
    public_host = ctx.config.core.public_host
    host = ctx.host

    async def listen(
        role: str, handler: PacketHandler, port: int, idle_timeout: float
    ) -> Address:
        """Start ``role``'s listener under the section's connection limits; only
        the idle timeout differs between roles."""
        listener = Listener(
            role,
            handler,
            Limits(
                max_connections=cfg.max_connections,
                max_per_address=cfg.max_connections_per_address,
                packet_timeout=cfg.packet_timeout,
                idle_timeout=idle_timeout,
            ),
            dropped,
            connections,
            ctx.resources,
        )
        service.listeners[role] = listener
        return await listener.start(host, port)

    try:
        if "turn" in cfg.roles:
            turn = TurnHandler(
                registry,
                ctx.metrics,
                cfg.turn_wait,
                relay_idle_timeout=cfg.relay_idle_timeout,
                max_relays=max(1, cfg.max_connections // 2),
                table=relay_table(ctx.resources, cfg.max_connections),
            )
            service.turn = turn
            address = await listen(
                "turn", turn, cfg.turn_port, cfg.turn_wait + cfg.packet_timeout
            )
            announce_host = public_host or (host if _specific(host) else "")
            if cfg.turn_address:
                service.turn_public = cfg.turn_address
            elif announce_host:
                service.turn_public = show_address((announce_host, address[1]))
            if service.turn_public:
                announced = service.turn_public

                async def announce_turn() -> None:
                    if not service.draining:  # a draining relay takes no pair
                        await registry.announce_turn(announced)

                duties.add(Duty.ANNOUNCE_TURN, TURN_ANNOUNCE_EVERY, announce_turn)

        if "stun" in cfg.roles:
            await listen(
                "stun", StunHandler(bus, ctx.metrics), cfg.stun_port, cfg.stun_hold
            )

        listing = ListingCache(registry, cfg.listing_cache)
        if "coordinator" in cfg.roles:
            shared_secret = (
                None
                if cfg.secret
                else SharedSecret(store, SECRET_KEY, "openttd", os.urandom)
            )
            secret_key = (
                cfg.secret.encode()
                if shared_secret is None
                else await shared_secret.resolve()
            )
            # Start NewGRF lookup indexes at a random offset, so a client that
            # kept its lookup table across a restart of an in-memory coordinator
            # does not mistake new indexes for old ones.
            await store.set(
                NEWGRF_COUNTER_KEY,
                str(random.SystemRandom().randrange(1 << 20) * 1000).encode(),
                only_if_absent=True,
            )
            relays: list[str] = []

            async def refresh_relays() -> None:
                relays[:] = await registry.turn_relays()

            def turn_address(conn: PacketConnection) -> str | None:
                if cfg.turn_address:
                    return cfg.turn_address
                if service.turn is not None:
                    if service.turn_public:
                        return service.turn_public
                    return show_address(
                        (conn.local[0], service.listeners["turn"].address[1])
                    )
                return random.choice(relays) if relays else None

            coordinator = Coordinator(
                settings=CoordinatorSettings(
                    connect_timeout=cfg.connect_timeout,
                    stun_wait=cfg.stun_wait,
                    verify_timeout=cfg.verify_timeout,
                    probe_timeout=cfg.probe_timeout,
                    server_ttl=cfg.server_ttl,
                    registrations_per_minute=float(cfg.registrations_per_minute),
                    max_servers_per_address=cfg.max_servers_per_address,
                    listing_cache=cfg.listing_cache,
                ),
                registry=registry,
                bus=bus,
                metrics=ctx.metrics,
                instance=service.instance,
                secret_key=secret_key,
                turn_address=turn_address,
                guesses=ctx.guess_budget(),
                insight=ctx.insight,
            )
            coordinator.listing = listing
            service.coordinator = coordinator
            coordinator.turn = service.turn
            await bus.start(coordinator.on_bus)
            await registry.announce_instance(service.instance)

            async def heartbeat() -> None:
                await _heartbeat(registry, coordinator, service.instance, shared_secret)

            duties.add(Duty.HEARTBEAT, cfg.instance_heartbeat, heartbeat)
            loop = asyncio.get_running_loop()

            async def sweep() -> None:
                # Reading the list drops expired records (servers of a dead
                # instance), even when no client asks for a listing.
                listing.invalidate()
                await listing.all(loop.time())

            duties.add(Duty.SWEEP, SWEEP_EVERY, sweep)
            if service.turn is None and not cfg.turn_address:
                duties.add(Duty.DISCOVER_RELAYS, TURN_ANNOUNCE_EVERY, refresh_relays)
            await listen(
                "coordinator", coordinator, cfg.coordinator_port, cfg.idle_timeout
            )
            service.listeners = {
                role: service.listeners[role]
                for role in ROLES
                if role in service.listeners
            }

        loop = asyncio.get_running_loop()

        async def all_records() -> list[ServerRecord]:
            return await listing.all(loop.time())

        async def one_record(code: str) -> ServerRecord | None:
            return await registry.get_server(code)

        ctx.add_router(make_router(all_records, one_record))
    except BaseException:
        await service.close()
        raise
    return service
