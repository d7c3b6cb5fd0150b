"""Shared OpenTTD state behind the Store: what every coordinator, STUN and TURN
process of one deployment agrees on.

Keys (all under ``openttd:``; values are JSON or short strings):

===============================  ============================================  =========
key                              value                                         lifetime
===============================  ============================================  =========
``openttd:secret``               key for invite-code secrets (when not set     none
                                 in the config: first process to start
                                 writes it with SET NX; every instance
                                 re-publishes it, store/shared_secret.py)
``openttd:code:<code>``          an issued invite code (SET NX claims it)      30 days,
                                                                               refreshed
``openttd:codes:<day>``          INCR count of codes drawn that UTC day        31 days
                                 (the global cap, ``--openttd-max-invite-
                                 codes``)
``openttd:servers``              hash: code -> server record (below)           per field
                                                                               ``expires``
``openttd:newgrf``               hash: ``<grfid>-<md5>`` -> index and name     none
``openttd:newgrf:next``          INCR counter of NewGRF lookup indexes         none
``openttd:ticket:<id>``          TURN ticket secret                            30 s
``openttd:turn:<host:port>``     an announced TURN relay                       15 s
``openttd:instance:<id>``        a live coordinator instance                   3 beats
===============================  ============================================  =========

Servers live in one hash so a listing is one HGETALL and an invite-code lookup
one HGET, however many processes share the Redis. A hash field has no TTL, so
each record carries ``expires`` (wall clock): the owner pushes it forward on
every SERVER_UPDATE (every 30 s) and deletes the field when the server leaves;
readers ignore expired records and any instance sweeps them out. Readers also
ignore, and sweep, the records of an instance whose liveness key is gone: an
instance killed without a goodbye stops being advertised after three of its
heartbeats, not after its servers' records expire. When an instance finds its
own liveness key gone (the store lost everything), it re-creates the records
and code reservations of the servers connected to it.

Pub/sub channel ``openttd:gc:<instance>`` carries commands to the instance that
holds a socket (see :mod:`crossroads.services.openttd.bus`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from crossroads.proto.openttd.codes import make_invite_code
from crossroads.proto.openttd.gameinfo import NewGRF
from crossroads.proto.openttd.record import ServerRecord
from crossroads.store.base import Store

PREFIX = "openttd:"
SERVERS_KEY = PREFIX + "servers"
NEWGRF_KEY = PREFIX + "newgrf"
NEWGRF_COUNTER_KEY = PREFIX + "newgrf:next"
SECRET_KEY = PREFIX + "secret"
#: An issued code stays reserved this long after its server was last seen, so a
#: server that is away for a while (or restarts) gets its code back rather than
#: someone else getting it.
CODE_RESERVATION = 30 * 24 * 3600.0
#: A TURN ticket is good this long (reference section 6: 30 s).
TICKET_TTL = 30.0
#: A TURN relay announcement lives this long; relays refresh every
#: :data:`TURN_ANNOUNCE_EVERY` (reference section 6: 15 s TTL, 10 s refresh).
TURN_ANNOUNCE_TTL = 15.0
TURN_ANNOUNCE_EVERY = 5.0
#: Instance liveness: refreshed every heartbeat (``--openttd-instance-heartbeat``,
#: default :data:`INSTANCE_EVERY`), it lives :data:`INSTANCE_HEARTBEATS`
#: heartbeats, so one late beat is forgiven and an instance killed without a
#: goodbye stops being advertised after at most that many (with a longer
#: TTL a killed instance's servers stayed listed, and joinable, for 80 s).
INSTANCE_EVERY = 10.0
INSTANCE_HEARTBEATS = 3
INSTANCE_TTL = INSTANCE_EVERY * INSTANCE_HEARTBEATS
#: How often to draw a new code when the drawn one is taken (2^40 codes: one
#: retry is already astronomically rare).
CODE_ATTEMPTS = 16
#: The global cap counts codes drawn per UTC day, one counter key a day. A
#: reservation lives CODE_RESERVATION, so the codes reserved now are at most
#: those drawn in the last CODE_DAYS days (counting the oldest, partly expired
#: day whole errs on the safe side). No per-key count is needed: a SCAN of a
#: million keys per registration would be the flood it guards against.
CODE_DAY = 24 * 3600.0
CODE_DAYS = int(CODE_RESERVATION // CODE_DAY) + 1


def channel(instance: str) -> str:
    """The pub/sub channel of one coordinator instance."""
    return f"{PREFIX}gc:{instance}"


@dataclass
class Registry:
    """Store-backed state; see the module docstring for the key layout."""

    store: Store
    random_bytes: Callable[[int], bytes]
    wall_clock: Callable[[], float] = time.time
    #: This instance's id (always alive to itself) and liveness heartbeat.
    instance: str = ""
    instance_every: float = INSTANCE_EVERY
    #: NewGRF lookup table cache: key -> index, index -> NewGRF.
    newgrf_index: dict[tuple[int, bytes], int] = field(default_factory=dict)
    newgrf_by_index: dict[int, NewGRF] = field(default_factory=dict)
    #: Invite codes reserved at once across the deployment; 0: no cap.
    max_codes: int = 0
    #: (day, codes drawn on the days before it that still count): final once
    #: the day is over, so read once a day per instance.
    _earlier_days: tuple[int, int] = field(default=(-1, 0), init=False, repr=False)

    # --------------------------------------------------------------- codes

    async def new_code(self) -> str | None:
        """A newly reserved invite code; None when ``max_codes`` are reserved."""
        if self.max_codes and not await self._count_new_code():
            return None
        for _ in range(CODE_ATTEMPTS):
            code = make_invite_code(self.random_bytes(8))
            if await self.store.set(
                f"{PREFIX}code:{code}", b"1", ttl=CODE_RESERVATION, only_if_absent=True
            ):
                return code
        raise RuntimeError("could not draw a free invite code")

    async def _count_new_code(self) -> bool:
        """Count one more code drawn today; False (uncounted) over the cap."""
        day = int(self.wall_clock() // CODE_DAY)
        key = f"{PREFIX}codes:{day}"
        drawn_today = await self.store.incr(key)
        await self.store.expire(key, CODE_DAYS * CODE_DAY)
        if self._earlier_days[0] != day:
            earlier = 0
            for past in range(day - CODE_DAYS + 1, day):
                raw = await self.store.get(f"{PREFIX}codes:{past}")
                earlier += int(raw) if raw is not None and raw.isdigit() else 0
            self._earlier_days = (day, earlier)
        if drawn_today + self._earlier_days[1] > self.max_codes:
            await self.store.incr(key, -1)
            return False
        return True

    async def keep_code(self, code: str) -> None:
        await self.store.set(f"{PREFIX}code:{code}", b"1", ttl=CODE_RESERVATION)

    # -------------------------------------------------------------- servers

    async def put_server(self, record: ServerRecord) -> None:
        await self.store.hset(SERVERS_KEY, {record.code: record.to_json()})

    async def get_server(self, code: str) -> ServerRecord | None:
        """A live server's record: not expired, and its instance alive."""
        raw = await self.store.hget(SERVERS_KEY, code)
        if raw is None:
            return None
        try:
            record = ServerRecord.from_json(raw)
        except (ValueError, KeyError, TypeError):
            return None
        if record.expires < self.wall_clock():
            return None
        if not await self.instance_alive(record.owner):
            return None
        return record

    async def delete_server(self, code: str, session: str) -> None:
        """Remove ``code`` if it still belongs to ``session``."""
        raw = await self.store.hget(SERVERS_KEY, code)
        if raw is None:
            return
        try:
            current = ServerRecord.from_json(raw).session
        except (ValueError, KeyError, TypeError):
            current = session
        if current == session:
            await self.store.hdel(SERVERS_KEY, code)

    async def all_servers(self) -> dict[str, bytes]:
        """Every stored record, raw, by invite code."""
        return await self.store.hgetall(SERVERS_KEY)

    async def newgrf_counter(self) -> bytes | None:
        """The highest NewGRF lookup index handed out, as stored."""
        return await self.store.get(NEWGRF_COUNTER_KEY)

    async def sweep(self, codes: list[str]) -> None:
        if codes:
            await self.store.hdel(SERVERS_KEY, *codes)

    # -------------------------------------------------------------- NewGRFs

    async def index_newgrfs(self, grfs: tuple[NewGRF, ...], budget: int) -> int:
        """Give every NewGRF a lookup index; returns how many were new.

        ``budget`` caps how many new entries this call may create (a server
        cannot grow the shared table without bound).
        """
        created = 0
        for grf in grfs:
            known = self.newgrf_index.get(grf.key)
            if known is not None:
                if grf.name and not self.newgrf_by_index[known].name:
                    await self._store_newgrf(known, grf)
                continue
            field_name = f"{grf.grfid:08x}-{grf.md5.hex()}"
            raw = await self.store.hget(NEWGRF_KEY, field_name)
            if raw is not None:
                data = json.loads(raw)
                index = int(data["i"])
                name = data.get("n") or grf.name
                self._cache(index, NewGRF(grf.grfid, grf.md5, name))
                if grf.name and not data.get("n"):
                    await self._store_newgrf(index, grf)
                continue
            if created >= budget:
                continue
            index = await self.store.incr(NEWGRF_COUNTER_KEY)
            created += 1
            await self._store_newgrf(index, grf)
        return created

    async def _store_newgrf(self, index: int, grf: NewGRF) -> None:
        field_name = f"{grf.grfid:08x}-{grf.md5.hex()}"
        value = json.dumps({"i": index, "n": grf.name or ""}).encode()
        await self.store.hset(NEWGRF_KEY, {field_name: value})
        self._cache(index, grf)

    def _cache(self, index: int, grf: NewGRF) -> None:
        self.newgrf_index[grf.key] = index
        self.newgrf_by_index[index] = NewGRF(grf.grfid, grf.md5, grf.name or "")

    async def load_newgrfs(self) -> None:
        """Refresh the local lookup-table cache from the store."""
        raw = await self.store.hgetall(NEWGRF_KEY)
        for field_name, value in raw.items():
            try:
                grfid_hex, md5_hex = field_name.split("-", 1)
                data = json.loads(value)
                grf = NewGRF(int(grfid_hex, 16), bytes.fromhex(md5_hex), str(data["n"]))
                index = int(data["i"])
            except (ValueError, KeyError, TypeError):
                continue
            self._cache(index, grf)

    # --------------------------------------------------------------- tickets

    async def put_ticket(self, left: str, right: str) -> None:
        await self.store.set(f"{PREFIX}ticket:{left}", right.encode(), ttl=TICKET_TTL)

    async def get_ticket(self, left: str) -> str | None:
        raw = await self.store.get(f"{PREFIX}ticket:{left}")
        return None if raw is None else raw.decode(errors="replace")

    async def drop_ticket(self, left: str) -> None:
        await self.store.delete(f"{PREFIX}ticket:{left}")

    # ----------------------------------------------------- relays, instances

    async def announce_turn(self, address: str) -> None:
        await self.store.set(f"{PREFIX}turn:{address}", b"1", ttl=TURN_ANNOUNCE_TTL)

    async def withdraw_turn(self, address: str) -> None:
        await self.store.delete(f"{PREFIX}turn:{address}")

    async def turn_relays(self) -> list[str]:
        keys = await self.store.keys(f"{PREFIX}turn:")
        return sorted(k[len(PREFIX) + 5 :] for k in keys)

    async def announce_instance(self, instance: str) -> bool:
        """Refresh ``instance``'s liveness key; True when the key had been
        missing (first start, or the store lost it: time to re-publish)."""
        key = f"{PREFIX}instance:{instance}"
        ttl = self.instance_every * INSTANCE_HEARTBEATS
        if await self.store.expire(key, ttl):
            return False
        await self.store.set(key, b"1", ttl=ttl)
        return True

    async def dead_instances(self, owners: set[str]) -> set[str]:
        """The instances among ``owners`` whose liveness key is gone."""
        dead = set()
        for owner in owners:
            if not await self.instance_alive(owner):
                dead.add(owner)
        return dead

    async def withdraw_instance(self, instance: str) -> None:
        await self.store.delete(f"{PREFIX}instance:{instance}")

    async def instance_alive(self, instance: str) -> bool:
        if instance and instance == self.instance:
            return True
        return await self.store.get(f"{PREFIX}instance:{instance}") is not None
