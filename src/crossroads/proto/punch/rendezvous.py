"""UDP rendezvous datagrams: how the server learns a client's public UDP endpoint.

The p2p service listens on three UDP ports (primary, first and second alternate).
After ``welcome`` a client sends a :class:`Probe` from its peer socket to each port;
the server records the source address it sees against the client's token and
answers with an :class:`Observed` carrying that address. Three ports seen from one
client socket tell the server (and the client) how its NAT maps:

- the same public port on all three: endpoint-independent mapping ("cone");
- ports advancing by the same non-zero step: endpoint-dependent, *sequential*
  mapping with that stride (RakNet's port-stride detection, reference §2.1);
- anything else: endpoint-dependent, *random* mapping.

Layout (all integers big-endian)::

    Probe    (44 bytes)  "XRq1" | token 16 | attempt u32 | seq u16 | zero padding 18
    Observed (30 bytes)  "XRr1" | attempt u32 | seq u16 | port index u8 |
                         family u8 (4 or 6) | port u16 | address 16 (IPv4 mapped)

The probe is padded so that the answer is never larger than the question: the
rendezvous port cannot be used to amplify traffic towards a spoofed source
(DESIGN.md, "Bad input"). A probe whose token is unknown gets no answer.
"""

from __future__ import annotations

import ipaddress
import struct

from crossroads.errors import DecodeError
from crossroads.proto.binary import pack_ip16
from crossroads.types import frozen

PROBE_MAGIC = b"XRq1"
OBSERVED_MAGIC = b"XRr1"
TOKEN_BYTES = 16
PROBE_SIZE = 44
OBSERVED_SIZE = 30

_PROBE = struct.Struct("!4s16sIH18x")
_OBSERVED = struct.Struct("!4sIHBBH16s")
assert _PROBE.size == PROBE_SIZE and _OBSERVED.size == OBSERVED_SIZE


@frozen
class Probe:
    """Client -> server: "this is peer ``token``, probing for ``attempt``"."""

    token: bytes
    attempt: int
    seq: int

    def encode(self) -> bytes:
        return _PROBE.pack(PROBE_MAGIC, self.token, self.attempt, self.seq)

    @classmethod
    def decode(cls, data: bytes) -> Probe:
        if len(data) != PROBE_SIZE:
            raise DecodeError("rendezvous probe has the wrong size", "size")
        magic, token, attempt, seq = _PROBE.unpack(data)
        if magic != PROBE_MAGIC:
            raise DecodeError("not a rendezvous probe", "bad-magic")
        return cls(token, attempt, seq)


@frozen
class Observed:
    """Server -> client: the address the server saw on rendezvous port ``index``."""

    attempt: int
    seq: int
    index: int
    host: str
    port: int

    def encode(self) -> bytes:
        packed = pack_ip16(self.host)
        return _OBSERVED.pack(
            OBSERVED_MAGIC,
            self.attempt,
            self.seq,
            self.index,
            ipaddress.ip_address(self.host).version,
            self.port,
            packed,
        )

    @classmethod
    def decode(cls, data: bytes) -> Observed:
        if len(data) != OBSERVED_SIZE:
            raise DecodeError("rendezvous answer has the wrong size", "size")
        magic, attempt, seq, index, family, port, packed = _OBSERVED.unpack(data)
        if magic != OBSERVED_MAGIC:
            raise DecodeError("not a rendezvous answer", "bad-magic")
        if index > 2:
            raise DecodeError("rendezvous port index out of range", "bad-index")
        address = ipaddress.IPv6Address(packed)
        if family == 4:
            mapped = address.ipv4_mapped
            if mapped is None:
                raise DecodeError("IPv4 answer without a mapped address", "bad-address")
            host = str(mapped)
        elif family == 6:
            host = str(address)
        else:
            raise DecodeError("unknown address family", "bad-family")
        if port == 0:
            raise DecodeError("port 0 in rendezvous answer", "bad-port")
        return cls(attempt, seq, index, host, port)


def classify_mapping(ports: tuple[int, ...]) -> tuple[str, int]:
    """(mapping behaviour, stride) from the public ports seen on the three
    rendezvous ports, in probe order.

    With fewer than three ports the behaviour is "unknown" unless two agree
    (then "independent"). A stride is accepted as "sequential" only when both
    steps agree and are small (at most 64): a NAT that allocates sequentially
    moves by 1 (or by a small fixed step) per new mapping, while two equal large
    jumps are far more likely to be chance on a random allocator.
    """
    if len(ports) < 2:
        return ("unknown", 0)
    if len(ports) == 2:
        return ("independent", 0) if ports[0] == ports[1] else ("unknown", 0)
    first, second = ports[1] - ports[0], ports[2] - ports[1]
    if first == 0 and second == 0:
        return ("independent", 0)
    if first == second and 0 < abs(first) <= 64:
        return ("sequential", first)
    return ("random", 0)
