"""`HybridPools`: SGLang's v2 calls, for hybrid models whose host memory is a group of pools (the KV pool plus
sidecars: sliding-window KV, DSA indexer, Mamba state, ...). A dense MHA/MLA model never makes them.

Each sidecar pool registered through `register_mem_host_pool_v2` is stored like the KV pool: its pages under its
own keys (the pool's name and layout in the key, `keys.py`), one page per SGLang hash. A pool whose pages this
backend cannot address (`pages.UnsupportedPool`: a Mamba state pool, `page_unified`) is refused by name once at
registration; a request that needs it is then a miss (its pages are never stored, so SGLang recomputes), never an
error in SGLang's threads.

`batch_exists_v2` follows SGLang's hit policies (`PoolHitPolicy`), as its own file backend does:
- ALL_PAGES: every page of the KV prefix must be in the pool (a DSA indexer);
- TRAILING_PAGES: only the pages of the window before a prefix's end (`len(transfer.keys)`, at least 1: SWA,
  Mamba state) must be; each prefix length that satisfies every pool is restorable;
- BLOCK_GROUPS (compressed DeepSeek V4 pools) is not stored by this backend: such a pool never restores, and the
  hit is 0 pages.
`batch_get_v2` / `batch_set_v2` read and write each transfer's pages (per page: True, or False for a page that
is missing, does not verify, or found no room in time).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from lmcache_vllm.integration.sglang.backend import PagePool
    from lmcache_vllm.storage.manager import StorageManager

logger = logging.getLogger(__name__)

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"  # SGLang's PoolHitPolicy values


class HybridPools:
    # The backend's, set in its __init__.
    manager: StorageManager
    pools: dict[str, PagePool]
    refused_pools: dict[str, str]

    def _register(self, name: str, host_pool: Any) -> Optional[PagePool]:
        raise NotImplementedError

    def transfer(self, name: str, op: str, hashes: Sequence[str], host_indices: Any) -> list[bool]:
        raise NotImplementedError

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        registered: dict[Any, Any] = getattr(self, "registered_pools", None) or {}
        registered[host_pool_name] = host_pool
        self.registered_pools = registered
        name = str(getattr(host_pool_name, "value", host_pool_name))
        existing = self.pools.get(name)
        if existing is None or existing.pages.pool is not host_pool:
            self._register(name, host_pool)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Optional[list[Any]] = None,
                        extra_info: Any = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        kv = self.pools.get("kv")
        if kv is None or not keys:
            return PoolTransferResult(0, {}, [])
        kv_pages = _leading(self._held(kv, keys))
        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(getattr(transfer.name, "value", transfer.name))
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            pool = self.pools.get(name)
            if pool is None or policy not in (ALL_PAGES, TRAILING_PAGES):
                self._refuse_pool(name, policy)
                restorable = set()
                break
            held = self._held(pool, keys[:kv_pages])
            if policy == ALL_PAGES:
                boundary = _leading(held)
                allowed = set(range(1, boundary + 1))
            else:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {p for p in range(1, kv_pages + 1) if all(held[max(0, p - window):p])}
                boundary = max(allowed, default=0)
            if boundary:
                hits[name] = boundary
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, load=True)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._transfer_v2(transfers, load=False)

    def _transfer_v2(self, transfers: list[Any], load: bool) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = str(getattr(transfer.name, "value", transfer.name))
            if name not in self.pools:
                self._refuse_pool(name, "")
            out[name] = self.transfer(name, "get" if load else "set", list(transfer.keys or []),
                                      transfer.host_indices)
        return out

    def _held(self, pool: PagePool, hashes: Sequence[str]) -> list[bool]:
        keys = [pool.keys.key(h) for h in hashes]
        found = self.manager.held([k for k in keys if k is not None])
        it = iter(found)
        return [False if k is None else next(it) for k in keys]

    def _refuse_pool(self, name: str, policy: str) -> None:
        seen = f"{name}:{policy}"
        if seen in self.refused_pools:
            return
        reason = self.refused_pools[seen] = self.refused_pools.get(name) or (
            f"hit policy {policy!r} is not stored by this backend" if policy else "not registered")
        logger.warning("lmcache-vllm (SGLang): sidecar pool %r: %s; requests that need it recompute", name,
                           reason)


def _leading(held: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(held) if not hit), len(held))

