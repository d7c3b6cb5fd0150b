"""The first-attempt relay rule, driven in memory with a fake
clock: from what the server learns at INIT -- the NN1/NN2/NN3 mappings and an ERT
probe from another server port -- a pair that pinging cannot connect (an
endpoint-dependent mapping against address-and-port-dependent filtering) is
relayed on its first attempt, not only after a failed one."""

from __future__ import annotations

from crossroads.proto.natneg.packets import ErtTest, decode
from crossroads.proto.natneg.server import (
    RELAY_REASONS,
    NatNegServer,
    NatNegSocket,
    RelayNeeded,
    ServerConfig,
    SessionId,
)
from tests.proto.natneg.test_server import (
    COOKIE,
    Client,
    Sent,
    connects,
    run_until,
    sent,
    tight,
)

FIRST = SessionId(COOKIE, 1)


def probing(**overrides: object) -> ServerConfig:
    """The service's layout: a probe socket on natneg1's IP, another port."""
    return tight(unsolicited_port=NatNegSocket.PROBE_PORT, **overrides)


def erts(out: Sent) -> list[tuple[bytes, tuple[str, int], NatNegSocket]]:
    return [item for item in out if isinstance(decode(item[0]), ErtTest)]


def answer(
    core: NatNegServer, out: Sent, now: float, *, probe: bool, ip: str | None = None
) -> Sent:
    """The SDK's answer to every ERT_TEST in ``out`` (to ``ip`` only, if given):
    an ERT_ACK to wherever it came from. ``probe`` False: the client's NAT drops
    the one from the probe port (address-and-port-dependent filtering)."""
    for wire, addr, endpoint in erts(out):
        if ip is not None and addr[0] != ip:
            continue
        if endpoint is NatNegSocket.PROBE_PORT and not probe:
            continue
        core.receive_datagram(wire[:7] + b"\x03" + wire[8:21], addr, now, endpoint)
    return core.datagrams_to_send(now)


def relays(core: NatNegServer) -> list[RelayNeeded]:
    return [e for e in core.pop_events() if isinstance(e, RelayNeeded)]


def test_symmetric_against_a_port_filter_is_relayed_on_the_first_attempt() -> None:
    """A symmetric host (NN1 and NN3 from different public ports) and a guest
    behind a port-restricted cone: the guest answers the server's own ERT but not
    the probe from the other port, so the first attempt goes to the relay, and
    no CONNECT with the other's public address is ever sent."""
    core = NatNegServer(probing())
    host = Client(1, "198.51.100.10", symmetric=True, version=4)
    guest = Client(0, "203.0.113.20", version=4, game_port=None)
    host.send_inits(core, 0.0)
    answer(core, sent(core, 0.0), 0.02, probe=True)
    guest.send_inits(core, 1.0)
    out = sent(core, 1.0)
    # The guest's own ERT (from natneg1) and the probe (from the probe port),
    # both to its negotiate socket; the symmetric host gets no probe, only the
    # question whether it is still there (it has waited 1 s in silence).
    assert sorted((addr, ep) for _, addr, ep in erts(out)) == [
        (host.source(1), NatNegSocket.PRIMARY),
        (guest.source(1), NatNegSocket.PRIMARY),
        (guest.source(1), NatNegSocket.PROBE_PORT),
    ]
    assert connects(answer(core, out, 1.03, probe=False)) == []
    assert relays(core) == []  # the probe's answer may still come
    assert connects(run_until(core, 1.2)) == []
    (event,) = relays(core)
    assert event == RelayNeeded(
        FIRST, (guest.ip, host.ip), "symmetric-vs-port-filtering"
    )
    assert event.reason in RELAY_REASONS
    assert "client 1 NN" in event.detail and "client 0" in event.detail
    assert core.relay_allocated(FIRST, ("192.0.2.1", 50001), ("192.0.2.1", 50002), 1.2)
    # Each its own side of the pair (the nearer client's CONNECT a little later).
    out = connects(sent(core, 1.2) + run_until(core, 1.5))
    assert {(c.remote_ip, c.remote_port) for c, _, _ in out} == {
        ("192.0.2.1", 50001),
        ("192.0.2.1", 50002),
    }


def test_an_answered_probe_means_a_direct_path_at_once() -> None:
    """The same pair, but the guest's NAT lets the probe in (a full or
    address-restricted cone): the symmetric side's new port gets through, so the
    pair is told each other's public addresses, without any extra wait."""
    core = NatNegServer(probing())
    host = Client(1, "198.51.100.10", symmetric=True, version=4)
    guest = Client(0, "203.0.113.20", version=4, game_port=None)
    host.send_inits(core, 0.0)
    answer(core, sent(core, 0.0), 0.02, probe=True)
    guest.send_inits(core, 1.0)
    out = connects(answer(core, sent(core, 1.0), 1.03, probe=True))
    assert out  # the CONNECT to the host leaves at once (the farther client)
    assert relays(core) == []
    assert all(c.remote_ip in (host.ip, guest.ip) for c, _, _ in out)


def test_an_early_cone_client_is_probed_when_its_partner_shows_symmetric() -> None:
    """The cone client completed first (its round trip is known); the probe goes
    to it when the symmetric partner completes, and counts as filtered
    ``probe_grace`` after its known round trip -- not ``rtt_wait``."""
    core = NatNegServer(probing())
    guest = Client(0, "203.0.113.20", version=4)
    host = Client(1, "198.51.100.10", symmetric=True, version=4, game_port=None)
    guest.send_inits(core, 0.0)
    out = sent(core, 0.0)
    assert [ep for _, _, ep in erts(out)] == [NatNegSocket.PRIMARY]  # no probe yet
    answer(core, out, 0.04, probe=True)  # rtt 40 ms
    host.send_inits(core, 1.0)
    out = sent(core, 1.0)
    assert (guest.source(1), NatNegSocket.PROBE_PORT) in [
        (a, e) for _, a, e in erts(out)
    ]
    answer(core, out, 1.01, probe=False)
    assert connects(run_until(core, 1.139)) == []
    assert relays(core) == []
    run_until(core, 1.15)  # 1.0 + 0.04 + probe_grace
    assert [e.reason for e in relays(core)] == ["symmetric-vs-port-filtering"]


def test_no_answer_at_all_proves_nothing_and_cones_get_no_probe() -> None:
    """A client that answers neither ERT tells nothing about its filter: the pair
    goes direct after ``rtt_wait``, as before. Two cones are never probed (their
    filtering does not decide anything): no datagram more than before."""
    core = NatNegServer(probing())
    host = Client(1, "198.51.100.10", symmetric=True, version=4)
    guest = Client(0, "203.0.113.20", version=4)
    host.send_inits(core, 0.0)
    answer(core, sent(core, 0.0), 0.02, probe=True)
    guest.send_inits(core, 0.3)
    sent(core, 0.3)  # never answered
    out = connects(run_until(core, 0.8))
    assert out and relays(core) == []

    core = NatNegServer(probing())
    a, b = Client(0, "203.0.113.20"), Client(1, "198.51.100.10")
    a.send_inits(core, 0.0)
    b.send_inits(core, 0.0)
    out = sent(core, 0.0)
    assert [ep for _, _, ep in erts(out)] == [
        NatNegSocket.PRIMARY,
        NatNegSocket.PRIMARY,
    ]


def test_a_probe_answer_from_elsewhere_or_unasked_is_dropped() -> None:
    """Only the probed client's IP, on the probe socket, answers the probe; an
    ERT_ACK on the probe socket for a client never probed is unsolicited."""
    core = NatNegServer(probing())
    a = Client(0, "203.0.113.20")
    a.send_inits(core, 0.0)
    ((ert, _, _),) = erts(sent(core, 0.0))
    ack = ert[:7] + b"\x03" + ert[8:21]
    core.receive_datagram(ack, a.source(1), 0.01, NatNegSocket.PROBE_PORT)
    assert core.stats.dropped == {}  # counted as its own ERT's answer (no probe)
    core.receive_datagram(ack, ("192.0.2.66", 1), 0.02, NatNegSocket.PROBE_PORT)
    assert core.stats.dropped == {"unsolicited-ert-ack": 1}
