"""A log line for refused clients and peers, at most one per interval.

A client refused by the address policy (:mod:`crossroads.proto.policy`) is
dropped without an answer, so the log is the only place its operator can see
why a first try failed; a flood of spoofed sources must not flood the log, so
lines are rate-limited and the ones left out are counted in the next line. The
metric (a drop reason per verdict) counts every refusal.
"""

from __future__ import annotations

import logging

from crossroads.proto.policy import Verdict
from crossroads.ratelog import RateLimitedLog
from crossroads.types import Address

#: Seconds between two log lines about refused addresses, per service: one line
#: per 10 s is readable during a flood and still immediate for a first try.
LOG_INTERVAL = 10.0


class RefusalLog:
    """Rate-limited "refused client" log lines for one service (one reason of a
    :class:`~crossroads.ratelog.RateLimitedLog`, which counts the lines held back)."""

    def __init__(self, log: logging.Logger, what: str, hint: str) -> None:
        self.what = what
        self.hint = hint
        self.lines = RateLimitedLog(log, LOG_INTERVAL)

    def refused(self, address: Address, verdict: Verdict) -> None:
        self.lines.log(
            "refused",
            "%s %s refused: %s address; %s",
            self.what,
            address[0],
            verdict.reason,
            self.hint,
        )
