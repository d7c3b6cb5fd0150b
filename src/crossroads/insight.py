"""Connection insight: the recorder services write attempt records to.

Theory of operation
-------------------
A service that ends a coordinated attempt (:class:`crossroads.proto.insight.Attempt`)
calls :meth:`InsightRecorder.record` from the event handler that already knows
the outcome: synchronous, no I/O, a few microseconds. The recorder

- appends it to a bounded ring (:attr:`InsightConfig.ring` records, this
  instance's recent history, what the API answers when the store cannot);
- counts it in Prometheus (``crossroads_insight_attempts_total{family,
  outcome, cause}``: causes are tokens from the services, a bounded set);
- queues it (bounded, :data:`MAX_PENDING`; an overflow is counted, never
  waited for) for a writer task that appends it to a capped stream in the
  store (``XADD MAXLEN ~`` with Redis: any instance answers for the cluster,
  and records survive an instance's restart) and adds its relayed bytes to
  the day's usage totals per game (a hash per UTC day, expiring after the
  retention).

Nothing here runs per relayed packet: a record's usage is read from the
relay's route counters once, when the session ends.

Pseudonymisation: sides are keyed hashes of their IP (see the proto module),
the key a per-deployment secret (``--insight-secret``, else ``insight.key``
created once in the state directory, mode 0600). Several machines sharing a
store should configure the same secret so one player has one id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from crossroads.config import check_non_negative, check_positive, setting
from crossroads.errors import DecodeError, StoreError
from crossroads.proto.insight import Attempt, Pseudonymiser, Side
from crossroads.store.base import Store
from crossroads.types import frozen

log = logging.getLogger("crossroads.insight")

NAME = "insight"
#: The capped stream of records in the store.
STREAM_KEY = "insight:attempts"
#: One hash per UTC day: ``<family>|<game>|<field>`` -> integer.
USAGE_KEY = "insight:usage:"
#: The key file in the state directory.
KEY_FILE = "insight.key"
#: Records waiting for the store writer. A store outage of a few seconds at a
#: few hundred attempts a second fits; beyond, records are dropped (counted):
#: the ring still has them, the relay still works.
MAX_PENDING = 10_000
#: Records the API reads from the stream to filter (newest first): a bound on
#: one request's work whatever the stream's length.
MAX_SCAN = 20_000
#: Usage fields kept per record in the day's hash.
USAGE_FIELDS = ("sessions", "packets_up", "bytes_up", "packets_down", "bytes_down")


@frozen
class Config:
    """``[insight]``: connection records and usage."""

    enabled: bool = setting(
        True,
        help="Keep a record of every coordinated connection attempt and the "
        "relayed usage (GET /v1/insight/*, admin token).",
    )
    ring: int = setting(
        1000,
        check=check_positive,
        help="Records each instance keeps in memory (its recent history).",
    )
    stream_max: int = setting(
        20_000,
        check=check_positive,
        help="Records kept in the store's capped stream (about 600 bytes each; "
        "Redis keeps up to 100 more: it trims whole stream nodes).",
    )
    retention_days: int = setting(
        30,
        check=check_positive,
        help="Days the per-game usage totals are kept in the store.",
    )
    raw_addresses: bool = setting(
        False,
        help="Keep clients' IP addresses in the records. Off: a keyed hash of "
        "the address, the /24 or /48, and the NAT kind only.",
    )
    secret: str = setting(
        "",
        help="Key of the address hashes (default: insight.key in --state-dir, "
        "created once). Give every machine of a cluster the same one.",
    )
    max_age: float = setting(
        0.0,
        check=check_non_negative,
        help="Seconds after which the API no longer lists a record (0: only "
        "the stream's length bounds them).",
    )


def load_or_create_key(directory: Path) -> bytes:
    """The insight key in ``directory`` (created once, 32 random bytes,
    mode 0600, like the credentials file)."""
    path = directory / KEY_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): using a key for this run only", path, exc)
        return secrets.token_bytes(32)
    key = secrets.token_bytes(32)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = directory / f".{KEY_FILE}.{os.getpid()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key.hex() + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            return bytes.fromhex(path.read_text().strip())
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot write %s (%s): using a key for this run only", path, exc)
    return key


def day_of(unix: float) -> str:
    """The UTC day of a Unix time, ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime(unix))


@frozen
class AttemptFilter:
    """What ``GET /v1/insight/attempts`` selects."""

    family: str = ""
    code: str = ""
    outcome: str = ""
    #: Unix seconds: only records that started at or after it.
    since: float = 0.0
    limit: int = 100

    def matches(self, attempt: Attempt) -> bool:
        return (
            (not self.family or attempt.family == self.family)
            and (not self.code or attempt.session == self.code)
            and (not self.outcome or attempt.outcome == self.outcome)
            and attempt.started >= self.since
        )


