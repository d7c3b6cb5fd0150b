"""The kernel plane's XDP hook (``--kernel-hook``; issue 30: "XDP where the
device supports it; choose per device").

client (192.0.2.2, 2001:db8:2::2) -- [toc] server [top] -- peer (198.51.100.2,
2001:db8:3::2), veth pairs. On relay_lab as is, the veths behave as veths do
for local senders; ``wire_like`` makes them look like NICs on a wire (full
checksums, NAPI on the far ends, forwarding on the server's devices, or off:
then the next hops come from the plane's ``next_hops`` map). The XDP
program forwards what it can finish, counted in its ``xdp_stats``; what it
cannot (a partial checksum, an egress that would drop its frames, no
neighbour yet, a device another process's XDP holds) goes on to tc, which
forwards it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from crossroads.transport import kernelplane
from crossroads.transport.kernelplane import (
    EGRESS_RECHECK,
    KernelPlane,
    KernelPlaneUnavailable,
    KernelRoute,
    LinkFacts,
    RouteKind,
    link_facts,
    xdp_policy,
)
from tests.transport.netns_support import inside, ip, relay_lab
from tests.transport.plane_support import keep_plane_globals, wire_like
from tests.transport.test_kernelplane import channel_data
from tests.transport.test_kernelturn import (
    kernel_counts,
    kernel_plane,
    turn_lab,
    uclient_channels,
)

pytestmark = pytest.mark.timeout(60)

#: (client, listening address, relayed address, peer) per family.
FAMILIES = {
    4: (("192.0.2.2", 40000), ("192.0.2.1", 3478), ("198.51.100.1", 50000), ("198.51.100.2", 60000)),
    6: (("2001:db8:2::2", 40000), ("2001:db8:2::1", 3478), ("2001:db8:3::1", 50000), ("2001:db8:3::2", 60000)),
}  # fmt: skip
CHANNEL = 0x4001


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root for namespaces and eBPF")
    with relay_lab("xd") as found:
        yield found


def _load(ns: str, hook: str = "xdp") -> KernelPlane:
    with inside(ns):
        try:
            plane = KernelPlane.load()
        except KernelPlaneUnavailable as exc:
            pytest.skip(f"kernel plane unavailable: {exc}")
    plane.hook = hook
    return plane


def _udp(ns: str, addr: tuple[str, int]) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    with inside(ns):
        sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(2.0)
    return sock


def _recv(sock: socket.socket, timeout: float = 2.0) -> tuple[bytes, object] | None:
    sock.settimeout(timeout)
    try:
        data, addr = sock.recvfrom(4096)
    except TimeoutError:
        return None
    return data, (addr[0], addr[1])


class Channel:
    """A ChannelData channel's two kernel routes, on ``plane`` in the server
    namespace, and the sockets at its ends."""

    def __init__(
        self, names: dict[str, str], plane: KernelPlane, family: int = 4
    ) -> None:
        self.client_addr, self.listen_addr, self.relayed, self.peer_addr = FAMILIES[
            family
        ]
        self.names, self.plane = names, plane
        self.client = _udp(names["client"], self.client_addr)
        self.listen = _udp(names["server"], self.listen_addr)
        self.peer = _udp(names["peer"], self.peer_addr)
        self.up = KernelRoute(
            RouteKind.UNWRAP_CHANNEL, self.client_addr, self.listen_addr,
            self.relayed, self.peer_addr, CHANNEL,
        )  # fmt: skip
        self.down = KernelRoute(
            RouteKind.WRAP_CHANNEL, self.peer_addr, self.relayed,
            self.listen_addr, self.client_addr, CHANNEL,
        )  # fmt: skip
        with inside(names["server"]):
            plane.attach("toc")
            plane.attach("top")
            assert plane.install(self.up) and plane.install(self.down)

    def both_ways(self, data: bytes) -> None:
        """ChannelData to the peer unwrapped; the peer's answer wrapped."""
        self.send_up(data)
        assert _recv(self.peer) == (data, self.relayed)
        self.peer.sendto(data[::-1], self.relayed)
        back = channel_data(data[::-1], CHANNEL)
        assert _recv(self.client) == (back, self.listen_addr)

    def send_up(self, data: bytes) -> None:
        """``data`` as ChannelData from the client toward the peer."""
        self.client.sendto(channel_data(data, CHANNEL), self.listen_addr)

    def send_up_until_delivered(self, data: bytes) -> tuple[bytes, object] | None:
        """Send ``data`` up every 0.1 s, for four rechecks at most, until one
        reaches the peer (what reached it; None: none did)."""
        for _ in range(round(4 * EGRESS_RECHECK / 0.1)):
            self.send_up(data)
            arrived = _recv(self.peer, 0.1)
            if arrived is not None:
                return arrived
        return None

    def send_up_until_by_xdp(self, data: bytes) -> int:
        """Send ``data`` up, each reaching the peer, every 0.1 s for four
        rechecks at most, until the XDP program has forwarded one; how many
        were sent."""
        sent = 0
        for _ in range(round(4 * EGRESS_RECHECK / 0.1)):
            self.send_up(data)
            assert _recv(self.peer) == (data, self.relayed)
            sent += 1
            if self.plane.xdp_stats()["forwarded"]:
                break
            time.sleep(0.1)
        return sent

    def close(self) -> None:
        with inside(self.names["server"]):
            self.plane.close()
        for sock in (self.client, self.listen, self.peer):
            sock.close()


