"""Sans-I/O STUN client: request transactions with RFC 8489 retransmissions.

Theory of operation
-------------------
One :class:`StunClientCore` serves one UDP socket and any number of concurrent
transactions, keyed by their 96-bit transaction id. :meth:`start_request` queues
the first transmission; the transport drains :meth:`datagrams_to_send`, arms one
timer at :meth:`get_timer` and calls :meth:`handle_timer` when it fires, and
feeds every received datagram to :meth:`receive_datagram`. Outcomes come out of
:meth:`events` as :class:`TransactionResult` (a response, or ``None`` on
timeout) and :class:`RequestReceived` (someone sent *us* a request — the
hairpinning test of RFC 5780 §4.7 looks for its own request coming back).

Retransmission schedule (RFC 8489 §6.2.1; reference stun-turn.md §3): the
request is sent, then resent after RTO, 2*RTO, 4*RTO... for Rc transmissions in
all; after the last one the client waits Rm*RTO (initial RTO) and gives up.
With RTO = 500 ms, Rc = 7, Rm = 16 that is sends at 0, 0.5, 1.5, 3.5, 7.5, 15.5,
31.5 s and failure at 39.5 s. A response is matched by transaction id only, not
by source address, because RFC 5780 CHANGE-REQUEST answers come from another
address on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from crossroads.errors import DecodeError
from crossroads.proto.core import Datagram, EventQueue, Outbox
from crossroads.proto.stun.attributes import Attribute
from crossroads.proto.stun.constants import Class, Method
from crossroads.proto.stun.message import Message, decode, encode, is_stun
from crossroads.types import Address, frozen


@frozen
class TransactionTimers:
    """Retransmission parameters (RFC 8489 §6.2.1 defaults)."""

    #: Initial retransmission timeout, seconds. RFC 8489: "SHOULD be 500 ms".
    rto: float = 0.5
    #: Total number of transmissions. RFC 8489: Rc "SHOULD be 7".
    rc: int = 7
    #: Wait after the last transmission, in initial RTOs. RFC 8489: Rm = 16.
    rm: int = 16

    def __post_init__(self) -> None:
        if self.rto <= 0 or self.rc < 1 or self.rm < 1:
            raise ValueError("rto must be > 0, rc and rm >= 1")

    @property
    def total(self) -> float:
        """Seconds from the first transmission to giving up."""
        return float(self.rto * ((1 << (self.rc - 1)) - 1) + self.rm * self.rto)


#: RFC 8489 defaults: 39.5 s to give up.
RFC8489_TIMERS = TransactionTimers()


@frozen
class TransactionResult:
    """The end of one transaction."""

    transaction_id: bytes
    #: The response (success or error), or None when the transaction timed out.
    response: Message | None
    #: Where the response came from.
    source: Address | None
    #: When the first transmission was queued and when the transaction ended.
    started: float
    finished: float
    #: How many times the request was sent.
    transmissions: int


@frozen
class RequestReceived:
    """A STUN request arrived on the client socket (e.g. a hairpinned request)."""

    message: Message
    source: Address


Event = TransactionResult | RequestReceived


@dataclass(slots=True)
class _Transaction:
    wire: bytes
    dest: Address
    timers: TransactionTimers
    started: float
    next_at: float
    interval: float
    sent: int = 0
    give_up_at: float | None = None


class StunClientCore(Outbox[Datagram], EventQueue[Event]):
    """Concurrent STUN client transactions on one socket (see module docstring).

    Args:
        random_bytes: source of transaction ids (``os.urandom`` in production;
            RFC 8489 §6: "uniformly and randomly chosen").
    """

    def __init__(self, random_bytes: Callable[[int], bytes]) -> None:
        super().__init__()
        self.random_bytes = random_bytes
        self._pending: dict[bytes, _Transaction] = {}
        #: Datagrams that were neither a response to a pending transaction nor
        #: a request, by reason (for diagnostics).
        self.ignored: dict[str, int] = {}

    def start_request(
        self,
        dest: Address,
        now: float,
        attributes: Iterable[Attribute] = (),
        *,
        method: int = Method.BINDING,
        timers: TransactionTimers = RFC8489_TIMERS,
        fingerprint: bool = True,
        integrity_key: bytes | None = None,
    ) -> bytes:
        """Queue a request to ``dest``; returns its transaction id."""
        txid = self.random_bytes(12)
        while txid in self._pending:
            txid = self.random_bytes(12)
        message = Message(Class.REQUEST, method, txid, tuple(attributes))
        wire = encode(message, fingerprint=fingerprint, integrity_key=integrity_key)
        self._pending[txid] = _Transaction(
            wire=wire,
            dest=dest,
            timers=timers,
            started=now,
            next_at=now,
            interval=timers.rto,
        )
        self._send_due(now)
        return txid

    def send_indication(
        self,
        dest: Address,
        attributes: Iterable[Attribute] = (),
        *,
        method: int = Method.BINDING,
    ) -> None:
        """Queue one indication (no transaction, no retransmission)."""
        message = Message(
            Class.INDICATION, method, self.random_bytes(12), tuple(attributes)
        )
        self._outbox.append((encode(message, fingerprint=True), dest))

    def cancel(self, transaction_id: bytes) -> None:
        """Forget a transaction without an event."""
        self._pending.pop(transaction_id, None)

    @property
    def pending(self) -> int:
        """Transactions still running."""
        return len(self._pending)

    def receive_datagram(self, data: bytes, addr: Address, now: float) -> None:
        """Feed one received datagram."""
        if not is_stun(data):
            self._ignore("not-stun")
            return
        try:
            message = decode(data)
        except DecodeError as exc:
            self._ignore(exc.reason)
            return
        if message.msg_class is Class.REQUEST:
            self._events.append(RequestReceived(message, addr))
            return
        if message.msg_class is Class.INDICATION:
            self._ignore("indication")
            return
        transaction = self._pending.pop(message.transaction_id, None)
        if transaction is None:
            self._ignore("unknown-transaction")  # late duplicate or stray
            return
        self._events.append(
            TransactionResult(
                message.transaction_id,
                message,
                addr,
                transaction.started,
                now,
                transaction.sent,
            )
        )

    def _ignore(self, reason: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1

    def _send_due(self, now: float) -> None:
        for txid, t in list(self._pending.items()):
            if t.give_up_at is not None:
                if now >= t.give_up_at:
                    del self._pending[txid]
                    self._events.append(
                        TransactionResult(txid, None, None, t.started, now, t.sent)
                    )
                continue
            if now >= t.next_at:
                self._outbox.append((t.wire, t.dest))
                t.sent += 1
                if t.sent >= t.timers.rc:
                    # RFC 8489 §6.2.1: wait Rm * RTO after the last transmission.
                    t.give_up_at = now + t.timers.rm * t.timers.rto
                else:
                    t.next_at = now + t.interval
                    t.interval *= 2  # RFC 8489 §6.2.1: RTO doubles each time

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next be called, or None."""
        deadlines = [
            t.give_up_at if t.give_up_at is not None else t.next_at
            for t in self._pending.values()
        ]
        return min(deadlines) if deadlines else None

    def handle_timer(self, now: float) -> None:
        """Retransmit what is due and fail what has run out of time."""
        self._send_due(now)