@dataclass(eq=False)
class InsightRecorder:
    """Where services write attempt records (see the module docstring)."""

    config: Config = field(default_factory=Config)
    #: None: this instance's ring only (unit tests, ``enabled`` off).
    store: Store | None = None
    pseudonymiser: Pseudonymiser = field(
        default_factory=lambda: Pseudonymiser(secrets.token_bytes(32))
    )
    instance: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}"
    )
    clock: Callable[[], float] = time.time
    ring: deque[Attempt] = field(init=False)
    #: Records the store writer could not keep up with, or the store refused.
    dropped: int = field(default=0, init=False)
    written: int = field(default=0, init=False)
    _pending: asyncio.Queue[Attempt] | None = field(default=None, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    attempts_total: Counter = field(init=False)
    relayed_bytes: Counter = field(init=False)
    _registry: CollectorRegistry | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.ring = deque(maxlen=self.config.ring)
        self.attempts_total = Counter(
            "crossroads_insight_attempts",
            "Coordinated connection attempts, by family, outcome and cause "
            "(why relayed or why failed; empty for a direct success).",
            ["family", "outcome", "cause"],
            registry=None,
        )
        self.relayed_bytes = Counter(
            "crossroads_insight_relayed_bytes",
            "Bytes relayed by finished sessions (both ways), by family.",
            ["family"],
            registry=None,
        )

    # Wiring -------------------------------------------------------------

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.attempts_total)
        registry.register(self.relayed_bytes)
        self._registry = registry

    def start(self) -> None:
        """Start the store writer (needs a running loop)."""
        if self.store is not None and self._task is None:
            self._pending = asyncio.Queue(MAX_PENDING)
            self._task = asyncio.create_task(self._write(), name="insight-writer")

    async def close(self) -> None:
        """Write what is pending (briefly), then stop."""
        if self._task is None:
            return
        if self._pending is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._pending.join()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._registry is not None:
            for collector in (self.attempts_total, self.relayed_bytes):
                with contextlib.suppress(KeyError):
                    self._registry.unregister(collector)
            self._registry = None

    # What services call ----------------------------------------------------

    def side(self, host: str, nat: str = "", rtt_ms: float | None = None) -> Side:
        """A side of a record: ``host`` pseudonymised (unless configured raw)."""
        return self.pseudonymiser.side(host, nat, rtt_ms)

    def now(self) -> float:
        """Unix time (records' ``started``)."""
        return self.clock()

    def record(self, attempt: Attempt) -> None:
        """Keep one record: ring, metrics, and (queued) the store."""
        if not self.config.enabled:
            return
        if not attempt.instance:
            attempt = replace(attempt, instance=self.instance)
        self.ring.append(attempt)
        self.attempts_total.labels(attempt.family, attempt.outcome, attempt.cause).inc()
        if attempt.usage is not None:
            self.relayed_bytes.labels(attempt.family).inc(attempt.usage.bytes)
        if self._pending is not None:
            try:
                self._pending.put_nowait(attempt)
            except asyncio.QueueFull:
                self.dropped += 1

    # The store writer --------------------------------------------------------

    async def _write(self) -> None:
        assert self._pending is not None and self.store is not None
        while True:
            attempt = await self._pending.get()
            try:
                await self._store(self.store, attempt)
                self.written += 1
            except StoreError:
                self.dropped += 1  # the store logs its outage once
            except Exception:
                self.dropped += 1
                log.warning("insight: store write failed", exc_info=True)
            finally:
                self._pending.task_done()

    async def _store(self, store: Store, attempt: Attempt) -> None:
        await store.stream_add(
            STREAM_KEY, attempt.encode(), maxlen=self.config.stream_max
        )
        usage = attempt.usage
        if usage is None:
            return
        key = USAGE_KEY + day_of(attempt.started)
        prefix = f"{attempt.family}|{attempt.game}|"
        values = {
            "sessions": 1,
            "packets_up": usage.packets_up,
            "bytes_up": usage.bytes_up,
            "packets_down": usage.packets_down,
            "bytes_down": usage.bytes_down,
        }
        for name, value in values.items():
            await store.hincrby(key, prefix + name, value)
        await store.expire(key, self.config.retention_days * 86_400)

    # What the API reads --------------------------------------------------------

    async def recent(self, scan: int = MAX_SCAN) -> list[Attempt]:
        """Recent records, newest first: the cluster's (the store's stream)
        when there is a store and it answers, else this instance's ring."""
        since = 0.0
        if self.config.max_age:
            since = self.clock() - self.config.max_age
        if self.store is not None:
            try:
                entries = await self.store.stream_range(
                    STREAM_KEY, count=scan, since_ms=int(since * 1000)
                )
            except StoreError:
                entries = None
            if entries is not None:
                return list(_decode_all(value for _id, value in entries))
        return [a for a in reversed(self.ring) if a.started >= since]

    async def attempts(self, selection: AttemptFilter) -> list[Attempt]:
        found: list[Attempt] = []
        for attempt in await self.recent():
            if selection.matches(attempt):
                found.append(attempt)
                if len(found) >= selection.limit:
                    break
        return found

    async def usage(self, days: int = 1) -> dict[str, Any]:
        """Totals per game per day (the store's hashes, kept for the
        retention) and per code (from the recent records: a code is per
        session, so they stay as bounded as the stream)."""
        today = self.clock()
        per_game: list[dict[str, Any]] = []
        for n in range(max(1, min(days, self.config.retention_days))):
            day = day_of(today - n * 86_400)
            totals: dict[tuple[str, str], dict[str, int]] = {}
            if self.store is not None:
                try:
                    raw = await self.store.hgetall(USAGE_KEY + day)
                except StoreError:
                    raw = {}
                for name, value in raw.items():
                    family, _, rest = name.partition("|")
                    game, _, metric = rest.rpartition("|")
                    if metric in USAGE_FIELDS:
                        entry = totals.setdefault((family, game), {})
                        entry[metric] = int(value)
            for (family, game), entry in sorted(totals.items()):
                per_game.append({"day": day, "family": family, "game": game, **entry})
        codes = _per_code(await self.recent())
        return {"per_game": per_game, "per_code": codes}

    async def summary(self, top: int = 10) -> dict[str, Any]:
        """What the console's insight page draws beside the records: attempts
        by family and outcome, why relayed (relayed attempts by cause), why
        failed, and the codes that relayed the most bytes, all from the
        recent records (bounded by :data:`MAX_SCAN`)."""
        outcomes: dict[tuple[str, str], int] = {}
        relayed: dict[str, int] = {}
        failed: dict[str, int] = {}
        records = await self.recent()
        for attempt in records:
            key = (attempt.family, attempt.outcome)
            outcomes[key] = outcomes.get(key, 0) + 1
            cause = attempt.cause or "unknown"
            if attempt.outcome == "relayed":
                relayed[cause] = relayed.get(cause, 0) + 1
            elif attempt.outcome == "failed":
                failed[cause] = failed.get(cause, 0) + 1

        def ranked(counts: dict[str, int]) -> list[dict[str, Any]]:
            order = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
            return [{"cause": cause, "count": count} for cause, count in order[:top]]

        codes = _per_code(records)
        return {
            "outcomes": [
                {"family": family, "outcome": outcome, "count": count}
                for (family, outcome), count in sorted(outcomes.items())
            ],
            "why_relayed": ranked(relayed),
            "why_failed": ranked(failed),
            "top_codes": codes[:top],
        }


