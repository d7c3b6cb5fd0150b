"""The connection-success matrix: every unordered pair of NAT kinds (a kind with
itself included) x every method, run through the lab, written as a table.

Methods are plug-ins: :func:`register` a :class:`Method` whose ``run`` coroutine gets
an :class:`Attempt` (the lab, the two sites, shared helpers) and returns an
:class:`Outcome`. Other areas add columns (natneg, SDK punch-through, port mapping)
by registering theirs in :data:`METHOD_MODULES`.

Scheduling: a pair (X, Y) runs between host X-a and host Y-b (two separate routers
even when X == Y). Attempts that share no host run in parallel; before each
attempt the NAT state of both sites' routers is flushed, so no attempt rides on
the conntrack entries of an earlier one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from crossroads.lab.kinds import KINDS, KINDS_BY_NAME, NatKind
from crossroads.lab.topology import Lab, Site
from crossroads.types import frozen

log = logging.getLogger("crossroads.lab.matrix")

#: The steps of the connection ladder, in the order it tries them.
VIA_STEPS = ("lan", "direct", "mapping", "punch", "relay")


@frozen
class Outcome:
    """What a method reports: did the two hosts exchange data both ways, and how."""

    connected: bool
    via: str | None = None
    #: Seconds to connect as the method measures it (None: the runner's clock).
    seconds: float | None = None
    detail: str = ""
    #: Connected on the first attempt, for methods that retry like a game
    #: (natneg); None: the method makes one attempt, so it is ``connected``.
    first_attempt: bool | None = None


@dataclass
class Attempt:
    """One method run between two lab hosts."""

    lab: Lab
    a: Site
    b: Site
    #: Objects shared by all attempts of one matrix run (the probe reflector,
    #: credentials, ...), created by methods' ``prepare`` hooks.
    shared: dict[str, Any] = field(default_factory=dict)


@frozen
class Result:
    a: str
    b: str
    method: str
    connected: bool
    seconds: float
    via: str | None
    detail: str = ""
    #: Connected without a retry (for one-attempt methods: ``connected``).
    first_attempt: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "method": self.method,
            "connected": self.connected,
            "first_attempt": self.first_attempt,
            "seconds": round(self.seconds, 3),
            "via": self.via,
        }


#: Key of :attr:`Attempt.shared` holding the one cookie every attempt of a
#: back-to-back run uses (methods that take a cookie, natneg); absent: each
#: attempt draws its own.
SHARED_COOKIE = "cookie"
#: The back-to-back run's cookie: the SDK test program's, always the same
#: (``shared/reference/gamespy-natneg.md`` §3.1).
SDK_TEST_COOKIE = 666

MethodRun = Callable[[Attempt], Awaitable[Outcome]]
Prepare = Callable[[Lab, dict[str, Any]], Awaitable[None]]


@frozen
class Method:
    """A column of the matrix."""

    name: str
    summary: str
    run: MethodRun
    #: The outcome the lab's NAT kinds must give; None when not predicted.
    expected: Callable[[NatKind, NatKind], bool] | None = None
    #: Hard limit for one attempt (the method's own timeouts are tighter).
    timeout: float = 20.0
    #: At most this many attempts of this method at once (heavy processes).
    max_parallel: int = 8
    #: Called once per matrix run before the first attempt (start helpers).
    prepare: Prepare | None = None
    #: Services the lab server must run for this method (``crossroads serve``).
    needs: tuple[str, ...] = ()
    #: The step that must win for a pair, when the method predicts it.
    expected_via: Callable[[NatKind, NatKind], str | None] | None = None
    #: Whether the first attempt must connect, for methods that retry (natneg);
    #: None (or a None answer for a pair): not predicted separately.
    expected_first: Callable[[NatKind, NatKind], bool | None] | None = None
    #: For slow methods: the (unordered) pairs a matrix runs unless the method
    #: is asked for by name (``--methods``); None: every pair, always.
    default_pairs: tuple[tuple[str, str], ...] | None = None

    def pairs(
        self, kinds: Sequence[NatKind], all_pairs: bool
    ) -> list[tuple[NatKind, NatKind]]:
        """The pairs of ``kinds`` this method runs."""
        every = pairs(kinds)
        if all_pairs or self.default_pairs is None:
            return every
        chosen = {frozenset(p) for p in self.default_pairs}
        return [(x, y) for x, y in every if frozenset((x.name, y.name)) in chosen]


METHODS: dict[str, Method] = {}

#: Modules that register methods when imported. One line per area.
METHOD_MODULES: list[str] = [
    "crossroads.lab.methods.direct",
    "crossroads.lab.methods.punch",
    "crossroads.lab.methods.raknet",
    "crossroads.lab.methods.ladder",
    "crossroads.lab.methods.natneg",
    "crossroads.lab.methods.sdk",
    "crossroads.lab.methods.relay",
    "crossroads.lab.methods.turn_udp",
    "crossroads.lab.methods.turn_tcp",
    "crossroads.lab.methods.openttd",
]


def register(method: Method) -> Method:
    """Add a method to the registry (its name is the column title)."""
    METHODS[method.name] = method
    return method


def load_methods() -> dict[str, Method]:
    for module in METHOD_MODULES:
        importlib.import_module(module)
    return METHODS


def pairs(kinds: Sequence[NatKind] = KINDS) -> list[tuple[NatKind, NatKind]]:
    """Every unordered pair of kinds, each kind with itself included."""
    return [(x, y) for i, x in enumerate(kinds) for y in kinds[i:]]


def sites_for(lab: Lab, x: NatKind, y: NatKind) -> tuple[Site, Site]:
    return lab.site(f"{x.name}-a"), lab.site(f"{y.name}-b")


@frozen
class Delays:
    """One-way delays (seconds) of one attempt's three paths, from delay lines."""

    server_a: float
    server_b: float
    a_b: float

    @classmethod
    def draw(cls, rng: random.Random, low: float, high: float) -> Delays:
        return cls(*(rng.uniform(low, high) for _ in range(3)))


