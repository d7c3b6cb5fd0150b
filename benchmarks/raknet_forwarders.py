"""Fixed memory of one RakNet UDPProxy forwarder (the ``bytes_per_item`` of the
``raknet-forwarders`` budget table, crossroads.transport.raknet_forwarder).

A real coordinator (the sans-I/O core) with the real built-in forwarder pool
(one UDP socket per forwarder) in this process: ``--clients`` in-memory RakNet
clients connect to the coordinator and ask for forwarders between each other
until ``--forwarders`` are open. Reported per forwarder, nothing queued:

- the process's RSS growth (Python objects: entry, tap, routes, the pool's and
  the coordinator's records, the socket object; and the allocator's slack);
- the kernel's objects for the socket, from /proc/slabinfo (root only): the
  UDP sock, its inode, the file, the dentry and the epoll item, counted as
  the growth of those caches' active objects times their object size.

Then every client leaves the coordinator: the forwarders, which forwarded
nothing, are closed (the check prints how many are left: 0).

    .venv/bin/python benchmarks/raknet_forwarders.py [--forwarders 400]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.proto.raknet.support import Client, Network  # noqa: E402

from crossroads.proto.raknet.bitstream import BitWriter  # noqa: E402
from crossroads.proto.raknet.messages import MessageId  # noqa: E402
from crossroads.proto.raknet.node import RakNetNode  # noqa: E402
from crossroads.proto.raknet.udpproxy import Sub  # noqa: E402
from crossroads.transport.admission import ResourceBudget  # noqa: E402
from crossroads.transport.raknet_forwarder import (  # noqa: E402
    ForwarderPool,
    forwarder_table,
)

#: The slab caches one UDP socket's kernel objects come from.
SOCKET_CACHES = ("UDP", "sock_inode_cache", "filp", "dentry", "eventpoll_epi")


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slab_bytes() -> int | None:
    try:
        with open("/proc/slabinfo", encoding="ascii") as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    total = 0
    for line in lines:
        fields = line.split()
        if fields[0] in SOCKET_CACHES:
            total += int(fields[1]) * int(fields[3])
    return total


def request(target_guid: int) -> bytes:
    writer = BitWriter()
    writer.write_u8(MessageId.UDP_PROXY_GENERAL)
    writer.write_u8(Sub.FORWARDING_REQUEST_FROM_CLIENT_TO_COORDINATOR)
    writer.write_address(("0.0.0.0", 0))
    writer.write_bool(False)
    writer.write_u64(target_guid)
    writer.write_u32(600_000)
    writer.write_bool(False)
    return writer.data()


async def main(forwarders: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    budget = ResourceBudget(fd_limit=hard)
    pool = ForwarderPool("127.0.0.1", forwarder_table(budget, forwarders, forwarders))
    node = RakNetNode(guid=7, forwarders=pool, proxy_public_ip="127.0.0.1")
    net = Network(node)
    # Enough clients that every pair is a forwarder of its own, from as many
    # addresses as the per-source cap (an eighth of the table) needs.
    count = 2
    while count * (count - 1) // 2 < forwarders:
        count += 1
    clients = [
        Client(net, (f"198.51.100.{1 + i % 200}", 40000 + i), 0x100 + i)
        for i in range(count)
    ]
    for client in clients:
        client.connect(1.0)
    gc.collect()
    rss0, slab0 = rss(), slab_bytes()
    now = 2.0
    for i, a in enumerate(clients):
        for b in clients[i + 1 :]:
            if len(pool.entries) >= forwarders:
                break
            a.send(request(b.guid), now)
    opened = len(pool.entries)
    gc.collect()
    rss1, slab1 = rss(), slab_bytes()
    print(f"forwarders open: {opened} (clients {count})")
    print(f"RSS per forwarder: {(rss1 - rss0) / opened:.0f} bytes")
    if slab0 is not None and slab1 is not None:
        print(f"kernel slab per forwarder: {(slab1 - slab0) / opened:.0f} bytes")
    else:
        print("kernel slab per forwarder: (needs root to read /proc/slabinfo)")
    leave = bytes([MessageId.DISCONNECTION_NOTIFICATION])
    for client in clients:
        client.send(leave, now)
    print(f"forwarders left after every client left: {len(pool.entries)}")
    await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--forwarders", type=int, default=400)
    asyncio.run(main(parser.parse_args().forwarders))
