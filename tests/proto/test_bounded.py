"""BoundedMap against a model: a plain list of (key, value), oldest first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.bounded import BoundedMap

Op = tuple[str, int, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "peek", "pop"]), st.integers(0, 9), st.integers()
    ),
    max_size=200,
)


def model_apply(
    model: list[tuple[int, int]], capacity: int, lru: bool, op: Op
) -> int | None:
    kind, key, value = op
    found = [i for i, (k, _) in enumerate(model) if k == key]
    if kind == "put":
        if found:
            i = found[0]
            if lru:
                model.pop(i)
                model.append((key, value))
            else:
                model[i] = (key, value)
        else:
            if len(model) >= capacity:
                model.pop(0)
            model.append((key, value))
        return None
    if not found:
        return None
    i = found[0]
    got = model[i][1]
    if kind == "pop":
        model.pop(i)
    elif kind == "get" and lru:
        model.append(model.pop(i))
    return got


@given(st.integers(1, 6), st.booleans(), ops)
def test_the_map_behaves_as_its_model(
    capacity: int, lru: bool, script: list[Op]
) -> None:
    bounded: BoundedMap[int, int] = BoundedMap(capacity, lru=lru)
    model: list[tuple[int, int]] = []
    evicted = 0
    for op in script:
        kind, key, value = op
        # A new key at a full map pushes one out.
        evicted += kind == "put" and key not in bounded and len(bounded) == capacity
        want = model_apply(model, capacity, lru, op)
        if kind == "put":
            bounded.put(key, value)
        else:
            assert getattr(bounded, kind)(key) == want
        assert bounded.items() == model
        assert len(bounded) == len(model) <= capacity
    assert bounded.evicted == evicted


def test_capacity_must_hold_an_entry() -> None:
    with pytest.raises(ValueError):
        BoundedMap(0)
