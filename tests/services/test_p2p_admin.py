"""The operator's view of p2p sessions (console, admin API): a hosted session
is listed, and revoking it disconnects its members."""

from __future__ import annotations

import json

import pytest
import websockets

from crossroads.runtime import Runtime
from crossroads.services.p2p import P2PService
from tests.services.test_p2p import hello, recv_type, rt, ws_url  # noqa: F401

pytestmark = pytest.mark.timeout(60)


async def test_hosted_session_is_listed_and_revoke_disconnects_it(
    rt: Runtime,  # noqa: F811
) -> None:
    service = rt.services["p2p"]
    assert isinstance(service, P2PService)
    async with websockets.connect(ws_url(rt)) as ws:
        await ws.send(hello())
        await recv_type(ws, "welcome")
        await ws.send(json.dumps({"type": "host"}))
        hosted = await recv_type(ws, "hosted")
        sessions = service.sessions()
        assert len(sessions) == 1
        assert sessions[0].client == "127.0.0.1"
        assert f"code {hosted['code']}" in sessions[0].detail
        assert "1/" in sessions[0].detail
        assert not service.revoke("no-such-session")
        assert service.revoke(sessions[0].id)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await recv_type(ws, "never")
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert service.sessions() == []
