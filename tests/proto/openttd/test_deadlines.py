"""The coordinator's one timer over all its flows."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.openttd.deadlines import COMPACT_RATIO, DeadlineBook


def test_the_earliest_deadline_wins_and_fires_once() -> None:
    book: DeadlineBook[str] = DeadlineBook()
    assert book.get_timer() is None
    book.update("join", 20.0)
    book.update("check", 7.0)
    assert book.get_timer() == 7.0
    assert book.due(6.9) == []
    assert book.due(7.0) == ["check"]
    assert book.get_timer() == 20.0
    assert book.due(100.0) == ["join"]
    assert book.due(200.0) == []
    assert book.get_timer() is None


def test_a_moved_or_ended_flow_does_not_fire_at_its_old_deadline() -> None:
    book: DeadlineBook[str] = DeadlineBook()
    book.update("join", 5.0)
    book.update("join", 9.0)  # the attempt moved on to a later stage
    book.update("check", 3.0)
    book.discard("check")  # the check concluded
    assert book.get_timer() == 9.0
    assert book.due(8.0) == []
    assert book.due(9.0) == ["join"]
    book.update("gone", 1.0)
    book.update("gone", None)
    assert book.get_timer() is None and len(book) == 0


def test_churn_does_not_grow_the_heap() -> None:
    book: DeadlineBook[int] = DeadlineBook()
    for step in range(10_000):
        book.update(step % 3, float(step))
    assert len(book) == 3
    assert book.entries <= COMPACT_RATIO * 16 + 1


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("update"),
            st.integers(0, 5),
            st.one_of(st.none(), st.integers(0, 50).map(float)),
        ),
        st.tuples(st.just("discard"), st.integers(0, 5), st.none()),
        st.tuples(st.just("due"), st.integers(0, 5), st.integers(0, 50).map(float)),
    ),
    max_size=60,
)


@given(ops)
def test_it_agrees_with_a_plain_dict(
    script: list[tuple[str, int, float | None]],
) -> None:
    book: DeadlineBook[int] = DeadlineBook()
    model: dict[int, float] = {}
    for op, key, value in script:
        if op == "update":
            book.update(key, value)
            if value is None:
                model.pop(key, None)
            else:
                model[key] = value
        elif op == "discard":
            book.discard(key)
            model.pop(key, None)
        else:
            assert value is not None
            fired = book.due(value)
            expected = sorted(
                (k for k, d in model.items() if d <= value), key=lambda k: model[k]
            )
            assert sorted(fired) == sorted(expected)
            assert [model[k] for k in fired] == sorted(model[k] for k in fired)
            for k in fired:
                del model[k]
        assert book.get_timer() == (min(model.values()) if model else None)
        assert len(book) == len(model)
