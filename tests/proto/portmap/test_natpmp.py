"""NAT-PMP (RFC 6886) codec: layouts from the RFC, round trips, random bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossroads.errors import DecodeError
from crossroads.proto.portmap import natpmp


def test_request_layouts() -> None:
    # RFC 6886 §3.2: version 0, opcode 0
    assert natpmp.ExternalAddressRequest().encode() == b"\x00\x00"
    # §3.3: version, opcode 1 (UDP), reserved, internal port, external port, lifetime
    request = natpmp.MapRequest(natpmp.Opcode.MAP_UDP, 5000, 6000, 7200)
    assert request.encode() == bytes.fromhex(
        "0001 0000 1388 1770 00001c20".replace(" ", "")
    )


def test_external_address_response() -> None:
    data = bytes.fromhex("0080 0000 00000e10 cb007101".replace(" ", ""))
    assert natpmp.decode_response(data) == natpmp.ExternalAddressResponse(
        0, 3600, "203.0.113.1"
    )


def test_response_layouts() -> None:
    # RFC 6886 §3.2: version 0, opcode 128, result, epoch, external IPv4 address
    address = natpmp.ExternalAddressResponse(0, 3600, "203.0.113.1")
    assert address.encode() == bytes.fromhex(
        "0080 0000 00000e10 cb007101".replace(" ", "")
    )
    # §3.3: version 0, opcode 128 + 2 (TCP), result 2, epoch, internal port,
    # mapped external port, lifetime
    mapped = natpmp.MapResponse(natpmp.Opcode.MAP_TCP, 2, 10, 5000, 6000, 7200)
    assert mapped.encode() == bytes.fromhex(
        "0082 0002 0000000a 1388 1770 00001c20".replace(" ", "")
    )
    # §3.4: a deletion asks for external port 0 and lifetime 0
    delete = natpmp.MapRequest(natpmp.Opcode.MAP_TCP, 5000, 0, 0)
    assert delete.encode() == bytes.fromhex(
        "0002 0000 1388 0000 00000000".replace(" ", "")
    )


def test_mapping_response_and_error() -> None:
    ok = natpmp.MapResponse(natpmp.Opcode.MAP_UDP, 0, 10, 5000, 6000, 3600)
    assert natpmp.decode_response(ok.encode()) == ok
    refused = natpmp.MapResponse(
        natpmp.Opcode.MAP_UDP, natpmp.Result.NOT_AUTHORIZED, 10, 5000, 0, 0
    )
    assert natpmp.decode_response(refused.encode()).result == 2  # type: ignore[union-attr]
    # a NAT-PMP gateway answering a PCP (version 2) request: version 0, result 1
    short = bytes.fromhex("0081 0001 00000005".replace(" ", ""))
    assert natpmp.decode_response(short) == natpmp.ErrorResponse(1, 1, 5)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x80",
        bytes.fromhex("0200000000000000"),
        bytes.fromhex("0001000000000000"),
        bytes(11),
    ],
)
def test_malformed(data: bytes) -> None:
    with pytest.raises(DecodeError):
        natpmp.decode_response(data)


@given(
    st.sampled_from(list(natpmp.Opcode)[1:]),
    st.integers(0, 65535),
    st.integers(0, 2**32 - 1),
    st.integers(0, 65535),
    st.integers(0, 65535),
    st.integers(0, 2**32 - 1),
)
def test_map_response_round_trip(
    op: natpmp.Opcode,
    result: int,
    epoch: int,
    internal: int,
    external: int,
    lifetime: int,
) -> None:
    response = natpmp.MapResponse(op, result, epoch, internal, external, lifetime)
    assert natpmp.decode_response(response.encode()) == response


@given(st.ip_addresses(v=4).map(str), st.integers(0, 2**32 - 1))
def test_address_response_round_trip(address: str, epoch: int) -> None:
    response = natpmp.ExternalAddressResponse(0, epoch, address)
    assert natpmp.decode_response(response.encode()) == response


@given(st.binary(max_size=40))
def test_random_bytes(data: bytes) -> None:
    try:
        natpmp.decode_response(data)
    except DecodeError:
        pass
