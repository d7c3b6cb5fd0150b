"""Hypothesis strategies for OpenTTD protocol values."""

from __future__ import annotations

from hypothesis import strategies as st

from crossroads.proto.openttd.gameinfo import DAYS_TILL_1920, GameInfo, NewGRF


def text(max_bytes: int) -> st.SearchStrategy[str]:
    """Strings without NUL whose UTF-8 fits ``max_bytes`` (long ASCII or short any)."""
    return st.one_of(
        st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=max_bytes),
        st.text(
            st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
            max_size=max_bytes // 4,
        ),
    )


u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)


def newgrf(with_name: bool) -> st.SearchStrategy[NewGRF]:
    return st.builds(
        NewGRF,
        grfid=u32,
        md5=st.binary(min_size=16, max_size=16),
        name=text(79) if with_name else st.none(),
    )


@st.composite
def game_info(draw: st.DrawFn, version: int, with_names: bool = True) -> GameInfo:
    """A GameInfo that survives a round trip through ``version``."""
    if version >= 3:
        game_date, start_date = draw(u32), draw(u32)
    else:
        game_date = DAYS_TILL_1920 + draw(u16)
        start_date = DAYS_TILL_1920 + draw(u16)
    return GameInfo(
        server_name=draw(text(79)),
        server_revision=draw(text(32)),
        use_password=draw(st.booleans()),
        clients_max=draw(u8),
        clients_on=draw(u8),
        spectators_on=draw(u8),
        map_width=draw(u16),
        map_height=draw(u16),
        landscape=draw(st.integers(0, 3)),
        dedicated=draw(st.booleans()),
        companies_max=draw(u8) if version >= 2 else 0,
        companies_on=draw(u8) if version >= 2 else 0,
        spectators_max=draw(u8) if version >= 2 else 0,
        game_date=game_date,
        start_date=start_date,
        newgrfs=tuple(draw(st.lists(newgrf(with_names), max_size=5)))
        if version >= 4
        else (),
        gamescript_version=draw(u32) if version >= 5 else 0xFFFFFFFF,
        gamescript_name=draw(text(79)) if version >= 5 else "",
        ticks_playing=draw(st.integers(0, 2**64 - 1)) if version >= 7 else None,
    )
