"""Method ``turn-tcp``: as ``turn-udp`` (two allocations on crossroads' TURN
server, one ChannelData frame each way), but each host talks to the TURN server
over TCP (RFC 8656 §3.1 TCP client-server transport; the relayed legs are UDP).
TCP passes every lab NAT and the ``udp-blocked`` firewall, so all pairs connect.
"""

from __future__ import annotations

from crossroads.lab.kinds import every_pair
from crossroads.lab.matrix import register
from crossroads.lab.methods.turn_udp import turn_method

METHOD = register(
    turn_method(
        "tcp",
        "crossroads' TURN relay, allocations over TCP (crossroads TURN client)",
        # Every lab site can open a TCP connection to the server.
        expected=every_pair,
    )
)