@pytest.mark.parametrize("hook", ["xdp", "xdp-unforwarded", "tc"])
@pytest.mark.parametrize("family", [4, 6])
def test_channel_data_with_finished_checksums_both_ways(
    names: dict[str, str], family: int, hook: str
) -> None:
    """On wire-like veths (finished checksums, as from a NIC), XDP in driver
    mode takes ChannelData's header off and puts it on, exact bytes and
    valid checksums (the receiving stack verifies them: a wrong one is
    dropped), for every size up to a full-MTU datagram, and tc forwards
    none of it; without forwarding on the server's devices too
    ("xdp-unforwarded": the next hops user space resolved). With
    ``--kernel-hook tc`` the tc program does the same by moving the headers
    (``tc_moves``), never the data."""
    forwarding = hook != "xdp-unforwarded"
    hook = hook.split("-")[0]
    plane = _load(names["server"], hook)
    with wire_like(names, forwarding=forwarding):
        channel = Channel(names, plane, family)
        try:
            sizes = [0, 1, 3, 4, 5, 100, 1399]
            if family == 6:
                sizes.append(1500 - 40 - 8 - 4)  # the largest that fits both ways
            else:
                sizes.append(1500 - 20 - 8 - 4)
            for n in sizes:
                channel.both_ways(bytes((i * 13 + n) % 256 for i in range(n)))
            stats, moves = plane.xdp_stats(), plane.tc_moves()
            by_xdp = 2 * len(sizes) if hook == "xdp" else 0
            assert stats["forwarded"] == by_xdp, stats
            assert moves == {"headers": 2 * len(sizes) - by_xdp, "data": 0}, moves
            assert plane.counters(channel.up) == (len(sizes), sum(sizes))
            assert plane.counters(channel.down) == (len(sizes), sum(sizes))
            assert {used for used, _ in plane.hooks.values()} == {hook}
        finally:
            channel.close()


def test_partial_checksums_go_to_tc(names: dict[str, str]) -> None:
    """Datagrams a local socket sends over a veth are CHECKSUM_PARTIAL: the
    field holds the pseudo-header's sum only, and XDP (no skb, the frame
    leaves finished) would forward a wrong checksum that the receiver drops.
    The program leaves them to tc, which forwards them correctly."""
    plane = _load(names["server"])
    with wire_like(names):
        for role in ("client", "peer"):  # back to a veth's default
            from tests.transport.netns_support import tx_checksum

            tx_checksum(names[role], "eth0", True)
        channel = Channel(names, plane)
        try:
            for n in range(3):
                channel.both_ways(b"partial %d" % n)
            stats = plane.xdp_stats()
            assert stats["forwarded"] == 0 and stats["left-checksum"] == 6, stats
            assert plane.counters(channel.up) == (3, 27)
        finally:
            channel.close()


def test_an_egress_that_would_drop_xdp_frames_goes_to_tc(names: dict[str, str]) -> None:
    """A frame sent into a veth whose peer has no NAPI is dropped after the
    program returned: with no XDP program on the client's and the peer's
    ends, the program never sends there; tc forwards."""
    plane = _load(names["server"])
    with wire_like(names):
        pass  # forwarding on, full checksums (tx off stays), no NAPI on the ends
    channel = Channel(names, plane)
    try:
        for n in range(3):
            channel.both_ways(b"no napi %d" % n)
        stats = plane.xdp_stats()
        assert stats["forwarded"] == 0 and stats["left-egress"] == 6, stats
    finally:
        channel.close()


