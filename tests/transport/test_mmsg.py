"""recvmmsg/sendmmsg batches on real loopback sockets."""

from __future__ import annotations

import socket

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
