"""The routers' nftables text: every kind's ruleset is one nft accepts, and a
UDP-blocking firewall drops UDP before anything else can accept it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from crossroads.lab.kinds import (
    KINDS,
    VARIANT_KINDS,
    NatKind,
    cgn_ruleset,
    router_firewall6,
    router_ruleset,
)

ALL_KINDS = (*KINDS, *VARIANT_KINDS)


def _forward_chain(ruleset: str) -> list[str]:
    found = re.search(r"chain forward \{\n(.*?)\n  \}", ruleset, re.DOTALL)
    assert found is not None, ruleset
    return [line.strip() for line in found.group(1).splitlines()[1:]]


def _rulesets() -> list[str]:
    texts = [cgn_ruleset(inside_net="100.64.1.0/24")]
    for kind in ALL_KINDS:
        texts.append(router_firewall6(kind))
        for hairpin in (False, True):
            texts.append(
                router_ruleset(
                    kind,
                    lan_net="192.168.1.0/24",
                    wan_ip="198.51.100.5",
                    hairpin=hairpin,
                    stun_check=(("198.51.100.1",), (3478, 3479)) if hairpin else None,
                )
            )
    return texts


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda kind: kind.name)
def test_only_a_udp_blocking_firewall_drops_udp_first(kind: NatKind) -> None:
    for ruleset in (
        router_firewall6(kind),
        router_ruleset(
            kind, lan_net="192.168.1.0/24", wan_ip="198.51.100.5", hairpin=False
        ),
    ):
        forward = _forward_chain(ruleset)
        assert (forward[0] == "meta l4proto udp drop") == (not kind.udp), ruleset
        assert forward[int(not kind.udp)] == "ct state established,related accept"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None, reason="nft -c needs root"
)
def test_nft_accepts_every_ruleset() -> None:
    for ruleset in _rulesets():
        # -c: parse and check against the kernel, apply nothing.
        done = subprocess.run(
            ["nft", "-c", "-f", "-"], input=ruleset, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr + ruleset
