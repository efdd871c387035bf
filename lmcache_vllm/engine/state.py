"""StateEngine: the recurrent states of a Mamba / linear-attention KV cache group, stored per prefix boundary.

Where `CacheEngine` stores the KV of every token, a state group has one state per prefix: the state after
token `boundary - 1`, kept by vLLM in one block (`layouts/state.py`: the pages of every layer of the group).
It is stored under the key of the chunk that ends at `boundary` (its digest names the whole prefix, its
group tag says it is a state), so only chunk boundaries are stored, and a lookup asks for the one state a
hit of `boundary` tokens needs. The storage is the one the group's attention engines use (shared L1).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.engine.holds import HeldPrefix
from lmcache_vllm.extra_keys import ExtraKeys
from lmcache_vllm.layouts.state import StatePageLayout
from lmcache_vllm.layouts.streams import DeferredRelease, Fence
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.codec import ChunkSpec
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.tokens import CacheKey, KeyBuilder, TokenIds

logger = logging.getLogger(__name__)


class StateEngine:
    """store / retrieve / lookup of the states of one state group (see the module docstring)."""

    def __init__(self, config: LMCacheConfig, layout: StatePageLayout, keys: KeyBuilder,
                 storage: StorageManager, caches: Sequence[torch.Tensor]):
        self.config = config
        self.layout = layout
        self.keys = keys
        self.storage = storage
        self.caches = list(caches)
        self._releases = DeferredRelease()

    def _key(self, tokens: TokenIds, boundary: int, extra: ExtraKeys | None) -> CacheKey | None:
        cs = self.keys.chunk_size
        if boundary <= 0 or boundary % cs or boundary > len(tokens):
            return None
        return self.keys.keys(tokens[:boundary], False, extra)[-1][0]

    def _spec(self) -> ChunkSpec:
        """The shape and dtype of this group's state chunks: what a read may allocate for one."""
        return (tuple(self.layout.chunk_shape()), torch.uint8)

    def _device(self) -> torch.device:
        return self.caches[0].device if self.caches else torch.device("cpu")

    def lookup_and_hold(self, tokens: TokenIds, boundary: int, extra: ExtraKeys | None = None) -> HeldPrefix:
        """Finds and holds the state at `boundary` (see `CacheEngine.lookup_and_hold`): the hit covers
        the chunk ending at `boundary` when the state is there."""
        key = self._key(tokens, boundary, extra)
        handle = self.storage.prefetch([key] if key is not None else [], expected=[self._spec()])
        cs = self.keys.chunk_size
        return HeldPrefix(handle, max(0, boundary - cs), [boundary] if key is not None else [])

    def store(self, tokens: TokenIds, states: Sequence[tuple[int, int]], extra: ExtraKeys | None = None) -> int:
        """Stores the state at each `(boundary, block)`; returns how many were newly stored."""
        self._releases.reap()
        todo = [(key, block) for key, block in ((self._key(tokens, b, extra), block) for b, block in states)
                if key is not None]
        present = self.storage.contains([key for key, _ in todo]) if todo else []
        gathered = []
        try:
            for (key, block), have in zip(todo, present):
                if have:
                    continue
                try:
                    obj = self.storage.allocate(self.layout.chunk_shape(), torch.uint8)
                except Exception as exc:  # a full arena must never break inference
                    metrics.inc("dropped_stores", reason="arena_full")
                    logs.warn(logger, "arena_full", "store of state %s dropped: %s", key.to_str(), exc)
                    break
                gathered.append((key, obj))
                self.layout.gather(self.caches, block, obj.tensor)
            Fence.record(self._device()).wait()
            for key, obj in gathered:
                self.storage.put(key, obj)
        finally:
            self._releases.add(Fence.record(self._device()), [obj.ref_down for _, obj in gathered])
        return len(gathered)

    def retrieve(self, tokens: TokenIds, boundary: int, block: int, extra: ExtraKeys | None = None,
                 owner: int | None = None,
                 lower_tiers: bool = True) -> bool:
        """Writes the state at `boundary` into block `block`; False if it is not stored (or is not a state
        of this group's shape), or `block` < 0 (vLLM gave no block for it)."""
        self._releases.reap()
        key = self._key(tokens, boundary, extra)
        if key is None or block < 0:
            return False
        objs = self.storage.get([key], owner, lower_tiers, expected=[self._spec()])
        if not objs:
            return False
        obj = objs[0]
        try:
            if tuple(obj.tensor.shape) != self.layout.chunk_shape() or obj.tensor.dtype != torch.uint8:
                metrics.inc("shape_mismatches")
                logs.warn(logger, "shape_mismatch", "state %s has shape %s %s, expected %s uint8; dropped",
                          key.to_str(), tuple(obj.tensor.shape), obj.tensor.dtype, self.layout.chunk_shape())
                self.storage.discard(key)  # (left in L1, every request with this prefix would fail on it)
                return False
            self.layout.scatter(obj.tensor, self.caches, block)
            return True
        finally:
            self._releases.add(Fence.record(self._device()), [obj.ref_down])

    def close(self) -> None:
        self._releases.drain()
