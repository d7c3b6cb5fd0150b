from __future__ import annotations

from crossroads.proto.openttd.coordinator import (
    ConnectionType,
    GcConnectFailed,
    GcStunRequest,
)
from crossroads.proto.openttd.ladder import SendToServer
from crossroads.proto.openttd.verify import (
    CHECK_TIMEOUT,
    Concluded,
    Probe,
    RegistrationCheck,
)
from tests.proto.openttd.timers import fire

KEY = "0a1b2c3d" + "11" * 12
V = "V" + KEY


def check(version: int = 6, turn: bool = True) -> RegistrationCheck:
    return RegistrationCheck(
        check_key=KEY,
        server_version=version,
        source_host="198.51.100.9",
        server_port=3979,
        turn_available=turn,
        now=0.0,
    )


def test_direct_server() -> None:
    c = check()
    assert c.start(0.0) == [SendToServer(GcStunRequest(V)), Probe("198.51.100.9", 3979)]
    assert c.stun_result(10, False, 0.1) == []
    # The STUN service saw the same address: no second probe.
    assert c.stun_observed(2, "198.51.100.9", 0.1) == []
    assert c.stun_result(2, True, 0.1) == []  # the probe is still out
    assert c.probe_result("198.51.100.9", True, 0.2) == [
        SendToServer(GcConnectFailed(V)),
        Concluded(ConnectionType.DIRECT, (("198.51.100.9", 3979),), True),
    ]


def test_every_observed_address_is_probed_once() -> None:
    c = check()
    c.start(0.0)
    assert c.stun_observed(10, "2001:db8::9", 0.1) == [Probe("2001:db8::9", 3979)]
    assert c.stun_observed(10, "2001:db8::9", 0.1) == []
    c.stun_result(10, True, 0.1)
    c.stun_observed(2, "198.51.100.9", 0.1)
    c.stun_result(2, True, 0.1)
    c.probe_result("198.51.100.9", False, 0.2)
    out = c.probe_result("2001:db8::9", True, 0.3)
    assert out[-1] == Concluded(ConnectionType.DIRECT, (("2001:db8::9", 3979),), True)


def test_behind_nat_is_stun() -> None:
    c = check()
    c.start(0.0)
    c.probe_result("198.51.100.9", False, 0.1)
    c.stun_result(10, False, 0.1)
    assert c.stun_result(2, True, 0.2) == []  # waiting for the observation
    out = c.stun_observed(2, "203.0.113.1", 0.3)
    assert out == [Probe("203.0.113.1", 3979)]
    out = c.probe_result("203.0.113.1", False, 0.4)
    assert out[-1] == Concluded(ConnectionType.STUN, (), True)


def test_isolated_is_turn_from_version_5_with_a_relay() -> None:
    for version, turn, expected in (
        (6, True, ConnectionType.TURN),
        (5, True, ConnectionType.TURN),
        (4, True, ConnectionType.ISOLATED),
        (6, False, ConnectionType.ISOLATED),
    ):
        c = check(version, turn)
        c.start(0.0)
        c.probe_result("198.51.100.9", False, 0.1)
        c.stun_result(10, False, 0.1)
        out = c.stun_result(2, False, 0.1)
        assert out[-1] == Concluded(expected, (), False)


def test_version_2_has_no_stun() -> None:
    c = check(2)
    assert c.start(0.0) == [Probe("198.51.100.9", 3979)]
    assert c.probe_result("198.51.100.9", True, 0.1) == [
        Concluded(ConnectionType.DIRECT, (("198.51.100.9", 3979),), False)
    ]


def test_timeout_concludes_with_what_is_known() -> None:
    c = check()
    c.start(0.0)
    c.stun_result(2, True, 0.1)
    assert c.get_timer() == CHECK_TIMEOUT
    assert fire(c, CHECK_TIMEOUT - 1) == []
    out = fire(c, CHECK_TIMEOUT)
    assert out == [
        SendToServer(GcConnectFailed(V)),
        Concluded(ConnectionType.STUN, (), True),
    ]
    assert c.done
    assert c.probe_result("198.51.100.9", True, 8.0) == []
