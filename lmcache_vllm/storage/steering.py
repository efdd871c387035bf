"""What an operator steers in a `StorageManager` (the management API's calls, docs/MANAGEMENT.md): where each chunk
is (`where`), deletes from L1 and the lower tiers that respect holds unless forced (`remove`), warm-ups into L1
(`warm`: from the lower tiers, other instances' L1 through P2P included), and the periodic check of the tenants'
L1 quotas (`watch_quotas`). A mixin over `reads.LowerTierReads` (its `_locate` and `_fetch`); it uses the
manager's `l1`, `lower` and loop. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.base import StorageBackend, release_objs
from lmcache_vllm.storage.codec import ChunkSpec
from lmcache_vllm.storage.reads import LowerTierReads

logger = logging.getLogger(__name__)

QUOTA_CHECK_S = 1.0
KeyLike = Union[str, Any]  # a key string or a CacheKey (anything with to_str())


def _key_str(key: KeyLike) -> str:
    return key if isinstance(key, str) else key.to_str()


class Steering(LowerTierReads):
    # The manager's (`manager.py`).
    _loop: asyncio.AbstractEventLoop
    _closed: bool
    _quota_checks: Optional[asyncio.Task[None]]

    def watch_quotas(self) -> None:
        """Starts the periodic quota check (once; the first quota set on this instance calls it)."""
        def start() -> None:
            if self._quota_checks is None:
                self._quota_checks = self._loop.create_task(self._check_quotas())
        if not self._closed:
            self._loop.call_soon_threadsafe(start)

    async def _check_quotas(self) -> None:
        """Every `QUOTA_CHECK_S`: tenants past their L1 quota lose their least recently used chunks (a store evicts
        at once what is free then; its own chunks, still held while stored, go at the next check)."""
        while True:
            await asyncio.sleep(QUOTA_CHECK_S)
            if not self.l1.tenants.limits():
                continue
            try:
                self.l1.enforce_quotas()
            except Exception:  # never a dead loop task: the next check tries again
                logs.warn(logger, "quota_check_failed", "enforcing the L1 quotas failed", exc_info=True)

    def where(self, keys: Sequence[KeyLike], timeout: float) -> list[list[str]]:
        """The tiers of this instance holding each key: L1, then each lower tier keeping payloads (a P2P
        directory says where others are: not asked). A tier that does not answer within `timeout` holds nothing."""
        ks = [_key_str(k) for k in keys]
        out = [[self.l1.name.value] if present else [] for present in self.l1.contains_many_sync(ks)]
        tiers = [t for t in self.lower if t.holds_payloads]
        if not ks or not tiers or self._closed:
            return out

        async def ask() -> list[list[bool] | BaseException]:
            return await asyncio.wait_for(asyncio.gather(*(t.contains(ks) for t in tiers), return_exceptions=True),
                                          timeout)

        fut = asyncio.run_coroutine_threadsafe(ask(), self._loop)
        try:
            answers = fut.result(timeout + 1.0)
        except Exception:
            fut.cancel()
            metrics.inc("storage_timeouts", op="lookup")
            return out
        for tier, found in zip(tiers, answers):
            if isinstance(found, BaseException):
                continue
            for held, present in zip(out, found):
                if present:
                    held.append(tier.name.value)
        return out

    def remove(self, keys: Sequence[KeyLike], *, l1: bool, lower: bool, force: bool,
               keep: Callable[[str], bool] = lambda key: False, timeout: float = 10.0) -> tuple[int, int]:
        """Deletes `keys` from L1 (`l1`: its compressed cold part too) and/or the lower tiers that keep payloads
        (`lower`): (chunks deleted, L1 chunks skipped). Without `force`, an L1 chunk someone holds (a pin, a load,
        a send) or `keep(key)` names is skipped; with it, the chunk leaves the index at once and its memory when its
        holders let go. The lower tiers go first, so that a P2P listing kept for the disk (p2p_serve_disk) is
        withdrawn with L1's."""
        ks = [_key_str(k) for k in keys]
        deleted = skipped = 0

        def in_memory(tier: StorageBackend) -> bool:
            names = tier.name.event_names
            return names is not None and names.medium == "CPU" and names.locality == "LOCAL"

        tiers = [t for t in self.lower if t.holds_payloads and (l1 if in_memory(t) else lower)] \
            if not self._closed else []
        if tiers and ks:
            async def drop() -> int:
                count = 0
                for tier in tiers:
                    present = await tier.contains(ks)
                    for key, held in zip(ks, present):
                        if held:
                            await tier.remove(key)
                            count += 1
                return count

            fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(drop(), timeout), self._loop)
            try:
                deleted += fut.result(timeout + 1.0)
            except Exception:
                fut.cancel()
                logs.warn(logger, "management_delete_failed", "deleting from the lower tiers did not finish",
                          exc_info=True)
        if l1:
            for key in ks:
                obj = self.l1.get_sync(key)
                if obj is None:
                    continue
                busy = obj.ref_count > 2  # the index's reference and ours: anything more is someone's hold
                obj.ref_down()
                if not force and (busy or keep(key)):
                    skipped += 1
                    continue
                deleted += int(self.l1.remove_sync(key))
        return deleted, skipped

    def warm(self, keys: Sequence[KeyLike], expected: Optional[Sequence[ChunkSpec]] = None, tenant: str = "",
             timeout: float = 60.0) -> "concurrent.futures.Future[list[bool]]":
        """Starts a warm-up of `keys` into L1 (`reads._warm`); its future says which keys it brought in."""
        ks = [_key_str(k) for k in keys]
        if self._closed:
            done: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
            done.set_result([False] * len(ks))
            return done
        specs = dict(zip(ks, expected)) if expected is not None else None
        return asyncio.run_coroutine_threadsafe(self._warm(ks, specs, tenant, timeout), self._loop)

    async def _warm(self, keys: Sequence[str], expected: Optional[Mapping[str, ChunkSpec]] = None,
                    tenant: str = "", timeout: float = 60.0) -> list[bool]:
        """A warm-up (the management API's prefetch, a move's target): reads each of `keys` that L1 lacks and a
        lower tier holds (another instance's L1 through P2P included) into L1 and keeps it there, counted for
        `tenant`; each chunk brought is listed in the P2P directory as this instance's from now on (a chunk a
        peer sent is never written through to a tier others read). Which keys this call brought into L1 (False:
        in L1 already, nowhere, or a read that failed); bounded by `timeout`."""
        todo = [i for i, k in enumerate(keys) if not self.l1.contains_sync(k)]
        brought = [False] * len(keys)
        if not todo or not self.lower:
            return brought
        wanted = [keys[i] for i in todo]
        try:
            where = await asyncio.wait_for(self._locate(wanted), timeout)
        except asyncio.TimeoutError:
            metrics.inc("storage_timeouts", op="lookup")
            return brought
        found = [(i, tier) for i, tier in zip(todo, where) if tier is not None]
        if not found:
            return brought
        found_keys = [keys[i] for i, _ in found]
        objs = await asyncio.wait_for(self._fetch(found_keys, [t for _, t in found], None, expected, tenant,
                                                  keep_all=True), timeout)
        listing = [t for t in self.lower if not t.holds_payloads]  # P2P: this instance holds them now
        try:
            for (i, _), obj in zip(found, objs):
                brought[i] = self.l1.contains_sync(keys[i])
                if brought[i]:  # whichever tier it came from, peers may pull it from here now
                    for lister in listing:
                        await lister.put(keys[i], obj)
        finally:
            release_objs(objs)
        return brought
