"""The Unity relay over ``wss`` from a real browser's WebSocket, as a WebGL
build of a Unity game uses it (``new WebSocket(url)``, ``binaryType =
"arraybuffer"``, no subprotocol; Chromium offers ``permessage-deflate``, which
the relay declines): headless Chromium is the joiner, a UDP socket the host.

The browser is told to accept the test's self-signed certificate
(``--ignore-certificate-errors``): what is tested is the browser's WebSocket
stack against the relay, not certificate trust (a real game needs a publicly
trusted certificate, README "Relay over WebSockets")."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.remote.webdriver import WebDriver

from crossroads.transport.tls import development_certificate
from tests.e2e.relay_support import (
    BIND_RECEIVED,
    RawPeer,
    allocate_pair,
    allocation_id,
    api,
    base_url,
    raw_accepted,
    raw_bind,
    raw_connect,
    raw_relay,
    relay_runtime,
    server_endpoint,
)
from tests.web.test_console_browser import chromium, off_loop

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with chromium(
        tmp_path / "chromium-profile", "--ignore-certificate-errors"
    ) as driver:
        driver.set_script_timeout(30)
        yield driver


#: The joiner, in the page: open the socket, send each message of ``steps``
#: and wait for the answer it expects (any binary message), then hand the
#: answers back. Frames are byte arrays both ways.
JOINER_JS = """
const [url, steps, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
const ws = new WebSocket(url);
ws.binaryType = "arraybuffer";
const answers = [];
let step = 0;
const next = () => {
  if (step === steps.length) { done({answers, extensions: ws.extensions, protocol: ws.protocol}); return; }
  const [send, expectReply] = steps[step++];
  if (send.length) ws.send(new Uint8Array(send));
  if (!expectReply) next();
};
ws.onopen = next;
ws.onmessage = (event) => { answers.push(Array.from(new Uint8Array(event.data))); next(); };
ws.onerror = () => done({error: "error", answers});
ws.onclose = (event) => done({error: "closed " + event.code, answers});
"""


async def test_browser_joiner_over_wss_and_udp_host(
    browser: WebDriver, tmp_path: Path
) -> None:
    cert, key = development_certificate(tmp_path)
    async with (
        relay_runtime(
            relay__websocket=True,
            relay__wss_host="localhost",
            core__tls_cert=str(cert),
            core__tls_key=str(key),
        ) as rt,
        api(rt) as http,
    ):
        host_alloc, join_alloc = await allocate_pair(http)
        hid = allocation_id(host_alloc)
        jid = allocation_id(join_alloc)
        udp = server_endpoint(host_alloc, "udp")
        host = RawPeer((udp["host"], udp["port"]))
        try:
            assert await host.request(raw_bind(host_alloc, 0)) == BIND_RECEIVED
            wss = server_endpoint(join_alloc, "wss")
            url = f"wss://{wss['host']}:{wss['port']}/"
            payload = os.urandom(1000)
            host_data = base64.b64decode(join_alloc["hostConnectionData"])
            steps: list[Any] = [
                [list(raw_bind(join_alloc, 0)), True],
                [list(raw_connect(jid, host_data)), True],
                [list(raw_relay(jid, hid, payload)), False],
                [[], True],  # the host's answer
            ]
            # A page of the server first: Chromium opens no WebSocket from the
            # driver's initial data: page.
            await off_loop(browser.get, base_url(rt) + "/healthz")
            page = asyncio.create_task(
                off_loop(browser.execute_async_script, JOINER_JS, url, steps)
            )
            # The host hears the browser's frame and answers it.
            assert await host.recv(timeout=20) == raw_relay(jid, hid, payload)
            host.send(raw_relay(hid, jid, payload[::-1]))
            result = await page
            assert "error" not in result, result
            assert [bytes(a) for a in result["answers"]] == [
                BIND_RECEIVED,
                raw_accepted(hid, jid),
                raw_relay(hid, jid, payload[::-1]),
            ]
            # Chromium offered permessage-deflate; the relay took none.
            assert result["extensions"] == "" and result["protocol"] == ""
        finally:
            host.close()
