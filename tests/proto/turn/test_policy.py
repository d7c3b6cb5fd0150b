"""Peer address policy: what a relay refuses by default."""

from __future__ import annotations

import pytest

from crossroads.proto.turn.policy import PeerPolicy, parse_networks

DENIED = [
    "127.0.0.1",
    "127.255.0.9",
    "::1",
    "10.1.2.3",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "255.255.255.255",
    "::",
    "fe80::1",
    "fd00::1",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "not an ip",
]
ALLOWED = [
    "8.8.8.8",
    "192.0.2.1",
    "198.51.100.7",
    "203.0.113.9",
    "2001:db8::1",
    "2606:4700::1",
]


@pytest.mark.parametrize("ip", DENIED)
def test_default_denies_internal_ranges(ip: str) -> None:
    assert not PeerPolicy().permits(ip)


@pytest.mark.parametrize("ip", ALLOWED)
def test_default_allows_public_and_documentation(ip: str) -> None:
    assert PeerPolicy().permits(ip)


def test_allow_loopback_lifts_only_loopback() -> None:
    policy = PeerPolicy(allow_loopback=True)
    assert policy.permits("127.0.0.1")
    assert policy.permits("::1")
    assert policy.permits("::ffff:127.0.0.1")
    assert not policy.permits("10.0.0.1")


def test_allow_and_deny_lists() -> None:
    policy = PeerPolicy(
        allow=parse_networks(["10.0.0.0/24"]),
        deny=parse_networks(["8.8.8.8", "10.0.0.0/8"]),
    )
    assert policy.permits("10.0.0.5")  # allow wins
    assert not policy.permits("10.0.1.5")
    assert not policy.permits("8.8.8.8")
    assert policy.permits("8.8.4.4")


def test_bad_network() -> None:
    with pytest.raises(ValueError, match="nope"):
        parse_networks(["nope"])