#: Routing tables of the delay lines: attempt slot k uses FIRST + 3k .. + 2.
FIRST_DELAY_TABLE = 100

#: One-way delays (seconds) drawn per path for a pair with a router that remaps on
#: a knock (``accepts_unsolicited``) when ``--delay`` sets none. Without distance
#: the two hosts are microseconds apart, less than any client's reaction time, and
#: whose first packet knocks first is a coin toss no server can settle; 20-80 ms
#: is the issue's example range ("one-way delay and jitter between sites, e.g.
#: 20-80 ms"), players in one country or neighbouring ones.
REMAP_DELAY = (0.02, 0.08)


def delay_span(
    x: NatKind, y: NatKind, delay: tuple[float, float] | None
) -> tuple[float, float] | None:
    """The delay range of one pair's attempt: ``delay`` for every pair when given,
    else :data:`REMAP_DELAY` for pairs with a remapping router, else none."""
    if delay is not None:
        return delay
    if x.accepts_unsolicited or y.accepts_unsolicited:
        return REMAP_DELAY
    return None


async def run_attempt(
    method: Method,
    attempt: Attempt,
    delays: Delays | None = None,
    slot: int = 0,
) -> Result:
    lab = attempt.lab
    await asyncio.gather(lab.reset_nat(attempt.a), lab.reset_nat(attempt.b))
    async with contextlib.AsyncExitStack() as stack:
        if delays is not None:
            table = FIRST_DELAY_TABLE + 3 * slot
            for (x, y), delay, offset in (
                ((attempt.a, "server"), delays.server_a, 0),
                ((attempt.b, "server"), delays.server_b, 1),
                ((attempt.a, attempt.b), delays.a_b, 2),
            ):
                await stack.enter_async_context(
                    lab.path_delay(x, y, delay, table=table + offset)
                )
        return await _timed_attempt(method, attempt)


async def _timed_attempt(method: Method, attempt: Attempt) -> Result:
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(method.run(attempt), method.timeout)
    except TimeoutError:
        outcome = Outcome(False, detail=f"no result in {method.timeout:.0f} s")
    except Exception as exc:  # a broken method must not stop the matrix
        log.exception("%s %s-%s failed", method.name, attempt.a.name, attempt.b.name)
        outcome = Outcome(False, detail=f"error: {exc!r}")
    elapsed = time.monotonic() - started
    seconds = outcome.seconds if outcome.seconds is not None else elapsed
    return Result(
        attempt.a.kind.name,
        attempt.b.kind.name,
        method.name,
        outcome.connected,
        seconds,
        outcome.via if outcome.connected else None,
        outcome.detail,
        outcome.connected
        if outcome.first_attempt is None
        else outcome.connected and outcome.first_attempt,
    )


