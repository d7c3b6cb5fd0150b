"""The book of joins under way (proto/openttd/attempts.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossroads.proto.openttd.attempts import AttemptBook


def test_a_join_is_found_by_key_code_and_client_until_it_is_removed() -> None:
    book: AttemptBook[str, int] = AttemptBook()
    book.add("k1", "+abc", 1, "join 1")
    book.add("k2", "+abc", 2, "join 2")
    book.add("k3", "+xyz", 1, "join 3")
    assert book.get("k2") == "join 2" and len(book) == 3
    assert sorted(book.of_code("+abc")) == ["join 1", "join 2"]
    assert sorted(book.of_client(1)) == ["join 1", "join 3"]
    assert book.count_of_client(1) == 2
    book.remove("k1")
    book.remove("k1")  # twice is harmless
    assert book.get("k1") is None
    assert book.of_code("+abc") == ["join 2"] and book.of_client(1) == ["join 3"]
    assert book.of_code("+nobody") == [] and book.count_of_client(9) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(), st.integers(0, 9), st.sampled_from("ab"), st.integers(0, 2)
        )
    )
)
def test_the_indexes_agree_and_hold_nothing_empty(
    steps: list[tuple[bool, int, str, int]],
) -> None:
    book: AttemptBook[int, int] = AttemptBook()
    live: dict[str, tuple[str, int]] = {}
    for add, n, code, client in steps:
        key = f"k{n}"
        if add and key not in live:
            book.add(key, code, client, n)
            live[key] = (code, client)
        elif not add:
            book.remove(key)
            live.pop(key, None)
    assert len(book) == len(live)
    for code in "ab":
        expected = sorted(int(k[1:]) for k, (c, _) in live.items() if c == code)
        assert sorted(book.of_code(code)) == expected
    for client in range(3):
        expected = sorted(int(k[1:]) for k, (_, c) in live.items() if c == client)
        assert sorted(book.of_client(client)) == expected
    book_indexes = (book._by_code, book._by_client)
    assert all(keys for index in book_indexes for keys in index.values())
