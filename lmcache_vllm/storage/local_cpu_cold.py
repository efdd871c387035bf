"""The cold part of L1, kept compressed (`extra_config.local_cpu_cold_fraction`): more distinct prompts in the same
host memory.

`max_local_cpu_size` is split: the arena (L1 proper, what vLLM loads from and saves through) gets `1 - fraction`
of it, this tier the rest as a byte budget of lossless-coded chunks (`codec.encode(..., coder="lossless")`:
1.47x fewer bytes on bf16 KV). It is a victim cache: a chunk enters when L1 evicts it (its bytes are copied out
on the evicting thread, one memcpy, and coded on this tier's own thread, so the arena's memory is free at
once and nothing slow runs on the thread that evicted), and leaves when it is read: a hit is decoded on this
tier's thread into L1 memory and promoted there (the manager's usual path for a lower tier's hit, asynchronous:
never in vLLM's step), so a chunk is held once, hot or cold. Over its budget it drops its least recently
entered chunks (they may still be on disk or in Redis). The manager does not write through to it
(`takes_writes`): L1 has the chunk then. Chunks waiting to be coded are bounded (`MAX_PENDING_BYTES`); beyond,
a victim is dropped (counted in `dropped_stores{reason=cold_backlog}`).
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import kv_events, metrics
from lmcache_vllm.storage import codec, coders
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.tier import Tier

if TYPE_CHECKING:
    from lmcache_vllm.storage.codec import ChunkMac
    from lmcache_vllm.storage.local_cpu import LocalCPUBackend

MAX_PENDING_BYTES = 256 << 20


def cold_bytes(config: LMCacheConfig) -> int:
    """The budget of the compressed part of L1 (0: none)."""
    if not config.local_cpu:
        return 0
    return int(config.max_local_cpu_bytes * config.extra_config.local_cpu_cold_fraction)


class ColdCPUBackend(StorageBackend):
    name = Tier.LOCAL_CPU_COLD
    takes_writes = False  # fed by L1's evictions, not by the manager's write-through

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                    mac: Optional[ChunkMac] = None) -> Optional[ColdCPUBackend]:
        budget = cold_bytes(config)
        return cls(budget) if budget > 0 else None

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()
        self._chunks: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._pending = 0  # bytes copied out of L1 and not coded yet
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-cold-l1", initializer=enter_background_cpus)
        self._closed = False

    def attach_l1(self, l1: LocalCPUBackend) -> None:
        l1.on_evicted(self._evicted)

    # ---- entering: L1's evictions ------------------------------------------------------------------
    def _evicted(self, key: str, obj: MemoryObj) -> None:
        """On the evicting thread, `obj` still alive: its bytes copied out (one memcpy), coded later."""
        nbytes = obj.nbytes
        with self._lock:
            if self._closed or self._pending + nbytes > MAX_PENDING_BYTES or nbytes > self.budget:
                metrics.inc("dropped_stores", reason="cold_backlog")
                return
            self._pending += nbytes
        copy = torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(obj.tensor.dtype).view(obj.tensor.shape)
        copy.copy_(obj.tensor)
        self._pool.submit(self._store, key, copy)

    def _store(self, key: str, tensor: torch.Tensor) -> None:
        try:
            parts = codec.encode_parts(key, tensor, coder=coders.LOSSLESS)
            value = parts.header + bytes(memoryview(parts.payload).cast("B"))
            dropped: list[str] = []
            with self._lock:
                old = self._chunks.pop(key, None)
                self._used += len(value) - (len(old) if old is not None else 0)
                self._chunks[key] = value
                while self._used > self.budget and self._chunks:
                    gone, data = self._chunks.popitem(last=False)
                    self._used -= len(data)
                    dropped.append(gone)
            metrics.inc("stored_chunks", tier=self.name)
            metrics.inc("stored_bytes", tensor.numel() * tensor.element_size(), tier=self.name)
            metrics.inc("coded_bytes", len(value) - len(parts.header), tier=self.name, codec=parts.coder)
            kv_events.stored(key, self.name)
            for gone in dropped:
                if gone != key:
                    metrics.inc("evictions", tier=self.name)
                    kv_events.removed(gone, self.name)
        finally:
            with self._lock:
                self._pending -= tensor.numel() * tensor.element_size()

    # ---- StorageBackend ----------------------------------------------------------------------------
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._chunks for key in keys]

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        with self._lock:
            value = self._chunks.get(key)
        if value is None:
            return None
        try:
            obj = await asyncio.wrap_future(self._pool.submit(codec.decode, value, key, alloc))
        except codec.CorruptEntry:  # only a bug could get here (the bytes never left this process)
            metrics.inc("corrupt_chunks", tier=self.name)
            obj = None
        else:
            if obj is None:
                metrics.inc("read_alloc_failures", tier=self.name)
                return None
        await self.remove(key)  # it leaves: promoted into L1 (one copy, hot or cold)
        return obj

    async def put(self, key: str, obj: MemoryObj) -> bool:
        return True  # (never asked: `takes_writes`) L1 holds it; it comes here when L1 evicts it

    async def remove(self, key: str) -> None:
        with self._lock:
            value = self._chunks.pop(key, None)
            if value is not None:
                self._used -= len(value)
        if value is not None:
            kv_events.removed(key, self.name)

    async def clear(self) -> None:
        with self._lock:
            keys, self._chunks, self._used = list(self._chunks), OrderedDict(), 0
        for key in keys:
            kv_events.removed(key, self.name)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        await self.clear()

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return {"resident_chunks": len(self._chunks), "used_bytes": self._used, "capacity_bytes": self.budget}
