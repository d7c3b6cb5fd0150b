"""From a ``--store`` URL to a redis-py client: plain Redis, TLS, Sentinel.

Accepted forms:

- ``redis://[[user]:password@]host[:port][/db]`` — one server.
- ``rediss://…`` — the same over TLS. Query parameters go to redis-py:
  ``?ssl_ca_certs=/etc/ssl/redis-ca.pem``, ``ssl_certfile=``/``ssl_keyfile=`` for
  client certificates, ``ssl_cert_reqs=none`` to skip verification (tests only).
- ``unix:///run/redis.sock?db=0`` — a local socket.
- ``redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db]`` —
  ask these Sentinels which server is the master of ``service`` (default
  ``mymaster``) and follow it through failovers: after a failover the next
  command fails once (a StoreError, which every caller already handles as an
  outage) and the one after reaches the new master. The password is the data
  servers'; ``?sentinel_password=`` gives the Sentinels' own when they have one.
  ``rediss+sentinel://`` talks TLS to the data servers (the Sentinels are asked
  in clear unless ``sentinel_ssl=true``).

Redis Cluster is not supported: crossroads' multi-key operations (Lua
compare-and-delete, pub/sub routing) assume one keyspace; run a master with
replicas under Sentinel instead, which is what its load needs.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from crossroads.errors import ConfigError
from crossroads.store.base import REDIS_SCHEMES

#: Sentinel's default port (redis.io, "Redis Sentinel": 26379).
SENTINEL_PORT = 26379
#: The master name in Sentinel's own example configuration.
DEFAULT_SERVICE = "mymaster"


def redis_client(url: str, **options: Any) -> aioredis.Redis:
    """A redis-py asyncio client for ``url`` (see the module docstring).

    ``options`` are connection settings (timeouts, health checks); for a plain
    URL, ``max_connections`` and ``timeout`` size a BlockingConnectionPool.

    Raises:
        ConfigError: the URL is malformed.
    """
    if url.startswith(("redis+sentinel://", "rediss+sentinel://")):
        return _sentinel_client(url, **options)
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigError(f"store: {url!r} is not a redis URL")
    pool = aioredis.BlockingConnectionPool.from_url(url, **options)
    return aioredis.Redis(connection_pool=pool)


def _sentinel_client(url: str, **options: Any) -> aioredis.Redis:
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    # netloc holds several host:port pairs, which urlsplit cannot parse itself.
    credentials, _, hosts = parts.netloc.rpartition("@")
    user, _, password = credentials.partition(":")
    sentinels = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or "]" in port:  # no port given (or a bare IPv6 address)
            host, port = item.strip(), str(SENTINEL_PORT)
        try:
            sentinels.append((host.strip("[]"), int(port)))
        except ValueError:
            raise ConfigError(f"store: bad sentinel address {item!r}") from None
    if not sentinels or not all(host for host, _ in sentinels):
        raise ConfigError("store: redis+sentinel:// needs at least one host:port")
    path = [p for p in parts.path.split("/") if p]
    service = unquote(path[0]) if path else DEFAULT_SERVICE
    try:
        db = int(path[1]) if len(path) > 1 else int(query.get("db", "0"))
    except ValueError:
        raise ConfigError(f"store: bad database number in {url!r}") from None
    # Sentinel pools are plain pools: no blocking wait for a free connection.
    options.pop("timeout", None)
    data_options: dict[str, Any] = dict(options)
    if user:
        data_options["username"] = unquote(user)
    if password:
        data_options["password"] = unquote(password)
    if parts.scheme.startswith("rediss"):
        data_options["ssl"] = True
        for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
            if key in query:
                data_options[key] = query[key]
    sentinel_options: dict[str, Any] = {
        key: options[key]
        for key in ("socket_timeout", "socket_connect_timeout")
        if key in options
    }
    if "sentinel_password" in query:
        sentinel_options["password"] = query["sentinel_password"]
    if query.get("sentinel_ssl", "").lower() in ("1", "true", "yes"):
        sentinel_options["ssl"] = True
    manager = Sentinel(  # type: ignore[no-untyped-call]
        sentinels, sentinel_kwargs=sentinel_options, **data_options
    )
    client: aioredis.Redis = manager.master_for(service, db=db)
    return client
