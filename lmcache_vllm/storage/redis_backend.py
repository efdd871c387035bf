"""L3: chunks in Redis (`redis.asyncio`, hiredis parser), shared between processes and hosts.

- URL: `redis://[user:password@]host:port/db`, `rediss://...` (TLS) or `unix:///path.sock?db=N`.
- One Redis key per chunk: `<prefix><key string>`; value = codec bytes (header + payload) written by a
  single SET (atomic: readers see the old value or the whole new one), with an optional TTL.
- Batched reads: per read group (default 1) one connection and one pipeline of MGETs of
  `read_batch_keys` keys each; each MGET's values are decoded (copy into allocator memory + checksum)
  on a decode thread while the next replies are read, which hides the decode behind the transfer.
  Existence checks are one pipeline of EXISTS.
- Writes: the value is encoded (copy + checksum) on the codec thread, never on the event loop; a key
  already present is not written again (one EXISTS first: a shared pool often has it already).
- Every call has a timeout, scaled by what it moves: `remote_timeout_secs` per chunk, so one MGET reply of 8
  chunks may take 8 times as long as a single chunk's, and a large legitimate read is never taken for a
  dead server. A connection error or timeout opens a circuit breaker: calls return misses at once (puts
  are dropped and counted) until a retry time that doubles after each failed retry, up to
  `remote_breaker_max_secs`. The first call after that time is the probe; success closes the breaker.
- Bytes that do not decode as a chunk for the key asked for are a miss; the Redis key is deleted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.memory import MemoryObj
from lmcache_vllm.config.redact import redact_text, redact_url, remember_secret, url_password
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.base import AllocFn, StorageBackend, gather_owned, release_objs
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

_DEFAULT = object()
# What decoding one key gave: the MemoryObj (None: nothing) and the counter that names the outcome.
Decoded = tuple[Optional[MemoryObj], str]


def _release_decoded(fut: Union[asyncio.Future[list[Decoded]], Future[list[Decoded]]]) -> None:
    """Done callback (asyncio or concurrent future) freeing the objects of an abandoned decode."""
    if fut.cancelled() or fut.exception() is not None:
        return
    release_objs(obj for obj, _ in fut.result())


def glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisBackend(StorageBackend):
    name = Tier.REDIS

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                    mac: Optional[codec.ChunkMac] = None) -> Optional[RedisBackend]:
        return cls(config, mac=mac) if config.remote_url else None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> Optional[str]:
        return "every instance and anyone who can reach the Redis server writes it" if config.remote_url else None

    def __init__(self, config: LMCacheConfig, *, mac: Optional[codec.ChunkMac] = None,
                 breaker_base_secs: float = 0.5):
        """The Redis named by `config.remote_url`, with the `extra_config.remote_*` settings; `mac`: the
        keyed MAC of every chunk written and required of every chunk read; `breaker_base_secs`: the
        first pause after a failure (it doubles up to `remote_breaker_max_secs`)."""
        extra = config.extra_config
        if not config.remote_url:
            raise ValueError("RedisBackend needs remote_url")
        url = config.remote_url
        self.url = url
        remember_secret(url_password(url))  # redacted from any text we show from now on
        self.mac = mac
        self.prefix = extra.remote_key_prefix
        self.ttl_ms = int(extra.remote_ttl_secs * 1000) if extra.remote_ttl_secs else None
        self.timeout = extra.remote_timeout_secs
        self.read_groups = extra.remote_read_groups
        self.read_batch_keys = extra.remote_read_batch_keys
        max_connections = extra.remote_max_connections
        # One thread each: decoding and encoding (memmove + xxh3, both without the GIL) overlap the
        # loop's socket I/O instead of stalling it.
        self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-redis-decode")
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-redis-encode")
        self.breaker_base = float(breaker_base_secs)
        self.breaker_max = extra.remote_breaker_max_secs
        self._failures = 0
        self._retry_at: Optional[float] = None  # breaker open until then (None: closed)
        self._probing = False
        # Connections are made lazily on the loop that first uses the client (the manager's loop).
        # A blocking pool: more concurrent calls than connections wait for one (bounded by the call
        # timeout) instead of failing with "too many connections".
        # No socket timeout: redis-py would apply it to a whole reply, however large; every call here
        # is bounded instead by `_call` or `_read_group`, per chunk it moves.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=self.timeout, socket_timeout=None,
            socket_connect_timeout=self.timeout, retry=Retry(NoBackoff(), 0))
        self._client = aioredis.Redis(connection_pool=pool)

    def __repr__(self) -> str:
        return f"RedisBackend({redact_url(self.url)!r}, prefix={self.prefix!r})"

    # ---- circuit breaker ------------------------------------------------------------------------
    @property
    def breaker_open(self) -> bool:
        return self._retry_at is not None

    def _may_call(self) -> bool:
        if self._retry_at is None:
            return True
        if time.monotonic() >= self._retry_at and not self._probing:
            self._probing = True
            return True
        metrics.inc("breaker_skipped_calls", tier=self.name)
        return False

    def _succeeded(self) -> None:
        if self._retry_at is not None:
            logger.info("redis at %s reachable again", redact_url(self.url))
        self._retry_at, self._failures, self._probing = None, 0, False

    def _failed(self, exc: BaseException) -> None:
        delay = min(self.breaker_max, self.breaker_base * (2 ** self._failures))
        if self._failures == 0:
            logger.warning("redis call failed (%s: %s); treating redis as down for %.1fs",
                           type(exc).__name__, redact_text(str(exc)), delay)
        self._failures += 1
        self._retry_at = time.monotonic() + delay
        self._probing = False

    async def _call(self, make_coro: Callable[[], Awaitable[Any]], default: Any = None, *, read: bool = False,
                    chunks: int = 1) -> Any:
        """Runs `make_coro()` under the breaker and a timeout of `remote_timeout_secs` per chunk it moves
        (`chunks=0`: the coroutine bounds its own waits); returns `default` on any failure. A failed
        or skipped read counts in `failed_reads` (a refused write is counted by `put`)."""
        if not self._may_call():
            if read:
                metrics.inc("failed_reads", tier=self.name)
            return default
        probe = self._retry_at is not None  # let through while open: this call is the probe
        try:
            coro = make_coro()
            result = await (asyncio.wait_for(coro, self.timeout * chunks) if chunks else coro)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            if read:
                metrics.inc("failed_reads", tier=self.name)
            self._failed(exc)
            try:
                await self._client.connection_pool.disconnect()
            except Exception:  # dropping dead sockets is best effort
                pass
            return default
        finally:
            # A probe that ended neither way (cancelled: its request was aborted, or shutdown) said
            # nothing about Redis; it must give the probe slot back, or no call would ever be let through.
            if probe and self._retry_at is not None:
                self._probing = False
        self._succeeded()
        return result

    # ---- StorageBackend ---------------------------------------------------------------------------
    def _rkey(self, key: str) -> str:
        return self.prefix + key

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        async def run() -> list[int]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(self._rkey(key))
                return await pipe.execute()

        found = await self._call(run, read=True)
        if found is None:
            return [False] * len(keys)
        return [bool(n) for n in found]

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        return (await self.get_many([key], alloc))[0]

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        if not keys:
            return []
        groups = min(self.read_groups, len(keys))
        step = -(-len(keys) // groups)
        spans = [(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        # Per group: (MemoryObj or None, counter name) per key.
        # Each MGET reply is bounded in `_read_group` by its own number of chunks.
        decoded = await self._call(
            lambda: gather_owned((self._read_group(keys[lo:hi], alloc) for lo, hi in spans),
                                 release=_release_decoded),
            default=_DEFAULT, read=True, chunks=0)
        if decoded is _DEFAULT:  # failed or breaker open: everything is a miss
            return [None] * len(keys)
        out: list[Optional[MemoryObj]] = []
        corrupt: list[str] = []
        for (lo, _), group in zip(spans, decoded):
            for i, (obj, outcome) in enumerate(group, start=lo):
                if outcome == "corrupt":
                    metrics.inc("corrupt_chunks", tier=self.name)
                    corrupt.append(keys[i])
                elif outcome == "alloc_failures":
                    metrics.inc("read_alloc_failures", tier=self.name)
                out.append(obj)
        for key in corrupt:
            await self._call(functools.partial(self._client.delete, self._rkey(key)))
            kv_events.removed(key, self.name.medium)
        return out

    async def _read_group(self, keys: Sequence[str], alloc: AllocFn) -> list[Decoded]:
        """One connection, one pipeline of MGETs of `read_batch_keys` keys each: every batch is decoded
        on the decode thread as soon as its reply is in, while the following replies are still being
        read, so the copy into `alloc` memory and the checksum hide behind the transfer."""
        pool = self._client.connection_pool
        batches = [keys[i:i + self.read_batch_keys] for i in range(0, len(keys), self.read_batch_keys)]
        decoding: list[Future[list[Decoded]]] = []
        try:
            conn = await asyncio.wait_for(pool.get_connection(),  # type: ignore[no-untyped-call]  # unannotated in redis-py
                                          self.timeout)
            try:
                await asyncio.wait_for(conn.send_packed_command(conn.pack_commands(
                    [("MGET", *(self._rkey(k) for k in batch)) for batch in batches])), self.timeout)
                for batch in batches:
                    values = await asyncio.wait_for(conn.read_response(), self.timeout * len(batch))
                    if not isinstance(values, list) or len(values) != len(batch):
                        raise RedisError(f"MGET of {len(batch)} keys answered {type(values).__name__}")
                    decoding.append(self._decode_pool.submit(self._decode_batch, batch, values, alloc))
            except BaseException:
                await conn.disconnect()  # replies may be left unread: never reuse it
                raise
            finally:
                await pool.release(conn)
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in decoding))
        except BaseException:
            # Decodes already running (or done) hand their objects to the release callback.
            for fut in decoding:
                if not fut.cancel():
                    fut.add_done_callback(_release_decoded)
            raise
        return [item for batch_result in results for item in batch_result]

    def _decode_batch(self, keys: Sequence[str], values: list[Optional[bytes]], alloc: AllocFn) -> list[Decoded]:
        """Runs on the decode thread; returns (MemoryObj or None, counter name) per key."""
        out: list[Decoded] = []
        try:
            for key, value in zip(keys, values):
                if value is None:
                    out.append((None, "misses"))
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

    async def put(self, key: str, obj: MemoryObj) -> bool:
        present = await self._call(lambda: self._client.exists(self._rkey(key)), default=None)
        if present:
            return True  # already in the pool (another instance, or written before L1 evicted it)
        if present is None:  # the check failed: so would the write
            metrics.inc("failed_writes", tier=self.name)
            return False
        value = await asyncio.get_running_loop().run_in_executor(
            self._encode_pool, codec.encode, key, obj.tensor, self.mac)
        ok = await self._call(lambda: self._client.set(self._rkey(key), value, px=self.ttl_ms),
                              default=False)
        if ok:
            kv_events.stored(key, self.name.medium)
            metrics.inc("stored_chunks", tier=self.name)
            metrics.inc("stored_bytes", obj.nbytes, tier=self.name)
        else:
            metrics.inc("failed_writes", tier=self.name)
        return bool(ok)

    async def put_bytes(self, key: str, value: bytes) -> bool:
        """Stores raw bytes under a key (tests and tools: e.g. to plant a corrupt value)."""
        return bool(await self._call(lambda: self._client.set(self._rkey(key), value), default=False))

    async def remove(self, key: str) -> None:
        if await self._call(lambda: self._client.delete(self._rkey(key))):
            kv_events.removed(key, self.name.medium)

    async def clear(self) -> bool:
        async def run() -> bool:
            batch: list[bytes] = []
            async for rkey in self._client.scan_iter(match=glob_escape(self.prefix) + "*", count=1000):
                batch.append(rkey)
                if len(batch) >= 1000:
                    await self._unlink(batch)
            await self._unlink(batch)
            return True
        return bool(await self._call(run, default=False))

    async def _unlink(self, rkeys: list[bytes]) -> None:
        if rkeys:
            await self._client.unlink(*rkeys)
            for rkey in rkeys:
                kv_events.removed(rkey.decode("utf-8", "replace")[len(self.prefix):], self.name.medium)
            rkeys.clear()

    async def ping(self) -> bool:
        return bool(await self._call(self._client.ping, default=False))

    async def close(self) -> None:
        try:
            await self._client.aclose()
            await self._client.connection_pool.disconnect()
        except Exception:  # closing sockets of a dead server must not fail shutdown
            logger.debug("redis close", exc_info=True)
        self._decode_pool.shutdown(wait=True)
        self._encode_pool.shutdown(wait=True)

    def gauges(self) -> dict[str, float]:
        return {"breaker_open": int(self.breaker_open), "unprotected_shared_tier": int(self.mac is None)}
