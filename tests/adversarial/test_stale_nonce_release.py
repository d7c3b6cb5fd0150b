"""A call that ends frees its allocation.

Chromium's closing Refresh (LIFETIME 0) carried a nonce older than the nonce
lifetime; crossroads answered 438, Chromium did not retry, and the allocation held
its ports until it expired. A correctly signed Refresh 0 with a stale nonce (ours,
minted for this 5-tuple, only too old) now frees the allocation; anything else
with a stale nonce still gets 438. The nonce lifetime is configurable.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from crossroads.proto.stun import Lifetime, Method, XorPeerAddress
from crossroads.proto.turn.auth import rest_password
from crossroads.proto.turn.credentials import LongTermSession
from crossroads.proto.turn.server import error_code_of
from tests.proto.turn.conftest import EPOCH, Harness, udp
from tests.services.test_turn import turn_fixture  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def _allocated(harness: Harness) -> LongTermSession:
    session = LongTermSession("alice", "secret")
    # An hour, so that it outlives the nonce (a long call refreshes instead).
    answer = harness.allocate(udp(), session, [Lifetime(3600)])
    assert error_code_of(answer) is None
    return session


def test_closing_refresh_with_stale_nonce_frees_the_allocation() -> None:
    harness = Harness()
    session = _allocated(harness)
    harness.advance(harness.server.nonces.lifetime + 60)
    assert udp() in harness.server.allocations
    answer = harness.request(
        Method.REFRESH, [Lifetime(0)], udp(), session, retry_stale=False
    )
    assert answer is not None and error_code_of(answer) is None
    assert answer.get(Lifetime) == Lifetime(0)
    assert harness.server.allocations == {}
    assert harness.binder.open_count == 0
    assert harness.server.counters.stale_nonce_releases == 1


def test_stale_nonce_still_gets_438_for_anything_but_a_release() -> None:
    harness = Harness()
    session = _allocated(harness)
    harness.advance(harness.server.nonces.lifetime + 60)
    for method, attributes in (
        (Method.REFRESH, [Lifetime(600)]),
        (Method.CREATE_PERMISSION, [XorPeerAddress("198.51.100.20", 5000)]),
    ):
        answer = harness.request(method, attributes, udp(), session, retry_stale=False)
        assert answer is not None and error_code_of(answer) == 438
    assert udp() in harness.server.allocations


def test_stale_release_needs_the_key_and_the_same_5_tuple() -> None:
    harness = Harness()
    session = _allocated(harness)
    harness.advance(harness.server.nonces.lifetime + 60)
    forged = LongTermSession("alice", "not-the-password")
    forged.realm, forged.nonce = session.realm, session.nonce
    answer = harness.request(
        Method.REFRESH, [Lifetime(0)], udp(), forged, retry_stale=False
    )
    assert answer is not None and error_code_of(answer) == 401
    # The same signed request from another port: the nonce is not ours there.
    answer = harness.request(
        Method.REFRESH, [Lifetime(0)], udp(40001), session, retry_stale=False
    )
    assert answer is not None and error_code_of(answer) == 438
    assert udp() in harness.server.allocations


def test_stale_release_cannot_free_a_newer_allocation_on_the_same_5_tuple() -> None:
    harness = Harness()
    old = _allocated(harness)
    harness.request(Method.REFRESH, [Lifetime(0)], udp(), old)
    # A new allocation on the same 5-tuple, signed with a newer nonce.
    harness.advance(harness.server.nonces.lifetime + 60)
    new = LongTermSession("alice", "secret")
    assert error_code_of(harness.allocate(udp(), new, [Lifetime(3600)])) is None
    harness.advance(harness.server.nonces.lifetime + 60)
    # A release signed with the first allocation's (older) nonce is refused.
    answer = harness.request(
        Method.REFRESH, [Lifetime(0)], udp(), old, retry_stale=False
    )
    assert answer is not None and error_code_of(answer) == 438
    assert udp() in harness.server.allocations


def test_an_expired_rest_username_can_still_free_its_allocation() -> None:
    harness = Harness()
    username = f"{int(EPOCH + 3600)}:carol"
    session = LongTermSession(username, rest_password("s3cr3t", username))
    answer = harness.allocate(udp(), session, [Lifetime(3600)])
    assert error_code_of(answer) is None
    harness.advance(3000)
    refresh = harness.request(Method.REFRESH, [Lifetime(3600)], udp(), session)
    assert refresh is not None and error_code_of(refresh) is None
    harness.advance(700)  # the username expired 100 s ago
    refused = harness.request(Method.REFRESH, [Lifetime(600)], udp(), session)
    assert refused is not None and error_code_of(refused) == 401
    release = harness.request(Method.REFRESH, [Lifetime(0)], udp(), session)
    assert release is not None and error_code_of(release) is None
    assert harness.server.allocations == {}


async def test_nonce_lifetime_is_configurable(turn: Any) -> None:
    service = await turn(turn__nonce_lifetime=45)
    assert service.core.nonces.lifetime == 45
    default = await turn()
    assert default.core.nonces.lifetime == 600
    text = generate_latest(default.ctx.metrics).decode()
    assert "crossroads_turn_stale_nonce_releases_total 0.0" in text
    assert "crossroads_turn_credential_renewals_total 0.0" in text
