"""The one address policy of every relay (crossroads.proto.policy)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from crossroads.proto.policy import (
    AddressPolicy,
    Scope,
    Verdict,
    embedded_ipv4,
    parse_networks,
    scopes_for,
)

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
    "198.18.0.1",
    "::",
    "fe80::1",
    "fe80::1%eth0",
    "fd00::1",
    "ff02::1",
    "64:ff9b:1::1",
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
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8
    "2002:808:808::1",  # 6to4 of 8.8.8.8
]


@pytest.mark.parametrize("ip", DENIED)
def test_default_denies_internal_ranges(ip: str) -> None:
    assert not AddressPolicy().permits(ip)


@pytest.mark.parametrize("ip", ALLOWED)
def test_default_allows_public_and_documentation(ip: str) -> None:
    assert AddressPolicy().permits(ip)


def test_verdicts_name_the_reason() -> None:
    policy = AddressPolicy()
    assert policy.judge("127.0.0.1") == Verdict.LOOPBACK
    assert policy.judge("10.0.0.1") == Verdict.PRIVATE
    assert policy.judge("169.254.169.254") == Verdict.LINK_LOCAL
    assert policy.judge("0.0.0.0") == Verdict.RESERVED
    assert policy.judge("bogus") == Verdict.MALFORMED
    assert Verdict.LINK_LOCAL.reason == "link-local"


def teredo(client: str, server: str = "65.54.227.120") -> str:
    """A Teredo address (RFC 4380 §4): server IPv4, flags, port and the client
    IPv4 each obfuscated by XOR with all ones."""
    value = (0x2001_0000 << 96) | (int(ipaddress.IPv4Address(server)) << 64)
    value |= (0x8000 << 48) | ((0xFFFF ^ 40000) << 32)
    value |= int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF
    return str(ipaddress.IPv6Address(value))


def embeddings(v4: str) -> list[str]:
    """Every IPv6 form that carries ``v4``."""
    low = int(ipaddress.IPv4Address(v4))
    forms = [
        (0, 96),  # ::a.b.c.d, IPv4-compatible
        (0xFFFF, 32),  # ::ffff:a.b.c.d, mapped
        (0xFFFF_0000, 32),  # ::ffff:0:a.b.c.d, translated
        (0x0064_FF9B << 96, 0),  # 64:ff9b::/96, NAT64
    ]
    out = [
        str(ipaddress.IPv6Address((prefix << shift) | low if shift else prefix | low))
        for prefix, shift in forms
    ]
    out.append(str(ipaddress.IPv6Address((0x2002 << 112) | (low << 80) | 1)))
    out.append(teredo(v4))
    return out


@pytest.mark.parametrize("v4", ["127.0.0.1", "10.0.0.1", "169.254.169.254"])
def test_every_embedded_form_is_refused(v4: str) -> None:
    policy = AddressPolicy()
    for form in embeddings(v4):
        assert policy.judge(form) == policy.judge(v4), form


def test_teredo_client_is_the_xored_last_32_bits() -> None:
    address = ipaddress.IPv6Address(teredo("10.9.8.7"))
    assert ipaddress.IPv4Address("10.9.8.7") in embedded_ipv4(address)


@given(st.integers(0, 2**32 - 1), st.integers(0, 5))
def test_an_embedding_is_judged_like_its_ipv4(value: int, which: int) -> None:
    # ::0.0.0.0 and ::0.0.0.1 are :: and ::1, judged as such (both refused).
    assume(which != 0 or value > 1)
    v4 = str(ipaddress.IPv4Address(value))
    own = ipaddress.IPv4Address("203.0.113.5")
    policy = AddressPolicy(self_addresses=frozenset({own}))
    assert policy.judge(embeddings(v4)[which]) == policy.judge(v4)


@given(st.integers(0, 2**128 - 1))
def test_judge_never_raises(value: int) -> None:
    assert isinstance(AddressPolicy().judge(str(ipaddress.IPv6Address(value))), Verdict)


def test_own_addresses_are_refused_in_every_form() -> None:
    own = ipaddress.IPv4Address("203.0.113.5")
    policy = AddressPolicy(self_addresses=frozenset({own}))
    assert policy.judge("203.0.113.5") == Verdict.SELF
    for form in embeddings("203.0.113.5"):
        assert policy.judge(form) == Verdict.SELF, form
    assert policy.permits("203.0.113.6")
    assert policy.is_self("::ffff:203.0.113.5")
    assert policy.is_self("127.0.0.9") and policy.is_self("0.0.0.0")
    assert not policy.is_self("203.0.113.6")


def test_admitted_scope() -> None:
    loop = AddressPolicy(
        self_addresses=frozenset({ipaddress.IPv4Address("127.0.0.1")}),
        admitted=frozenset({Scope.LOOPBACK}),
    )
    assert loop.permits("127.0.0.1")  # own, but in the admitted scope
    assert loop.permits("::1")
    assert loop.permits("::ffff:127.0.0.1")
    assert not loop.permits("10.0.0.1")
    assert loop.admitting(Scope.PRIVATE).permits("10.0.0.1")


def test_scopes_for_the_advertised_address() -> None:
    assert scopes_for(["127.0.0.1"]) == {Scope.LOOPBACK}
    assert scopes_for(["192.168.1.10"]) == {Scope.PRIVATE}
    assert scopes_for(["203.0.113.5", "0.0.0.0", "junk", ""]) == frozenset()


def test_allow_and_deny_lists() -> None:
    policy = AddressPolicy(
        allow=parse_networks(["10.0.0.0/24"]),
        deny=parse_networks(["8.8.8.8", "10.0.0.0/8", "203.0.113.0/24"]),
    )
    assert policy.permits("10.0.0.5")  # allow wins
    assert not policy.permits("10.0.1.5")
    assert policy.judge("8.8.8.8") == Verdict.DENIED
    assert policy.judge("::ffff:203.0.113.1") == Verdict.DENIED
    assert policy.permits("8.8.4.4")


def test_bad_network() -> None:
    with pytest.raises(ValueError, match="nope"):
        parse_networks(["nope"])
