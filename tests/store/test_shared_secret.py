"""SharedSecret: re-published when the store lost it, first writer wins."""

from __future__ import annotations

import logging

import pytest

from crossroads.store.memory import MemoryStore
from crossroads.store.shared_secret import SharedSecret


async def test_a_lost_secret_is_put_back_and_a_foreign_one_adopted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="crossroads.store")
    store = MemoryStore()
    first = SharedSecret(store, "x:secret", "x")
    second = SharedSecret(store, "x:secret", "x")
    key = await first.resolve()
    assert await second.resolve() == key
    assert await first.republish() is None  # nothing lost, nothing changed

    await store.delete("x:secret")  # the store lost it
    assert await first.republish() is None
    assert await store.get("x:secret") == key and first.restored == 1
    assert await second.republish() is None  # the same key: nothing to adopt

    await store.set("x:secret", b"f" * 64)  # another instance won the race
    assert await first.republish() == b"f" * 64
    assert first.current == b"f" * 64 and first.previous == [key]
    assert first.adopted == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("re-published" in m for m in messages)
    assert any("adopted" in m for m in messages)
    assert not any(key.decode() in m or "f" * 64 in m for m in messages)
