"""Type stub of the optional C data plane (see _turnfast.c and dataplane.py)."""

from collections.abc import Callable
from typing import Any

RECV_BATCH: int
REWRITE_NONE: int
REWRITE_UNWRAP_CHANNEL: int
REWRITE_WRAP_CHANNEL: int

class _Counters:
    forwarded: int
    forwarded_bytes: int
    send_errors: int
    malformed: int
    batches: int
    drained: int
    throttled: int
    sends: int

class Budget:
    bps: float
    throttled: int
    def __init__(self, bps: float = ...) -> None: ...
    def allow(self, size: int) -> bool: ...

class Poller:
    wakeups: int
    events: int
    sends: int
    def register(self, fd: int, tap: RouteTap) -> None: ...
    def unregister(self, fd: int) -> None: ...
    def poll(self) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

class Route:
    sock: Any
    dest: tuple[str, int]
    control: tuple[int, int, bytes] | None
    rewrite: int
    channel: int
    budget: Budget | None
    packets: int
    octets: int
    def __init__(
        self,
        sock: Any,
        dest: tuple[str, int],
        control: tuple[int, int, bytes] | None = ...,
        *,
        rewrite: int = ...,
        channel: int = ...,
        budget: Budget | None = ...,
    ) -> None: ...

class RouteTap(_Counters):
    fd: int
    prefix: int
    length_at: int
    max_size: int
    ancillary: bool
    sock: Any
    routes: dict[Any, Any]
    fallback: Callable[..., None]
    def __init__(
        self,
        sock: Any,
        routes: dict[Any, Any],
        fallback: Callable[..., None],
        *,
        prefix: int = ...,
        length_at: int = ...,
        max_size: int = ...,
        ancillary: bool = ...,
    ) -> None: ...
    def readable(self) -> None: ...
    def datagram_received(self, data: bytes, addr: Any) -> None: ...
    def close(self) -> None: ...

def set_gso(enabled: bool) -> None: ...
def gso_stats() -> dict[str, Any]: ...
