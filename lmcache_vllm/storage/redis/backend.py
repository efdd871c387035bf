"""L3: chunks in Redis (`redis.asyncio`, hiredis parser), shared between processes and hosts: one server, a
Redis Cluster, or the master a set of Sentinels names (`remote_url`, see config/remote_url.py and
docs/SCALING.md), with TLS and ACL users.

- One Redis key per chunk: `<prefix><key string>` (no hash tags: in a cluster the chunks of one prompt spread
  over the shards); value = codec bytes (header + payload) written by a single SET (atomic: readers see the
  old value or the whole new one), with an optional TTL.
- Batched reads, per node (`topology.py`): per read group (default 1) one connection and one pipeline
  (MGETs of `read_batch_keys` keys on one server; GETs in a cluster, whose keys live in different slots);
  each batch's values are decoded (copy into allocator memory + checksum) on a decode thread while the next
  replies are read, which hides the decode behind the transfer. Existence checks are one pipeline of
  EXISTS per node. A redirect (MOVED/ASK during a resharding) is re-sent through redis-py, which follows it.
- Writes: the value is encoded (coded with `remote_serde`, copy + checksum) on the codec thread, never on the
  event loop; a key already present is not written again (one EXISTS first: a shared pool often has it already).
  Reads decode every codec (the header names it), on the decode thread.
- Every call has a timeout, scaled by what it moves: `remote_timeout_secs` per chunk, so one reply of 8
  chunks may take 8 times as long as a single chunk's, and a large legitimate read is never taken for a
  dead server. Each node has its own circuit breaker and in-flight limit (`guard.py`): a node that fails
  makes only its own keys misses (counted) and its writes dropped, while the others keep serving.
- At start the tier connects once (`client.preflight`): a wrong password, a wrong CA, a plain client at a
  TLS port is one clear error in the log (no credentials), and the tier then answers misses: never a crash.
- Bytes that do not decode as a chunk for the key asked for are a miss; the Redis key is deleted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis.asyncio.cluster as aiocluster
from redis.exceptions import RedisError

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.config.redact import redact_text, remember_secret
from lmcache_vllm.config.remote_url import is_mooncake_url, parse_remote_url
from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.base import StorageBackend, gather_owned, release_objs
from lmcache_vllm.storage.redis.client import ClientSettings, async_client, endpoint_name, preflight
from lmcache_vllm.storage.redis.guard import CALL_ERRORS, CallFailed, NodeGuard
from lmcache_vllm.storage.redis.topology import REDIRECTS, Cluster, Route, Standalone, read_reply
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

Decoded = list[tuple[MemoryObj | None, str]]  # per key: the object (or None) and what happened


def _release_decoded(fut: Any) -> None:
    """Done callback (asyncio or concurrent future) freeing the objects of an abandoned decode."""
    if fut.cancelled() or fut.exception() is not None:
        return
    release_objs(obj for obj, _ in fut.result())


def _is_redis(config: LMCacheConfig) -> bool:
    """Whether `remote_url` names Redis (not LMCache's mooncakestore://, the Mooncake tier's)."""
    return bool(config.remote_url) and not is_mooncake_url(config.remote_url or "")


def glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisBackend(StorageBackend):
    name = Tier.REDIS

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Callable[[str], bool] | None = None,
                    mac: codec.ChunkMac | None = None) -> RedisBackend | None:
        return cls(config, mac=mac) if _is_redis(config) else None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> str | None:
        return "every instance and anyone who can reach the Redis server writes it" if _is_redis(config) else None

    def __init__(self, config: LMCacheConfig, *, mac: codec.ChunkMac | None = None,
                 breaker_base_secs: float = 0.5, check_at_start: bool = True):
        """The Redis named by `config.remote_url`, with the `extra_config.remote_*` and `ssl_*` settings;
        `mac`: the keyed MAC of every chunk written and required of every chunk read; `breaker_base_secs`:
        a node's first pause after a failure (it doubles up to `remote_breaker_max_secs`);
        `check_at_start`: connect once now and log what is wrong (see the module docstring)."""
        extra = config.extra_config
        if not config.remote_url:
            raise ValueError("RedisBackend needs remote_url")
        self.target = parse_remote_url(config.remote_url)
        remember_secret(self.target.password)  # redacted from any text we show from now on
        self.location = self.target.display()  # the URL without its password
        self.mac = mac
        self.serde = config.remote_serde  # the codec of the values it writes (it reads every codec)
        self.prefix = extra.remote_key_prefix
        self.ttl_ms = int(extra.remote_ttl_secs * 1000) if extra.remote_ttl_secs else None
        self.timeout = extra.remote_timeout_secs
        self.read_groups = extra.remote_read_groups
        self.read_batch_keys = extra.remote_read_batch_keys
        # Decoding and encoding (coder, memmove, xxh3: all without the GIL) overlap the loop's socket I/O instead
        # of stalling it: one decode thread (it decodes a batch while the next arrives), an encode thread per
        # concurrent write-through (`write_workers`: lossless codes at ~0.45 GB/s per core).
        self._decode_pool, self._encode_pool = (
            ThreadPoolExecutor(n, thread_name_prefix=f"lmcache-redis-{job}", initializer=enter_background_cpus)
            for job, n in (("decode", 1), ("encode", extra.write_workers)))
        settings = ClientSettings.from_extra(extra)

        def make_guard(name: str, on_failure: Any = None) -> NodeGuard:
            return NodeGuard(name, base_secs=breaker_base_secs, max_secs=extra.remote_breaker_max_secs,
                             max_inflight=extra.remote_max_connections, slot_wait_secs=self.timeout,
                             on_failure=on_failure)

        # Connections are made lazily on the loop that first uses the client (the manager's loop).
        self._client: Any = async_client(self.target, settings)
        self.topology: Standalone | Cluster
        if isinstance(self._client, aiocluster.RedisCluster):
            self.topology = Cluster(self._client, "cluster", make_guard, refresh_secs=breaker_base_secs,
                                    timeout=self.timeout)
        else:
            self.topology = Standalone(self._client, endpoint_name(self.target), make_guard)
        self.start_problem: str | None = None
        if check_at_start:
            self._check_at_start(settings)
        self._unregister_gauges = metrics.register_gauges(self._node_gauges)

    def __repr__(self) -> str:
        return f"RedisBackend({self.location!r}, prefix={self.prefix!r})"

    def _check_at_start(self, settings: ClientSettings) -> None:
        found = preflight(self.target, settings)
        if found is None:
            return
        self.start_problem, fatal = found
        if fatal:
            logger.error("lmcache-vllm: the Redis tier %s cannot be used: %s. Until this is fixed every read "
                         "is a miss and every write is dropped (counted); inference goes on.", self.location,
                         self.start_problem)
        else:
            logger.warning("lmcache-vllm: the Redis tier %s does not answer at start-up: %s; its calls are "
                           "misses until it does", self.location, self.start_problem)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def breaker_open(self) -> bool:
        """Whether some node's breaker is open (its keys are misses)."""
        return any(guard.is_open for guard in self.topology.guards())

    def gauges(self) -> dict[str, float]:
        return {"breaker_open": int(self.breaker_open), "unprotected_shared_tier": int(self.mac is None)}

    def _node_gauges(self) -> Iterator[tuple[str, dict[str, Any], float]]:
        for guard in self.topology.guards():
            yield "redis_node_breaker_open", {"node": guard.name}, int(guard.is_open)

    def _rkey(self, key: str) -> str:
        return self.prefix + key

    # ---- reads ------------------------------------------------------------------------------------
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        found = [False] * len(keys)

        async def check(route: Route) -> None:
            async def run() -> list[Any]:
                async with self.topology.connection(route, self.timeout) as conn:
                    await conn.send_packed_command(conn.pack_commands([("EXISTS", rkeys[i]) for i in route.indices]))
                    return [await read_reply(conn) for _ in route.indices]
            try:
                replies = await route.guard.call(run, self.timeout)
            except CallFailed:
                metrics.inc("failed_reads", tier=self.name)
                return
            for i, reply in zip(route.indices, replies):
                if isinstance(reply, REDIRECTS):
                    reply = await self._redirected(route, "EXISTS", rkeys[i])
                found[i] = bool(reply) and not isinstance(reply, BaseException)

        routes = await self.topology.routes(rkeys)
        if sum(len(r.indices) for r in routes) < len(keys):  # keys of slots no node serves now
            metrics.inc("failed_reads", tier=self.name)
        await asyncio.gather(*(check(route) for route in routes))
        return found

    async def _redirected(self, route: Route, *command: Any) -> Any:
        """`command` re-sent through redis-py's cluster client, which follows MOVED/ASK (and patches its
        slot map); the reply, or the exception it ended with."""
        metrics.inc("redis_node_redirects", node=route.guard.name)
        try:
            return await asyncio.wait_for(self._client.execute_command(*command), self.timeout)
        except (*CALL_ERRORS, *REDIRECTS) as exc:
            return exc

    async def get(self, key: str, alloc: AllocFn) -> MemoryObj | None:
        return (await self.get_many([key], alloc))[0]

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[MemoryObj | None]:
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        routes = await self.topology.routes(rkeys)
        spans: list[tuple[Route, list[int]]] = []
        for route in routes:  # each node's share in up to `read_groups` groups, one connection each
            groups = min(self.read_groups, len(route.indices))
            step = -(-len(route.indices) // groups)
            spans += [(route, route.indices[i:i + step]) for i in range(0, len(route.indices), step)]
        # Each reply is bounded in `_read_span` by its own number of chunks.
        decoded = await gather_owned((self._read_span(route, idx, keys, rkeys, alloc) for route, idx in spans),
                                     release=_release_decoded)
        out: list[MemoryObj | None] = [None] * len(keys)
        failed_nodes = set()
        corrupt: list[str] = []
        redirected: list[tuple[Route, int]] = []
        for (route, idx), group in zip(spans, decoded):
            if group is None:  # the node failed or its breaker is open: its keys are misses
                failed_nodes.add(route.guard.name)
                continue
            hits = 0
            for i, (obj, outcome) in zip(idx, group):
                out[i] = obj
                if outcome == "hits":
                    hits += 1
                elif outcome == "redirect":
                    redirected.append((route, i))
                else:
                    self._count(outcome, route.guard.name, keys[i], corrupt)
            metrics.inc("redis_node_read_chunks", hits, node=route.guard.name)  # once per span, not per chunk
        if sum(len(idx) for _, idx in spans) < len(keys):
            failed_nodes.add("")  # keys of slots no node serves now
        for _ in failed_nodes:
            metrics.inc("failed_reads", tier=self.name)
        for route, i in redirected:
            out[i] = await self._get_redirected(route, keys[i], rkeys[i], alloc, corrupt)
        for key in corrupt:
            await self.remove(key)
        return out

    def _count(self, outcome: str, node: str, key: str, corrupt: list[str]) -> None:
        if outcome == "hits":
            metrics.inc("redis_node_read_chunks", node=node)
        elif outcome == "corrupt":
            metrics.inc("corrupt_chunks", tier=self.name)
            corrupt.append(key)
        elif outcome == "alloc_failures":
            metrics.inc("read_alloc_failures", tier=self.name)

    async def _get_redirected(self, route: Route, key: str, rkey: str, alloc: AllocFn,
                              corrupt: list[str]) -> MemoryObj | None:
        value = await self._redirected(route, "GET", rkey)
        if isinstance(value, BaseException):
            metrics.inc("failed_reads", tier=self.name)
            return None
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._decode_pool, self._decode_batch, [key], [value], alloc)
        try:
            ((obj, outcome),) = await fut
        except BaseException:
            fut.add_done_callback(_release_decoded)
            raise
        self._count(outcome, route.guard.name, key, corrupt)
        return obj

    async def _read_span(self, route: Route, idx: list[int], keys: Sequence[str], rkeys: Sequence[str],
                         alloc: AllocFn) -> Decoded | None:
        """One connection to the route's node, one pipeline: every batch of `read_batch_keys` replies is
        decoded on the decode thread as soon as it is in, while the following replies are still being read,
        so the copy into `alloc` memory and the checksum hide behind the transfer. None when the node failed
        (or its breaker is open)."""
        span_keys = [keys[i] for i in idx]
        span_rkeys = [rkeys[i] for i in idx]
        step = self.read_batch_keys
        batches = [range(i, min(i + step, len(idx))) for i in range(0, len(idx), step)]
        per_key = self.topology.per_key_commands
        decoding: list[Future[Decoded]] = []

        async def read() -> None:
            async with self.topology.connection(route, self.timeout) as conn:
                commands = [("GET", rk) for rk in span_rkeys] if per_key else \
                    [("MGET", *span_rkeys[b.start:b.stop]) for b in batches]
                await conn.send_packed_command(conn.pack_commands(commands))
                for b in batches:
                    async with asyncio.timeout(self.timeout * len(b)):
                        if per_key:
                            values = [await read_reply(conn) for _ in b]
                        else:
                            values = await conn.read_response()
                    if not isinstance(values, list) or len(values) != len(b):
                        raise RedisError(f"MGET of {len(b)} keys answered {type(values).__name__}")
                    decoding.append(self._decode_pool.submit(self._decode_batch, span_keys[b.start:b.stop],
                                                             values, alloc))
        try:
            await route.guard.call(read, None)
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in decoding))
        except BaseException as exc:
            # Decodes already running (or done) hand their objects to the release callback.
            for fut in decoding:
                if not fut.cancel():
                    fut.add_done_callback(_release_decoded)
            if isinstance(exc, CallFailed):
                return None
            raise
        return [item for batch_result in results for item in batch_result]

    def _decode_batch(self, keys: Sequence[str], values: list[Any], alloc: AllocFn) -> Decoded:
        """Runs on the decode thread; returns (MemoryObj or None, what happened) per key."""
        out: Decoded = []
        try:
            for key, value in zip(keys, values):
                if value is None:
                    out.append((None, "misses"))
                    continue
                if isinstance(value, BaseException):  # a redirect: read again through redis-py
                    out.append((None, "redirect"))
                    continue
                try:
                    obj = codec.decode(value, key, alloc, self.mac)
                except codec.CorruptEntry as exc:
                    logs.warn(logger, "redis_corrupt", "corrupt redis value under %r: %s; deleting it",
                              self._rkey(key), exc)
                    out.append((None, "corrupt"))
                    continue
                out.append((obj, "hits" if obj is not None else "alloc_failures"))
        except BaseException:
            release_objs(obj for obj, _ in out)
            raise
        return out

    # ---- writes -----------------------------------------------------------------------------------
    async def put(self, key: str, obj: MemoryObj) -> bool:
        rkey = self._rkey(key)
        try:
            guard = await self.topology.guard_of(rkey)
            present = await guard.call(lambda: self._client.exists(rkey), self.timeout)
        except CallFailed:  # the check failed: so would the write
            metrics.inc("failed_writes", tier=self.name)
            return False
        if present:
            return True  # already in the pool (another instance, or written before L1 evicted it)
        value = await asyncio.get_running_loop().run_in_executor(
            self._encode_pool, functools.partial(codec.encode, key, obj.tensor, self.mac, coder=self.serde))
        try:
            ok = await guard.call(lambda: self._client.set(rkey, value, px=self.ttl_ms), self.timeout)
        except CallFailed:
            ok = False
        if ok:
            kv_events.stored(key, self.name)
            metrics.inc("stored_chunks", tier=self.name)
            metrics.inc("stored_bytes", obj.nbytes, tier=self.name)
            header = codec.parse_header(value)
            metrics.inc("coded_bytes", header.payload_len, tier=self.name, codec=header.coder_name)
            metrics.inc("redis_node_stored_chunks", node=guard.name)
        else:
            metrics.inc("failed_writes", tier=self.name)
        return bool(ok)

    async def put_bytes(self, key: str, value: bytes) -> bool:
        """Stores raw bytes under a key (tests and tools: e.g. to plant a corrupt value)."""
        rkey = self._rkey(key)
        try:
            guard = await self.topology.guard_of(rkey)
            return bool(await guard.call(lambda: self._client.set(rkey, value), self.timeout))
        except CallFailed:
            return False

    async def remove(self, key: str) -> None:
        rkey = self._rkey(key)
        try:
            guard = await self.topology.guard_of(rkey)
            if await guard.call(lambda: self._client.delete(rkey), self.timeout):
                kv_events.removed(key, self.name)
        except CallFailed:
            pass

    async def clear(self) -> bool:
        """Removes every key under the prefix (SCAN on every node, UNLINK); False if a node failed."""
        try:
            async for rkeys in self.topology.scan(glob_escape(self.prefix) + "*"):
                await asyncio.wait_for(self._client.unlink(*rkeys), self.timeout * 10)
                for rkey in rkeys:
                    kv_events.removed(rkey.decode("utf-8", "replace")[len(self.prefix):], self.name)
        except CALL_ERRORS as exc:
            logger.warning("clearing redis %s failed: %s: %s", self.location, type(exc).__name__, redact_text(str(exc)))
            return False
        return True

    async def ping(self) -> bool:
        """Whether every node answers PING."""
        try:
            if isinstance(self.topology, Cluster):
                await self.topology.ready()
                for node in self._client.get_primaries():
                    guard = await self.topology.guard_of_node(node.name)
                    await guard.call(functools.partial(self._client.ping, target_nodes=node), self.timeout)
            else:
                await self.topology.guard.call(self._client.ping, self.timeout)
        except CallFailed:
            return False
        return True

    async def close(self) -> None:
        self._unregister_gauges()
        try:
            await self.topology.close()
        except Exception:  # closing sockets of a dead server must not fail shutdown
            logger.debug("redis close", exc_info=True)
        self._decode_pool.shutdown(wait=True)
        self._encode_pool.shutdown(wait=True)
