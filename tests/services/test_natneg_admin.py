"""The operator's view of natneg (console, admin API): negotiations are listed
(not revocable: they end within seconds), relay pairs are listed and revoking
one closes its sockets."""

from __future__ import annotations

import pytest

from crossroads.proto.natneg.packets import NegotiateResult
from tests.services.natneg_sdk import SdkNegotiator
from tests.services.test_natneg import (  # noqa: F401 (fixtures)
    Starter,
    both,
    close_negotiators,
    exchange_game_data,
    game_socket,
    natneg,
    servers,
    service_of,
)

pytestmark = pytest.mark.timeout(60)


async def test_relay_pair_is_listed_and_revoke_closes_it(
    natneg: Starter,  # noqa: F811
) -> None:
    # A long idle timeout: the pair stays until revoked.
    rt = await natneg(natneg__relay_mode="always", natneg__relay_idle_timeout=60.0)
    service = service_of(rt)
    srv = servers(rt)
    host_game = game_socket()
    try:
        host = SdkNegotiator(
            version=4, cookie=901, client_index=1, servers=srv, game_sock=host_game
        )
        guest = SdkNegotiator(
            version=4, cookie=901, client_index=0, servers=srv, bind_ip="127.0.0.5"
        )
        await both(host, guest)
        assert host.outcome and host.outcome.result == NegotiateResult.SUCCESS
        await exchange_game_data(host, guest)
        listed = {s.id: s for s in service.sessions()}
        (pair_id,) = [i for i in listed if i.startswith("relay-901-")]
        pair = listed[pair_id]
        # Client 0 (the guest) first, client 1 (the host) second.
        assert pair.revocable and pair.client == "127.0.0.5 <-> 127.0.0.1"
        assert "datagrams relayed" in pair.detail
        negotiation = listed.get("901")
        if negotiation is not None:  # still lingering for duplicates
            assert not negotiation.revocable and "negotiation" in negotiation.detail
            assert not service.revoke("901")
        assert not service.revoke("relay-902") and not service.revoke("relay-x")
        assert not service.revoke("relay-901")  # the serial is part of the id
        assert service.revoke(pair_id)
        assert pair_id not in {s.id for s in service.sessions()}
        assert rt.metrics.get_sample_value("crossroads_natneg_relays") == 0
    finally:
        host_game.close()
