"""Tables keyed by what the network sends stay bounded without handing a
hammering client a fresh start (crossroads.proto.bounded).

Before: each limit evicted with ``del d[next(iter(d))]``, the oldest
*inserted* entry. A client refused by the allocation API's rate limiter that
kept calling stayed the oldest entry however often it called, so as soon as
the table filled with other addresses its bucket was dropped and its next call
got a fresh burst. Now the least recently *seen* entry goes.
"""

from __future__ import annotations

import socket

from crossroads.services.relay_api import RateLimiter
from crossroads.transport.pktinfo import ReplySource

TABLE = 8


def test_a_refused_client_stays_refused_while_new_addresses_fill_the_table() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=1 / 60, burst=2, clock=lambda: now[0], max_clients=TABLE)
    hammer = "198.51.100.7"
    assert limiter.allow(hammer) and limiter.allow(hammer)
    refused = 0
    for n in range(10 * TABLE):
        now[0] += 0.01  # far too little to refill a token (one a minute)
        assert limiter.allow(f"203.0.113.{n}")
        refused += not limiter.allow(hammer)
    assert refused == 10 * TABLE  # before: let through again every TABLE calls
    assert limiter.forgotten > 0  # the table did overflow (bounded)


def test_an_active_client_keeps_its_reply_source_through_a_flood() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", 0))
        source = ReplySource(sock, capacity=TABLE)
        client, alias = ("192.0.2.1", 4000), (0, 0, b"\x7f\0\0\x02")
        source.remember(client, alias)
        for n in range(10 * TABLE):
            source.remember(("203.0.113.9", 1000 + n), (0, 0, b"\x7f\0\0\x01"))
            # A reply to the client now still leaves from the alias it dialled.
            assert source.control_for(client) == alias
            source.remember(client, alias)  # the client's next datagram
        assert len(source) == TABLE
