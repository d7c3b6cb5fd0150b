"""The console's insight page in headless Chromium with real traffic: a GameSpy
natneg negotiation (punched: direct) and a Unity relay session carrying frames
(relayed). The page needs the admin token, then draws each attempt's path
(one lane per step, the winner marked), the "why relayed" breakdown and the
top codes by bytes, with the bytes the test sent; no console error (the CSP
holds), labels and contrast checked in the page."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver

from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from tests.conftest import eventually
from tests.e2e import relay_support
from tests.e2e.relay_support import base_url, raw_relay
from tests.e2e.test_relay import session
from tests.services.natneg_sdk import SdkNegotiator
from tests.web.test_console import ADMIN_TOKEN, console_overrides
from tests.web.test_console_browser import (
    CONTRAST_JS,
    TEXT_SELECTOR,
    UNLABELLED_JS,
    artifacts_dir,
    browser,
    natneg_negotiation,
    off_loop,
    severe_console_messages,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

__all__ = ["browser"]  # the fixture, used by name

FRAMES, SIZE = 40, 500


# The page redraws the table whenever the API answers (the family filter asks
# again), so rows found one call and read the next can be gone: read the whole
# table in one script, in the browser, at one moment.
ATTEMPTS_JS = """
return Array.from(document.querySelectorAll("#attempts tbody tr"), (row) => {
  const winner = row.querySelector("figure.path rect.winner");
  return {
    family: row.dataset.family || "",
    text: row.innerText,
    winner: winner ? winner.dataset.step || "" : "",
  };
});
"""


def attempts_table(driver: WebDriver) -> list[dict[str, str]]:
    table: list[dict[str, str]] = driver.execute_script(ATTEMPTS_JS)
    return table


def visible_text(driver: WebDriver, selector: str) -> str:
    text = driver.execute_script(
        "const el = document.querySelector(arguments[0]);"
        " return el ? el.innerText : '';",
        selector,
    )
    return str(text)


@pytest.fixture
async def insight_runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = await start(
        default_config(
            console_overrides(
                core__only=["relay", "natneg"],
                core__state_dir=str(tmp_path / "state"),
                relay__api_keys=[relay_support.API_KEY],
                natneg__session_timeout=1.5,
                natneg__connect_interval=0.3,
                natneg__linger=2.0,
            )
        )
    )
    try:
        yield rt
    finally:
        SdkNegotiator.close_all()
        await rt.close()


async def relay_session(rt: Runtime) -> tuple[str, int]:
    """A host-joiner link carrying frames both ways, then closed; its code
    (the host's allocation id) and the bytes sent."""
    async with relay_support.api(rt) as http:
        host, joiner, hid, jid, host_alloc, _ = await session(http)
        sent = 0
        try:
            for n in range(FRAMES):
                up = raw_relay(jid, hid, bytes([n]) * SIZE)
                joiner.send(up)
                assert await host.recv() == up
                down = raw_relay(hid, jid, bytes([n]) * SIZE)
                host.send(down)
                assert await joiner.recv() == down
                sent += len(up) + len(down)
            host.send(b"\xda\x72\x00\x0b" + hid)  # CLOSE: the session ends
            assert (await joiner.recv())[:4] == b"\xda\x72\x00\x09"
        finally:
            host.close()
            joiner.close()
    return str(host_alloc["allocationId"]), sent


async def test_insight_page_draws_real_attempts(
    insight_runtime: Runtime, browser: WebDriver
) -> None:
    rt = insight_runtime
    url = base_url(rt)
    await natneg_negotiation(rt)
    _code, sent = await relay_session(rt)

    async def recorded() -> bool:
        families = {a.family for a in rt.insight.ring}
        return {"natneg", "relay"} <= families

    await eventually(recorded, "both attempts recorded", timeout=20)
    relayed = next(a for a in rt.insight.ring if a.family == "relay")
    assert relayed.usage is not None

    await off_loop(browser.get, url + "/insight")
    holder = await off_loop(browser.find_element, By.ID, "insight")
    assert not await off_loop(holder.is_displayed)  # nothing without the token
    assert await off_loop(browser.execute_script, UNLABELLED_JS) == []

    def submit(token: str) -> None:
        field = browser.find_element(By.ID, "token")
        field.clear()
        field.send_keys(token, Keys.ENTER)

    await off_loop(submit, "wrong-token")

    async def refused() -> bool:
        text = await off_loop(lambda: browser.find_element(By.ID, "admin-status").text)
        return "refused" in text

    await eventually(refused, "a wrong token is refused")
    assert not await off_loop(holder.is_displayed)
    await off_loop(submit, ADMIN_TOKEN)

    def rows() -> dict[str, str]:
        return {row["family"]: row["text"] for row in attempts_table(browser)}

    async def drawn() -> bool:
        return await off_loop(holder.is_displayed) and {"natneg", "relay"} <= set(
            await off_loop(rows)
        )

    await eventually(drawn, "the page lists both attempts", timeout=20)
    shown = await off_loop(rows)
    assert "direct" in shown["natneg"] and "punch" in shown["natneg"]
    assert "relayed" in shown["relay"] and "relay-only" in shown["relay"]
    assert relayed.session in shown["relay"]

    # The path: one lane per step, the winner's lane marked.
    def winners() -> dict[str, str]:
        return {row["family"]: row["winner"] for row in attempts_table(browser)}

    assert await off_loop(winners) == {"natneg": "punch", "relay": "relay"}

    # Why relayed: the relay session's cause, counted once.
    why = await off_loop(visible_text, browser, "#why-relayed tbody")
    assert why.split() == ["relay-only", "1"], why
    # Top codes: the session, with the bytes the test sent (both ways).
    top = await off_loop(visible_text, browser, "#top-codes tbody tr")
    assert top.startswith(relayed.session), top
    assert relayed.usage.bytes == pytest.approx(sent, rel=0.01)
    half = f"{sent / 2 / 1e3:.1f} kB"
    assert top.count(half) == 2, (top, half)

    # The family filter asks the API again.
    def pick(family: str) -> None:
        select = browser.find_element(By.ID, "family")
        select.send_keys(family)

    await off_loop(pick, "natneg")

    async def filtered() -> bool:
        return set(await off_loop(rows)) == {"natneg"}

    await eventually(filtered, "the family filter leaves natneg only")
    await off_loop(
        browser.save_screenshot, str(artifacts_dir() / "console-insight.png")
    )
    assert await off_loop(browser.execute_script, CONTRAST_JS, TEXT_SELECTOR) == []
    assert await off_loop(browser.execute_script, UNLABELLED_JS) == []
    logged = await off_loop(severe_console_messages, browser)
    assert all("401" in message for message in logged), logged
