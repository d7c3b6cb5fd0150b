"""recvmmsg/sendmmsg batches on real loopback sockets."""

from __future__ import annotations

import socket
import time

import pytest

from crossroads.transport import mmsg

pytestmark = pytest.mark.skipif(not mmsg.available(), reason="needs Linux recvmmsg")


def _pair(family: int = socket.AF_INET) -> tuple[socket.socket, socket.socket]:
    host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    server = socket.socket(family, socket.SOCK_DGRAM)
    server.bind((host, 0))
    server.setblocking(False)
    client = socket.socket(family, socket.SOCK_DGRAM)
    client.bind((host, 0))
    client.settimeout(2)
    return server, client


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_batch_receive_and_reply(family: int) -> None:
    server, client = _pair(family)
    try:
        batch = mmsg.MmsgSocket(server, batch=8, slot=64)
        assert batch.recv() == 0  # nothing yet: EAGAIN is not an error
        for n in range(5):
            client.sendto(bytes([n]) * (n + 1), server.getsockname())
        received = 0
        for _ in range(100):
            received += (count := batch.recv())
            if count:
                break
        assert received == 5
        client_addr = client.getsockname()
        for i in range(5):
            data = batch.data(i, batch.length(i))
            assert data == bytes([i]) * (i + 1)
            assert not batch.truncated(i)
            assert batch.port(i) == client_addr[1]
            assert socket.inet_ntop(family, batch.raw_address(i)) == client_addr[0]
            assert batch.queue_reply(i, b"re:" + data)
        assert batch.flush() == 0
        replies = [client.recvfrom(100)[0] for _ in range(5)]
        assert replies == [b"re:" + bytes([n]) * (n + 1) for n in range(5)]
    finally:
        server.close()
        client.close()


def test_truncation_and_full_batch() -> None:
    server, client = _pair()
    try:
        batch = mmsg.MmsgSocket(server, batch=2, slot=16)
        client.sendto(b"x" * 40, server.getsockname())
        client.sendto(b"y" * 4, server.getsockname())
        count = 0
        for _ in range(100):
            count = batch.recv()
            if count:
                break
        assert count >= 1 and batch.truncated(0)
        assert batch.queue_reply(0, b"a")
        assert not batch.queue_reply(0, b"b" * 17)  # larger than a slot
        assert batch.queue_reply(0, b"c")
        assert not batch.queue_reply(0, b"d")  # batch full
        assert batch.flush() == 0
        assert client.recvfrom(100)[0] == b"a"
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_drain_hands_over_each_datagram_with_its_sender_and_sends_the_replies(
    family: int,
) -> None:
    server, client = _pair(family)
    try:
        # Six datagrams, four slots a batch: drain must go round twice.
        batch = mmsg.MmsgSocket(server, batch=4, slot=64)
        for n in range(6):
            client.sendto(b"n%d" % n, server.getsockname())
        seen: list[tuple[bytes, tuple[str, int]]] = []
        drops: list[tuple[str, int]] = []

        def handle(data: bytes, sender: tuple[str, int], slot: int) -> None:
            seen.append((data, sender))
            assert batch.queue_reply(slot, b"re:" + data)

        for _ in range(200):
            batch.drain(handle, lambda reason, n: drops.append((reason, n)), 8)
            if len(seen) == 6:
                break
            time.sleep(0.01)
        client_addr = client.getsockname()[:2]
        assert seen == [(b"n%d" % n, client_addr) for n in range(6)]
        assert drops == []
        replies = [client.recvfrom(100)[0] for _ in range(6)]
        assert replies == [b"re:n%d" % n for n in range(6)]
    finally:
        server.close()
        client.close()


def test_drain_counts_a_truncated_datagram_and_hands_over_the_rest() -> None:
    server, client = _pair()
    try:
        batch = mmsg.MmsgSocket(server, batch=4, slot=16)
        client.sendto(b"x" * 40, server.getsockname())
        client.sendto(b"fits", server.getsockname())
        seen: list[bytes] = []
        drops: list[tuple[str, int]] = []
        for _ in range(200):
            batch.drain(
                lambda data, sender, slot: seen.append(data),
                lambda reason, n: drops.append((reason, n)),
                1,
            )
            if seen:
                break
            time.sleep(0.01)
        assert seen == [b"fits"] and drops == [("too-big", 1)]
    finally:
        server.close()
        client.close()
