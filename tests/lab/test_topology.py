"""Lab lifecycle: idempotent up, complete down, cleanup after a failed up, and no
route out of the lab."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess

import pytest

from crossroads.lab import netns
from crossroads.lab.topology import (
    TOPOLOGY_VERSION,
    Lab,
    LabError,
    State,
    make_sites,
)

from .conftest import unique_prefix

pytestmark = [pytest.mark.lab, pytest.mark.timeout(120)]


def test_bad_prefix_is_refused() -> None:
    for bad in ("", "a-b", "X", "1abc", "abcdefghijklm"):
        with pytest.raises(LabError):
            Lab(bad)


def test_state_file_round_trips_and_keeps_its_keys() -> None:
    state = State("xr", {"server": 4242}, created=1700000000.5, version=4)
    text = state.dump()
    # `down` and `exec` of older code read this file too: the keys stay.
    assert json.loads(text) == {
        "prefix": "xr",
        "pids": {"server": 4242},
        "created": 1700000000.5,
        "version": 4,
    }
    assert State.load(text) == state


def test_site_addresses_are_the_documented_plan() -> None:
    sites = make_sites()
    third = sites[2]
    assert (third.lan_net, third.gateway, third.host_ip) == (
        "192.168.3.0/24",
        "192.168.3.1",
        "192.168.3.2",
    )
    assert (third.lan_net6, third.gateway6, third.host_ip6) == (
        "2001:db8:3::/64",
        "2001:db8:3::1",
        "2001:db8:3::2",
    )
    for site in sites:
        lan = ipaddress.ip_network(site.lan_net)
        lan6 = ipaddress.ip_network(site.lan_net6)
        assert ipaddress.ip_address(site.gateway) in lan
        assert ipaddress.ip_address(site.gateway6) in lan6
        assert ipaddress.ip_address(site.host_ip6) in lan6
        if site.kind.natted:
            assert ipaddress.ip_address(site.host_ip) in lan
        else:
            assert site.host_ip == site.public_ip
    assert len({site.lan_net for site in sites}) == len(sites)


def test_names_resolve(lab: Lab) -> None:
    assert lab.resolve("full-cone") == f"{lab.prefix}-full-cone-a"
    assert lab.resolve("cgnat-b") == f"{lab.prefix}-cgnat-b"
    assert lab.resolve("cgnat-b-cgn") == f"{lab.prefix}-cgnat-b-c"
    assert (
        lab.resolve("symmetric-random-a-router") == f"{lab.prefix}-symmetric-random-a-r"
    )
    assert lab.resolve("server") == f"{lab.prefix}-srv"
    with pytest.raises(LabError):
        lab.resolve("open-a-router")
    with pytest.raises(LabError):
        lab.resolve("no-such-kind")


def test_up_is_idempotent_and_processes_run(lab: Lab) -> None:
    assert lab.is_up()
    pids = dict(lab.state.pids)
    assert asyncio.run(lab.up()) is False  # already up: nothing rebuilt
    assert lab.state.pids == pids
    assert {"coturn", "crossroads", "miniupnpd-restricted-cone-a"} <= set(pids)


def test_a_lab_built_by_older_code_is_not_up(lab: Lab) -> None:
    assert lab.is_up()
    lab.state.version = TOPOLOGY_VERSION - 1
    lab._save_state()
    try:
        assert not lab.is_up()  # `up` would rebuild it
    finally:
        lab.state.version = TOPOLOGY_VERSION
        lab._save_state()
    assert lab.is_up()


def test_nothing_routes_out_of_the_lab(lab: Lab) -> None:
    # The internet router has no default route: an address outside the lab's
    # ranges is unreachable from every namespace, so nothing can leave.
    out = subprocess.run(
        ["ip", "-n", lab.inet_ns, "route", "get", "8.8.8.8"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0, out.stdout
    routes = subprocess.run(
        ["ip", "-n", lab.inet_ns, "route", "show", "default"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert routes.stdout.strip() == ""


def test_down_removes_everything_and_a_failed_up_cleans_up() -> None:
    the_lab = Lab(unique_prefix("xd"), server=False)

    class Boom(Exception):
        pass

    async def fail_after_network() -> None:
        raise Boom

    async def scenario() -> None:
        # A failure after the network is built takes it all down again.
        the_lab._start_processes = fail_after_network  # type: ignore[method-assign]
        with pytest.raises(Boom):
            await the_lab.up()
        assert netns.names(the_lab.prefix) == []
        del the_lab._start_processes
        # A real up, then down: no namespace, no process, no state left.
        try:
            assert await the_lab.up() is True
            pids = list(the_lab.state.pids.values())
            assert pids and all(netns.alive(pid) for pid in pids)
            assert len(netns.names(the_lab.prefix)) == len(the_lab.namespaces())
        finally:
            await the_lab.down()
        assert netns.names(the_lab.prefix) == []
        assert not any(netns.alive(pid) for pid in pids)
        assert not the_lab.state_dir.exists()

    asyncio.run(scenario())


def test_cli_exec_runs_in_a_lab_host(lab: Lab) -> None:
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "crossroads", "lab", "exec", "--prefix", lab.prefix]
        + ["cgnat-b", "--", "ip", "-4", "-o", "addr", "show", "dev", "lan"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert lab.site("cgnat-b").host_ip in out.stdout
