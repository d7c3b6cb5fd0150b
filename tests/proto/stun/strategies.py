"""Hypothesis strategies for valid STUN attributes and messages."""

from __future__ import annotations

import ipaddress

from hypothesis import strategies as st

from crossroads.proto.stun import attributes as at
from crossroads.proto.stun.constants import Class, Method

hosts = st.one_of(
    st.builds(lambda n: str(ipaddress.IPv4Address(n)), st.integers(0, 2**32 - 1)),
    st.builds(lambda n: str(ipaddress.IPv6Address(n)), st.integers(0, 2**128 - 1)),
)
ports = st.integers(0, 65535)
text = st.text(max_size=40)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
codes = st.integers(300, 699)

_ADDRESS_CLASSES = [
    at.MappedAddress,
    at.ResponseAddress,
    at.SourceAddress,
    at.ChangedAddress,
    at.XorMappedAddress,
    at.XorPeerAddress,
    at.XorRelayedAddress,
    at.AlternateServer,
    at.ResponseOrigin,
    at.OtherAddress,
]

attributes: st.SearchStrategy[at.Attribute] = st.one_of(
    *[st.builds(cls, hosts, ports) for cls in _ADDRESS_CLASSES],
    *[
        st.builds(cls, text)
        for cls in (at.Username, at.Realm, at.Nonce, at.Software, at.AlternateDomain)
    ],
    st.builds(at.Data, st.binary(max_size=64)),
    st.builds(at.Padding, st.binary(max_size=64)),
    st.builds(at.Userhash, st.binary(min_size=32, max_size=32)),
    st.builds(at.ReservationToken, st.binary(min_size=8, max_size=8)),
    *[
        st.builds(cls, u32)
        for cls in (at.Lifetime, at.Priority, at.ConnectionId, at.CacheTimeout)
    ],
    st.builds(at.IceControlled, u64),
    st.builds(at.IceControlling, u64),
    st.builds(at.ChannelNumber, st.integers(0, 65535)),
    st.builds(at.ResponsePort, ports),
    st.builds(at.RequestedTransport, st.integers(0, 255)),
    st.builds(at.RequestedAddressFamily, st.integers(0, 255)),
    st.builds(at.AdditionalAddressFamily, st.integers(0, 255)),
    st.builds(at.DontFragment),
    st.builds(at.UseCandidate),
    st.builds(at.EvenPort, st.booleans()),
    st.builds(at.ChangeRequest, st.booleans(), st.booleans()),
    st.builds(at.ErrorCodeAttribute, codes, text),
    st.builds(at.AddressErrorCode, st.integers(0, 255), codes, text),
    st.builds(
        at.UnknownAttributes, st.lists(st.integers(0, 65535), max_size=5).map(tuple)
    ),
    st.builds(at.Icmp, st.integers(0, 127), st.integers(0, 511), u32),
    st.builds(at.PasswordAlgorithm, st.integers(0, 65535), st.binary(max_size=9)),
    st.builds(
        at.PasswordAlgorithms,
        st.lists(
            st.tuples(st.integers(0, 65535), st.binary(max_size=9)), max_size=3
        ).map(tuple),
    ),
    st.builds(
        at.UnknownAttribute,
        st.integers(0, 65535).filter(lambda t: t not in at.ATTRIBUTE_CLASSES),
        st.binary(max_size=16),
    ),
)

methods = st.one_of(st.sampled_from(list(Method)), st.integers(0, 0xFFF))

messages = st.builds(
    lambda cls, method, txid, attrs: (cls, method, txid, tuple(attrs)),
    st.sampled_from(list(Class)),
    methods,
    st.binary(min_size=12, max_size=12),
    st.lists(attributes, max_size=6),
)
