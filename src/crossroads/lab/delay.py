"""One-way delay and jitter on chosen paths of the lab's internet, in userspace.

``tc netem`` would be the usual tool, but a kernel may lack ``sch_netem`` (the
machines this lab runs on have only a few qdiscs), so the lab builds its own delay
line: a TUN device in the internet namespace and a policy route that sends the
chosen flows (source network -> destination network, arriving on the bridge) into
it. Each packet read from the TUN device is written back after its delay; the
kernel then receives it *from* the TUN device, which the policy rule does not
match, and forwards it on its way. The packets are the real ones, NAT state and all;
only their time on the wire changes.

Typical use: a server far from one site (its path to the server is long) while the
two sites are close to each other -- the geometry in which the first ping of the
client nearer to the server reaches the other router before that router's client
has sent anything (docs/natneg.md, "CONNECT timing").
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import struct
from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field

from crossroads.lab import netns

#: <linux/if_tun.h>: TUNSETIFF ioctl, IFF_TUN (layer 3), IFF_NO_PI (no header).
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
#: Largest packet read from the TUN device (the lab's MTU is 1500).
_MAX_PACKET = 65535
#: Routing table (and rule priority) of the first delay line; each line of one lab
#: needs its own (``table``). Far from the kernel's 0/32766/32767 rules.
DEFAULT_TABLE = 77


@dataclass(eq=False)
class DelayLine:
    """Delay every packet from ``src`` to ``dst`` networks (pairs of CIDRs) by
    ``delay`` seconds plus a uniform ``[0, jitter]`` in the namespace ``ns``
    (the lab's internet router), while the ``async with`` block runs."""

    ns: str
    paths: Sequence[tuple[str, str]]
    _: KW_ONLY
    delay: float
    jitter: float = 0.0
    table: int = DEFAULT_TABLE
    seed: InitVar[int | None] = None
    device: str = field(init=False)
    packets: int = field(default=0, init=False)
    _random: random.Random = field(init=False)
    _fd: int | None = field(default=None, init=False)
    #: Packets on the line: their release timers, by sequence number.
    _pending: dict[int, asyncio.TimerHandle] = field(default_factory=dict, init=False)
    _sequence: int = field(default=0, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)

    def __post_init__(self, seed: int | None) -> None:
        self.paths = list(self.paths)
        self.device = f"dly{self.table}"
        self._random = random.Random(seed)

    async def __aenter__(self) -> DelayLine:
        with netns.entered(self.ns):
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                request = struct.pack(
                    "16sH", self.device.encode(), _IFF_TUN | _IFF_NO_PI
                )
                fcntl.ioctl(fd, _TUNSETIFF, request)
            except OSError:
                os.close(fd)
                raise
        self._fd = fd
        try:
            lines = [
                f"link set {self.device} up",
                f"route replace default dev {self.device} table {self.table}",
            ]
            lines += [
                f"rule add iif br0 from {src} to {dst} lookup {self.table}"
                f" priority {self.table}"
                for src, dst in self.paths
            ]
            await netns.ip_batch(lines, self.ns)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(fd, self._on_readable)
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._close()

    def _on_readable(self) -> None:
        fd = self._fd
        assert fd is not None and self._loop is not None
        while True:
            try:
                packet = os.read(fd, _MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            wait = self.delay + self._random.uniform(0.0, self.jitter)
            self._sequence += 1
            key = self._sequence
            self._pending[key] = self._loop.call_later(wait, self._release, key, packet)

    def _release(self, key: int, packet: bytes) -> None:
        self._pending.pop(key, None)
        if self._fd is None:
            return
        try:
            os.write(self._fd, packet)
            self.packets += 1
        except OSError:
            pass  # the lab is being torn down; a lost packet is a lost packet

    async def _close(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        # Closing the descriptor deletes the (non-persistent) device and with it
        # the route through it; the rules go by priority.
        os.close(fd)
        lines = [
            f"rule del priority {self.table} lookup {self.table}" for _ in self.paths
        ]
        try:
            await netns.ip_batch(lines, self.ns)
        except Exception:  # noqa: BLE001 - best effort: the namespace may be gone
            pass
