"""Hypothesis strategies shared by the fuzz tests of several areas."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(
    *,
    text_size: int = 20,
    width: int = 4,
    max_leaves: int = 12,
    keys: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[Any]:
    """Any JSON document: scalars, lists and objects nested up to ``max_leaves``
    leaves; ``keys`` adds likely member names to the random ones."""
    key_names = st.text(max_size=10) if keys is None else keys | st.text(max_size=10)
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=text_size),
        lambda inner: (
            st.lists(inner, max_size=width)
            | st.dictionaries(key_names, inner, max_size=width)
        ),
        max_leaves=max_leaves,
    )
