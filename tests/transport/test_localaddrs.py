"""The host's own addresses (crossroads.transport.localaddrs)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.config import default_config
from crossroads.services import load_service_modules
from crossroads.transport.localaddrs import (
    configured_hosts,
    interface_addresses,
    own_addresses,
    parse_addr_dump,
)
from crossroads.transport.sockets import listening_ports, make_udp_socket


@given(st.binary(max_size=200))
def test_parse_addr_dump_takes_any_bytes(raw: bytes) -> None:
    addresses, _done = parse_addr_dump(raw)
    assert all(a.version in (4, 6) for a in addresses)


def test_interface_addresses_include_loopback() -> None:
    addresses = interface_addresses()
    assert ipaddress.ip_address("127.0.0.1") in addresses


def test_configured_hosts_and_cache() -> None:
    load_service_modules()  # the sections that declare host settings
    config = default_config(
        {"core.public_host": "203.0.113.7", "turn.external_ip": "198.51.100.9"}
    )
    assert {
        ipaddress.ip_address("203.0.113.7"),
        ipaddress.ip_address("198.51.100.9"),
    } <= configured_hosts(config)
    assert ipaddress.ip_address("0.0.0.0") not in configured_hosts(config)
    assert ipaddress.ip_address("203.0.113.7") in own_addresses(config)


def test_listening_ports_follow_the_sockets() -> None:
    sock = make_udp_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    assert port in listening_ports()
    sock.close()
    assert port not in listening_ports()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip"
)
def test_interface_addresses_in_a_namespace() -> None:
    """Every address of a veth end in a namespace of the test's own, the
    secondary one too (SIOCGIFCONF would miss the IPv6 one)."""
    ns = f"lap-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:

        def inside(*args: str) -> None:
            subprocess.run(["ip", "-n", ns, *args], check=True)

        inside("link", "add", "va", "type", "veth", "peer", "name", "vb")
        inside("addr", "add", "203.0.113.77/24", "dev", "va")
        inside("addr", "add", "203.0.113.78/24", "dev", "va")
        inside("addr", "add", "2001:db8::77/64", "dev", "va", "nodad")
        inside("link", "set", "va", "up")
        inside("link", "set", "vb", "up")
        code = (
            "from crossroads.transport.localaddrs import interface_addresses;"
            "print(' '.join(sorted(map(str, interface_addresses()))))"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        assert {"203.0.113.77", "203.0.113.78", "2001:db8::77"} <= set(out)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
