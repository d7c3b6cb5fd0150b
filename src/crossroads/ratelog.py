"""Log lines an attacker cannot multiply: at most one per reason per interval.

Authentication failures (a TURN 401 for a bad MESSAGE-INTEGRITY, a Unity relay
BIND with a bad HMAC, an expired credential, a wrong API key) must be visible to
an operator, but one line per failure would let anyone fill the disk and drown
everything else at line rate. :class:`RateLimitedLog` writes the first failure
of each reason at once, then at most one line per reason every ``interval``
seconds, saying how many similar lines it held back since the last one.

Nothing secret goes in: callers pass the reason, the client address and public
identifiers (a TURN username, an allocation id), never a password, key, HMAC,
token or API key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

#: Seconds between two lines of one reason: a minute is what an operator reading
#: the log needs to see that failures go on, and bounds a flood to 1,440 lines a
#: day per reason.
DEFAULT_INTERVAL = 60.0
#: Reasons tracked at once; a caller's reasons are a fixed set, this only stops
#: a mistaken caller that puts client data in ``reason`` from growing the table.
MAX_REASONS = 256


@dataclass(eq=False)
class RateLimitedLog:
    """At most one log line per reason per ``interval`` seconds."""

    logger: logging.Logger
    interval: float = DEFAULT_INTERVAL
    _: KW_ONLY
    level: int = logging.WARNING
    clock: Callable[[], float] = time.monotonic
    #: reason -> (time of the last line, lines held back since).
    _last: dict[str, tuple[float, int]] = field(default_factory=dict, init=False)
    #: Lines written and held back, for tests and metrics.
    written: int = field(default=0, init=False)
    suppressed: int = field(default=0, init=False)

    def log(self, reason: str, message: str, *args: object) -> bool:
        """Log ``message % args`` under ``reason`` unless one was logged within
        the interval (then only count it). Returns whether a line was written."""
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last[0] < self.interval:
            self._last[reason] = (last[0], last[1] + 1)
            self.suppressed += 1
            return False
        held = last[1] if last is not None else 0
        if last is None and len(self._last) >= MAX_REASONS:
            self._last.clear()
        self._last[reason] = (now, 0)
        self.written += 1
        if held:
            self.logger.log(
                self.level,
                message + " (%d similar in the last %.0f s not logged)",
                *args,
                held,
                now - last[0] if last is not None else 0.0,
            )
        else:
            self.logger.log(self.level, message, *args)
        return True
