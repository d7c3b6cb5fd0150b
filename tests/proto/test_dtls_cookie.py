"""Stateless DTLS cookies (crossroads.proto.dtls_cookie): ClientHellos made by
a real DTLS client (OpenSSL through pyOpenSSL, on memory BIOs), the
HelloVerifyRequest it accepts, cookies bound to address, port, random and
period, and random bytes that never do more than DecodeError."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from OpenSSL import SSL

from crossroads.errors import DecodeError
from crossroads.proto.dtls_cookie import (
    COOKIE_PERIOD,
    COOKIE_SIZE,
    HANDSHAKE_HEADER_SIZE,
    MIN_CLIENT_HELLO_BODY,
    RECORD_HEADER_SIZE,
    ClientHello,
    CookieJar,
    hello_verify_request,
    is_dtls,
    parse_client_hello,
)

CLIENT = ("198.51.100.7", 40000)


def client_flight(connection: SSL.Connection) -> bytes:
    try:
        connection.do_handshake()
    except SSL.WantReadError:
        pass
    return connection.bio_read(65536)


def new_client() -> SSL.Connection:
    connection = SSL.Connection(SSL.Context(SSL.DTLS_CLIENT_METHOD))
    connection.set_connect_state()
    return connection


def test_a_real_client_accepts_the_hello_verify_request() -> None:
    """OpenSSL's client answers our HelloVerifyRequest with the same random,
    message_seq 1 and our cookie, which verifies; a reply is smaller than the
    request that asked for it."""
    jar = CookieJar(os.urandom(32))
    client = new_client()
    first = client_flight(client)
    hello = parse_client_hello(first)
    assert hello is not None and hello.cookie == b"" and hello.message_sequence == 0
    cookie = jar.cookie(CLIENT, hello.random, now=1000.0)
    reply = hello_verify_request(hello, cookie)
    assert len(reply) < len(first)
    assert reply[RECORD_HEADER_SIZE] == 3  # hello_verify_request
    assert reply[5:11] == first[5:11]  # record sequence number echoed
    client.bio_write(reply)
    second = parse_client_hello(client_flight(client))
    assert second is not None
    assert second.cookie == cookie and second.random == hello.random
    assert second.message_sequence == 1
    assert jar.verify(second.cookie, CLIENT, second.random, now=1001.0)


def test_cookies_are_bound_to_address_port_random_and_time() -> None:
    jar = CookieJar(os.urandom(32))
    random = os.urandom(32)
    now = 5 * COOKIE_PERIOD + 1
    cookie = jar.cookie(CLIENT, random, now)
    assert len(cookie) == COOKIE_SIZE
    assert jar.verify(cookie, CLIENT, random, now)
    # Accepted in the next period, not in the one after.
    assert jar.verify(cookie, CLIENT, random, now + COOKIE_PERIOD)
    assert not jar.verify(cookie, CLIENT, random, now + 2 * COOKIE_PERIOD)
    assert not jar.verify(cookie, ("198.51.100.8", 40000), random, now)
    assert not jar.verify(cookie, ("198.51.100.7", 40001), random, now)
    assert not jar.verify(cookie, CLIENT, os.urandom(32), now)
    assert not jar.verify(cookie[:-1], CLIENT, random, now)
    # Another process (another secret) does not accept it.
    assert not CookieJar(os.urandom(32)).verify(cookie, CLIENT, random, now)
    assert jar.verify(
        jar.cookie(("2001:db8::1", 5), random, 0.0), ("2001:db8::1", 5), random, 0.0
    )


def test_the_reply_never_exceeds_the_smallest_client_hello() -> None:
    hello = ClientHello(0, 0, b"\0" * 32, b"")
    reply = hello_verify_request(hello, b"\0" * COOKIE_SIZE)
    smallest = RECORD_HEADER_SIZE + HANDSHAKE_HEADER_SIZE + MIN_CLIENT_HELLO_BODY
    assert len(reply) == 48 <= smallest  # docs/security.md, README


@pytest.mark.parametrize(
    ("datagram", "outcome"),
    [
        (b"", None),
        (b"\x17\xfe\xfd" + bytes(10), None),  # application data: not a hello
        (b"\x16\xfe\xfd\x00\x01" + bytes(8) + bytes(12), None),  # epoch 1
        (b"\x16\xfe\xfd" + bytes(5), DecodeError),  # truncated header
        (b"\x16\x03\x01" + bytes(10) + bytes(12), DecodeError),  # TLS version
    ],
)
def test_what_is_not_a_client_hello(datagram: bytes, outcome: object) -> None:
    if outcome is DecodeError:
        with pytest.raises(DecodeError):
            parse_client_hello(datagram)
    else:
        assert parse_client_hello(datagram) is None


def test_truncations_of_a_real_client_hello_are_decode_errors() -> None:
    hello = client_flight(new_client())
    for size in range(1, len(hello)):
        try:
            parsed = parse_client_hello(hello[:size])
        except DecodeError:
            continue
        assert parsed is None or size >= RECORD_HEADER_SIZE
    assert parse_client_hello(hello) is not None


def test_rfc7983_demultiplexing() -> None:
    assert is_dtls(20) and is_dtls(63)
    assert not is_dtls(0) and not is_dtls(19) and not is_dtls(64)


@given(st.binary(max_size=400))
def test_random_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    try:
        parse_client_hello(data)
    except DecodeError:
        pass


@given(st.binary(min_size=1, max_size=300))
def test_random_bodies_in_a_client_hello_record(body: bytes) -> None:
    handshake = (
        bytes([1]) + len(body).to_bytes(3, "big") + b"\0\0" + b"\0\0\0"
        + len(body).to_bytes(3, "big") + body
    )  # fmt: skip
    record = b"\x16\xfe\xfd\0\0" + bytes(6) + len(handshake).to_bytes(2, "big")
    try:
        hello = parse_client_hello(record + handshake)
    except DecodeError:
        return
    assert hello is not None and len(hello.random) == 32
