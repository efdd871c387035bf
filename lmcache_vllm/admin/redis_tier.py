"""`inspect`, `clear` and `ping` of an L3 Redis pool (redis-py, synchronous: one short-lived CLI call): one
server, every primary of a Redis Cluster (keys are scanned node by node: SCAN works per node there), or the
master a set of Sentinels names, with the tier's TLS settings (`ClientSettings`).

Chunks live under `<prefix><key string>` (see `storage/redis/backend.py`). `inspect` reads per key its
length, the first `codec.MAX_HEADER_SIZE` bytes (GETRANGE) and its idle time (OBJECT IDLETIME: Redis
keeps no write time, so "oldest/newest" are least/most recently used); `verify=True` also GETs each value
as bytes to check the payload checksum. A key under the prefix that is no chunk key is not ours (left
alone); a chunk key of this format whose value does not decode is corrupt (the tier deletes it on read).
`clear` finds keys with SCAN and removes them with UNLINK (one slot per call); a namespace filter is applied
to the key strings alone.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Iterator

import redis
import redis.cluster
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, ResponseError

from lmcache_vllm.admin.report import TierReport, namespace_matches, namespace_of
from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.redis import glob_escape
from lmcache_vllm.storage.redis.client import ClientSettings, describe_failure, endpoint_name, sync_client
from lmcache_vllm.tokens import CacheKey

SCAN_BATCH = 500
CLI_SETTINGS = ClientSettings(timeout=5.0)  # no TLS files; 5 s per call


def connect(url: str, settings: ClientSettings) -> Any:
    """The pool's client: a `redis.Redis`, or a `redis.cluster.RedisCluster` (connected at once)."""
    return sync_client(parse_remote_url(url), settings)


@contextlib.contextmanager
def node_clients(url: str, settings: ClientSettings) -> Iterator[list[tuple[str, redis.Redis]]]:
    """(name, plain client) of every node holding keys: the one server or master, or each cluster
    primary (a key SCANned on a node lives on that node, so per-node pipelines need no routing)."""
    client = connect(url, settings)
    try:
        if isinstance(client, redis.cluster.RedisCluster):
            yield [(node.name, client.get_redis_connection(node)) for node in client.get_primaries()]
        else:
            yield [(endpoint_name(parse_remote_url(url)), client)]
    finally:
        client.close()


def _scan(client: redis.Redis, prefix: str) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for rkey in client.scan_iter(match=glob_escape(prefix) + "*", count=SCAN_BATCH):
        batch.append(rkey)
        if len(batch) >= SCAN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _idle_times(client: redis.Redis, rkeys: list[bytes]) -> list[int | None]:
    pipe = client.pipeline(transaction=False)
    for rkey in rkeys:
        pipe.object("idletime", rkey)
    try:
        return list(pipe.execute(raise_on_error=False))
    except ResponseError:  # an LFU eviction policy has no idle times
        return [None] * len(rkeys)


def _judge(rkey: bytes, key: str, length: int, head: bytes, client: redis.Redis, verify: bool) -> str | None:
    """None when the value is a valid chunk for `key`, else the problem (the Redis tier would delete it)."""
    try:  # the rule the Redis tier reads by (`codec.decode`): header, then header + payload bytes exactly
        header = codec.parse_header(head, key)
        codec.check_size(header, length)
    except codec.CorruptEntry as exc:
        return str(exc)
    if verify:
        value = client.get(rkey)
        if not isinstance(value, bytes):  # None: removed meanwhile, nothing to report
            return None
        try:
            codec.verify_stored(header, memoryview(value)[header.header_len:])
        except codec.CorruptEntry as exc:
            return str(exc)
    return None


def inspect_redis(url: str, prefix: str, *, verify: bool = False,
                  settings: ClientSettings = CLI_SETTINGS) -> TierReport:
    report = TierReport("redis", f"{parse_remote_url(url).display()} prefix {prefix!r}", verified=verify,
                        time_note=" (from idle times: least / most recently used)")
    with node_clients(url, settings) as nodes:
        for name, client in nodes:
            before = report.chunks
            _inspect_node(client, prefix, verify, report)
            report.nodes[name] = report.chunks - before
    return report


