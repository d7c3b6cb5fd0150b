"""The console in a real browser: headless Chromium (Debian ``chromium`` +
``chromium-driver``, driven by selenium) against a running server with real
traffic — a TURN allocation from coturn's ``turnutils_uclient``, a Unity relay
session, a GameSpy natneg negotiation. The page shows them, numbers change
without a reload, the admin page needs the token and its revoke ends a real
allocation; no console errors; keyboard order, labels and contrast are checked
in the page. Screenshots go to ``$CROSSROADS_ARTIFACTS`` (else a temporary
directory, printed)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver

from crossroads.client.openttd import GameInfoResponder
from crossroads.client.relay import RelayApi, RelayConnection
from crossroads.config import default_config
from crossroads.runtime import Runtime, start
from crossroads.services.natneg import NatNegService
from crossroads.services.turn import TurnService
from tests.conftest import eventually
from tests.e2e.relay_support import base_url
from tests.interop.test_turn import uclient
from tests.services.natneg_sdk import SdkNegotiator
from tests.services.openttd.helpers import register
from tests.web.test_console import (
    ADMIN_TOKEN,
    API_KEY,
    PASSWORD,
    USER,
    console_overrides,
    turn_server,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

T = TypeVar("T")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1200,1600",
)


def artifacts_dir() -> Path:
    configured = os.environ.get("CROSSROADS_ARTIFACTS")
    directory = (
        Path(configured)
        if configured
        else Path(tempfile.gettempdir()) / "crossroads-artifacts"
    )
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextmanager
def chromium(profile: Path, *extra_flags: str) -> Iterator[WebDriver]:
    """Headless Chromium driven by selenium, with ``extra_flags``."""
    binary, driver_binary = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver_binary is None:
        pytest.fail(
            "chromium/chromedriver missing: make install (Debian chromium, chromium-driver)"
        )
    options = Options()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, *extra_flags):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=ChromeService(driver_binary), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with chromium(tmp_path / "chromium-profile") as driver:
        yield driver


async def off_loop(call: Callable[..., T], *args: Any) -> T:
    """Selenium blocks; the server under test runs on this event loop."""
    return await asyncio.to_thread(call, *args)


FOCUS_FIRST_REVOKE_JS = """
const button = document.querySelector('section[data-kind="turn"] button.revoke');
if (!button) return null;
button.focus();
return button.getAttribute("aria-label");
"""


def counter(driver: WebDriver, key: str) -> float:
    text = driver.find_element(By.CSS_SELECTOR, f'[data-counter="{key}"]').text
    return float(text or "nan")


def severe_console_messages(driver: WebDriver) -> list[str]:
    logs = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [entry["message"] for entry in logs if entry["level"] == "SEVERE"]


# Contrast ratio of WCAG 2.1 (§1.4.3 "Contrast (Minimum)": 4.5:1 for text),
# computed in the page from the colours the browser actually uses.
CONTRAST_JS = """
function lum(c) {
  const [r, g, b] = c.match(/\\d+(\\.\\d+)?/g).slice(0, 3).map(Number).map((v) => {
    v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}
function background(el) {
  for (; el; el = el.parentElement) {
    const bg = getComputedStyle(el).backgroundColor;
    if (bg && !bg.startsWith("rgba(0, 0, 0, 0)") && bg !== "transparent") return bg;
  }
  return "rgb(255, 255, 255)";
}
const worst = [];
for (const el of document.querySelectorAll(arguments[0])) {
  if (!el.textContent.trim() || el.offsetParent === null) continue;
  const a = lum(getComputedStyle(el).color), b = lum(background(el));
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  if (ratio < 4.5) worst.push(el.tagName + " " + ratio.toFixed(2) + " " + el.textContent.trim().slice(0, 30));
}
return worst;
"""

UNLABELLED_JS = """
const bad = [];
for (const el of document.querySelectorAll("input, select, textarea")) {
  if (el.type !== "hidden" && el.labels.length === 0 && !el.getAttribute("aria-label")) bad.push(el.id || el.name);
}
for (const el of document.querySelectorAll("button, a")) {
  const name = (el.getAttribute("aria-label") || el.textContent || "").trim();
  if (!name) bad.push(el.outerHTML.slice(0, 60));
}
return bad;
"""

TEXT_SELECTOR = "p, li, th, td, caption, h1, h2, a, label, button, summary, span"


def focus_order(driver: WebDriver, presses: int) -> list[str]:
    """Describe the element focused after each Tab press."""
    driver.refresh()  # focus starts at the top of a freshly loaded document
    seen = []
    for _ in range(presses):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        active = driver.switch_to.active_element
        seen.append((active.get_attribute("textContent") or "").strip())
    return seen


@pytest.fixture
async def busy_runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = await start(
        default_config(
            console_overrides(
                core__only=["stun", "turn", "relay", "natneg", "openttd"],
                openttd__secret="console-test-secret",
                core__state_dir=str(tmp_path / "state"),
                natneg__relay_allow="127.0.0.0/8",
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


async def natneg_negotiation(rt: Runtime) -> None:
    service = rt.services["natneg"]
    assert isinstance(service, NatNegService)
    primary = next(iter(service.addresses.values()))
    servers = [primary, primary, primary]
    host = SdkNegotiator(
        version=3, cookie=4242, client_index=1, servers=servers, finished_idle=0.3
    )
    guest = SdkNegotiator(
        version=3, cookie=4242, client_index=0, servers=servers,
        bind_ip="127.0.0.5", finished_idle=0.3,
    )  # fmt: skip
    try:
        await asyncio.gather(host.run(), guest.run())
    finally:
        host.close()
        guest.close()


async def test_console_in_chromium_with_real_traffic(
    busy_runtime: Runtime, browser: WebDriver
) -> None:
    rt = busy_runtime
    url = base_url(rt)
    shots = artifacts_dir()
    turn = rt.services["turn"]
    assert isinstance(turn, TurnService)

    await off_loop(browser.get, url + "/")
    assert await off_loop(counter, browser, "turn_allocations") == 0

    # Real traffic. coturn's uclient leaves its allocations behind when it
    # exits (no Refresh 0): they stay listed until revoked or expired.
    _, port = turn_server(rt)
    output = await uclient(
        "-y",
        "-m",
        "1",
        "-n",
        "5",
        "-u",
        USER,
        "-w",
        PASSWORD,
        "-p",
        str(port),
        "127.0.0.1",
    )
    assert "Total lost packets 0" in output, output[-2000:]
    assert len(turn.sessions()) >= 1
    cleanups: list[Callable[[], Awaitable[None]]] = []
    async with RelayApi(url, API_KEY) as api:
        allocation = await api.allocate(max_connections=2)
        host = await RelayConnection.open(allocation)
        try:
            await host.bind()
            await natneg_negotiation(rt)
            # An OpenTTD server as OpenTTD 13 registers (protocol-level peer:
            # the real binary needs a namespace and a minute, see
            # tests/interop/test_openttd.py).
            game = GameInfoResponder()
            await game.start()
            registered = await register(rt, game.port)
            cleanups.append(registered.close)
            cleanups.append(game.close)

            # The numbers change without a reload (the page polls).
            async def shows_traffic() -> bool:
                values = [
                    await off_loop(counter, browser, key)
                    for key in (
                        "turn_allocations",
                        "relay_allocations",
                        "natneg_negotiations",
                        "openttd_servers",
                    )
                ]
                return all(value >= 1 for value in values)

            await eventually(
                shows_traffic, "the overview shows the traffic", timeout=20
            )
            charts = await off_loop(
                browser.find_elements, By.CSS_SELECTOR, "[data-chart] svg polyline"
            )
            assert charts, "no chart drawn"
            await off_loop(browser.save_screenshot, str(shots / "console-overview.png"))
            page_text = await off_loop(
                lambda: browser.find_element(By.TAG_NAME, "body").text
            )
            assert USER not in page_text and ADMIN_TOKEN not in page_text
            assert "turnutils_uclient" in page_text or "Connect a client" in page_text

            # Accessibility checks on the overview.
            assert (
                await off_loop(browser.execute_script, CONTRAST_JS, TEXT_SELECTOR) == []
            )
            assert await off_loop(browser.execute_script, UNLABELLED_JS) == []
            order = await off_loop(focus_order, browser, 4)
            assert order[:4] == ["Skip to content", "Overview", "Admin", "Metrics"], (
                order
            )

            # The admin page: nothing without the token, a wrong one is refused.
            await off_loop(browser.get, url + "/admin")
            admin = await off_loop(browser.find_element, By.ID, "admin")
            assert not await off_loop(admin.is_displayed)
            assert await off_loop(browser.execute_script, UNLABELLED_JS) == []

            def submit(token: str) -> None:
                field = browser.find_element(By.ID, "token")
                field.clear()
                field.send_keys(token, Keys.ENTER)  # keyboard only

            assert await off_loop(severe_console_messages, browser) == []
            await off_loop(submit, "wrong-token")

            async def refused() -> bool:
                status = await off_loop(
                    lambda: browser.find_element(By.ID, "admin-status").text
                )
                return "refused" in status

            await eventually(refused, "a wrong token is refused")
            # Chromium logs the refused request itself; nothing else may appear.
            logged = await off_loop(severe_console_messages, browser)
            assert all("401" in message for message in logged), logged
            assert not await off_loop(admin.is_displayed)

            await off_loop(submit, ADMIN_TOKEN)

            async def revoke_buttons() -> int:
                buttons = await off_loop(
                    browser.find_elements,
                    By.CSS_SELECTOR,
                    'section[data-kind="turn"] button.revoke',
                )
                return len(buttons)

            async def listed() -> bool:
                shown = await off_loop(admin.is_displayed)
                return shown and await revoke_buttons() == len(turn.sessions())

            await eventually(listed, "the admin page lists the TURN allocations")
            for kind in ("relay", "openttd"):
                rows = await off_loop(
                    browser.find_elements,
                    By.CSS_SELECTOR,
                    f'section[data-kind="{kind}"] tbody tr',
                )
                assert len(rows) == 1, kind
            openttd_section = await off_loop(
                browser.find_element, By.CSS_SELECTOR, 'section[data-kind="openttd"]'
            )
            assert registered.code in await off_loop(lambda: openttd_section.text)
            await off_loop(browser.save_screenshot, str(shots / "console-admin.png"))
            assert (
                await off_loop(browser.execute_script, CONTRAST_JS, TEXT_SELECTOR) == []
            )

            # Revoke one TURN allocation with the keyboard (focus + Enter).
            before = len(turn.sessions())

            def press_first_revoke() -> None:
                # The page redraws its tables every poll: find and focus the
                # button in one script, so no handle outlives a redraw.
                label = browser.execute_script(FOCUS_FIRST_REVOKE_JS)
                assert str(label).startswith("Revoke turn session"), label
                browser.switch_to.active_element.send_keys(Keys.ENTER)

            await off_loop(press_first_revoke)

            async def revoked() -> bool:
                return (
                    len(turn.sessions()) == before - 1
                    and await revoke_buttons() == before - 1
                )

            await eventually(revoked, "the revoked allocation is gone, server and page")
            status_text = await off_loop(
                lambda: browser.find_element(By.ID, "admin-status").text
            )
            assert status_text.startswith("Revoked turn session")
            await off_loop(browser.save_screenshot, str(shots / "console-revoked.png"))

            # Phone width: nothing wider than the screen but the scroll boxes.
            await off_loop(browser.set_window_size, 375, 800)
            await off_loop(browser.get, url + "/")
            overflow = await off_loop(
                browser.execute_script,
                "return document.documentElement.scrollWidth - window.innerWidth",
            )
            assert overflow <= 0
            await off_loop(browser.save_screenshot, str(shots / "console-phone.png"))
            assert await off_loop(severe_console_messages, browser) == []
        finally:
            for cleanup in reversed(cleanups):
                await cleanup()
            await host.close()
