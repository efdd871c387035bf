"""The redis-py client for each `remote_url` form (config/remote_url.py), asynchronous for the tier and
synchronous for the admin tools and the start-up check, with the TLS settings of `extra_config`; and
`describe_failure`, which turns what redis-py raised into one line saying what to fix.

- One server (redis://, rediss://, valkey://, unix://): a blocking connection pool (more calls than
  connections wait for one). No socket timeout: a reply of many chunks may take long; every call is bounded
  by the tier instead, per chunk it moves.
- A Redis Cluster: redis-py's `RedisCluster` (slot map, MOVED/ASK, ...), no retries of its own (a failure
  is the tier's miss at once), `reinitialize_steps=0` (a MOVED patches the slot map; it never closes every
  node's connections, which would cut other nodes' calls in flight), not requiring full slot coverage, and
  a socket timeout (each reply holds at most one chunk here, and its topology refreshes must be bounded).
  Each node's pool allows twice the in-flight limit: redirects during a resharding use a second connection.
- Sentinel: redis-py's `Sentinel(...).master_for(name)`: the master is asked for on every new connection, so
  after a failover the next connection goes to the new master.
Credentials go to redis-py only: never into a log line, an error or a repr of ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisClusterException, ResponseError
from redis.retry import Retry

from lmcache_vllm.config import ExtraConfig
from lmcache_vllm.config.redact import redact_text, remember_secret, split_url
from lmcache_vllm.config.remote_url import RedisTarget, Topology, sentinel_master_name


@dataclass(frozen=True)
class ClientSettings:
    """What a client needs besides the URL: timeouts, pool size and TLS files (from `extra_config`)."""

    timeout: float = 2.0
    max_connections: int = 16
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"

    @classmethod
    def from_extra(cls, extra: ExtraConfig) -> ClientSettings:
        return cls(extra.remote_timeout_secs, extra.remote_max_connections, extra.ssl_ca_certs,
                   extra.ssl_certfile, extra.ssl_keyfile, extra.ssl_cert_reqs)

    def tls_kwargs(self, target: RedisTarget) -> dict[str, Any]:
        if not target.tls:
            return {}
        return {"ssl_ca_certs": self.ssl_ca_certs, "ssl_certfile": self.ssl_certfile,
                "ssl_keyfile": self.ssl_keyfile, "ssl_cert_reqs": self.ssl_cert_reqs,
                # 'optional' checks a certificate the server presents, its host name included (a valid
                # certificate of another host is no authentication of this one); 'none' checks nothing.
                "ssl_check_hostname": self.ssl_cert_reqs in ("required", "optional")}


def _redis_py_url(target: RedisTarget) -> str:
    """The single-server URL in redis-py's spelling (valkey:// is redis://), its user info quoted: redis-py's
    parser ends the user info at the first `/`, `?` or `#`, ours at the last `@` (config/redact.py)."""
    parts = split_url(target.url)
    assert parts is not None  # (a parsed target's URL)
    auth = ""
    if parts.userinfo is not None:
        auth = quote(target.username or "", safe="")
        if target.password is not None:
            auth += ":" + quote(target.password, safe="")
        auth += "@"
    scheme = parts.scheme.lower()
    return {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme) + "://" + auth + parts.rest


def _auth(target: RedisTarget) -> dict[str, Any]:
    return {"username": target.username, "password": target.password}


def _master_name(target: RedisTarget) -> str:
    return sentinel_master_name(target, os.environ)[0]


def async_client(target: RedisTarget, settings: ClientSettings) -> Any:
    """The tier's client (connections are made lazily, on the loop that first uses it): a
    `redis.asyncio.Redis` or `redis.asyncio.cluster.RedisCluster`. Typed Any here and in the tier: the
    installed types-redis stubs describe redis-py 4, not the redis-py 8 API used."""
    tls = settings.tls_kwargs(target)
    no_retry = AsyncRetry(NoBackoff(), 0)
    if target.topology is Topology.CLUSTER:
        return aiocluster.RedisCluster(
            startup_nodes=[aiocluster.ClusterNode(host, port) for host, port in target.nodes],
            require_full_coverage=False, reinitialize_steps=0, retry=no_retry,
            max_connections=2 * settings.max_connections, socket_timeout=settings.timeout,
            socket_connect_timeout=settings.timeout, ssl=target.tls, **tls, **_auth(target))
    if target.topology is Topology.SENTINEL:
        sentinel = AsyncSentinel(list(target.nodes), sentinel_kwargs=_sentinel_kwargs(target, settings),
                                 socket_timeout=None, socket_connect_timeout=settings.timeout, ssl=target.tls,
                                 retry=no_retry, **tls, **_auth(target))
        return sentinel.master_for(_master_name(target), db=target.db, max_connections=settings.max_connections)
    pool: Any = aioredis.BlockingConnectionPool.from_url(
        _redis_py_url(target), max_connections=settings.max_connections, timeout=settings.timeout,
        socket_timeout=None, socket_connect_timeout=settings.timeout, retry=no_retry, **tls)
    return aioredis.Redis(connection_pool=pool)


def _sentinel_kwargs(target: RedisTarget, settings: ClientSettings) -> dict[str, Any]:
    """How we talk to the Sentinels themselves: bounded, TLS when the URL says so, no data-node password."""
    return {"socket_timeout": settings.timeout, "socket_connect_timeout": settings.timeout,
            "ssl": target.tls, **settings.tls_kwargs(target)}


def sync_client(target: RedisTarget, settings: ClientSettings) -> Any:
    """A synchronous client (admin tools, the start-up check); a cluster client connects at once."""
    tls = settings.tls_kwargs(target)
    timeouts: dict[str, Any] = {"socket_timeout": settings.timeout, "socket_connect_timeout": settings.timeout}
    if target.topology is Topology.CLUSTER:
        return redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in target.nodes],
            require_full_coverage=False, retry=Retry(NoBackoff(), 0), ssl=target.tls, **timeouts, **tls,
            **_auth(target))
    if target.topology is Topology.SENTINEL:
        sentinel = redis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_kwargs(target, settings),
                                           ssl=target.tls, **timeouts, **tls, **_auth(target))
        return sentinel.master_for(_master_name(target), db=target.db)
    return redis.Redis.from_url(_redis_py_url(target), **timeouts, **tls)


def endpoint_name(target: RedisTarget) -> str:
    """The label of a single-server or Sentinel target (metrics, logs); a cluster's nodes are host:port."""
    if target.topology is Topology.UNIX:
        return f"unix:{target.unix_path}"
    if target.topology is Topology.SENTINEL:
        return f"sentinel:{_master_name(target)}"
    host, port = target.nodes[0]
    return f"{host}:{port}"


