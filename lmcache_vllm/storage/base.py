"""The storage tier interface (`StorageBackend`) and the small types the tiers share.

Backends are asynchronous and run on the StorageManager's event loop; keys are key strings
(`CacheKey.to_str()`), values are `MemoryObj`s from the manager's `HostAllocator`. A backend never raises
for a missing, corrupt or unreachable entry: it answers a miss and counts what happened in `metrics`
(labelled with its `name`); `gauges()` reports its size and health.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Optional, Sequence, TypeVar

from lmcache_vllm.memory import AllocFn, MemoryObj, release_all

if TYPE_CHECKING:
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.storage.codec import ChunkMac
    from lmcache_vllm.storage.local_cpu import LocalCPUBackend
from lmcache_vllm.storage.tier import Tier

T = TypeVar("T")


@dataclass(frozen=True)
class InstanceIdentity:
    """Which serving instance and tensor-parallel rank a storage manager belongs to (P2P names it in its
    directory): `instance` is vLLM's engine id, the same on every rank of one instance."""

    instance: str
    tp_rank: int = 0
    tp_size: int = 1


class StorageBackend(abc.ABC):
    """One storage tier. Defaults are no-ops so that a tier only implements what it supports."""

    name: Tier  # which kind of tier this is (metric labels, logs, lookup answers)
    # False for a tier that only knows where chunks are (P2P's directory): a write-through there is not a copy
    # others can read when this instance is gone (`StorageManager.wait_written` does not wait for it).
    holds_payloads = True
    # False for a tier the manager does not write through (L1's compressed cold part: fed by L1's evictions).
    takes_writes = True
    # Whether a chunk read from this tier is promoted into L1 (P2P: only with extra_config.p2p_keep_pulled).
    promotes = True

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                    mac: Optional[ChunkMac] = None) -> Optional[StorageBackend]:
        """The tier as `config` configures it, or None when the configuration does not enable it
        (`registry.LOWER_TIERS` asks each lower tier). `key_filter(key)` says whether a chunk found in
        shared storage belongs to this process; `mac` is the keyed MAC chunks carry outside memory."""
        return None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> Optional[str]:
        """Who besides this process can write the tier `config` configures (None: nobody): such a tier
        needs a chunk MAC, or anyone who can write it plants KV the model reads (`registry`)."""
        return None

    def attach_l1(self, l1: LocalCPUBackend) -> None:
        """The manager's L1, as soon as both exist (a tier fed by L1's evictions: `local_cpu_cold.py`)."""
        return None

    def attach(self, l1: LocalCPUBackend, identity: InstanceIdentity, tiers: Sequence[StorageBackend]) -> None:
        """The manager's L1, the instance it serves and its lower tiers, once known (a tier that serves what
        this instance holds to others: P2P)."""
        return None

    @abc.abstractmethod
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Existence of each key, answered in one batch."""

    @abc.abstractmethod
    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        """The chunk under `key` in memory from `alloc` (one ref for the caller), or None on a miss."""

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        """Batched `get`; tiers with a cheaper batch path override it."""
        return [await self.get(key, alloc) for key in keys]

    @abc.abstractmethod
    async def put(self, key: str, obj: MemoryObj) -> bool:
        """Stores `obj` under `key` (the caller keeps its reference); False when the store was dropped."""

    async def remove(self, key: str) -> None:
        return None

    async def clear(self) -> bool | None:
        """Removes every entry; False when the tier could not be reached."""
        return None

    async def close(self) -> None:
        return None

    def gauges(self) -> dict[str, float]:
        """Gauge name -> value now (`used_bytes`, `capacity_bytes`, `resident_chunks`, ...)."""
        return {}


def release_objs(objs: Iterable[Optional[MemoryObj]]) -> None:
    release_all(objs)  # one lock per allocator


def _release_task_result(task: asyncio.Future[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    release_objs(result if isinstance(result, list) else [result])


async def gather_owned(coros: Iterable[Awaitable[T]],
                       release: Optional[Callable[[asyncio.Future[Any]], None]] = None) -> list[T]:
    """`asyncio.gather` for coroutines returning MemoryObjs (or lists of them) with a ref for us.

    If one fails or the gathering task is cancelled, results that complete anyway are released (by
    `release(task)`, default: every MemoryObj of the result) instead of leaked."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
            task.add_done_callback(release or _release_task_result)
        raise


class Handoff:
    """Passes MemoryObjs from the loop to a caller that may give up waiting; abandoned ones are freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._result: Optional[list[MemoryObj]] = None
        self._abandoned = False

    def deliver(self, objs: list[MemoryObj]) -> None:
        with self._lock:
            if not self._abandoned:
                self._result = objs
                self._ready.set()
                return
        release_objs(objs)

    def take(self, timeout: float) -> Optional[list[MemoryObj]]:
        self._ready.wait(timeout)
        with self._lock:
            if self._result is None:
                self._abandoned = True
                return None
            result, self._result = self._result, None
            return result
