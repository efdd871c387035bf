"""`LMCacheHiCacheStorage`: our tiers as SGLang's HiCache storage backend (its "L3", below SGLang's device and
host memory), loaded by SGLang's `StorageBackendFactory` by module path:

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "lmcache", "module_path": "lmcache_vllm.integration.sglang",
      "class_name": "LMCacheHiCacheStorage", "interface_v1": 1, "local_disk": "/var/cache/lmcache", ...}'

One `StorageManager` per SGLang scheduler process (one per TP rank), configured by `config.backend_config`,
keys by `keys.PageKeys`, pages addressed by `pages.HostPages`. SGLang's controller calls from its own
threads (backup, prefetch), never from the scheduler's step; every call returns within a bounded time:
- `batch_set_v1(keys, host_indices)` copies each page from SGLang's host pool into a chunk of our arena
  (`StorageManager.allocate`), stores it (`put`: L1 when configured, then the write-through to every lower tier)
  and waits, bounded by `blocking_timeout_secs`, until the lower tiers have it (`wait_written`): True per page
  that is stored. Pages go in windows of `extra_config.write_queue_depth`, so a 128-page batch is never dropped
  for want of queue room, and wait for arena room within the same bound.
- `batch_exists(keys)`: the number of leading pages some tier holds (`contains_prefix`, bounded by
  `lookup_timeout_ms`; a tier that does not answer has nothing).
- `batch_get_v1(keys, host_indices)`: the longest prefix of pages any tier holds, read into our arena
  (`StorageManager.get`: checksum, MAC, shape and dtype verified by the tiers) in windows that fit the arena,
  then copied into SGLang's pool; a page that does not verify is a miss and never touches the pool.
- the generic path (`interface_v1` off: `get` / `batch_get` / `set` / `batch_set` / `exists`) stores the same
  bytes under the same keys from and into SGLang's flat pages.
- hybrid models' sidecar pools: `hybrid.HybridPools` (the v2 calls).
A dead, slow or corrupt tier is a miss or a failed store, counted (`sglang_pages`, and the tiers' own
metrics, in SGLang's /metrics through `prometheus`), never an exception into SGLang's threads. `clear()` empties
every tier; `close()` drains the write queue (`close_drain_secs`) and stops the storage thread; `get_stats()`
gives SGLang its `StorageMetrics`. The page copies run on the calling SGLang thread with an OpenMP team of one
(`_own_thread`).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from lmcache_vllm.cpu_affinity import single_threaded_torch
from lmcache_vllm.integration.sglang import prometheus
from lmcache_vllm.integration.sglang.config import backend_config, no_tier
from lmcache_vllm.integration.sglang.hybrid import HybridPools
from lmcache_vllm.integration.sglang.keys import PageKeys, Parallelism, model_inputs, page_identity
from lmcache_vllm.integration.sglang.pages import HostPages, UnsupportedPool
from lmcache_vllm.integration.sglang.stats import CallStats
from lmcache_vllm.memory import AllocationError, MemoryObj
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.base import InstanceIdentity, release_objs
from lmcache_vllm.storage.manager import StorageManager

logger = logging.getLogger(__name__)
_thread_state = threading.local()

KV_POOL = "kv"  # SGLang's PoolName.KV: the pool `register_mem_pool_host` hands over


class PagePool:
    """One registered host pool: its pages and their keys."""

    def __init__(self, pages: HostPages, keys: PageKeys):
        self.pages = pages
        self.keys = keys


class LMCacheHiCacheStorage(HybridPools, HiCacheStorage):
    """See the module docstring. Constructed by SGLang as `LMCacheHiCacheStorage(storage_config, kwargs)`."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict[str, Any]] = None):
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("lmcache-vllm's HiCache backend does not split heads between heterogeneous TP sizes "
                             "(tp_lcm_size); serve every instance sharing its tiers at one TP size")
        self.storage_config = storage_config
        self.parallel = Parallelism.of(storage_config)
        self.config = backend_config(getattr(storage_config, "extra_config", None))
        self.manager = StorageManager(self.config)
        try:
            self._start(storage_config)
        except BaseException:
            self.manager.close()
            raise

    def _start(self, storage_config: Any) -> None:
        if not self.manager.lower and not self.config.local_cpu:
            raise no_tier()  # nothing below SGLang's host memory to store pages in
        self.timeout = self.config.blocking_timeout_secs
        self.window = max(1, self.config.extra_config.write_queue_depth)
        self.pools: dict[str, PagePool] = {}
        self.refused_pools: dict[str, str] = {}
        self.stats = CallStats(bool(getattr(storage_config, "enable_storage_metrics", False)))
        self._model_inputs = model_inputs(getattr(storage_config, "model_name", None), self.config)
        self._closed = False
        self._lock = threading.Lock()
        # Every TP rank of one SGLang server is a child of the same launcher: its pid names the instance (P2P).
        self.manager.attach_instance(InstanceIdentity(f"sglang-{socket.gethostname()}-{os.getppid()}",
                                                      self.parallel.tp_rank, self.parallel.tp_size))
        prometheus.start(str(getattr(storage_config, "model_name", "") or ""), self.parallel.tp_rank)

    # ---- registration ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = self._register(KV_POOL, mem_pool_host)
        if pool is None:
            raise UnsupportedPool(self.refused_pools[KV_POOL])  # the attach fails, with the reason
        logger.info("lmcache-vllm (SGLang): pages of %s stored under keys %s<hash> (%d bytes each; tiers: %s)",
                    KV_POOL, pool.keys.prefix, pool.pages.nbytes,
                    ", ".join(t.name.value for t in self.manager.lower) or "local_cpu only")

    def _register(self, name: str, host_pool: Any) -> Optional[PagePool]:
        try:
            pages = HostPages(host_pool, name)
        except UnsupportedPool as exc:
            self.refused_pools[name] = str(exc)
            logger.warning("lmcache-vllm (SGLang): %s; its pages are not stored", exc)
            return None
        identity = page_identity(self._model_inputs, pages, self.config.extra_config.cache_namespace)
        pool = self.pools[name] = PagePool(pages, PageKeys(identity, pages, self.parallel))
        return pool

    # ---- v1: zero-copy between SGLang's host pool and our arena ------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self.transfer(KV_POOL, "set", keys, host_indices)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self.transfer(KV_POOL, "get", keys, host_indices)

    def transfer(self, name: str, op: str, hashes: Sequence[str], host_indices: Any) -> list[bool]:
        """Stores (`op` "set") or loads ("get") the pages of pool `name` at `host_indices` under `hashes`; True
        per page done (a load: the leading run). Refused (all False) when they are not pages of that pool."""
        _own_thread()
        with self.stats.call(op) as call:
            pool = self.pools.get(name)
            starts = pool.pages.page_starts(host_indices, len(hashes)) if pool is not None else None
            if pool is None or starts is None:
                return self._refused(op, len(hashes))
            if op == "set":
                results = self._store(pool, hashes, [pool.pages.saver(s) for s in starts])
            else:
                results = self._load(pool, hashes, [pool.pages.loader(s) for s in starts])
            call.done(sum(results), pool.pages.nbytes)
            return results

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        with self.stats.call("exists"):
            pool = self.pools.get(KV_POOL)
            if pool is None:
                self._refused("exists", len(keys))
                return 0
            return self._found(pool, keys)

    # ---- the generic path: SGLang's flat pages ----------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Optional[torch.Tensor]:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) and got else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Optional[torch.Tensor]]:
        targets = list(target_locations or [])
        pool = self.pools.get(KV_POOL)
        if pool is None or len(targets) != len(keys) or not all(isinstance(t, torch.Tensor) for t in targets):
            self._refused("get", len(keys))
            return [None] * len(keys)
        _own_thread()
        with self.stats.call("get") as call:
            to_flat = pool.pages.to_flat

            def fill(i: int) -> Callable[[torch.Tensor], bool]:
                return lambda src: to_flat(src, targets[i])
            results = self._load(pool, keys, [fill(i) for i in range(len(keys))])
            call.done(sum(results), pool.pages.nbytes)
        return [t if ok else None for t, ok in zip(targets, results)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        flats = list(values or [])
        pool = self.pools.get(KV_POOL)
        if pool is None or len(flats) != len(keys) or not all(isinstance(v, torch.Tensor) for v in flats):
            self._refused("set", len(keys))
            return False
        _own_thread()
        with self.stats.call("set") as call:
            fill_flat = pool.pages.fill_flat

            def fill(i: int) -> Callable[[torch.Tensor], bool]:
                return lambda dst: fill_flat(flats[i], dst)
            results = self._store(pool, keys, [fill(i) for i in range(len(keys))])
            call.done(sum(results), pool.pages.nbytes)
        return all(results)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- our tiers ---------------------------------------------------------------------------------
    def _refused(self, op: str, n: int) -> list[bool]:
        metrics.inc("sglang_pages", n, op=op, outcome="refused")
        return [False] * n

    def _found(self, pool: PagePool, hashes: Sequence[str]) -> int:
        keys = _prefix_keys(pool, hashes)
        n = self.manager.contains_prefix(keys) if keys and not self._closed else 0
        metrics.inc("sglang_pages", n, op="exists", outcome="ok")
        metrics.inc("sglang_pages", len(hashes) - n, op="exists", outcome="missed")
        return n

    def _store(self, pool: PagePool, hashes: Sequence[str],
               fills: Sequence[Callable[[torch.Tensor], Any]]) -> list[bool]:
        """Stores page i (written into a chunk by `fills[i]`) under `hashes[i]`; True per page every lower
        tier holds (or L1, with none) within `blocking_timeout_secs`."""
        deadline = time.monotonic() + self.timeout
        results = [False] * len(hashes)
        window: list[tuple[int, str]] = []

        def drain() -> None:
            for i, key in window:
                results[i] = self.manager.wait_written([key], max(0.0, deadline - time.monotonic()))
            window.clear()

        shape, dtype = pool.pages.spec
        for i, page_hash in enumerate(hashes):
            key = pool.keys.key(page_hash)
            if key is None or self._closed:
                continue
            obj = self._allocate(shape, dtype, window, drain, deadline)
            if obj is None:
                break  # no room within the time: later pages cannot do better
            try:
                if fills[i](obj.tensor) is False:
                    continue  # not a page of this pool (a flat page of another size)
                self.manager.put(key, obj)
                window.append((i, key))
            finally:
                obj.ref_down()  # L1 and the write queue hold their own references
            if len(window) >= self.window:
                drain()
        drain()
        stored = sum(results)
        metrics.inc("sglang_pages", stored, op="set", outcome="ok")
        metrics.inc("sglang_pages", len(hashes) - stored, op="set", outcome="failed")
        return results

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, window: list[tuple[int, str]],
                  drain: Callable[[], None], deadline: float) -> Optional[MemoryObj]:
        """A chunk of the arena for one page: at once, or after the pages in flight are written, or within
        the deadline; None when the arena stays full."""
        for attempt in range(2):
            try:
                timeout = 0.0 if attempt == 0 and window else max(0.0, deadline - time.monotonic())
                return self.manager.allocate(shape, dtype, timeout=timeout)
            except AllocationError:
                if not window:
                    break
                drain()
        logger.warning("lmcache-vllm (SGLang): no arena room for a page of %s within %.1fs", shape, self.timeout)
        return None

    def _load(self, pool: PagePool, hashes: Sequence[str],
              fills: Sequence[Callable[[torch.Tensor], Any]]) -> list[bool]:
        """The longest prefix of pages any tier holds, each verified chunk handed to `fills[i]` (which copies it
        into SGLang's memory); in windows of at most half the arena, all within `blocking_timeout_secs`."""
        keys = _prefix_keys(pool, hashes)
        results = [False] * len(hashes)
        spec = pool.pages.spec
        per_window = max(1, self.manager.allocator.capacity // 2 // max(1, pool.pages.nbytes))
        deadline = time.monotonic() + self.timeout
        done = 0
        while done < len(keys) and not self._closed and time.monotonic() < deadline:
            batch = keys[done:done + per_window]
            objs = self.manager.get(batch, expected=[spec] * len(batch))
            ok = 0
            try:
                for obj in objs:
                    if tuple(obj.tensor.shape) != spec[0] or obj.tensor.dtype != spec[1] or \
                            fills[done + ok](obj.tensor) is False:
                        break
                    results[done + ok] = True
                    ok += 1
            finally:
                release_objs(objs)
            done += ok
            if ok < len(batch):
                break
        loaded = sum(results)
        metrics.inc("sglang_pages", loaded, op="get", outcome="ok")
        metrics.inc("sglang_pages", len(hashes) - loaded, op="get", outcome="missed")
        return results

    # ---- lifecycle -----------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Empties every tier (SGLang's /clear_hicache_storage_backend): all chunks under this configuration's
        disk directory and Redis key prefix, other models' included."""
        if self._closed:
            return False
        return self.manager.clear(lower_tiers=True)

    def get_stats(self) -> Any:
        return self.stats.take()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.manager.close()
        prometheus.stop()


def _own_thread() -> None:
    """The page copies of a call run on the calling thread alone (SGLang's backup or prefetch thread): an OpenMP
    team of its own would slow the model's thread down and, on a busy host, the copies too (`cpu_affinity`)."""
    if not getattr(_thread_state, "single", False):
        _thread_state.single = single_threaded_torch() or True


def _prefix_keys(pool: PagePool, hashes: Sequence[str]) -> list[str]:
    """The keys of the leading hashes that have one (a prefix ends at the first that has none)."""
    out: list[str] = []
    for page_hash in hashes:
        key = pool.keys.key(page_hash)
        if key is None:
            break
        out.append(key)
    return out