def test_an_egress_that_stops_taking_xdp_frames_goes_to_tc_within_a_recheck(
    names: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The peer's veth end loses its XDP program (NAPI) after the route was
    installed: XDP frames sent into it would now be dropped after the
    program returned, where nothing falls back. The plane reads the egress
    facts again every EGRESS_RECHECK seconds and, from then on, leaves the
    datagrams to tc: the peer gets them again, with a log line saying why."""
    plane = _load(names["server"])
    with wire_like(names) as far_ends:
        channel = Channel(names, plane)
        try:
            channel.both_ways(b"by xdp")
            assert plane.xdp_stats()["forwarded"] == 2
            with inside(names["peer"]):
                far_ends["peer"].close()  # the peer's eth0 has no NAPI now
            with caplog.at_level(logging.INFO, logger="crossroads.dataplane"):
                arrived = channel.send_up_until_delivered(b"lost")
            assert arrived == (b"lost", channel.relayed)
            assert "XDP no longer sends out of top (its veth peer has no XDP" in (
                caplog.text
            )
            before = plane.xdp_stats()
            channel.both_ways(b"by tc")
            after = plane.xdp_stats()
            assert after["left-egress"] == before["left-egress"] + 1, after
            assert after["forwarded"] == before["forwarded"] + 1, after  # back: XDP
        finally:
            channel.close()


def test_no_neighbour_yet_goes_to_tc_then_xdp(names: dict[str, str]) -> None:
    """Without the next hop's link-layer address, bpf_fib_lookup cannot
    finish the packet: XDP passes it untouched, tc forwards it (resolving
    the neighbour); the next one goes by XDP."""
    plane = _load(names["server"])
    with wire_like(names):
        channel = Channel(names, plane)
        try:
            subprocess.run(
                ["ip", "-n", names["server"], "neigh", "flush", "dev", "top"],
                check=True,
            )
            channel.send_up(b"first")
            assert _recv(channel.peer) == (b"first", channel.relayed)
            stats = plane.xdp_stats()
            assert stats["forwarded"] == 0 and stats["left-next-hop"] == 1, stats
            from tests.transport.plane_support import prime_neighbours

            prime_neighbours(names["server"], (channel.peer_addr[0],))
            channel.send_up(b"first")
            assert _recv(channel.peer) == (b"first", channel.relayed)
            assert plane.xdp_stats()["forwarded"] == 1
            assert plane.counters(channel.up) == (2, 10)
        finally:
            channel.close()


def test_without_forwarding_xdp_takes_the_next_hop_user_space_resolved(
    names: dict[str, str],
) -> None:
    """A relay host need not forward: there bpf_fib_lookup answers only
    FWD_DISABLED, and the XDP program takes the next hop the plane resolved
    from the routing and neighbour tables (map ``next_hops``). Until the
    kernel knows the neighbour, datagrams go by tc (which resolves it);
    within a recheck, by XDP; the route's removal takes its next hop out."""
    plane = _load(names["server"])
    with wire_like(names, forwarding=False):
        subprocess.run(
            ["ip", "-n", names["server"], "neigh", "flush", "dev", "top"], check=True
        )
        channel = Channel(names, plane)
        try:
            channel.send_up(b"hop?")
            assert _recv(channel.peer) == (b"hop?", channel.relayed)
            stats = plane.xdp_stats()
            assert stats["forwarded"] == 0 and stats["left-next-hop"] == 1, stats
            sent = 1 + channel.send_up_until_by_xdp(b"hop?")
            assert plane.xdp_stats()["forwarded"] == 1
            assert plane.counters(channel.up) == (sent, 4 * sent)
            with inside(names["server"]):
                assert len(plane.next_hops()) == 2  # the peer's and the client's
                plane.remove(channel.up)
                assert len(plane.next_hops()) == 1
        finally:
            channel.close()


def test_an_egress_that_starts_taking_xdp_frames_gets_its_next_hop_in_a_recheck(
    names: dict[str, str],
) -> None:
    """Without forwarding, a route installed while its egress could not take
    XDP frames (the peer's veth end without NAPI) goes by tc; once the
    egress can, the watcher resolves the route's next hop too, and XDP
    forwards it from the next recheck."""
    plane = _load(names["server"])
    with wire_like(names, forwarding=False) as far_ends:
        with inside(names["peer"]):
            far_ends["peer"].close()
        channel = Channel(names, plane)
        napi = None
        try:
            channel.send_up(b"up")
            assert _recv(channel.peer) == (b"up", channel.relayed)
            stats = plane.xdp_stats()
            assert stats["forwarded"] == 0 and stats["left-egress"] == 1, stats
            with inside(names["peer"]):
                napi = KernelPlane.load()
                napi.hook = "xdp"
                napi.attach("eth0")  # NAPI on the peer's end now
            channel.send_up_until_by_xdp(b"up")
            assert plane.xdp_stats()["forwarded"] == 1
            with inside(names["server"]):
                top = socket.if_nametoindex("top")
                assert (top, channel.peer_addr[0]) in plane.next_hops()
        finally:
            channel.close()
            if napi is not None:
                with inside(names["peer"]):
                    napi.close()


def test_a_next_hop_takes_its_neighbours_new_mac_within_a_recheck(
    names: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without forwarding, the next hop's MAC follows the neighbour table:
    the peer's MAC changes (a gateway's failover, say) and the server's
    neighbour entry with it; from the next recheck XDP sends to the new MAC.
    No destination's route is looked up again here (NEXT_HOP_BATCH 0): one
    neighbour lookup per gateway does it, however many destinations."""
    monkeypatch.setattr(kernelplane, "NEXT_HOP_BATCH", 0)
    plane = _load(names["server"])
    with wire_like(names, forwarding=False):
        channel = Channel(names, plane)
        try:
            channel.both_ways(b"old mac")
            assert plane.xdp_stats()["forwarded"] == 2
            new = "02:00:00:00:0a:0b"
            peer_ip = channel.peer_addr[0]
            ip("-n", names["peer"], "link", "set", "eth0", "address", new)
            ip("-n", names["server"], "neigh", "replace", peer_ip, "lladdr", new,
               "dev", "top", "nud", "reachable")  # fmt: skip
            assert channel.send_up_until_delivered(b"new") == (b"new", channel.relayed)
            with inside(names["server"]):
                top = socket.if_nametoindex("top")
            assert plane.next_hops()[top, peer_ip][0] == bytes.fromhex("02000000 0a0b")
            before = plane.xdp_stats()["forwarded"]
            channel.both_ways(b"by xdp")
            assert plane.xdp_stats()["forwarded"] == before + 2
        finally:
            channel.close()


def test_a_second_plane_on_the_device_falls_back_to_tc(names: dict[str, str]) -> None:
    """One XDP program per device: the second plane (another process, a
    second worker) finds the device taken, says so, and runs tc there; the
    first one's XDP passes what it does not route, so the second's routes
    still forward."""
    first, second = _load(names["server"]), _load(names["server"])
    with wire_like(names):
        one = Channel(names, first)
        try:
            with inside(names["server"]):
                second.attach("toc")
                second.attach("top")
            hooks = {hook for hook, _ in second.hooks.values()}
            assert hooks == {"tc"}, second.hooks
            assert all("another XDP program" in why for _, why in second.hooks.values())
            route = KernelRoute(
                RouteKind.REWRITE, ("192.0.2.2", 40001), ("192.0.2.1", 3478),
                ("198.51.100.1", 50001), ("198.51.100.2", 60000),
            )  # fmt: skip
            with inside(names["server"]):
                assert second.install(route)
            other = _udp(names["client"], ("192.0.2.2", 40001))
            try:
                other.sendto(b"second", ("192.0.2.1", 3478))
                assert _recv(one.peer) == (b"second", ("198.51.100.1", 50001))
            finally:
                other.close()
            assert second.counters(route) == (1, 6)
            assert second.xdp_stats()["forwarded"] == 0
            one.both_ways(b"first's")
            assert first.xdp_stats()["forwarded"] == 2
        finally:
            with inside(names["server"]):
                second.close()
            one.close()


def test_auto_takes_xdp_on_nic_drivers_and_tc_on_veth() -> None:
    """The per-device policy (docs/architecture.md "Which hook, per device")."""
    nic, veth = LinkFacts(None, False), LinkFacts("veth", False, 3, 0)
    assert xdp_policy("auto", nic) is None  # forwarding on or off
    assert "veth" in (xdp_policy("auto", veth) or "")
    assert "bridge" in (xdp_policy("auto", LinkFacts("bridge", False)) or "")
    assert xdp_policy("xdp", veth) is None
    assert xdp_policy("tc", nic) == "--kernel-hook tc"


def test_auto_on_veth_says_tc_and_why(
    names: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    plane = _load(names["server"], "auto")
    try:
        with (
            caplog.at_level(logging.INFO, "crossroads.dataplane"),
            inside(names["server"]),
        ):
            plane.attach("toc")
        assert "dataplane: device toc: tc (a veth" in caplog.text
    finally:
        with inside(names["server"]):
            plane.close()


async def test_uclient_channels_forwarded_by_xdp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """coturn's turnutils_uclient with channels through crossroads on the
    kernel plane with --kernel-hook xdp: 0 loss, and the XDP program (not
    tc, not the sockets) forwarded the ChannelData both ways."""
    keep_plane_globals(monkeypatch)
    async with turn_lab("xdp") as (ns, rt, service):
        sent, received = await uclient_channels(ns, service)
        stats = kernel_plane(rt).xdp_stats()
        to_peer, to_client = kernel_counts(service)
        assert to_peer >= sent and to_client >= received
        # Every datagram the kernel forwarded, XDP did (uclient's first
        # datagrams may find no neighbour yet: those went by tc).
        assert stats["forwarded"] >= sent + received - 4, stats
        assert stats["left-checksum"] == stats["left-egress"] == 0, stats
        assert all(tap.forwarded == 0 for tap in service.routes.taps.values())
        # /metrics says so: the hook per device and the XDP program's counts.
        scraped = rt.metrics.get_sample_value
        for device in ("toc", "top"):
            labels = {"device": device, "hook": "xdp"}
            assert scraped("crossroads_dataplane_device_info", labels) == 1
        for outcome, count in kernel_plane(rt).xdp_stats().items():
            labels = {"outcome": outcome}
            assert scraped("crossroads_dataplane_xdp_datagrams_total", labels) == count


def test_an_ipv4_datagram_without_checksum_keeps_none(names: dict[str, str]) -> None:
    """IPv4 UDP may carry no checksum (0, RFC 768): XDP forwards it with
    none (an incremental update of 0 would be a wrong checksum, and the
    receiver would drop it)."""
    plane = _load(names["server"])
    with wire_like(names):
        channel = Channel(names, plane)
        try:
            channel.client.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK
            channel.peer.setsockopt(socket.SOL_SOCKET, 11, 1)
            for n in range(3):
                channel.both_ways(b"no checksum %d" % n)
            assert plane.xdp_stats()["forwarded"] == 6
        finally:
            channel.close()


_HOLDER = """
import time
from crossroads.transport.kernelplane import KernelPlane, KernelRoute, RouteKind
plane = KernelPlane.load()
plane.hook = "xdp"
plane.attach("toc")
plane.attach("top")
assert plane.hooks[plane.devices[0]][0] == "xdp", plane.hooks
assert plane.install(KernelRoute(RouteKind.REWRITE, ("192.0.2.2", 40000),
    ("192.0.2.1", 3478), ("198.51.100.1", 50000), ("198.51.100.2", 60000)))
print("ready", flush=True)
time.sleep(60)
"""


def test_a_second_process_falls_back_to_tc_and_a_killed_one_leaves_no_xdp(
    names: dict[str, str],
) -> None:
    """Another process holds the device's XDP: this one runs tc there and
    its route forwards through the holder's XDP program (which passes what
    it does not route); SIGKILLed, the holder's XDP link goes with it."""
    plane = _load(names["server"])
    with wire_like(names):
        holder = subprocess.Popen(
            ["ip", "netns", "exec", names["server"], sys.executable, "-c", _HOLDER],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        mine = _udp(names["client"], ("192.0.2.2", 40001))
        theirs = _udp(names["client"], ("192.0.2.2", 40000))
        peer = _udp(names["peer"], ("198.51.100.2", 60000))
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "ready"
            route = KernelRoute(
                RouteKind.REWRITE, ("192.0.2.2", 40001), ("192.0.2.1", 3478),
                ("198.51.100.1", 50001), ("198.51.100.2", 60000),
            )  # fmt: skip
            with inside(names["server"]):
                plane.attach("toc")
                assert plane.install(route)
                toc = socket.if_nametoindex("toc")
            hook, why = plane.hooks[toc]
            assert hook == "tc" and "another XDP program" in why
            theirs.sendto(b"theirs", ("192.0.2.1", 3478))
            assert _recv(peer) == (b"theirs", ("198.51.100.1", 50000))
            mine.sendto(b"mine", ("192.0.2.1", 3478))
            assert _recv(peer) == (b"mine", ("198.51.100.1", 50001))
            assert plane.counters(route) == (1, 4)
            holder.kill()
            holder.wait(10)
            with inside(names["server"]):
                assert not link_facts(toc).xdp
            mine.sendto(b"still", ("192.0.2.1", 3478))
            assert _recv(peer) == (b"still", ("198.51.100.1", 50001))
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(10)
            with inside(names["server"]):
                plane.close()
            for sock in (mine, theirs, peer):
                sock.close()