async def run_matrix(
    lab: Lab,
    methods: Iterable[Method],
    *,
    kinds: Sequence[NatKind] = KINDS,
    parallel: int = 8,
    progress: Callable[[Result, int, int], None] | None = None,
    all_pairs: Iterable[str] = (),
    delay: tuple[float, float] | None = None,
    seed: int = 1,
    back_to_back: bool = False,
    cookie: int = SDK_TEST_COOKIE,
) -> list[Result]:
    """Run every pair for every method (a method with ``default_pairs`` runs
    those only unless named in ``all_pairs``); attempts sharing no host run in
    parallel. With ``delay`` (low, high seconds) each attempt's three paths
    (server-a, server-b, a-b) get a one-way delay drawn uniformly from it;
    without it only pairs with a remapping router do (:func:`delay_span`).

    ``back_to_back``: every cell one after another, in table order, with no
    pause between them, and every attempt with the same ``cookie`` (as the SDK
    test program plays, and games that reuse theirs): each meets what the one
    before left on the server."""
    if back_to_back:
        parallel = 1
    rng = random.Random(seed)
    free_slots = list(range(parallel))
    methods = list(methods)
    full = set(all_pairs)
    shared: dict[str, Any] = {}
    if back_to_back:
        shared[SHARED_COOKIE] = cookie
    cleanups: list[Callable[[], Awaitable[None]]] = []
    shared["cleanups"] = cleanups
    jobs = [(m, x, y) for m in methods for x, y in m.pairs(kinds, m.name in full)]
    results: list[Result] = []
    try:
        for method in methods:
            if method.prepare is not None:
                await method.prepare(lab, shared)
        busy: set[str] = set()
        per_method: dict[str, int] = {m.name: 0 for m in methods}
        pending = list(jobs)
        running: dict[asyncio.Task[Result], tuple[Method, Site, Site, int]] = {}
        while pending or running:
            for job in list(pending):
                if len(running) >= parallel:
                    break
                method, x, y = job
                a, b = sites_for(lab, x, y)
                if a.name in busy or b.name in busy:
                    continue
                if per_method[method.name] >= method.max_parallel:
                    continue
                pending.remove(job)
                busy.update((a.name, b.name))
                per_method[method.name] += 1
                attempt = Attempt(lab, a, b, shared)
                slot = free_slots.pop()
                span = delay_span(x, y, delay)
                delays = Delays.draw(rng, *span) if span is not None else None
                task = asyncio.create_task(run_attempt(method, attempt, delays, slot))
                running[task] = (method, a, b, slot)
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                method, a, b, slot = running.pop(task)
                free_slots.append(slot)
                busy.difference_update((a.name, b.name))
                per_method[method.name] -= 1
                result = task.result()
                results.append(result)
                if progress is not None:
                    progress(result, len(results), len(jobs))
    finally:
        for cleanup in reversed(cleanups):
            try:
                await cleanup()
            except Exception:
                log.exception("matrix cleanup failed")
    order = {(m.name, x.name, y.name): i for i, (m, x, y) in enumerate(jobs)}
    results.sort(key=lambda r: order[(r.method, r.a, r.b)])
    return results


def unexpected(results: Iterable[Result]) -> list[Result]:
    """The results that differ from their method's prediction."""
    out = []
    for result in results:
        method = METHODS.get(result.method)
        if method is None or method.expected is None:
            continue
        x, y = KINDS_BY_NAME[result.a], KINDS_BY_NAME[result.b]
        if method.expected(x, y) != result.connected:
            out.append(result)
        elif method.expected_first is not None and (
            method.expected_first(x, y) not in (None, result.first_attempt)
        ):
            out.append(result)
        elif result.connected and method.expected_via is not None:
            if method.expected_via(x, y) not in (None, result.via):
                out.append(result)
    return out


def progress_line(result: Result, done: int, total: int) -> str:
    mark = "ok  " if result.connected else "FAIL"
    via = f" via {result.via}" if result.via else ""
    return (
        f"[{done:3d}/{total}] {result.method:<10} {result.a:>20} <-> "
        f"{result.b:<20} {mark} {result.seconds:6.2f} s{via}"
    )


def _cell(result: Result | None) -> str:
    if result is None:
        return ""
    if result.connected:
        retry = "" if result.first_attempt else " (retry)"
        return f"✅ {result.via} {result.seconds:.2f}s{retry}"
    return "❌"


def _times(rows: Sequence[Result]) -> str:
    """``median / p90`` of the rows' times to connect, or a dash."""
    times = sorted(r.seconds for r in rows)
    if not times:
        return "—"
    p90 = times[min(len(times) - 1, round(0.9 * (len(times) - 1)))]
    return f"{statistics.median(times):.2f} / {p90:.2f} s"


