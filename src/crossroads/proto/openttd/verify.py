"""The registration check: how can clients reach a server that just registered?

Theory of operation
-------------------
After SERVER_REGISTER the coordinator finds out the server's connection type
before it answers GC_REGISTER_ACK (reference ``openttd-coordinator.md`` section 7):

- It probes the address the registration came from at the announced game port
  at once: a TCP connect that must complete a real game-protocol exchange
  (CLIENT_GAME_INFO -> SERVER_GAME_INFO), not just a SYN/ACK, because a port can
  be open without OpenTTD behind it (the service does the probe; the core asks
  for it with :class:`Probe` and gets :meth:`probe_result`).
- With protocol 3+ it also sends GC_STUN_REQUEST with a ``V`` token. The server
  opens one STUN connection per address family; each address the STUN service
  reports is probed too (once per distinct IP).

It concludes when every probe has answered and, at protocol 3+, both STUN
results of the server are in (with the observed address for each success), or
after :data:`CHECK_TIMEOUT`. The result is:

- DIRECT when a probe succeeded (those addresses are what clients try first);
- else STUN when any STUN result succeeded (the server can do NAT traversal);
- else ISOLATED, which protocol 5+ servers see as TURN when a relay is known.

At protocol 3+ it then sends GC_CONNECT_FAILED for the ``V`` token, which makes
the server close its STUN sockets.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from crossroads.proto.core import EventQueue
from crossroads.proto.openttd.codes import TokenSide, token_for
from crossroads.proto.openttd.coordinator import (
    VERSION_STUN,
    VERSION_TURN,
    ConnectionType,
    GcConnectFailed,
    GcStunRequest,
)
from crossroads.proto.openttd.ladder import STUN_RESULTS_PER_SIDE, SendToServer
from crossroads.types import frozen

#: The probe concludes after this long at most (reference section 7: 7 s).
CHECK_TIMEOUT = 7.0


@frozen
class Probe:
    """Connect to host:port and ask for the game info."""

    host: str
    port: int


@frozen
class Concluded:
    connection_type: ConnectionType
    #: Addresses that answered the probe, IPv4 first.
    direct: tuple[tuple[str, int], ...] = ()
    stun_ok: bool = False


VerifyCommand = SendToServer | Probe | Concluded


@dataclass(slots=True)
class RegistrationCheck(EventQueue[VerifyCommand]):
    """One server's reachability check; see the module docstring. The
    commands an input causes are its return value; those of the timer are
    queued for :meth:`pop_events` (the core API)."""

    check_key: str
    server_version: int
    source_host: str
    server_port: int
    turn_available: bool
    now: float
    timeout: float = CHECK_TIMEOUT
    token: str = field(init=False)
    _deadline: float = field(init=False)
    _results: dict[int, bool] = field(init=False, default_factory=dict)
    _seen: dict[int, str] = field(init=False, default_factory=dict)
    _probing: set[str] = field(init=False, default_factory=set)
    _probed: dict[str, bool] = field(init=False, default_factory=dict)
    _done: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        EventQueue.__init__(self)  # the dataclass __init__ does not call it
        self.token = token_for(TokenSide.VERIFY, self.check_key)
        self._deadline = self.now + self.timeout

    @property
    def done(self) -> bool:
        return self._done

    @property
    def uses_stun(self) -> bool:
        return self.server_version >= VERSION_STUN

    def get_timer(self) -> float | None:
        return None if self._done else self._deadline

    def start(self, now: float) -> list[VerifyCommand]:
        commands: list[VerifyCommand] = []
        if self.uses_stun:
            commands.append(SendToServer(GcStunRequest(self.token)))
        commands += self._probe(self.source_host)
        return commands

    def stun_result(self, family: int, ok: bool, now: float) -> list[VerifyCommand]:
        if self._done:
            return []
        if (
            family not in self._results
            and len(self._results) >= 2 * STUN_RESULTS_PER_SIDE
        ):
            return []  # bounded: made-up families cannot grow the table
        self._results[family] = ok
        return self._maybe_conclude()

    def stun_observed(self, family: int, host: str, now: float) -> list[VerifyCommand]:
        if self._done:
            return []
        if family not in self._seen and len(self._seen) >= 2 * STUN_RESULTS_PER_SIDE:
            return []
        self._seen[family] = host
        return self._probe(host) + self._maybe_conclude()

    def probe_result(self, host: str, ok: bool, now: float) -> list[VerifyCommand]:
        if self._done or host not in self._probing:
            return []
        self._probing.discard(host)
        self._probed[host] = ok
        return self._maybe_conclude()

    def handle_timer(self, now: float) -> None:
        """Conclude with what is known at the deadline (to :meth:`pop_events`)."""
        if not self._done and now >= self._deadline:
            self._events += self._conclude()

    def _probe(self, host: str) -> list[VerifyCommand]:
        if host in self._probed or host in self._probing:
            return []
        self._probing.add(host)
        return [Probe(host, self.server_port)]

    def _maybe_conclude(self) -> list[VerifyCommand]:
        if self._probing:
            return []
        if self.uses_stun:
            if len(self._results) < STUN_RESULTS_PER_SIDE:
                return []
            if any(ok and f not in self._seen for f, ok in self._results.items()):
                return []
        return self._conclude()

    def _conclude(self) -> list[VerifyCommand]:
        self._done = True
        direct = sorted(
            (host for host, ok in self._probed.items() if ok),
            key=lambda h: (ipaddress.ip_address(h).version, h),
        )
        stun_ok = any(self._results.values())
        if direct:
            kind = ConnectionType.DIRECT
        elif stun_ok:
            kind = ConnectionType.STUN
        elif self.server_version >= VERSION_TURN and self.turn_available:
            kind = ConnectionType.TURN
        else:
            kind = ConnectionType.ISOLATED
        commands: list[VerifyCommand] = []
        if self.uses_stun:
            commands.append(SendToServer(GcConnectFailed(self.token)))
        commands.append(
            Concluded(kind, tuple((h, self.server_port) for h in direct), stun_ok)
        )
        return commands
