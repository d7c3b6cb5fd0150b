"""Where a TURN side waits for its peer: pairing, the one timer, the cap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.openttd.lobby import (
    MISMATCH,
    TicketCheck,
    TicketVerdict,
    TurnLobby,
)
from crossroads.proto.openttd.store import GetTicket, StoreRead


def test_the_second_side_pairs_with_the_first_and_the_wait_ends() -> None:
    lobby: TurnLobby[str] = TurnLobby(wait_timeout=20.0, max_waiting=10)
    assert lobby.pair("t1", "secret") is None
    assert lobby.wait("t1", "secret", "first", now=100.0)
    assert lobby.get_timer() == 120.0
    assert lobby.pair("t1", "secret") == "first"
    assert len(lobby) == 0 and lobby.get_timer() is None
    lobby.handle_timer(500.0)
    assert lobby.pop_events() == []


def test_another_secret_is_a_mismatch_and_the_waiting_side_stays() -> None:
    lobby: TurnLobby[str] = TurnLobby(wait_timeout=20.0, max_waiting=10)
    lobby.wait("t1", "secret", "first", now=0.0)
    assert lobby.pair("t1", "guess") is MISMATCH
    assert lobby.pair("t1", "secret") == "first"


def test_a_side_whose_peer_never_came_is_handed_back_at_its_deadline() -> None:
    lobby: TurnLobby[str] = TurnLobby(wait_timeout=20.0, max_waiting=10)
    lobby.wait("t1", "s", "early", now=0.0)
    lobby.wait("t2", "s", "late", now=5.0)
    lobby.handle_timer(19.9)
    assert lobby.pop_events() == []
    lobby.handle_timer(20.0)
    assert lobby.pop_events() == ["early"]
    assert lobby.get_timer() == 25.0
    assert lobby.pair("t1", "s") is None  # gone with its deadline


def test_a_side_that_left_takes_its_deadline_with_it() -> None:
    lobby: TurnLobby[str] = TurnLobby(wait_timeout=20.0, max_waiting=10)
    lobby.wait("t1", "s", "first", now=0.0)
    lobby.leave("t1", "someone-else")  # not the waiting side: nothing changes
    assert len(lobby) == 1
    lobby.leave("t1", "first")
    assert len(lobby) == 0 and lobby.get_timer() is None
    # The same ticket may wait again, with a fresh deadline.
    assert lobby.wait("t1", "s", "again", now=50.0)
    lobby.handle_timer(21.0)
    assert lobby.pop_events() == []
    lobby.handle_timer(70.0)
    assert lobby.pop_events() == ["again"]


def test_the_lobby_refuses_past_its_cap_and_a_second_waiter_per_ticket() -> None:
    lobby: TurnLobby[str] = TurnLobby(wait_timeout=20.0, max_waiting=2)
    assert lobby.wait("t1", "s", "a", now=0.0)
    assert not lobby.wait("t1", "s", "b", now=0.0)
    assert lobby.wait("t2", "s", "c", now=0.0)
    assert not lobby.wait("t3", "s", "d", now=0.0)
    lobby.clear()
    assert len(lobby) == 0 and lobby.get_timer() is None


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["wait", "pair", "leave", "timer"]),
            st.integers(0, 5),
            st.floats(0.0, 10.0),
        ),
        max_size=60,
    )
)
def test_every_waiting_side_ends_exactly_once(
    steps: list[tuple[str, int, float]],
) -> None:
    """Whatever the order of arrivals, pairings, departures and timers, a side
    leaves the lobby once (paired, gone or timed out), the timer is the
    earliest live deadline, and the lobby stays within its cap."""
    lobby: TurnLobby[int] = TurnLobby(wait_timeout=20.0, max_waiting=4)
    now = 0.0
    waiting: dict[str, tuple[int, float]] = {}
    next_conn = 0
    ended: list[int] = []
    for action, ticket, advance in steps:
        now += advance
        ticket_id = f"t{ticket}"
        if action == "wait":
            next_conn += 1
            if lobby.wait(ticket_id, "s", next_conn, now):
                waiting[ticket_id] = (next_conn, now + 20.0)
        elif action == "pair":
            paired = lobby.pair(ticket_id, "s")
            if ticket_id in waiting:
                assert paired == waiting.pop(ticket_id)[0]
                ended.append(paired)
            else:
                assert paired is None
        elif action == "leave" and ticket_id in waiting:
            ended.append(waiting.pop(ticket_id)[0])
            lobby.leave(ticket_id, ended[-1])
        elif action == "timer":
            lobby.handle_timer(now)
            expired = lobby.pop_events()
            assert sorted(expired) == sorted(
                conn for conn, deadline in waiting.values() if deadline <= now
            )
            ended += expired
            waiting = {t: w for t, w in waiting.items() if w[1] > now}
        assert len(lobby) == len(waiting) <= 4
        expected = min((w[1] for w in waiting.values()), default=None)
        assert lobby.get_timer() == expected
    assert len(ended) == len(set(ended))


def test_a_ticket_is_valid_only_with_the_stored_secret() -> None:
    check = TicketCheck("left", "secret")
    [read] = check.start()
    assert read == StoreRead(1, GetTicket("left"))
    assert check.store_result(2, "secret") == []  # not its request
    assert check.store_result(1, "secret") == [TicketVerdict.VALID]
    assert check.store_result(1, "secret") == []  # answered already
    for stored in (None, "other", b"secret", 7):
        check = TicketCheck("left", "secret")
        check.start()
        assert check.store_result(1, stored) == [TicketVerdict.INVALID]
    check = TicketCheck("left", "secret")
    check.start()
    assert check.store_failed(1) == [TicketVerdict.STORE_ERROR]
