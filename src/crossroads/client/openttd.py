"""Protocol-level OpenTTD peers: a coordinator client and a game-info responder.

For tests, benchmarks and diagnostics: :class:`GcClient` speaks the coordinator
protocol (as an OpenTTD server or client would) and :class:`GameInfoResponder`
answers CLIENT_GAME_INFO like an OpenTTD game server, which is all the
coordinator's direct probe asks. Neither plays the game.
"""

from __future__ import annotations

import asyncio
import contextlib

from crossroads.proto.openttd.coordinator import (
    COORDINATOR_VERSION,
    GcMessage,
    GcNewgrfLookup,
    PeerMessage,
    decode_gc_packet,
    encode_peer_packet,
)
from crossroads.proto.openttd.game import GamePacketType
from crossroads.proto.openttd.gameinfo import GameInfo, NewGRF, encode_game_info
from crossroads.proto.openttd.wire import HEADER_SIZE, Writer


class PacketStream:
    """OpenTTD packets over an asyncio stream pair."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int, **kwargs: object) -> PacketStream:
        reader, writer = await asyncio.open_connection(host, port, **kwargs)  # type: ignore[arg-type]
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv_packet(self, timeout: float = 5.0) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            header = await self.reader.readexactly(HEADER_SIZE)
            size = header[0] | (header[1] << 8)
            payload = await self.reader.readexactly(size - HEADER_SIZE)
        return header[2], payload

    async def at_eof(self, timeout: float = 5.0) -> bool:
        """True when the other side closes (before ``timeout``)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    data = await self.reader.read(65536)
                    if not data:
                        return True
        except (TimeoutError, ConnectionError):
            return False

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class GcClient(PacketStream):
    """A coordinator peer that keeps a NewGRF lookup table like OpenTTD does."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int = COORDINATOR_VERSION,
    ) -> None:
        super().__init__(reader, writer)
        self.version = version
        self.lookup: dict[int, NewGRF] = {}
        self.cursor = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, version: int = COORDINATOR_VERSION
    ) -> GcClient:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, version)

    async def send_message(self, message: PeerMessage) -> None:
        await self.send(encode_peer_packet(message))

    async def recv(self, timeout: float = 5.0) -> GcMessage:
        packet_type, payload = await self.recv_packet(timeout)
        message = decode_gc_packet(packet_type, payload, self.version, self.lookup)
        if isinstance(message, GcNewgrfLookup):
            self.lookup.update(message.entries)
            self.cursor = message.cursor
        return message


def server_game_info_packet(info: GameInfo, version: int = 6) -> bytes:
    """A SERVER_GAME_INFO packet, as an OpenTTD server answers a probe."""
    w = Writer(GamePacketType.SERVER_GAME_INFO)
    encode_game_info(w, info, version)
    return w.finish()


class GameInfoResponder:
    """Answers CLIENT_GAME_INFO with SERVER_GAME_INFO on a TCP port."""

    def __init__(self, info: GameInfo | None = None) -> None:
        self.info = info or GameInfo(server_name="responder", server_revision="13.0")
        self.queries = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            async with asyncio.timeout(5):
                header = await reader.readexactly(HEADER_SIZE)
                if header[2] == GamePacketType.CLIENT_GAME_INFO:
                    self.queries += 1
                    writer.write(server_game_info_packet(self.info))
                    await writer.drain()
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
