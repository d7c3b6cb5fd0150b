"""The stun service on real loopback sockets (UDP and TCP), with the runtime."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from crossroads.config import default_config
from crossroads.errors import ConfigError
from crossroads.proto.stun import (
    ChangeRequest,
    Class,
    Method,
    OtherAddress,
    ResponseOrigin,
    XorMappedAddress,
    decode,
    encode,
    request,
)
from crossroads.runtime import Runtime, start
from crossroads.services.stun import StunService
from crossroads.types import Address
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(30)

TXID = bytes(range(12))


def _stun(runtime: Runtime) -> StunService:
    service = runtime.services["stun"]
    assert isinstance(service, StunService)
    return service


def _udp_exchange(
    data: bytes, dest: Address, *, expect: bool = True, local: str = "127.0.0.1"
) -> tuple[bytes, Address] | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((local, 0))
        sock.settimeout(2.0 if expect else 0.3)
        sock.sendto(data, dest)
        try:
            reply, source = sock.recvfrom(70000)
        except TimeoutError:
            return None
        return reply, (source[0], source[1])


def _metrics(runtime: Runtime) -> str:
    host, port = runtime.http_address
    return httpx.get(f"http://{host}:{port}/metrics").text


async def test_udp_binding(runtime: Runtime) -> None:
    stun = _stun(runtime)
    primary = stun.primary
    result = await asyncio.to_thread(
        _udp_exchange, encode(request(Method.BINDING, TXID)), primary
    )
    assert result is not None
    wire, source = result
    assert source == primary
    msg = decode(wire)
    assert msg.msg_class is Class.SUCCESS and msg.transaction_id == TXID
    xma = msg.get(XorMappedAddress)
    assert xma is not None and xma.host == "127.0.0.1"
    assert msg.get(ResponseOrigin) == ResponseOrigin(*primary)
    assert msg.get(OtherAddress) is None  # one IP: never claimed
    text = await asyncio.to_thread(_metrics, runtime)
    assert 'crossroads_stun_requests_total{transport="udp"} 1.0' in text
    assert (
        'crossroads_stun_responses_total{class="success",transport="udp"} 1.0' in text
    )


async def test_bad_input_is_dropped_and_counted() -> None:
    # STUN alone: with the turn service attached, Allocate and ChannelData
    # are TURN's to answer (401, counted drops).
    runtime = await start(default_config(loopback_config(core__only=["stun"])))
    try:
        await _check_bad_input(runtime)
    finally:
        await runtime.close()


async def _check_bad_input(runtime: Runtime) -> None:
    primary = _stun(runtime).primary
    for data in (b"\xff" * 30, b"\x40\x00\x00\x04abcd", b"", b"\x00\x01\x00"):
        assert (
            await asyncio.to_thread(_udp_exchange, data, primary, expect=False) is None
        )
    # No TURN attached: other methods are silently discarded (RFC 8489 §6.3).
    allocate = encode(request(Method.ALLOCATE, TXID))
    assert (
        await asyncio.to_thread(_udp_exchange, allocate, primary, expect=False) is None
    )
    text = await asyncio.to_thread(_metrics, runtime)
    assert 'crossroads_stun_dropped_total{reason="unsupported-method"} 1.0' in text
    assert 'crossroads_stun_dropped_total{reason="not-stun"} 1.0' in text
    assert 'crossroads_stun_dropped_total{reason="channel-data-no-turn"} 1.0' in text
    assert 'crossroads_stun_dropped_total{reason="malformed"} 1.0' in text


async def test_tcp_without_turn_discards_other_methods_and_channel_data() -> None:
    """Over TCP with no TURN attached, the same rules as over UDP: another
    method is discarded silently (RFC 8489 §6.3), ChannelData is dropped, both
    counted, and the connection goes on serving Binding."""
    runtime = await start(default_config(loopback_config(core__only=["stun"])))
    try:
        host, port = _stun(runtime).primary
        reader, writer = await asyncio.open_connection(host, port)
        try:
            allocate = encode(request(Method.ALLOCATE, b"A" * 12))
            channel = b"\x40\x01\x00\x03abc\x00"
            binding = encode(request(Method.BINDING, b"B" * 12))
            writer.write(allocate + channel + binding)
            await writer.drain()
            header = await asyncio.wait_for(reader.readexactly(20), 5)
            body = await reader.readexactly(int.from_bytes(header[2:4], "big"))
            answer = decode(header + body)
            assert answer.transaction_id == b"B" * 12
            assert answer.msg_class is Class.SUCCESS
        finally:
            writer.close()
        text = await asyncio.to_thread(_metrics, runtime)
        assert 'crossroads_stun_dropped_total{reason="unsupported-method"} 1.0' in text
        assert (
            'crossroads_stun_dropped_total{reason="channel-data-no-turn"} 1.0' in text
        )
        assert 'crossroads_stun_requests_total{transport="tcp"} 1.0' in text
    finally:
        await runtime.close()


async def test_tcp_binding_with_split_and_pipelined_frames(runtime: Runtime) -> None:
    host, port = _stun(runtime).primary
    reader, writer = await asyncio.open_connection(host, port)
    try:
        first = encode(request(Method.BINDING, b"A" * 12), fingerprint=True)
        second = encode(request(Method.BINDING, b"B" * 12))
        writer.write(first[:7])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(first[7:] + second)
        await writer.drain()
        got = []
        for _ in range(2):
            header = await asyncio.wait_for(reader.readexactly(20), 5)
            body = await reader.readexactly(int.from_bytes(header[2:4], "big"))
            got.append(decode(header + body))
        assert [m.transaction_id for m in got] == [b"A" * 12, b"B" * 12]
        local = writer.get_extra_info("sockname")
        assert got[0].get(XorMappedAddress) == XorMappedAddress(local[0], local[1])
        # Garbage closes the connection.
        writer.write(b"\xff" * 8)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_rfc5780_with_second_ip() -> None:
    config = default_config(loopback_config(stun__alt_host="127.0.0.2"))
    runtime = await start(config)
    try:
        stun = _stun(runtime)
        endpoints = [e.local for e in stun.udp_endpoints]
        assert [h for h, _ in endpoints] == [
            "127.0.0.1",
            "127.0.0.1",
            "127.0.0.2",
            "127.0.0.2",
        ]
        assert endpoints[0][1] == endpoints[2][1] and endpoints[1][1] == endpoints[3][1]
        data = encode(request(Method.BINDING, TXID, [ChangeRequest(True, True)]))
        result = await asyncio.to_thread(_udp_exchange, data, endpoints[0])
        assert result is not None
        wire, source = result
        assert source == endpoints[3]
        msg = decode(wire)
        assert msg.get(ResponseOrigin) == ResponseOrigin(*endpoints[3])
        assert msg.get(OtherAddress) == OtherAddress(*endpoints[3])
        data = encode(request(Method.BINDING, TXID, [ChangeRequest(False, True)]))
        result = await asyncio.to_thread(_udp_exchange, data, endpoints[2])
        assert result is not None and result[1] == endpoints[3]
        assert decode(result[0]).get(OtherAddress) == OtherAddress(*endpoints[1])
        assert len(stun.describe()) == 8
    finally:
        await runtime.close()


async def test_rate_limit_counts() -> None:
    runtime = await start(default_config(loopback_config(stun__rate_limit=2)))
    try:
        primary = _stun(runtime).primary
        data = encode(request(Method.BINDING, TXID))
        answers = [
            await asyncio.to_thread(_udp_exchange, data, primary, expect=i < 2)
            for i in range(3)
        ]
        assert answers[0] is not None and answers[1] is not None and answers[2] is None
        text = await asyncio.to_thread(_metrics, runtime)
        assert 'crossroads_stun_dropped_total{reason="rate-limited"} 1.0' in text
    finally:
        await runtime.close()


async def test_rfc5780_can_be_turned_off() -> None:
    runtime = await start(default_config(loopback_config(stun__rfc5780=False)))
    try:
        stun = _stun(runtime)
        assert len(stun.udp_endpoints) == 1
        result = await asyncio.to_thread(
            _udp_exchange, encode(request(Method.BINDING, TXID)), stun.primary
        )
        assert result is not None
        assert decode(result[0]).get(ResponseOrigin) is None
    finally:
        await runtime.close()


@pytest.mark.parametrize(
    "overrides",
    [
        {"stun__alt_host": "127.0.0.2", "core__host": "0.0.0.0"},
        {"stun__alt_host": "::1"},
        {"stun__alt_host": "127.0.0.2", "stun__rfc5780": False},
    ],
)
async def test_bad_rfc5780_config(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        await start(default_config(loopback_config(**overrides)))


def test_alt_port_must_differ() -> None:
    with pytest.raises(ConfigError):
        default_config({"stun.port": 4000, "stun.alt_port": 4000})


async def test_asyncio_datagram_path_without_batching() -> None:
    """The per-datagram asyncio path (used where recvmmsg is unavailable)."""
    runtime = await start(default_config(loopback_config(stun__batch_io=False)))
    try:
        stun = _stun(runtime)
        assert not any(
            type(e).__name__ == "BatchUdpEndpoint" for e in stun.udp_endpoints
        )
        binding = encode(request(Method.BINDING, TXID))
        result = await asyncio.to_thread(_udp_exchange, binding, stun.primary)
        assert result is not None and decode(result[0]).msg_class is Class.SUCCESS
        assert (
            await asyncio.to_thread(
                _udp_exchange, b"\xff" * 20, stun.primary, expect=False
            )
            is None
        )
        text = await asyncio.to_thread(_metrics, runtime)
        assert 'crossroads_stun_dropped_total{reason="not-stun"} 1.0' in text
    finally:
        await runtime.close()


async def test_ipv6_loopback_udp_and_tcp() -> None:
    runtime = await start(default_config(loopback_config(core__host="::1")))
    try:
        stun = _stun(runtime)
        assert stun.primary[0] == "::1"
        from crossroads.client.stun import stun_binding

        udp = await stun_binding(stun.primary, local=("::1", 0))
        assert udp.mapped == udp.local and udp.mapped[0] == "::1"
        assert udp.response_origin == stun.primary
        tcp = await stun_binding(stun.primary, transport="tcp")
        assert tcp.mapped[0] == "::1"
    finally:
        await runtime.close()


async def test_random_datagrams_never_break_the_server() -> None:
    import random

    # No rate limit, so the last, valid request is answered whatever came before.
    runtime = await start(default_config(loopback_config(stun__rate_limit=0)))
    stun = _stun(runtime)
    rng = random.Random(5780)
    templates = [encode(request(Method.BINDING, TXID)), b"\x40\x00\x00\x04abcd"]

    def blast() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for n in range(400):
                if n % 2:
                    data = bytearray(rng.choice(templates))
                    for _ in range(rng.randint(1, 4)):
                        data[rng.randrange(len(data))] = rng.randrange(256)
                    data += rng.randbytes(rng.randint(0, 12))
                else:
                    data = bytearray(rng.randbytes(rng.randint(0, 64)))
                sock.sendto(bytes(data), stun.primary)

    try:
        await asyncio.to_thread(blast)
        result = await asyncio.to_thread(
            _udp_exchange, encode(request(Method.BINDING, TXID)), stun.primary
        )
        assert result is not None and decode(result[0]).msg_class is Class.SUCCESS
        text = await asyncio.to_thread(_metrics, runtime)
        assert "internal-error" not in text
        assert 'crossroads_stun_dropped_total{reason="not-stun"}' in text
    finally:
        await runtime.close()


async def test_tcp_connection_limit() -> None:
    runtime = await start(default_config(loopback_config(stun__tcp_max_connections=1)))
    try:
        host, port = _stun(runtime).primary
        first = await asyncio.open_connection(host, port)
        for _ in range(100):  # wait until the server has accepted it
            if _stun(runtime).connections:
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once
        writer.close()
        # The first connection still works.
        first[1].write(encode(request(Method.BINDING, TXID)))
        header = await asyncio.wait_for(first[0].readexactly(20), 5)
        assert header[:2] == b"\x01\x01"
        first[1].close()
        text = await asyncio.to_thread(_metrics, runtime)
        assert (
            'crossroads_stun_dropped_total{reason="tcp-connection-limit"} 1.0' in text
        )
    finally:
        await runtime.close()


async def test_wildcard_bind_replies_from_the_address_the_client_used() -> None:
    """RFC 8489 §6.3.1.2: the response's source is the request's destination,
    also on a 0.0.0.0 socket (IP_PKTINFO). Traffic stays on 127.0.0.0/8."""
    runtime = await start(default_config(loopback_config(core__host="0.0.0.0")))
    try:
        stun = _stun(runtime)
        port = stun.primary[1]
        binding = encode(request(Method.BINDING, TXID))
        for destination in ("127.0.0.1", "127.0.0.2", "127.0.0.9"):
            result = await asyncio.to_thread(
                _udp_exchange, binding, (destination, port)
            )
            assert result is not None and result[1] == (destination, port)
    finally:
        await runtime.close()
