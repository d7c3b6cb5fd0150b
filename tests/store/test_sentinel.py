"""Redis Sentinel: a real master, a real replica and three real redis-sentinel
processes (Debian ``redis-sentinel``). crossroads runs on a
``redis+sentinel://`` store; the master is killed; Sentinel promotes the
replica; nothing written (and replicated) before is lost and crossroads keeps
working — the store, and a relay allocation made before the failover."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from crossroads.client.relay import RelayApi
from crossroads.config import default_config
from crossroads.errors import ConfigError, StoreError
from crossroads.runtime import start
from crossroads.store.redis import RedisStore
from crossroads.store.redis_url import redis_client
from tests.conftest import RedisServer, eventually, free_port, loopback_config

pytestmark = pytest.mark.timeout(90)

SERVICE = "crossroads-test"
API_KEY = "sentinel-relay-key"
#: Sentinel declares the master down after 1 s without a reply (its default is
#: 30 s, far too slow for a test) and gives a failover 5 s.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class SentinelSet:
    """A master, one replica and three sentinels (quorum 2) on loopback."""

    def __init__(self) -> None:
        binary = shutil.which("redis-sentinel")
        if binary is None:
            pytest.fail("redis-sentinel missing: make install (Debian redis-sentinel)")
        self.directory = Path(tempfile.mkdtemp(prefix="crossroads-sentinel-"))
        self.master = RedisServer()
        self.replica = RedisServer(
            extra=["--replicaof", "127.0.0.1", str(self.master.port)]
        )
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        for port in self.sentinel_ports:
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [binary, str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def sentinel(self, index: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], socket_timeout=2)

    def master_port(self) -> int | None:
        try:
            host_port = self.sentinel().sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        return None if host_port is None else int(host_port[1])

    def wait_ready(self) -> None:
        """Replica in sync; every sentinel knows the replica and the others."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                info = redis.Redis(port=self.replica.port).info("replication")
                ready = info.get("master_link_status") == "up" and all(
                    self.sentinel(i).sentinel_master(SERVICE)["num-other-sentinels"]
                    == 2
                    and self.sentinel(i).sentinel_master(SERVICE)["num-slaves"] >= 1
                    for i in range(3)
                )
            except redis.RedisError:
                ready = False
            if ready:
                return
            time.sleep(0.1)
        raise AssertionError("sentinels never saw the whole set")

    def stop(self) -> None:
        for process in self.sentinels:
            process.terminate()
        for process in self.sentinels:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.replica.stop()
        self.master.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    started = SentinelSet()
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def test_urls_are_parsed_or_refused() -> None:
    for bad in ("redis+sentinel:///svc", "redis+sentinel://host:notaport/svc"):
        with pytest.raises(ConfigError):
            redis_client(bad)
    with pytest.raises(ConfigError):
        redis_client("http://example.invalid/")
    # A default port and service, a password and database: built without I/O.
    client = redis_client("redis+sentinel://:pw@127.0.0.1/svc/3")
    pool = client.connection_pool
    assert pool.service_name == "svc"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 3
    assert pool.connection_kwargs["password"] == "pw"
    sentinel = pool.sentinel_manager.sentinels[0]  # type: ignore[attr-defined]
    assert sentinel.connection_pool.connection_kwargs["port"] == 26379


async def test_failover_loses_nothing_and_crossroads_keeps_working(
    sentinel_set: SentinelSet,
) -> None:
    rt = await start(
        default_config(
            loopback_config(
                core__only="relay",
                core__store=sentinel_set.url,
                relay__api_keys=API_KEY,
                relay__allow_private_peers=True,
            )
        )
    )
    host, port = rt.http_address
    base = f"http://{host}:{port}"
    try:
        store = rt.store
        assert isinstance(store, RedisStore)
        for n in range(50):
            await store.set(f"sentinel-test:{n}", str(n).encode())
        async with RelayApi(base, API_KEY) as api:
            allocation = await api.allocate(max_connections=2)
        # Redis replication is asynchronous: WAIT until the replica has every
        # write, so "nothing lost" is what Sentinel promises, not luck.
        master = redis.Redis(port=sentinel_set.master.port)
        assert master.execute_command("WAIT", 1, 5000) == 1

        old_port = sentinel_set.master.port
        sentinel_set.master.process.send_signal(signal.SIGKILL)
        sentinel_set.master.process.wait()

        async def promoted() -> bool:
            return sentinel_set.master_port() == sentinel_set.replica.port

        await eventually(promoted, "Sentinel promoted the replica", timeout=30)
        assert sentinel_set.master_port() != old_port

        async def store_answers() -> bool:
            try:
                return await store.get("sentinel-test:0") == b"0"
            except StoreError:
                return False  # the first command after a failover may fail

        await eventually(store_answers, "the store reached the new master", timeout=20)
        for n in range(50):
            assert await store.get(f"sentinel-test:{n}") == str(n).encode()
        # The relay API works on: a join code for the allocation made before,
        # and a new allocation.
        async with RelayApi(base, API_KEY) as api:
            code = await api.join_code(allocation.allocation_id)
            joined = await api.join(code)
            assert joined.host_connection_data == allocation.connection_data
            assert (await api.allocate(max_connections=1)).allocation_id
        assert await store.set("sentinel-test:after", b"yes")
        replica = redis.Redis(port=sentinel_set.replica.port)
        assert replica.get("sentinel-test:after") == b"yes"
    finally:
        await rt.close()
