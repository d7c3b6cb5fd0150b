"""When to tell two peers to start a hole punch so that both start together.

A server that tells two NATed peers "connect to each other" sends each a message;
each peer sends its first packet (a natneg CONNECT_PING, a TCP SYN) the moment that
message arrives. If one peer's first packet reaches the other's router before that
router's own peer has sent anything toward it, a port-restricted router drops it,
and a router that accepts unsolicited input keeps a conntrack entry that makes it
remap its own peer's port when that peer sends -- the first attempt fails (the
arithmetic is in docs/natneg.md, "CONNECT timing").

The server knows each peer's round-trip time ``rtt``; the message takes about
``rtt / 2`` to arrive. Sending to the farther peer first and to the nearer one
``(rtt_far - rtt_near) / 2`` later makes both arrive, and both first packets leave,
at the same moment, so they cross in flight. RakNet's NatPunchthroughServer gets the
same effect by telling both peers a common start time (CONNECT_AT_TIME); the
protocols here cannot carry a time, so the server times its sends instead.

*Poll delay.* A client that reads its socket every ``poll`` seconds (the GameSpy
SDK's sample calls ``NNThink`` every 10 ms) answers a probe up to one interval
late, so a measured round trip is ``2 d + p`` with ``p`` in ``[0, poll)``. The
half-difference of two such samples is the true difference of the one-way times
``D`` give or take ``poll / 2``. A lead of ``D`` plus that error can hold the nearer
peer's message past the farther peer's arrival, so the farther peer's first packet
may knock on the nearer one's router before its message arrived: worse than no
lead at all (in the lab a 5.7 ms lead from a poll-inflated sample cost a pair
0.7 s). So the lead is the measured half-difference *minus* ``poll / 2``, never
below 0: it never exceeds ``D``, and never goes to the wrong peer, so the held
message arrives no later than the other one -- timing only moves the schedule
from "both at once" toward "both arrive together", never past it. What is left is
a gap below one poll interval, the size of the peers' own reaction jitter.
"""

from __future__ import annotations


def crossing_leads(
    rtt_a: float | None, rtt_b: float | None, max_lead: float, poll: float = 0.0
) -> tuple[float, float]:
    """Seconds to hold the message to peer A and to peer B.

    One of the two is always 0 (the farther peer's message goes at once); the other
    is the difference of the one-way times less half of ``poll`` (the longest
    delay a client's polling adds to a measured round trip, see "Poll delay"
    above), at least 0 and at most ``max_lead`` (a peer that fakes a slow round
    trip must not hold its partner back for long). An unknown round trip gives no
    lead: both at once, as servers have always done.
    """
    if rtt_a is None or rtt_b is None:
        return (0.0, 0.0)
    lead = min(max(0.0, (abs(rtt_a - rtt_b) - poll) / 2), max_lead)
    return (0.0, lead) if rtt_a >= rtt_b else (lead, 0.0)