def describe_failure(exc: BaseException, target: RedisTarget) -> tuple[str, bool]:
    """(what went wrong and what to do, whether it is a misconfiguration that retrying will not fix).
    The target's password never appears in the text."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    tls_hint = "the TLS settings (rediss://, extra_config.ssl_*)"
    if isinstance(exc, AuthenticationError) or any(s in low for s in ("wrongpass", "noauth", "invalid password",
                                                                      "invalid username-password")):
        who = f"user {target.username!r}" if target.username else "the default user"
        what = (f"authentication failed for {who}: check the user and password in remote_url (Redis ACL / "
                f"requirepass)")
        fatal = True
    elif "certificate required" in low:
        what, fatal = ("the server requires a client certificate: set extra_config.ssl_certfile and "
                       "ssl_keyfile"), True
    elif "certificate verify failed" in low or "certificate_verify_failed" in low:
        what, fatal = (f"TLS: the server's certificate is not trusted (not signed by a CA in "
                       f"extra_config.ssl_ca_certs, or not issued for this host name): check {tls_hint}"), True
    elif "wrong version number" in low or "wrong_version_number" in low or "record layer failure" in low \
            or "packet length too long" in low:
        what, fatal = ("TLS handshake failed: the server does not speak TLS on this port; use redis:// (or "
                       "its TLS port)"), True
    elif target.tls and ("eof occurred in violation of protocol" in low or "unexpected eof" in low):
        what, fatal = ("the server ended the TLS connection after the handshake: it requires a client "
                       "certificate it trusts (extra_config.ssl_certfile, ssl_keyfile)"), True
    elif target.tls and "connection reset" in low:
        what, fatal = ("the server reset the TLS connection: it may require a client certificate "
                       "(extra_config.ssl_certfile, ssl_keyfile) or not speak TLS on this port"), False
    elif target.tls and "timeout connecting" in low:
        what, fatal = ("no TLS handshake within remote_timeout_secs: the server is unreachable, or the port "
                       "does not speak TLS (then use redis://)"), False
    elif target.tls is False and ("connection closed by server" in low or "connection reset" in low):
        what, fatal = ("the server closed the connection at once: if it listens with TLS (tls-port), use "
                       "rediss:// (rediss-cluster://, rediss-sentinel://)"), True
    elif isinstance(exc, RedisClusterException) and "cluster mode is not enabled" in low:
        what, fatal = "the server is not a Redis Cluster node: use redis://host:port for a single server", True
    elif isinstance(exc, redis.sentinel.MasterNotFoundError):
        name = _master_name(target)
        what, fatal = (f"no Sentinel names a master {name!r}: check the master name (…/master_name or "
                       f"REDIS_SERVICE_NAME) and that the Sentinels are up ({text})"), False
    elif isinstance(exc, ResponseError) and "unknown command" in low and "sentinel" in low:
        what, fatal = "the nodes of a redis-sentinel:// URL must be Sentinels (port 26379 by default)", True
    else:
        what, fatal = f"unreachable ({text})", False
    remember_secret(target.password)
    return redact_text(what), fatal


def preflight(target: RedisTarget, settings: ClientSettings) -> tuple[str, bool] | None:
    """Connects once, synchronously, and PINGs (every primary of a cluster); also refuses a single-server
    URL naming a cluster node (most keys would answer MOVED). None when everything answered, else
    `describe_failure`'s (text, fatal)."""
    client = None
    try:
        client = sync_client(target, settings)
        if isinstance(client, redis.cluster.RedisCluster):
            client.ping(target_nodes=redis.cluster.RedisCluster.PRIMARIES)
            return None
        client.ping()
        if target.topology in (Topology.SINGLE, Topology.UNIX):
            info = client.info("cluster")
            if isinstance(info, dict) and info.get("cluster_enabled"):
                return (f"{endpoint_name(target)} is a node of a Redis Cluster: use "
                        f"redis-cluster://{endpoint_name(target)} (a single-server URL gets MOVED for most "
                        f"keys)"), True
        return None
    except Exception as exc:  # anything redis-py raises is described, never propagated
        return describe_failure(exc, target)
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a half-open client is best effort
                pass


def pool_state(client: Any) -> str:
    """A single-server client's connection pool as a log line shows it (a stalled call's diagnosis: were all
    connections taken?); other topologies say nothing. redis-py's pool keeps no public counts."""
    pool = getattr(client, "connection_pool", None)
    in_use, idle = getattr(pool, "_in_use_connections", None), getattr(pool, "_available_connections", None)
    if in_use is None or idle is None:
        return "pool: -"
    return f"pool: {len(in_use)} in use, {len(idle)} idle, at most {getattr(pool, 'max_connections', '?')}"
