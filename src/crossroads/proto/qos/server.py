"""Sans-I/O QoS server core: answers Unity/Multiplay QoS requests.

Theory of operation
-------------------
A QoS server is an echo with a shape (docs/qos.md): every well-formed request
gets one response, the request's sequence, identifier and timestamp copied
back, with the flow control nibble saying whether the client should slow
down. The client computes its round trip from the echoed timestamp; the server
never reads a clock for the client and keeps nothing about a request once it
has answered.

The only state is a per-source request count in fixed windows of
:data:`WINDOW` seconds (the budget's table ``qos-sources`` admits each source
on its first request of a window and releases every source when the window
ends, so that state lives at most one window, then the timer clears it):

- up to ``rate`` requests per window: answered, flow control 0;
- up to ``2 * rate``: answered with flow control "throttle" (units growing
  with the excess), which Unity's clients honour by backing off this server;
- beyond: dropped (``rate`` drop reason).

A source the table refuses (the table is full: a flood of spoofed sources)
shares one overflow count with the same rule, ``OVERFLOW_SHARE`` times the
per-source rate, answered with throttle only: legitimate newcomers still get
answers during a flood, and the flood gets at most that many per window.

No answer is ever larger than its request: the response drops the request's
magic, version and title (at least two bytes), so the server is no
amplifier whatever the source (the reflection budget is not needed).
Malformed input is dropped and counted in :attr:`QosServer.drops` by reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crossroads.errors import DecodeError
from crossroads.proto.admission import Admitter, LocalTable
from crossroads.proto.budget import source_key
from crossroads.proto.core import Datagram, Outbox
from crossroads.proto.qos.messages import (
    FLOW_NONE,
    decode_request,
    encode_response,
    throttle,
)
from crossroads.types import Address

#: Seconds per rate window: rates are "per second" like every per-source
#: limit of crossroads (proto/stun/ratelimit.py).
WINDOW = 1.0
#: Default answers per source per window before throttling. Unity's services
#: runner sends 5 requests per server per measurement (RequestsPerEndpoint),
#: its older client a few more; 50 lets a household of ten players measure at
#: once and is still nothing for a server (each answer is ~13 bytes).
DEFAULT_RATE = 50
#: The overflow count (sources the table refused) gets this many times the
#: per-source rate: the table is full only under a flood of distinct sources,
#: and new legitimate clients then share this, with throttle set.
OVERFLOW_SHARE = 8
_OVERFLOW = "\0overflow"


@dataclass(eq=False)
class QosServer(Outbox[Datagram]):
    """Answers QoS requests with per-source rate control (see module doc)."""

    rate: int = DEFAULT_RATE
    #: The table that admits a source's rate state (the budget's
    #: ``qos-sources`` in a running process).
    admission: Admitter = field(default_factory=LocalTable)
    #: Requests dropped, by reason (``short``, ``bad-magic``, ``rate`` ...).
    drops: dict[str, int] = field(default_factory=dict, init=False)
    #: Answers sent, and those of them with throttle set.
    answered: int = field(default=0, init=False)
    throttled: int = field(default=0, init=False)
    _counts: dict[str, int] = field(default_factory=dict, init=False)
    #: Admitted sources of this window, as given to ``admit`` (for release).
    _admitted: list[str] = field(default_factory=list, init=False)
    _window_end: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def sources(self) -> int:
        """Sources with rate state now."""
        return len(self._admitted)

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        try:
            request = decode_request(data)
        except DecodeError as exc:
            self._drop(exc.reason)
            return
        if self._window_end is not None and now >= self._window_end:
            self._end_window()
        host = addr[0]
        # IPv4 hosts are their own key (no parsing on the hot path); an IPv6
        # source counts per /64 like every per-source cap (proto/budget.py).
        key = source_key(host) if ":" in host else host
        counts = self._counts
        count = counts.get(key)
        limit = self.rate
        if count is None:
            if self.admission.admit(host) is None:
                self._admitted.append(host)
                count = 0
                if self._window_end is None:
                    self._window_end = now + WINDOW
            else:
                key = _OVERFLOW
                count = counts.get(key, 0)
                limit = self.rate * OVERFLOW_SHARE
                if self._window_end is None:
                    self._window_end = now + WINDOW
        count += 1
        counts[key] = count
        if count > 2 * limit:
            self._drop("rate")
            return
        flow = FLOW_NONE
        if count > limit or key == _OVERFLOW:
            # Units grow with the excess: one unit per eighth of the rate over.
            flow = throttle(1 + (count - limit) * 8 // max(1, limit))
            self.throttled += 1
        self.answered += 1
        self._outbox.append((encode_response(request, flow), addr))

    def _end_window(self) -> None:
        release = self.admission.release
        for host in self._admitted:
            release(host)
        self._admitted.clear()
        self._counts.clear()
        self._window_end = None

    def get_timer(self) -> float | None:
        return self._window_end

    def handle_timer(self, now: float) -> None:
        if self._window_end is not None and now >= self._window_end:
            self._end_window()

    def close(self) -> None:
        """Release every source's state (the service is stopping)."""
        self._end_window()
