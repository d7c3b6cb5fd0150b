"""Commands between OpenTTD service instances, over Store pub/sub.

Each coordinator instance subscribes to its own channel ``openttd:gc:<id>``.
Whoever needs something done by the instance holding a socket publishes a small
JSON object there:

- ``{"t": "send", "code": C, "data": B64}``: write these packet bytes to the
  server registered as ``C`` (a join handled by another instance talks to the
  server through the instance that holds it);
- ``{"t": "event", "token": T, "ev": "failed"|"stun"|"connected", ...}``: a peer
  reported on attempt ``T`` to an instance other than the attempt's owner (the
  owner's id is inside the token);
- ``{"t": "seen", "token": T, "family": F, "host": H, "port": P}``: the STUN
  service saw ``T``'s packet from H:P;
- ``{"t": "drop", "code": C, "session": S}``: a newer registration of ``C``
  replaced session ``S``; close it.

A message for this very instance skips the store and is handled directly, so a
single process with the in-memory store does no serialisation at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from crossroads.errors import DecodeError, StoreError
from crossroads.proto import jsontext
from crossroads.services.openttd.registry import channel
from crossroads.store.base import Store, Subscription

log = logging.getLogger("crossroads.openttd")

#: Largest bus message we accept (a packet is at most 32 KiB, base64 ~44 KiB).
MAX_MESSAGE = 64 * 1024

Handler = Callable[[dict[str, Any]], None]


class Bus:
    """Routes commands to the instance that holds a socket."""

    def __init__(self, store: Store, instance: str, metrics: CollectorRegistry) -> None:
        self.store = store
        self.instance = instance
        self._handler: Handler | None = None
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._dropped = Counter(
            "crossroads_openttd_bus_dropped",
            "Bus messages dropped, by reason.",
            ["reason"],
            registry=metrics,
        )
        self._sent = Counter(
            "crossroads_openttd_bus_published",
            "Bus messages published to another instance.",
            registry=metrics,
        )

    async def start(self, handler: Handler) -> None:
        """Receive this instance's messages with ``handler``."""
        self._handler = handler
        self._subscription = await self.store.subscribe(channel(self.instance))
        self._task = asyncio.create_task(self._run(self._subscription))

    async def _run(self, subscription: Subscription) -> None:
        while True:
            try:
                raw = await subscription.get(timeout=5.0)
            except StoreError as exc:
                # Logged once per outage by the store itself.
                log.debug("openttd bus: %s; retrying", exc)
                await asyncio.sleep(1.0)
                continue
            if raw is None:
                continue
            if len(raw) > MAX_MESSAGE:
                self._dropped.labels("too-large").inc()
                continue
            try:
                message = jsontext.loads(raw)
            except DecodeError:
                self._dropped.labels("bad-json").inc()
                continue
            if not isinstance(message, dict):
                self._dropped.labels("bad-json").inc()
                continue
            self._deliver(message)

    def _deliver(self, message: dict[str, Any]) -> None:
        if self._handler is None:
            self._dropped.labels("no-handler").inc()
            return
        try:
            self._handler(message)
        except Exception:
            # A malformed message must not stop the bus.
            log.exception("openttd bus: handler failed")
            self._dropped.labels("handler-error").inc()

    async def send(self, instance: str, message: dict[str, Any]) -> None:
        if instance == self.instance and self._handler is not None:
            self._deliver(message)
            return
        try:
            await self.store.publish(channel(instance), json.dumps(message).encode())
            self._sent.inc()
        except StoreError:
            self._dropped.labels("store-error").inc()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.close()
            self._subscription = None