def to_markdown(results: Sequence[Result], *, command: str, wall: float) -> str:
    """docs/nat-matrix.md: a summary, then one kind x kind table per method."""
    seen = {r.a for r in results} | {r.b for r in results}
    kinds = [k for k in KINDS_BY_NAME if k in seen]
    methods = list(dict.fromkeys(r.method for r in results))
    by_key = {(r.method, r.a, r.b): r for r in results}
    lines = [
        "# NAT connection-success matrix",
        "",
        f"Generated by `{command}` ({len(results)} attempts, {wall:.0f} s wall",
        "time). Do not edit by hand: run the command again.",
        "",
        "Each attempt runs between host *A*-a and host *B*-b of the NAT lab",
        "(two separate routers even for a kind paired with itself), after both",
        "routers' NAT state was flushed; pairs are unordered, so the tables are",
        "symmetric.",
        "A cell reads `✅ via seconds` (the",
        "step that connected and the time it took; `(retry)` when only the",
        "method's retry connected, as a game retries: natneg, and the sdk's",
        "random searches) or `❌`. How each",
        "kind is built: [nat-lab.md](nat-lab.md).",
        "",
        *(
            [
                "Back to back: every cell one after another, no pause, all on one",
                "server with one cookie (the SDK test program's 666, for methods",
                "that take a cookie), so each negotiation meets the session the",
                "previous cell left on it.",
                "",
            ]
            if "--back-to-back" in command
            else []
        ),
        *(
            []
            if "--delay" in command
            else [
                "Attempts with a `port-restricted-remap` router run with a one-way",
                f"delay of {REMAP_DELAY[0] * 1000:.0f}-{REMAP_DELAY[1] * 1000:.0f} ms"
                " drawn per path (server-A, server-B, A-B; `--seed`):",
                "without distance whose first packet knocks first is a coin toss.",
                "",
            ]
        ),
        "## Summary",
        "",
        "First attempt and with retries (natneg retries once, the sdk's",
        "random-search pairs up to twice; for the other methods the two columns",
        "are the same), with median / p90 time to connect.",
        "",
        "| method | what it tries | first attempt | median / p90 |"
        " with retries | median / p90 |",
        "|---|---|---|---|---|---|",
    ]
    for name in methods:
        rows = [r for r in results if r.method == name]
        first = [r for r in rows if r.first_attempt]
        ok = [r for r in rows if r.connected]
        summary = METHODS[name].summary if name in METHODS else ""
        share = 100 / max(1, len(rows))
        lines.append(
            f"| `{name}` | {summary} | {len(first)}/{len(rows)} "
            f"({len(first) * share:.0f} %) | {_times(first)} | {len(ok)}/{len(rows)} "
            f"({len(ok) * share:.0f} %) | {_times(ok)} |"
        )
    steps = [(s, [r.seconds for r in results if r.via == s]) for s in VIA_STEPS]
    lines += [
        "",
        "Median time to connect per step (all methods):",
        "",
        "| step | attempts won | median |",
        "|---|---|---|",
    ]
    for step, times in steps:
        if times:
            lines.append(
                f"| {step} | {len(times)} | {statistics.median(times):.2f} s |"
            )
    wrong = unexpected(results)
    lines += ["", f"Outcomes differing from the prediction: {len(wrong)}."]
    for r in wrong:
        lines.append(
            f"- `{r.method}` {r.a} ↔ {r.b}: connected={r.connected} via={r.via}"
        )
    for name in methods:
        lines += ["", f"## `{name}`", ""]
        if name in METHODS:
            lines += [METHODS[name].summary, ""]
        if len([r for r in results if r.method == name]) < len(pairs()):
            lines += [
                "Only the pairs below were run (the method is slow: the default",
                f"matrix runs a subset; `crossroads lab matrix --methods {name}`",
                "runs every pair). An empty cell was not run.",
                "",
            ]
        per_step = [
            (s, [r.seconds for r in results if r.method == name and r.via == s])
            for s in VIA_STEPS
        ]
        won = [f"{s} {statistics.median(t):.2f} s ({len(t)})" for s, t in per_step if t]
        if won:
            lines += [
                "Median time to connect per step (pairs won): " + ", ".join(won) + ".",
                "",
            ]
        lines.append("| A \\ B | " + " | ".join(kinds) + " |")
        lines.append("|---" * (len(kinds) + 1) + "|")
        for i, x in enumerate(kinds):
            cells = []
            for j, y in enumerate(kinds):
                key = (name, x, y) if i <= j else (name, y, x)
                cells.append(_cell(by_key.get(key)))
            lines.append(f"| **{x}** | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)
