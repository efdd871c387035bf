"""StorageManager: the tiers L1 host memory -> L2 local disk -> L3 Redis behind one synchronous facade.

The engine calls the facade from its own thread; the lower tiers run on an asyncio loop that the manager
owns on a daemon thread. Every wait is bounded, and a dead, slow or corrupt tier is a miss, never an
exception to the caller:

- `put(key, obj)` indexes `obj` in L1 at once (L1 takes its own reference; the caller keeps and later
  drops its own) and queues one write-through to the lower tiers. The queue is bounded
  (`write_queue_depth`): when it is full the store is dropped and counted; inference never waits.
- `contains(keys)` is L1 only (no I/O: the store path never waits on a slow tier). `contains_prefix(keys)`
  / `get(keys)` answer the longest run of consecutive hits from the first key, searching L1, then each
  lower tier in one batched existence check for the keys still unknown. `get` returns that prefix as
  MemoryObjs with a reference for the caller; lower-tier hits are read into memory from the L1
  allocator and promoted into L1. A chunk is visible to these only once fully written (L1 indexes a
  chunk after its bytes are in; disk renames a complete file into place; Redis SETs it whole).
- `prefetch(keys)` is the two-phase protection of a lookup's promise: it holds the L1 prefix at once,
  then asks the lower tiers where the rest is (`handle.located()`, bounded by the lookup timeout), reads
  it in the background, promotes it and *holds* it too, so L1 cannot evict any of it before the
  request's `get(keys, owner=handle.owner)`, which takes the holds over as the caller's references.
  Holds end when that `get` takes them, when the handle's `cancel()` is called (it also stops the
  reads), or after `prefetch_hold_secs`; every object read is either in L1, held, or released.
- What an operator steers (`steering.py`): where chunks are, deletes, warm-ups into L1, per-tenant quotas.
- `close()` drains queued writes for at most `close_drain_secs`, closes every backend, stops the loop
  and joins its thread and the backends' thread pools.

Config: an `LMCacheConfig` (typed and defaulted; our own knobs are `config.extra_config`, declared in
`config/extra.py`): the tier keys (see `registry.py`), `blocking_timeout_secs` (get), `lookup_timeout_ms`
(contains_prefix), `extra_config.write_queue_depth`, `write_workers`, `close_drain_secs`,
`prefetch_hold_secs`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.memory import HostAllocator, MemoryObj
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage.base import Handoff, InstanceIdentity, StorageBackend, release_objs
from lmcache_vllm.storage.codec import ChunkSpec
from lmcache_vllm.storage.local_cpu import LocalCPUBackend
from lmcache_vllm.storage.prefetch import PrefetchHandle, PrefetchHolds
from lmcache_vllm.storage.registry import build_allocator, build_lower_tiers
from lmcache_vllm.storage.steering import Steering
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.storage.writes import WriteTracker

logger = logging.getLogger(__name__)

KeyLike = Union[str, Any]  # a key string or a CacheKey (anything with to_str())


def _key_str(key: KeyLike) -> str:
    return key if isinstance(key, str) else key.to_str()


class StorageManager(Steering):
    def __init__(self, config: LMCacheConfig, *, allocator: Optional[HostAllocator] = None,
                 key_filter: Optional[Callable[[str], bool]] = None):
        extra = config.extra_config
        self.get_timeout = config.blocking_timeout_secs
        self.lookup_timeout = config.lookup_timeout_ms / 1000.0
        self.close_drain_secs = extra.close_drain_secs
        self.prefetch_hold_secs = extra.prefetch_hold_secs
        self._holds = PrefetchHolds()
        self._writes = WriteTracker()
        self._queue_depth = extra.write_queue_depth
        self._num_writers = extra.write_workers
        self._owns_allocator = allocator is None
        self.allocator = allocator if allocator is not None else build_allocator(config)
        self.l1 = LocalCPUBackend(self.allocator, keep_entries=config.local_cpu)
        self.lower: list[StorageBackend] = build_lower_tiers(config, key_filter)
        for tier in self.lower:
            tier.attach_l1(self.l1)
        self._write_tiers = [tier for tier in self.lower if tier.takes_writes]  # (L1's cold part: fed by evictions)
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="lmcache-storage-loop", daemon=True)
        self._thread.start()
        self._queue: asyncio.Queue[tuple[str, MemoryObj]] = asyncio.run_coroutine_threadsafe(
            self._make_queue(), self._loop).result()
        self._writers: list[asyncio.Task[None]] = []
        if self._write_tiers:
            for _ in range(max(1, self._num_writers)):
                self._loop.call_soon_threadsafe(self._start_writer)
        self._quota_checks: Optional[asyncio.Task[None]] = None
        self._loop.call_soon_threadsafe(self._sweep_holds)
        self._unregister_gauges = metrics.register_gauges(self._gauges)

    # ---- loop thread ------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        enter_background_cpus()  # threads this loop starts (its executor's) inherit the CPUs
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _sweep_holds(self) -> None:
        """Releases the prefetches whose hold time passed, then again in a while (on the loop: a prefetch's
        timeout at most a quarter of the hold time, and at most a second, late)."""
        self._holds.expire(time.monotonic())
        if not self._closed:
            self._loop.call_later(min(1.0, self.prefetch_hold_secs / 4), self._sweep_holds)

    async def _make_queue(self) -> asyncio.Queue[tuple[str, MemoryObj]]:
        return asyncio.Queue()

    def _start_writer(self) -> None:
        self._writers.append(self._loop.create_task(self._writer()))

    async def _put_timed(self, tier: StorageBackend, key: str, obj: MemoryObj) -> bool:
        t0 = time.perf_counter()
        ok = await tier.put(key, obj)
        metrics.observe("tier_write_seconds", time.perf_counter() - t0, tier=tier.name)
        return ok

    async def _writer(self) -> None:
        while True:
            key, obj = await self._queue.get()
            try:
                results = await asyncio.gather(*(self._put_timed(tier, key, obj) for tier in self._write_tiers),
                                               return_exceptions=True)
                for tier, result in zip(self._write_tiers, results):
                    if isinstance(result, BaseException):  # a refused write (False) the tier counted
                        logs.warn(logger, f"{tier.name}_put_failed", "%s put failed: %r", tier.name, result)
                        metrics.inc("failed_writes", tier=tier.name)
                self._writes.ended(key, all(result is True for result in results))
            except BaseException:
                self._writes.ended(key, False)
                raise
            finally:
                obj.ref_down()
                with self._lock:
                    self._pending -= 1
                self._queue.task_done()

    # ---- facade -----------------------------------------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, timeout: float = 0.0) -> MemoryObj:
        """A MemoryObj from the L1 arena (evicting LRU entries); raises memory.AllocationError when full."""
        return self.l1.allocate(shape, dtype, timeout=timeout)

    def _l1_prefix(self, keys: Sequence[str]) -> int:
        return next((i for i, k in enumerate(keys) if not self.l1.contains_sync(k)), len(keys))

    def put(self, key: KeyLike, obj: MemoryObj, tenant: str = "") -> None:
        """Stores `obj` under `key`: L1 now (counted for `tenant`, a cache_salt), lower tiers through the bounded
        write queue."""
        self.put_many([key], [obj], tenant)

    def put_many(self, keys: Sequence[KeyLike], objs: Sequence[MemoryObj], tenant: str = "") -> None:
        """`put` of each (key, object), the write-throughs handed to the loop in one call: a store's chunks wake
        the loop thread once, not once each (each wake-up takes the GIL from whoever runs, vLLM's step too)."""
        if self._closed:
            return
        queued: list[tuple[str, MemoryObj]] = []
        for key, obj in zip(keys, objs):
            k = _key_str(key)
            known = self.l1.keep_entries and self.l1.contains_sync(k)
            self.l1.put_sync(k, obj, tenant)
            if not self._write_tiers or (known and not self._writes.failed(k)):
                continue  # written through when first stored (or read from below); a failed write is retried
            with self._lock:
                if self._closed:
                    break
                if self._pending >= self._queue_depth:
                    metrics.inc("dropped_stores", reason="queue_full")
                    self._writes.ended(k, False)
                    continue
                self._pending += 1
                self._writes.started(k)
                obj.ref_up()  # the queue's reference, dropped once every lower tier has the bytes
                queued.append((k, obj))
        if queued:
            self._loop.call_soon_threadsafe(self._enqueue, queued)

    def _enqueue(self, items: list[tuple[str, MemoryObj]]) -> None:
        for item in items:
            self._queue.put_nowait(item)

    def wait_written(self, keys: Sequence[KeyLike], timeout: float) -> bool:
        """Waits until every one of `keys` is in every lower tier: the writes queued so far ended well, and
        keys with no write seen lately (stored long ago, found in L1, or dropped before any write) are
        there when the tiers are asked. False if one is not, or after `timeout` seconds."""
        if not self._write_tiers:
            return True
        deadline = time.monotonic() + timeout
        ok, unseen = self._writes.wait([_key_str(k) for k in keys], timeout)
        if not ok or not unseen:
            return ok
        if self._closed:
            return False
        fut = asyncio.run_coroutine_threadsafe(self._in_every_lower_tier(unseen), self._loop)
        try:
            return fut.result(max(0.0, deadline - time.monotonic()))
        except Exception:  # a timeout or a failing tier: not known to be written
            fut.cancel()
            return False

    async def _in_every_lower_tier(self, keys: list[str]) -> bool:
        tiers = [tier for tier in self._write_tiers if tier.holds_payloads]
        found = await asyncio.gather(*(tier.contains(keys) for tier in tiers), return_exceptions=True)
        return all(not isinstance(f, BaseException) and all(f) for f in found)

    def attach_instance(self, identity: InstanceIdentity) -> None:
        """Names the serving instance and TP rank this storage belongs to (the P2P tier advertises it and
        starts serving L1 to other instances); before it, such a tier finds and serves nothing."""
        for tier in self.lower:
            tier.attach(self.l1, identity, self.lower)

    def pin_prefix(self, keys: Sequence[KeyLike]) -> list[MemoryObj]:
        """The L1 chunks of the longest prefix of `keys` in L1, each with a reference for the caller (which
        keeps the allocator from evicting it until the caller drops it). No I/O, not counted as a hit: a
        prefill instance holds what it just stored for its decode instance (`transfer/holds.py`)."""
        out: list[MemoryObj] = []
        for k in keys:
            obj = self.l1.get_sync(_key_str(k))
            if obj is None:
                break
            out.append(obj)
        return out

    def discard(self, key: KeyLike) -> None:
        """Drops `key` from L1 (a chunk found unusable: left there, it would stay the most recently used
        entry of its key, and every later request with that prefix would find it and fail again)."""
        self.l1.remove_sync(_key_str(key))

    def contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether each key is in L1 memory: no I/O, so the store path never waits on a slow tier (a
        write-through that finds a key present in a lower tier skips it there)."""
        return self.l1.contains_many_sync([_key_str(k) for k in keys])

    def contains_prefix(self, keys: Sequence[KeyLike]) -> int:
        return len(self.prefix_tiers(keys))

    def prefix_tiers(self, keys: Sequence[KeyLike]) -> list[Tier]:
        """The tier holding each key of the longest prefix of `keys` found (L1 first, then the first
        lower tier that has it); a tier that does not answer within the lookup timeout has nothing."""
        ks = [_key_str(k) for k in keys]
        n = self._l1_prefix(ks)
        found = [self.l1.name] * n
        if n == len(ks) or not self.lower or self._closed:
            return found
        fut = asyncio.run_coroutine_threadsafe(self._prefix_in_lower(ks[n:]), self._loop)
        try:
            return found + fut.result(self.lookup_timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            metrics.inc("storage_timeouts", op="lookup")
        except Exception:
            logs.warn(logger, "storage_lookup_failed", "storage lookup failed", exc_info=True)
            metrics.inc("storage_errors", op="lookup")
        return found

    def held(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether some tier holds each key, not only a prefix (L1, then one batched check per lower tier);
        a lower tier that does not answer within the lookup timeout holds nothing."""
        ks = [_key_str(k) for k in keys]
        found = self.l1.contains_many_sync(ks)
        rest = [k for k, hit in zip(ks, found) if not hit]
        if not rest or not self.lower or self._closed:
            return found
        fut = asyncio.run_coroutine_threadsafe(self._locate(rest), self._loop)
        try:
            where = iter(fut.result(self.lookup_timeout))
        except Exception as exc:
            fut.cancel()
            timed_out = isinstance(exc, concurrent.futures.TimeoutError)
            metrics.inc("storage_timeouts" if timed_out else "storage_errors", op="lookup")
            return found
        return [hit or next(where) is not None for hit in found]

    def get(self, keys: Sequence[KeyLike], owner: Optional[int] = None,
            lower_tiers: bool = True, expected: Optional[Sequence[ChunkSpec]] = None,
            tenant: str = "") -> list[MemoryObj]:
        """The longest prefix of `keys` found in any tier; each object carries a ref for the caller.
        With `owner` (a prefetch's `handle.owner`) that prefetch's holds become the caller's refs.
        `lower_tiers=False`: memory only (a load after a prefetch never waits on a slow tier). `expected`:
        the shape and dtype of each key's chunk (reads of another are corrupt entries: `reads.py`); `tenant`:
        whose chunks promoted into L1 count as (`tenants.py`)."""
        ks = [_key_str(k) for k in keys]
        out = self._take_held(ks, owner) if owner is not None else []
        for k in ks[len(out):]:
            obj = self._holds.take(k, owner)  # a prefetch's hold becomes the caller's reference
            if obj is None:
                obj = self.l1.get_sync(k)
            if obj is None:
                break
            out.append(obj)
        metrics.inc("chunk_hits", len(out), tier=self.l1.name)
        metrics.inc("read_bytes", sum(obj.nbytes for obj in out), tier=self.l1.name)
        if len(out) == len(ks):
            return out
        metrics.inc("chunk_misses", len(ks) - len(out), tier=self.l1.name)
        if not self.lower or self._closed or not lower_tiers:
            return out
        handoff = Handoff()
        specs = dict(zip(ks, expected)) if expected is not None else None
        fut = asyncio.run_coroutine_threadsafe(self._fetch_into(ks[len(out):], handoff, specs, tenant), self._loop)
        lower = handoff.take(self.get_timeout)
        if lower is None:
            fut.cancel()
            metrics.inc("storage_timeouts", op="get")
            return out
        return out + lower

    def _take_held(self, ks: list[str], owner: int) -> list[MemoryObj]:
        """The objects `owner`'s prefetch holds for the leading keys, its holds passed to the caller (one lock
        for the whole load; L1 fills a gap); where neither has a key the run ends (holds taken past it are
        released)."""
        taken = self._holds.take_many(ks, owner)
        out: list[MemoryObj] = []
        for i, (k, obj) in enumerate(zip(ks, taken)):
            if obj is None:
                obj = self.l1.get_sync(k)
            if obj is None:
                release_objs(taken[i + 1:])
                break
            out.append(obj)
        return out

    def prefetch(self, keys: Sequence[KeyLike], peer: Optional[StorageBackend] = None,
                 expected: Optional[Sequence[ChunkSpec]] = None, tenant: str = "") -> PrefetchHandle:
        """Holds the L1 prefix of `keys` at once, then (on the loop) asks the lower tiers where the rest
        is (`handle.located()`), reads that into L1 and holds it too. Holds last until a `get` with
        `handle.owner` takes them, the handle is cancelled or `prefetch_hold_secs` pass. `peer`: a tier of
        this request only (a prefill instance's chunks, `transfer/client.py`), read before the lower tiers.
        `expected`, `tenant`: as for `get`."""
        ks = [_key_str(k) for k in keys]
        if self._closed:
            return PrefetchHandle(None, 0)
        owner = self._holds.new_owner(self.prefetch_hold_secs)  # released by the loop's sweep then (`_sweep_holds`)
        release = functools.partial(self._holds.release_owner, owner)
        found: list[MemoryObj] = []
        while len(found) < len(ks):
            found += self.l1.get_prefix_sync(ks[len(found):])  # one lock per run of L1 chunks
            if len(found) == len(ks):
                break
            shared = self._holds.share(ks[len(found)])  # not in L1 (or no L1) but held by another prefetch
            if shared is None:
                break
            found.append(shared)
        n = len(found)
        self._holds.hold_many(owner, ks[:n], found)
        if n == len(ks) or not (self.lower or peer):
            if peer is not None:  # nothing to pull: the peer may drop what it keeps for this request
                asyncio.run_coroutine_threadsafe(peer.close(), self._loop)
            return PrefetchHandle(None, n, release, owner)
        metrics.inc("prefetches")
        handle = PrefetchHandle(None, n, release, owner, lower_pending=True)
        specs = dict(zip(ks, expected)) if expected is not None else None
        handle.attach(asyncio.run_coroutine_threadsafe(self._prefetch(ks[n:], owner, handle, n, peer, specs, tenant),
                                                       self._loop))
        return handle

    def clear(self, lower_tiers: bool = True) -> bool:
        """Empties L1, prefetch holds included (and the lower tiers unless `lower_tiers` is False);
        False when a lower tier did not finish within the get timeout."""
        self._holds.release_all()
        self.l1.clear_sync()
        if not lower_tiers or self._closed or not self.lower:
            if lower_tiers and not self.lower:
                kv_events.cleared()  # every tier is empty (each chunk's removal was reported as well)
            return True
        # Gathered on the loop: its futures must belong to that loop.
        async def clear_lower() -> list[bool | None | BaseException]:
            return await asyncio.wait_for(
                asyncio.gather(*(t.clear() for t in self.lower), return_exceptions=True), self.get_timeout)

        fut = asyncio.run_coroutine_threadsafe(clear_lower(), self._loop)
        try:
            results = fut.result(self.get_timeout + 1.0)
        except Exception:
            logger.warning("clearing lower tiers did not finish", exc_info=True)
            fut.cancel()
            return False
        failed = [t.name for t, r in zip(self.lower, results) if r is False or isinstance(r, BaseException)]
        if failed:
            logger.warning("clearing %s failed", ", ".join(failed))
        else:
            kv_events.cleared()
        return not failed

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """This manager's gauges for `metrics` (read when stats are taken)."""
        yield "write_queue_pending", {}, self._pending
        yield "prefetch_held_chunks", {}, self._holds.num_held()
        for tier in [self.l1, *self.lower]:
            for name, value in tier.gauges().items():
                yield name, {"tier": tier.name}, value

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until queued write-throughs are done (tests, benchmarks, shutdown); False on timeout."""
        if self._closed or not self._write_tiers:
            return True
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._queue.join(), timeout), self._loop)
        try:
            fut.result(timeout + 1.0)
            return True
        except Exception:
            fut.cancel()
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._unregister_gauges()
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(
                self.close_drain_secs + 10.0)
        except Exception:
            logger.warning("storage shutdown did not finish cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._holds.release_all()
        self.l1.clear_sync()
        if self._owns_allocator:
            self.allocator.close()

    async def _shutdown(self) -> None:
        try:
            await asyncio.wait_for(self._queue.join(), self.close_drain_secs)
        except asyncio.TimeoutError:
            logger.warning("dropping %d queued writes at close", self._queue.qsize())
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        while not self._queue.empty():
            _, obj = self._queue.get_nowait()
            obj.ref_down()
            metrics.inc("dropped_stores", reason="shutdown")
        # Whatever else is still running on the loop (prefetches, abandoned reads) is cancelled.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for tier in self.lower:
            try:
                await asyncio.wait_for(tier.close(), 10.0)
            except Exception:
                logger.warning("closing %s failed", tier.name, exc_info=True)

    def __enter__(self) -> "StorageManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
