"""The Send/Data indication fast path."""

from __future__ import annotations

import ipaddress
import zlib

from hypothesis import given
from hypothesis import strategies as st

from crossroads.proto.turn.fastpath import (
    data_indication,
    parse_send_indication,
    xor_peer_address,
)

ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(lambda a: str(ipaddress.IPv6Address(a)))
peers = st.tuples(st.one_of(ipv4, ipv6), st.integers(0, 65535))
txids = st.binary(min_size=12, max_size=12)


def send_indication(
    peer: tuple[str, int], payload: bytes, txid: bytes, *, df: bool, fingerprint: bool
) -> bytes:
    body = xor_peer_address(peer, txid)
    pad = -len(payload) & 3
    body += b"\x00\x13" + len(payload).to_bytes(2, "big") + payload + bytes(pad)
    if df:
        body += b"\x00\x1a\x00\x00"
    length = len(body) + (8 if fingerprint else 0)
    message = (
        b"\x00\x16" + length.to_bytes(2, "big") + b"\x21\x12\xa4\x42" + txid + body
    )
    if fingerprint:
        crc = (zlib.crc32(message) ^ 0x5354554E) & 0xFFFFFFFF
        message += b"\x80\x28\x00\x04" + crc.to_bytes(4, "big")
    return message


@given(peers, st.binary(max_size=200), txids, st.booleans(), st.booleans())
def test_send_round_trip(
    peer: tuple[str, int], payload: bytes, txid: bytes, df: bool, fingerprint: bool
) -> None:
    wire = send_indication(peer, payload, txid, df=df, fingerprint=fingerprint)
    assert parse_send_indication(wire) == (peer, payload, df)


@given(peers, st.binary(max_size=200), txids)
def test_corrupt_fingerprint_refused(
    peer: tuple[str, int], payload: bytes, txid: bytes
) -> None:
    wire = bytearray(send_indication(peer, payload, txid, df=False, fingerprint=True))
    wire[-1] ^= 1
    assert parse_send_indication(bytes(wire)) is None


@given(st.binary(max_size=120))
def test_random_bytes_give_result_or_none(data: bytes) -> None:
    result = parse_send_indication(b"\x00\x16" + data)
    if result is not None:
        (host, port), payload, df = result
        ipaddress.ip_address(host)
        assert 0 <= port <= 65535


@given(peers, st.binary(max_size=200), txids)
def test_data_indication_layout(
    peer: tuple[str, int], payload: bytes, txid: bytes
) -> None:
    wire = data_indication(peer, payload, txid)
    assert wire[:2] == b"\x00\x17"
    assert int.from_bytes(wire[2:4], "big") == len(wire) - 20
    assert len(wire) % 4 == 0
    # Same attribute layout as a Send indication: reuse the parser on a retyped copy.
    as_send = b"\x00\x16" + wire[2:]
    assert parse_send_indication(as_send) == (peer, payload, False)
