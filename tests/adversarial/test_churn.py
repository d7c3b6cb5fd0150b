"""No leaks. After churn, live objects are back where they
started (counted by type after a full collection; not timings, not RSS).

Every TURN allocate/free cycle used to keep ~3.4 KiB (the deleted Allocation
and its relay object stayed referenced by the core's deadline heap until their
old deadline, up to an hour), in the C data plane and in pure Python alike; the
p2p hosting peers that allocated TURN relays with their credentials kept theirs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from crossroads.runtime import Runtime
from crossroads.services.turn import TurnService
from crossroads.transport.turnplane import ACCELERATED
from tests.adversarial.turn_quota_support import (
    grown,
    live_objects,
    measure_turn_churn,
    p2p_churn,
    p2p_with_turn,
    settled,
)
from tests.conftest import eventually

pytestmark = pytest.mark.timeout(120)

TURN_CYCLES = 20_000
P2P_SESSIONS = 2_000


async def test_turn_churn_leaves_object_counts_where_they_started() -> None:
    assert await measure_turn_churn(TURN_CYCLES) == {}


@pytest.mark.skipif(not ACCELERATED, reason="this process already runs pure Python")
def test_turn_churn_in_the_pure_python_data_plane() -> None:
    # The data plane is chosen at import time: a process of its own.
    env = dict(os.environ, CROSSROADS_TURN_PURE_PYTHON="1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.adversarial.turn_quota_support", "10000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}


@pytest.fixture
async def rt() -> AsyncIterator[Runtime]:
    async with p2p_with_turn(
        # Every hosting peer is a new TURN client on 127.0.0.1: its 401 must
        # not be rate-limited away.
        turn__unauthenticated_rate=100_000,
        # 32 sessions at once, all from 127.0.0.1.
        p2p__max_sessions_per_ip=64,
        # A freed allocation is remembered (replay protection) for one nonce
        # lifetime + 5 s: short here, so the test sees it go.
        turn__nonce_lifetime=1,
        p2p__max_connections_per_ip=1000,
        # Each freed allocation leaves an insight record in a bounded ring and
        # stream: small enough for the warm-up (100 sessions) to fill, so the
        # measured churn shows what grows without bound.
        insight__ring=50,
        insight__stream_max=50,
    ) as runtime:
        yield runtime


def _forgotten(runtime: Runtime) -> Callable[[], Awaitable[bool]]:
    turn = runtime.services["turn"]
    assert isinstance(turn, TurnService)

    async def check() -> bool:
        return turn.core.freed_count == 0

    return check


async def test_p2p_sessions_with_turn_leave_object_counts_where_they_started(
    rt: Runtime,
) -> None:
    await p2p_churn(rt, 100)
    await settled(rt)
    before = live_objects()
    await p2p_churn(rt, P2P_SESSIONS)
    await settled(rt)
    # One nonce lifetime (1 s) + 5 s after the last release; generous bound
    # for a loaded machine.
    await eventually(
        _forgotten(rt), "the replay memory of freed allocations expired", timeout=30
    )
    await asyncio.sleep(0)
    assert grown(before, live_objects()) == {}
