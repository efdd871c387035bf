"""How `StorageManager` reads its lower tiers (L2 disk, L3 Redis), on its event loop: `_locate` (which
tier holds each key, one batched existence check per tier), `_fetch` (read the longest lower-tier prefix
into L1 memory and promote it), `_prefetch` (phase two of a prefetch: locate, tell the handle, read,
hold). A prefetch may put a per-request tier in front of the lower ones (a prefill instance's transfer
server, `transfer/client.py`): what it does not serve is then looked for in the lower tiers. With `expected`
(key -> the shape and dtype its chunk must have, from the engine's layout) every tier allocates only what
the key's chunk is (`codec.ExpectedAlloc`): a header claiming more is a corrupt entry, not an allocation.
A mixin: it uses the manager's `lower`, `l1`, `_holds` and `lookup_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.base import Handoff, StorageBackend, gather_owned, release_objs
from lmcache_vllm.storage.codec import ChunkSpec, ExpectedAlloc
from lmcache_vllm.storage.prefetch import Located, PrefetchHandle
from lmcache_vllm.storage.tier import Tier

if TYPE_CHECKING:
    from lmcache_vllm.storage.local_cpu import LocalCPUBackend
    from lmcache_vllm.storage.prefetch import PrefetchHolds

logger = logging.getLogger(__name__)


def _located_prefix(where: Sequence[Optional[StorageBackend]]) -> list[StorageBackend]:
    """The tiers of the leading keys that some tier holds (up to the first key found nowhere)."""
    prefix: list[StorageBackend] = []
    for tier in where:
        if tier is None:
            break
        prefix.append(tier)
    return prefix


class LowerTierReads:
    # The manager's, set in `StorageManager.__init__`.
    lower: list[StorageBackend]
    l1: LocalCPUBackend
    lookup_timeout: float
    _holds: PrefetchHolds

    async def _locate(self, keys: Sequence[str],
                      tiers: Optional[Sequence[StorageBackend]] = None) -> list[Optional[StorageBackend]]:
        """For each key the first of `tiers` (default: the lower tiers) holding it (None: nowhere); one
        batch per tier."""
        where: list[Optional[StorageBackend]] = [None] * len(keys)
        unknown = list(range(len(keys)))
        for tier in self.lower if tiers is None else tiers:
            if not unknown:
                break
            try:
                found = await tier.contains([keys[i] for i in unknown])
            except Exception as exc:
                logs.warn(logger, f"{tier.name}_contains_failed", "%s contains failed: %r", tier.name, exc)
                metrics.inc("failed_reads", tier=tier.name)
                continue
            unknown_next = []
            for i, hit in zip(unknown, found):
                if hit:
                    where[i] = tier
                else:
                    unknown_next.append(i)
            unknown = unknown_next
        return where

    async def _prefix_in_lower(self, keys: Sequence[str]) -> list[Tier]:
        return [tier.name for tier in _located_prefix(await self._locate(keys))]

    async def _fetch(self, keys: Sequence[str], where: Optional[list[Optional[StorageBackend]]] = None,
                     tiers: Optional[Sequence[StorageBackend]] = None,
                     expected: Optional[Mapping[str, ChunkSpec]] = None, tenant: str = "",
                     keep_all: bool = False) -> list[MemoryObj]:
        """Reads the longest prefix of `keys` that `tiers` (default: the lower tiers) hold into L1 memory;
        promotes (unless the tier says not to: P2P keeps a chunk where it was computed; `keep_all`: a warm-up
        keeps every chunk) as `tenant`'s; refs for the caller. `where` (from `_locate`) saves asking the tiers
        again; `expected`: see the module docstring."""
        tiers = list(self.lower if tiers is None else tiers)
        if where is None:
            where = await self._locate(keys, tiers)
        located = _located_prefix(where)
        n = len(located)
        rank = {id(tier): r for r, tier in enumerate(tiers)}  # where each key's tier stands in `tiers`
        by_tier: dict[int, list[int]] = {}
        for i in range(n):
            by_tier.setdefault(rank[id(located[i])], []).append(i)
        alloc: AllocFn = self.l1.try_allocate if expected is None else ExpectedAlloc(self.l1.try_allocate, expected)

        async def read(tier: StorageBackend, idx: list[int]) -> list[Optional[MemoryObj]]:
            t0 = time.perf_counter()
            try:
                return await tier.get_many([keys[i] for i in idx], alloc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logs.warn(logger, f"{tier.name}_get_failed", "%s get failed: %r", tier.name, exc)
                metrics.inc("failed_reads", tier=tier.name)
                return [None] * len(idx)
            finally:
                metrics.observe("tier_read_seconds", time.perf_counter() - t0, tier=tier.name)

        reading = list(by_tier)
        results = await gather_owned(read(tiers[t], by_tier[t]) for t in reading)
        objs: list[Optional[MemoryObj]] = [None] * n
        for t, got in zip(reading, results):
            for i, obj in zip(by_tier[t], got):
                objs[i] = obj
        kept: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            kept.append(obj)
        keep = len(kept)
        release_objs(objs[keep:])
        for i, obj in enumerate(kept):
            tier = located[i]
            metrics.inc("chunk_hits", tier=tier.name)
            metrics.inc("read_bytes", obj.nbytes, tier=tier.name)
            if tier.promotes or keep_all:
                self.l1.put_sync(keys[i], obj, tenant)
        for r, tier in enumerate(tiers):  # keys each tier was asked about and could not serve
            asked = sum(1 for i in range(len(keys)) if (held_by := where[i]) is None or rank[id(held_by)] > r)
            metrics.inc("chunk_misses", asked, tier=tier.name)
        return kept

    async def _fetch_into(self, keys: Sequence[str], handoff: Handoff,
                          expected: Optional[Mapping[str, ChunkSpec]] = None, tenant: str = "") -> None:
        try:
            objs: list[MemoryObj] = await self._fetch(keys, expected=expected, tenant=tenant)
        except asyncio.CancelledError:
            handoff.deliver([])
            raise
        except Exception:
            logs.warn(logger, "storage_read_failed", "storage read failed", exc_info=True)
            metrics.inc("storage_errors", op="get")
            objs = []
        handoff.deliver(objs)

    async def _prefetch(self, keys: Sequence[str], owner: int, handle: PrefetchHandle,
                        ready: int, peer: Optional[StorageBackend] = None,
                        expected: Optional[Mapping[str, ChunkSpec]] = None, tenant: str = "") -> int:
        """Phase two of a prefetch: asks the lower tiers (behind `peer`, when given) where `keys` are
        (bounded by the lookup timeout: no answer in time is no hit), tells the handle, then reads and holds
        that prefix. What `peer` does not serve is then looked for in the lower tiers. Tells the handle when
        it is over, however it ends (`handle.done()`)."""
        got = 0
        try:
            tiers = list(self.lower) if peer is None else [peer, *self.lower]
            got = await self._locate_and_fetch(keys, owner, tiers, handle, ready, expected, tenant)
            if peer is not None and got < len(keys) and self.lower:
                got += await self._locate_and_fetch(keys[got:], owner, list(self.lower), handle, None, expected,
                                                    tenant)
            return got
        finally:
            handle.finished(got)

    async def _locate_and_fetch(self, keys: Sequence[str], owner: int, tiers: list[StorageBackend],
                                handle: PrefetchHandle, ready: Optional[int] = None,
                                expected: Optional[Mapping[str, ChunkSpec]] = None, tenant: str = "") -> int:
        """Locates `keys` in `tiers`, reads and holds their longest prefix; with `ready` (the first
        round of a prefetch) tells the handle where that prefix is."""
        try:
            where = await asyncio.wait_for(self._locate(keys, tiers), self.lookup_timeout)
        except asyncio.TimeoutError:
            metrics.inc("storage_timeouts", op="lookup")
            where = [None] * len(keys)
        if handle.cancelled:
            # Before Python 3.12, wait_for returns the tiers' answer when the cancel came just as
            # they answered, swallowing it: without this check the prefetch of a request that went
            # away read every chunk into the arena anyway.
            raise asyncio.CancelledError()
        located = _located_prefix(where)
        n = len(located)
        if ready is not None:
            handle.set_located(Located((Tier.LOCAL_CPU,) * ready + tuple(tier.name for tier in located)))
        if n == 0:
            return 0
        objs = await self._fetch(keys[:n], where[:n], tiers, expected, tenant)
        for key, obj in zip(keys, objs):  # no await since the fetch: a cancel cannot come between
            self._holds.hold(owner, key, obj)
        return len(objs)
