"""`inspect`, `clear` and `ping` of an L3 Redis pool (redis-py, synchronous: one short-lived CLI call).

Chunks live under `<prefix><key string>` (see `storage/redis_backend.py`). `inspect` reads per key its
length, the first `codec.MAX_HEADER_SIZE` bytes (GETRANGE) and its idle time (OBJECT IDLETIME: Redis
keeps no write time, so "oldest/newest" are least/most recently used); `verify=True` also GETs each value
as bytes to check the payload checksum. A key under the prefix that is no chunk key is not ours (left
alone); a chunk key of this format whose value does not decode is corrupt (the tier deletes it on read). `clear`
finds keys with SCAN and removes them with UNLINK; a
namespace filter is applied to the key strings alone.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Iterator
from urllib.parse import urlparse

import redis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from lmcache_vllm.admin.report import TierReport, namespace_matches, namespace_of
from lmcache_vllm.config.redact import redact_text, redact_url
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.redis_backend import glob_escape
from lmcache_vllm.tokens import CacheKey

SCAN_BATCH = 500


def connect(url: str, timeout: float = 5.0) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


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
    try:
        header = codec.parse_header(head, key)
    except codec.CorruptEntry as exc:
        return str(exc)
    if length != header.header_len + header.payload_len:
        return f"{length} bytes, header says {header.header_len + header.payload_len}"
    if verify:
        value = client.get(rkey)
        if not isinstance(value, bytes):  # None: removed meanwhile, nothing to report
            return None
        try:
            codec.verify_payload(header, memoryview(value)[header.header_len:])
        except codec.CorruptEntry as exc:
            return str(exc)
    return None


def inspect_redis(url: str, prefix: str, *, verify: bool = False, timeout: float = 5.0) -> TierReport:
    client = connect(url, timeout)
    report = TierReport("redis", f"{redact_url(url)} prefix {prefix!r}", verified=verify,
                        time_note=" (from idle times: least / most recently used)")
    now = time.time()
    try:
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
    finally:
        client.close()
    return report


def clear_redis(url: str, prefix: str, *, namespace: str | None = None, dry_run: bool = False,
                timeout: float = 5.0) -> dict[str, int]:
    """Removes every key under `prefix` (only those of `namespace`, when given)."""
    client = connect(url, timeout)
    removed = 0
    try:
        for rkeys in _scan(client, prefix):
            if namespace is not None:
                rkeys = [k for k in rkeys
                         if namespace_matches(namespace_of(k.decode("utf-8", "replace")[len(prefix):]),
                                              namespace)]
            if rkeys and not dry_run:
                client.unlink(*rkeys)
            removed += len(rkeys)
    finally:
        client.close()
    return {"keys": removed}


def ping_redis(url: str, *, count: int = 5, timeout: float = 5.0) -> dict[str, Any]:
    """Connects (TLS and AUTH as the URL says), PINGs `count` times and reads a few INFO fields.
    `error` is set (and `ok` False) when the server cannot be reached or refuses us."""
    parsed = urlparse(url)
    out: dict[str, Any] = {"url": redact_url(url), "ok": False, "tls": parsed.scheme == "rediss",
                 "auth": "user+password" if parsed.username and parsed.password else
                 "password" if parsed.password else "none"}
    client = connect(url, timeout)
    try:
        t0 = time.perf_counter()
        client.ping()
        out["connect_ms"] = round(1000 * (time.perf_counter() - t0), 3)
        latencies = []
        for _ in range(max(1, count)):
            t0 = time.perf_counter()
            client.ping()
            latencies.append(1000 * (time.perf_counter() - t0))
        out["ping_ms"] = {"min": round(min(latencies), 3), "median": round(statistics.median(latencies), 3),
                          "max": round(max(latencies), 3)}
        info = client.info()
        out["server"] = {k: info.get(k) for k in ("redis_version", "used_memory", "maxmemory",
                                                   "maxmemory_policy", "connected_clients")}
        out["ok"] = True
    except AuthenticationError as exc:
        out["error"] = redact_text(f"authentication failed: {exc}")
        out["auth_failed"] = True
    except (RedisError, OSError) as exc:
        out["error"] = redact_text(f"{type(exc).__name__}: {exc}")
        if "SSL" in str(exc) or "certificate" in str(exc):
            out["tls_failed"] = True
    finally:
        client.close()
    return out
