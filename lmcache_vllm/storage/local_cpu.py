"""L1: an index from key strings to `MemoryObj`s living in the `HostAllocator` arena.

The index holds one reference on each object it stores and registers itself as the object's evictor, so
the allocator evicts least-recently-used entries when an allocation does not fit (only entries nobody
else references or pins). A `get` returns the object with an extra reference for the caller and marks
it used. All operations are synchronous and thread-safe (the engine's thread and the manager's loop
thread both call them); async wrappers satisfy `StorageBackend`. `on_removed(listener)`: `listener(key)` is
called (outside the index's lock, on whichever thread removed it) for every entry that leaves: evicted,
removed or cleared (P2P withdraws it from its directory); `on_evicted(listener)`: `listener(key, obj)` for an
evicted one while its bytes are still there.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from lmcache_vllm.memory import AllocationError, AllocFn, HostAllocator, MemoryObj, touch_all
from lmcache_vllm.observability import kv_events, metrics
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.tier import Tier


class LocalCPUBackend(StorageBackend):
    name = Tier.LOCAL_CPU

    def __init__(self, allocator: HostAllocator, *, keep_entries: bool = True):
        self.allocator = allocator
        # keep_entries=False (config local_cpu: False): the arena is only a staging area for transfers.
        self.keep_entries = keep_entries
        self._lock = threading.Lock()
        self._index: dict[str, MemoryObj] = {}
        self._key_of: dict[int, str] = {}  # id(obj) -> key, for the eviction callback
        self._removal_listeners: list[Callable[[str], None]] = []
        self._eviction_listeners: list[Callable[[str, MemoryObj], None]] = []

    def on_removed(self, listener: Callable[[str], None]) -> None:
        """`listener(key)` for every entry that leaves L1 from now on (it must not raise or block)."""
        self._removal_listeners.append(listener)

    def on_evicted(self, listener: Callable[[str, MemoryObj], None]) -> None:
        """`listener(key, obj)` when the allocator evicts an entry, on the evicting thread, before its memory is
        freed (the compressed cold part of L1 copies it out: `local_cpu_cold.py`); it must not block."""
        self._eviction_listeners.append(listener)

    def _removed(self, key: str) -> None:
        kv_events.removed(key, self.name)
        for listener in self._removal_listeners:
            listener(key)

    # ---- synchronous API (used directly by the manager) ------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, timeout: float = 0.0) -> MemoryObj:
        return self.allocator.allocate(shape, dtype, timeout=timeout)

    def try_allocate(self, shape: Sequence[int], dtype: torch.dtype) -> Optional[MemoryObj]:
        """Allocation for reads from lower tiers: never waits; None when memory is held by others."""
        try:
            return self.allocator.allocate(shape, dtype, timeout=0.0)
        except AllocationError:  # the tier being read counts it (read_alloc_failures)
            return None

    def contains_sync(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def get_sync(self, key: str) -> Optional[MemoryObj]:
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return None
            obj.ref_up()
        obj.touch()
        return obj

    def contains_many_sync(self, keys: Sequence[str]) -> list[bool]:
        """`contains_sync` of each key, under one lock."""
        with self._lock:
            return [key in self._index for key in keys]

    def get_prefix_sync(self, keys: Sequence[str]) -> list[MemoryObj]:
        """`get_sync` of the leading keys up to the first one not indexed, under one lock (a lookup's or a
        load's chunks)."""
        out: list[MemoryObj] = []
        with self._lock:
            index = self._index
            for key in keys:
                obj = index.get(key)
                if obj is None:
                    break
                out.append(obj)
            self.allocator.ref_up_all(out)  # under the index's lock: none can be evicted before
        touch_all(out)
        return out

    def put_sync(self, key: str, obj: MemoryObj) -> bool:
        """Indexes `obj` under `key` with the index's own reference; an existing entry is kept."""
        if not self.keep_entries:
            return False
        with self._lock:
            if key in self._index:
                return True  # keys name content: the stored copy is the same bytes
            obj.ref_up()
            self._index[key] = obj
            self._key_of[id(obj)] = key
        obj.set_evictor(self._on_evict)
        kv_events.stored(key, self.name)
        metrics.inc("stored_chunks", tier=self.name)
        metrics.inc("stored_bytes", obj.nbytes, tier=self.name)
        return True

    def remove_sync(self, key: str) -> bool:
        with self._lock:
            obj = self._index.pop(key, None)
            if obj is None:
                return False
            self._key_of.pop(id(obj), None)
        obj.clear_evictor()
        obj.ref_down()
        self._removed(key)
        return True

    def clear_sync(self) -> None:
        with self._lock:
            keys = list(self._index)
        for key in keys:
            self.remove_sync(key)

    def __len__(self) -> int:
        return len(self._index)

    def _on_evict(self, obj: MemoryObj) -> None:
        with self._lock:
            key = self._key_of.pop(id(obj), None)
            if key is None or self._index.get(key) is not obj:
                return  # already removed by remove_sync, which dropped the index's reference
            del self._index[key]
        metrics.inc("evictions", tier=self.name)
        for listener in self._eviction_listeners:
            listener(key, obj)
        self._removed(key)
        obj.ref_down()

    # ---- StorageBackend ----------------------------------------------------------------------
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains_sync(k) for k in keys]

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        return self.get_sync(key)

    async def put(self, key: str, obj: MemoryObj) -> bool:
        return self.put_sync(key, obj)

    async def remove(self, key: str) -> None:
        self.remove_sync(key)

    async def clear(self) -> None:
        self.clear_sync()

    async def close(self) -> None:
        self.clear_sync()

    def gauges(self) -> dict[str, float]:
        return {"resident_chunks": len(self._index), "used_bytes": self.allocator.used_bytes,
                "capacity_bytes": self.allocator.capacity}
