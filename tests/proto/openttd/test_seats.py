"""The servers registered on an instance and the per-source counts
(proto/openttd/seats.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.openttd.seats import Seats


def test_a_seat_is_counted_per_source_and_released_once() -> None:
    seats: Seats[str] = Seats()
    assert seats.take("+a", "conn1", "192.0.2.1", None) is None
    # An IPv6 /64 is one source.
    seats.take("+b", "conn2", "2001:db8::1", None)
    seats.take("+c", "conn3", "2001:db8::2", None)
    assert seats.count_from("2001:db8::99") == 2 and seats.count_from("192.0.2.1") == 1
    assert seats.release("+b", "conn2") and not seats.release("+b", "conn2")
    assert not seats.release("+c", "conn1")  # not its seat
    assert seats.count_from("2001:db8::2") == 1 and len(seats) == 2


def test_re_registering_under_another_code_moves_the_seat() -> None:
    seats: Seats[str] = Seats()
    seats.take("+a", "conn", "192.0.2.1", None)
    assert seats.take("+b", "conn", "192.0.2.1", "+a") is None
    assert seats.by_code == {"+b": "conn"} and seats.count_from("192.0.2.1") == 1
    # The same code again changes nothing.
    assert seats.take("+b", "conn", "192.0.2.1", "+b") is None
    assert seats.count_from("192.0.2.1") == 1


def test_a_displaced_connection_gives_its_count_back_at_once() -> None:
    """Before the split the displaced server's count stayed: its close found
    the seat taken by the new connection and released nothing, so a server
    that came back this way used up its source's quota for good."""
    seats: Seats[str] = Seats()
    seats.take("+a", "old", "192.0.2.1", None)
    assert seats.take("+a", "new", "192.0.2.1", None) == "old"
    assert seats.count_from("192.0.2.1") == 1
    assert not seats.release("+a", "old")  # the old connection's close
    assert seats.count_from("192.0.2.1") == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from(["+a", "+b", "+c"]),
            st.integers(0, 3),
            st.sampled_from(["192.0.2.1", "192.0.2.2"]),
        )
    )
)
def test_counts_always_match_the_seats(steps: list[tuple[bool, str, int, str]]) -> None:
    seats: Seats[int] = Seats()
    hosts: dict[int, str] = {}
    holding: dict[int, str] = {}
    for take, code, conn, host in steps:
        host = hosts.setdefault(conn, host)  # a connection keeps its address
        if take:
            seats.take(code, conn, host, holding.get(conn))
            displaced = [c for c, held in holding.items() if held == code and c != conn]
            for c in displaced:
                del holding[c]
            holding[conn] = code
        elif holding.get(conn) == code:
            assert seats.release(code, conn)
            del holding[conn]
    assert seats.by_code == {code: conn for conn, code in holding.items()}
    for host in ("192.0.2.1", "192.0.2.2"):
        expected = sum(1 for conn in holding if hosts[conn] == host)
        assert seats.count_from(host) == expected
