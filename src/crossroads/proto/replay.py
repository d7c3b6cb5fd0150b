"""The sliding replay window of the authenticated datagram channels (DTLS
records, the p2p secure channel).

One bit a counter behind the highest counter seen (RFC 4303 §3.4.3's anti-replay
window, which RFC 6347 §4.1.2.6 adopts for DTLS and RFC 6479 describes as a
bitmap): a counter already seen, or older than the window, is not fresh. The
window moves only in :meth:`ReplayWindow.accept`, called once a datagram
authenticated, so forged datagrams cannot shift it. Each protocol sets its size.
"""

from __future__ import annotations

from typing import ClassVar


class ReplayWindow:
    """Counters seen in the last :attr:`SIZE` below the highest one."""

    __slots__ = ("highest", "_bits")
    #: Counters the window covers, set by each protocol's subclass.
    SIZE: ClassVar[int]

    def __init__(self) -> None:
        self.highest = -1
        self._bits = 0  # bit i set: counter (highest - i) was seen

    def fresh(self, counter: int) -> bool:
        """False for a duplicate or a counter older than the window."""
        if counter > self.highest:
            return True
        offset = self.highest - counter
        return offset < self.SIZE and not (self._bits >> offset) & 1

    def accept(self, counter: int) -> None:
        """Mark ``counter`` seen (call only after the datagram authenticated)."""
        if counter > self.highest:
            shift = counter - self.highest
            self._bits = ((self._bits << shift) | 1) & ((1 << self.SIZE) - 1)
            self.highest = counter
        else:
            self._bits |= 1 << (self.highest - counter)


__all__ = ["ReplayWindow"]