def _inspect_node(client: redis.Redis, prefix: str, verify: bool, report: TierReport) -> None:
    now = time.time()
    for rkeys in _scan(client, prefix):
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.strlen(rkey)
            pipe.getrange(rkey, 0, codec.MAX_HEADER_SIZE - 1)
        replies = pipe.execute()
        idle = _idle_times(client, rkeys)
        for i, rkey in enumerate(rkeys):
            length, head = replies[2 * i], replies[2 * i + 1]
            name = rkey.decode("utf-8", "replace")
            if not length:
                continue  # removed meanwhile
            key = name[len(prefix):]
            try:
                fmt_version = CacheKey.from_str(key).fmt_version
            except ValueError:
                report.ignored += 1  # not a chunk key: nothing of ours
                continue
            if fmt_version != codec.FORMAT_VERSION:
                report.other_format += 1
                continue
            problem = _judge(rkey, key, length, head, client, verify)
            if problem is not None:
                report.add_corrupt(name, problem)
            else:
                idle_s = idle[i]
                when = now - idle_s if isinstance(idle_s, int) else None
                report.add_chunk(key, length, when)


def clear_redis(url: str, prefix: str, *, namespace: str | None = None, dry_run: bool = False,
                settings: ClientSettings = CLI_SETTINGS) -> dict[str, int]:
    """Removes every key under `prefix` (only those of `namespace`, when given), node by node."""
    removed = 0
    with node_clients(url, settings) as nodes:
        for _, client in nodes:
            for rkeys in _scan(client, prefix):
                if namespace is not None:
                    rkeys = [k for k in rkeys
                             if namespace_matches(namespace_of(k.decode("utf-8", "replace")[len(prefix):]),
                                                  namespace)]
                for slot_keys in _by_slot(rkeys):  # UNLINK of several keys: one slot each in a cluster
                    if not dry_run:
                        client.unlink(*slot_keys)
                    removed += len(slot_keys)
    return {"keys": removed}


def _by_slot(rkeys: list[bytes]) -> list[list[bytes]]:
    groups: dict[int, list[bytes]] = {}
    for rkey in rkeys:
        groups.setdefault(key_slot(rkey), []).append(rkey)
    return list(groups.values())


def ping_redis(url: str, *, count: int = 5, settings: ClientSettings = CLI_SETTINGS) -> dict[str, Any]:
    """Connects (TLS and AUTH as the URL and `settings` say), PINGs `count` times every node (each primary
    of a cluster) and reads a few INFO fields of the first. `error` is set (and `ok` False) when a node
    cannot be reached or refuses us."""
    target = parse_remote_url(url)
    out: dict[str, Any] = {"url": target.display(), "ok": False, "tls": target.tls, "topology": target.topology.value,
                 "auth": "user+password" if target.username and target.password else
                 "password" if target.password else "none"}
    try:
        t0 = time.perf_counter()
        with node_clients(url, settings) as nodes:
            latencies = []
            for i, (_, client) in enumerate(nodes):
                client.ping()
                if i == 0:
                    out["connect_ms"] = round(1000 * (time.perf_counter() - t0), 3)
                for _ in range(max(1, count)):
                    t1 = time.perf_counter()
                    client.ping()
                    latencies.append(1000 * (time.perf_counter() - t1))
            out["nodes"] = [name for name, _ in nodes]
            out["ping_ms"] = {"min": round(min(latencies), 3), "median": round(statistics.median(latencies), 3),
                              "max": round(max(latencies), 3)}
            info = nodes[0][1].info()
            out["server"] = {k: info.get(k) for k in ("redis_version", "used_memory", "maxmemory",
                                                       "maxmemory_policy", "connected_clients")}
        out["ok"] = True
    except Exception as exc:  # every failure is one described line
        out["error"], _ = describe_failure(exc, target)
        if isinstance(exc, AuthenticationError) or out["error"].startswith("authentication failed"):
            out["auth_failed"] = True
        elif "TLS" in out["error"] or "certificate" in out["error"] or "rediss://" in out["error"]:
            out["tls_failed"] = True
    return out
