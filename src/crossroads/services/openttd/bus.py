"""Carries :mod:`crossroads.proto.openttd.bus` messages between OpenTTD
service instances, over Store pub/sub.

Each coordinator instance subscribes to its own channel ``openttd:gc:<id>``
and hands every message that decodes to its handler; anything else is dropped
and counted in ``crossroads_openttd_bus_dropped{reason}``. A message for this
very instance skips the store and is handled directly, so a single process
with the in-memory store does no serialisation at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from crossroads.errors import DecodeError, StoreError
from crossroads.proto.openttd.bus import BusMessage, decode_bus_message
from crossroads.proto.openttd.routing import Forward
from crossroads.services.openttd.metrics import counter
from crossroads.services.openttd.registry import channel
from crossroads.store.base import Store, Subscription

log = logging.getLogger("crossroads.openttd")

Handler = Callable[[BusMessage], None]


class Bus:
    """Routes commands to the instance that holds a socket."""

    def __init__(self, store: Store, instance: str, metrics: CollectorRegistry) -> None:
        self.store = store
        self.instance = instance
        self._handler: Handler | None = None
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._dropped = counter(
            metrics, "bus_dropped", "Bus messages dropped, by reason.", "reason"
        )
        self._sent = counter(
            metrics, "bus_published", "Bus messages published to another instance."
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
            if raw is not None:
                self.receive(raw)

    def receive(self, raw: bytes) -> None:
        """One message as it came out of the store: handled, or dropped and counted."""
        try:
            message = decode_bus_message(raw)
        except DecodeError as exc:
            self._dropped.labels(exc.reason).inc()
            return
        self._deliver(message)

    def _deliver(self, message: BusMessage) -> None:
        if self._handler is None:
            self._dropped.labels("no-handler").inc()
            return
        try:
            self._handler(message)
        except Exception:
            # A handler bug must not stop the bus.
            log.exception("openttd bus: handler failed")
            self._dropped.labels("handler-error").inc()

    async def publish(self, forward: Forward) -> None:
        """Run a core's bus command (proto/openttd/routing.py)."""
        await self.send(forward.instance, forward.message)

    async def send(self, instance: str, message: BusMessage) -> None:
        if instance == self.instance and self._handler is not None:
            self._deliver(message)
            return
        try:
            await self.store.publish(channel(instance), message.encode())
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
