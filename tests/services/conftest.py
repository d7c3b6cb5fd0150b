"""Fixtures shared by the service tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.interop.raknet_support import RakNetPeer


@pytest.fixture
def peers() -> Iterator[tuple[RakNetPeer, RakNetPeer]]:
    """Two real RakNet 4.081 peers (PyPI ``raknet==0.3.0``) on 127.0.0.1.
    Imported here, not at the top: the other service tests do not need the
    wheel (the RakNet tests fail without it, they never skip)."""
    from tests.interop.raknet_support import RakNetPeer

    a, b = RakNetPeer(), RakNetPeer()
    yield a, b
    a.close()
    b.close()
