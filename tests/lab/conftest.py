"""One NAT lab for the whole test session (building it takes ~10 s), under a
prefix unique to this pytest process so parallel runs never share namespaces."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator

import pytest

from crossroads.lab.topology import Lab


def lab_available() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the NAT lab needs root"
    for tool in ("ip", "nft", "conntrack", "turnserver", "miniupnpd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make install)"
    return None


def unique_prefix(tag: str) -> str:
    """``tag`` and this process's id, or ``CROSSROADS_TEST_LAB_PREFIX`` verbatim
    (a machine shared by several people, each with a namespace prefix of their
    own)."""
    return (
        os.environ.get("CROSSROADS_TEST_LAB_PREFIX") or f"{tag}{os.getpid() % 100000}"
    )


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    reason = lab_available()
    if reason is not None:
        pytest.fail(reason)
    the_lab = Lab(unique_prefix("xt"))
    try:
        asyncio.run(the_lab.up())
        yield the_lab
    finally:
        asyncio.run(the_lab.down())
