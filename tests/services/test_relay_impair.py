"""QA impairment of one Unity relay session from the admin API: loss, delay
and jitter on its relayed frames both ways, off the data plane while set and
back on it when cleared; refused without the admin token or with bad values."""

from __future__ import annotations

import uuid

import httpx
import pytest

from crossroads.services.relay import RelayService
from crossroads.transport.relay import OffPlaneForward
from tests.conftest import running_service
from tests.e2e.relay_support import api, base_url, raw_relay, relay_runtime
from tests.e2e.test_relay import session

pytestmark = pytest.mark.timeout(60)

ADMIN = "impair-admin-token-0123456789"


async def test_impairment_loses_delays_and_clears() -> None:
    async with relay_runtime(core__admin_token=ADMIN) as rt, api(rt) as http:
        relay = running_service(rt, "relay", RelayService)
        assert relay.node is not None
        endpoint = relay.node.endpoint
        host, joiner, hid, jid, _h, _j = await session(http)
        joiner_id = str(uuid.UUID(bytes=jid))
        admin = httpx.AsyncClient(
            base_url=base_url(rt), headers={"Authorization": f"Bearer {ADMIN}"}
        )

        async def impair(**values: object) -> httpx.Response:
            body = {"kind": "relay", "id": joiner_id, **values}
            return await admin.post("/console/api/admin/impair", json=body)

        def off_plane() -> list[bool]:
            return [
                isinstance(forward, OffPlaneForward)
                for forward in endpoint.core.routes.values()
            ]

        try:
            assert off_plane() == [False, False]  # on the data plane
            # Everything lost, both ways.
            answer = await impair(loss=1)
            assert answer.status_code == 200, answer.text
            assert off_plane() == [True, True]
            joiner.send(raw_relay(jid, hid, b"lost up"))
            host.send(raw_relay(hid, jid, b"lost down"))
            assert await host.silent() and await joiner.silent()
            assert endpoint.impaired_lost == 2
            # Delay and jitter: every frame still arrives, held back.
            assert (await impair(delay_ms=50, jitter_ms=20)).status_code == 200
            for n in range(10):
                frame = raw_relay(jid, hid, bytes([n]) * 100)
                joiner.send(frame)
                assert await host.recv() == frame
            assert endpoint.impaired_delayed == 10
            # All zero: cleared, back on the data plane, frames as before.
            assert (await impair()).status_code == 200
            assert off_plane() == [False, False] and not endpoint.impaired
            frame = raw_relay(hid, jid, b"clear again")
            host.send(frame)
            assert await joiner.recv() == frame
            assert endpoint.impaired_delayed == 10

            # Refused: no token, bad values, unknown session.
            anonymous = await httpx.AsyncClient(base_url=base_url(rt)).post(
                "/console/api/admin/impair",
                json={"kind": "relay", "id": joiner_id, "loss": 1},
            )
            assert anonymous.status_code == 401
            for bad in ({"loss": 2}, {"delay_ms": -1}, {"delay_ms": "NaN"}):
                assert (await impair(**bad)).status_code == 400, bad
            unknown = await admin.post(
                "/console/api/admin/impair",
                json={"kind": "relay", "id": str(uuid.uuid4()), "loss": 1},
            )
            assert unknown.status_code == 404
            assert not endpoint.impaired

            # The link's insight record counts what the impairment lost.
            host.send(b"\xda\x72\x00\x0b" + hid)  # CLOSE: the session ends
            assert (await joiner.recv())[:4] == b"\xda\x72\x00\x09"
            [record] = [a for a in rt.insight.ring if a.family == "relay"]
            assert record.usage is not None
            assert dict(record.usage.drops) == {"qa-impairment": 2}
        finally:
            await admin.aclose()
            host.close()
            joiner.close()
