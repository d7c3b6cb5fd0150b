"""Type stub of the optional C data plane (see _turnfast.c and turnplane.py)."""

from collections.abc import Callable
from typing import Any

RECV_BATCH: int

class _Counters:
    forwarded: int
    forwarded_bytes: int
    send_errors: int
    malformed: int
    batches: int
    drained: int
    throttled: int

class ListenerTap(_Counters):
    fd: int
    clients: dict[tuple[str, int], dict[int, tuple[Any, tuple[str, int]]]]
    fallback: Callable[[bytes, Any], None]
    def datagram_received(self, data: bytes, addr: Any) -> None: ...
    def readable(self) -> None: ...

class RelayTap(_Counters):
    fd: int
    bps: float
    peer_channels: dict[tuple[str, int], int]
    fallback: Callable[[bytes, Any], None]
    def datagram_received(self, data: bytes, addr: Any) -> None: ...
    def allow(self, size: int) -> bool: ...
    def readable(self) -> None: ...
    def set_client(self, fd: int, addr: tuple[str, int], sendto: Any = ...) -> None: ...

class ChannelRouter(_Counters):
    endpoints: dict[Any, dict[tuple[str, int], dict[int, tuple[Any, tuple[str, int]]]]]
    fallback: Callable[[bytes, tuple[str, int], Any], None]
    def handle_channel_data(
        self, data: bytes, client: tuple[str, int], endpoint: Any
    ) -> None: ...

class Poller:
    wakeups: int
    events: int
    def register(self, fd: int, tap: RelayTap | ListenerTap | RouteTap) -> None: ...
    def unregister(self, fd: int) -> None: ...
    def poll(self) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

class Route:
    sock: Any
    dest: tuple[str, int]
    control: tuple[int, int, bytes] | None
    packets: int
    octets: int
    def __init__(
        self,
        sock: Any,
        dest: tuple[str, int],
        control: tuple[int, int, bytes] | None = ...,
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
    def close(self) -> None: ...