def _per_code(records: Iterable[Attempt]) -> list[dict[str, Any]]:
    """Usage per code (day, family, code) from records, largest first."""
    per_code: dict[tuple[str, str, str], dict[str, Any]] = {}
    for attempt in records:
        if attempt.usage is None:
            continue
        day = day_of(attempt.started)
        key = (day, attempt.family, attempt.session)
        entry = per_code.setdefault(
            key,
            {
                "day": day,
                "family": attempt.family,
                "code": attempt.session,
                "game": attempt.game,
                **dict.fromkeys(USAGE_FIELDS, 0),
            },
        )
        entry["sessions"] += 1
        entry["packets_up"] += attempt.usage.packets_up
        entry["bytes_up"] += attempt.usage.bytes_up
        entry["packets_down"] += attempt.usage.packets_down
        entry["bytes_down"] += attempt.usage.bytes_down
    return sorted(
        per_code.values(),
        key=lambda e: e["bytes_up"] + e["bytes_down"],
        reverse=True,
    )


def _decode_all(values: Iterable[bytes]) -> Iterable[Attempt]:
    for value in values:
        try:
            yield Attempt.decode(value)
        except DecodeError:
            continue  # not a record of ours: skip it


def recorder_for(
    cfg: Config, store: Store | None, state_dir: Path | None
) -> InsightRecorder:
    """The runtime's recorder: the configured key, else the state directory's."""
    if cfg.secret:
        key = cfg.secret.encode()
    elif state_dir is not None:
        key = load_or_create_key(state_dir)
    else:
        key = secrets.token_bytes(32)
    return InsightRecorder(
        config=cfg,
        store=store if cfg.enabled else None,
        pseudonymiser=Pseudonymiser(key, raw=cfg.raw_addresses),
    )
