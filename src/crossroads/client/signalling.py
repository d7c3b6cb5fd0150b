"""Client side of the p2p signalling WebSocket (``docs/p2p-protocol.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import websockets
from websockets.asyncio.client import ClientConnection

from crossroads.errors import DecodeError, RemoteProtocolError
from crossroads.proto.punch import signalling as sig

log = logging.getLogger("crossroads.client.p2p")

Handler = Callable[[sig.Message], Awaitable[None] | None]


class SignallingError(RemoteProtocolError):
    """The server answered with an ``error`` frame, or the connection failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class SignallingClient:
    """One WebSocket to the p2p service; dispatches server frames to a handler.

    The client answers the server's ``ping`` by itself.
    """

    def __init__(
        self,
        url: str,
        handler: Handler,
        binary: Callable[[bytes], None] | None = None,
    ) -> None:
        self.url = url
        self._handler = handler
        self._binary = binary
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiters: list[
            tuple[Callable[[sig.Message], bool], asyncio.Future[sig.Message]]
        ] = []
        self._pings: dict[int, float] = {}
        self.closed = asyncio.Event()
        self.welcome: sig.Welcome | None = None

    async def connect(
        self,
        key: bytes,
        name: str = "",
        timeout: float = 10.0,
        sock: socket.socket | None = None,
    ) -> sig.Welcome:
        """Open the WebSocket (over ``sock`` when given: an unconnected TCP socket,
        e.g. made in another network namespace), send ``hello``, await ``welcome``."""
        extra: dict[str, Any] = {}
        if sock is not None:
            parsed = urlparse(self.url)
            port = parsed.port or (443 if parsed.scheme == "wss" else 80)
            sock.setblocking(False)
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(
                    sock, (parsed.hostname or "", port)
                ),
                timeout,
            )
            extra["sock"] = sock
        self._ws = await asyncio.wait_for(
            websockets.connect(
                self.url, max_size=sig.MAX_FRAME_BYTES, open_timeout=timeout, **extra
            ),
            timeout,
        )
        self._reader = asyncio.create_task(self._read())
        welcome = await self.request(
            sig.Hello(sig.PROTOCOL_VERSION, key, name),
            lambda m: isinstance(m, sig.Welcome),
            timeout=timeout,
            ref="hello",
        )
        assert isinstance(welcome, sig.Welcome)
        self.welcome = welcome
        return welcome

    @property
    def connected(self) -> bool:
        """Whether the WebSocket is open (it may still close at any moment)."""
        return self._ws is not None

    async def send_frame(self, frame: bytes) -> None:
        """Send one binary frame (a relayed datagram) as it is."""
        if self._ws is None:
            raise SignallingError("not_connected", "signalling is not connected")
        await self._ws.send(frame)

    async def send(self, message: sig.Message) -> None:
        if self._ws is None:
            raise SignallingError("not_connected", "signalling is not connected")
        try:
            await self._ws.send(sig.encode(message))
        except websockets.ConnectionClosed as exc:
            raise SignallingError("closed", str(exc)) from None

    def expect(
        self, match: Callable[[sig.Message], bool]
    ) -> asyncio.Future[sig.Message]:
        """A future for the next server frame that ``match`` accepts."""
        future: asyncio.Future[sig.Message] = asyncio.get_running_loop().create_future()
        self._waiters.append((match, future))
        return future

    async def request(
        self,
        message: sig.Message,
        match: Callable[[sig.Message], bool],
        *,
        timeout: float = 10.0,
        ref: str | None = None,
    ) -> sig.Message:
        """Send ``message`` and wait for the answer ``match`` accepts; an ``error``
        frame whose ``ref`` is this message's type raises :class:`SignallingError`."""
        ref = ref or message.TYPE

        def accept(m: sig.Message) -> bool:
            return match(m) or (isinstance(m, sig.Error) and m.ref == ref)

        future = self.expect(accept)
        await self.send(message)
        try:
            answer = await asyncio.wait_for(future, timeout)
        finally:
            future.cancel()
        if isinstance(answer, sig.Error) and not match(answer):
            raise SignallingError(answer.code, answer.message)
        return answer

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for frame in self._ws:
                if isinstance(frame, bytes) and frame[:1] == b"\x01":
                    if self._binary is not None:
                        self._binary(frame)
                    continue
                try:
                    message = sig.decode_server(frame)
                except DecodeError as exc:
                    log.warning("bad frame from signalling server: %s", exc)
                    continue
                if isinstance(message, sig.Ping):
                    await self.send(sig.Pong(message.id))
                    continue
                consumed = False
                for entry in list(self._waiters):
                    match, future = entry
                    if future.done():
                        self._waiters.remove(entry)
                    elif match(message):
                        self._waiters.remove(entry)
                        future.set_result(message)
                        consumed = True
                        break
                if consumed:
                    continue
                try:
                    result = self._handler(message)
                    if result is not None:
                        await result
                except Exception:
                    log.exception("error handling %s", message.TYPE)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()
            for _, future in self._waiters:
                if not future.done():
                    future.set_exception(SignallingError("closed", "signalling closed"))
            self._waiters.clear()

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader
