"""CacheEngine: moves KV between an engine's paged KV cache and the tiered store, chunk by chunk.

It knows tokens → chunk keys (`tokens.KeyBuilder`) and paged layout → stored chunk
(`layouts.PagedKVLayout`); it knows nothing of vLLM. Prefix semantics: a chunk is only useful if every
chunk before it is present, so lookups and retrievals stop at the first miss.

On a GPU the layout's copies are only enqueued on the current stream (`layouts.streams`): a store waits for
its gathers (one fence per call, on the calling thread) before it publishes the chunks, and a retrieve hands
the chunks it read back to storage only once the stream has passed its scatters (`DeferredRelease`), so an
arena range is never reused while a copy may still read it. On the CPU both happen at once.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
from dataclasses import dataclass, field
from typing import Generator, Sequence

import numpy as np
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.engine.holds import HeldPrefix
from lmcache_vllm.extra_keys import ExtraKeys, tenant_of
from lmcache_vllm.layouts.base import PagedKVLayout
from lmcache_vllm.layouts.streams import DeferredRelease, Fence
from lmcache_vllm.memory import MemoryObj, release_all
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.codec import ChunkSpec
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.tokens import TOKEN_BYTES, CacheKey, KeyBuilder, TokenIds, token_bytes

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    key: CacheKey
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class _RetrievePlan:
    chunks: list[_Chunk] = field(default_factory=list)
    objs: list[MemoryObj] = field(default_factory=list)


def _as_bool_mask(mask: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    if mask is None:
        return torch.ones(num_tokens, dtype=torch.bool)
    mask = torch.as_tensor(mask, dtype=torch.bool).flatten()
    if mask.numel() != num_tokens:
        raise ValueError(f"mask has {mask.numel()} entries but there are {num_tokens} tokens")
    return mask


def _device(kv_caches: Sequence[torch.Tensor]) -> torch.device:
    return kv_caches[0].device if len(kv_caches) else torch.device("cpu")


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.long).flatten()
    if slot_mapping.numel() < num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.numel()} entries but {num_tokens} tokens need a slot")
    return slot_mapping


class CacheEngine:
    """store / retrieve / lookup of KV for token sequences, on plain tensors.

    `kv_caches` is the engine's per-layer list of paged KV tensors and `slot_mapping[i]` the slot of
    token i (block_id * block_size + offset; < 0 means "no slot", skipped).
    """

    def __init__(self, config: LMCacheConfig, layout: PagedKVLayout, key_builder: KeyBuilder,
                 storage: StorageManager | None = None) -> None:
        """`storage`: a StorageManager shared with other engines (the KV cache groups of one model, each
        keyed by its group tag: `key_builder.template.group`), else the engine builds its own."""
        self.config = config
        self.layout = layout
        self.keys = key_builder
        # One group of a multi-group model counts its tokens per group; the model's totals are counted once
        # by whoever drives the groups (`grouped.py`).
        self._group = key_builder.template.group
        self._owns_storage = storage is None
        self.storage = storage if storage is not None else StorageManager(config)
        self._releases = DeferredRelease()  # chunks read by copies still in flight on a GPU

    # ------------------------------------------------------------------ helpers
    def _release_after(self, kv_caches: Sequence[torch.Tensor], objs: list[MemoryObj]) -> None:
        """Drops our references on `objs` once the copies enqueued so far have passed (at once on the CPU),
        all in one call (one allocator lock)."""
        if objs:
            self._releases.add(Fence.record(_device(kv_caches)), [functools.partial(release_all, list(objs))])

    def _count(self, what: str, tokens: int) -> None:
        if self._group:
            metrics.inc(f"group_{what}_tokens", tokens, group=self._group)
        else:
            metrics.inc(f"{what}_tokens", tokens)

    def _chunks(self, tokens: TokenIds, include_partial: bool, extra: ExtraKeys | None) -> list[_Chunk]:
        return [_Chunk(key, start, end) for key, start, end in self.keys.keys(tokens, include_partial, extra)]

    def _store_chunks(self, tokens: TokenIds, mask: torch.Tensor, extra: ExtraKeys | None,
                      include_partial: bool | None = None) -> list[_Chunk]:
        """Chunks worth storing: fully inside the mask and not in L1 yet (a lower tier that has one
        already skips its write-through there). A partial last chunk with `save_unfull_chunk` (or when
        `include_partial` says so)."""
        partial = self.config.save_unfull_chunk if include_partial is None else include_partial
        chunks = self._chunks(tokens, partial, extra)
        self._note_for_events(tokens, chunks, extra)
        if not chunks:
            return []
        # Tokens outside the mask before each position, once: a chunk is stored when it has none.
        outside = np.concatenate(([0], np.cumsum(~mask.numpy(), dtype=np.int64)))
        chunks = [c for c in chunks if outside[c.end] == outside[c.start]]
        if not chunks:
            return []
        present = self.storage.contains([c.key for c in chunks])
        todo = [c for c, p in zip(chunks, present) if not p]
        metrics.inc("store_skipped_tokens", sum(c.num_tokens for c, p in zip(chunks, present) if p))
        return todo

    def _specs(self, chunks: Sequence[_Chunk]) -> list[ChunkSpec]:
        """The shape and dtype each chunk must have: what a read may allocate for it (`codec.ExpectedAlloc`)."""
        dtype = self.layout.geometry.dtype
        return [(tuple(self.layout.chunk_shape(c.num_tokens)), dtype) for c in chunks]

    def _allocate(self, chunk: _Chunk) -> MemoryObj | None:
        try:
            return self.storage.allocate(self.layout.chunk_shape(chunk.num_tokens), self.layout.geometry.dtype)
        except Exception as exc:  # a full arena must never break inference
            metrics.inc("dropped_stores", reason="arena_full")
            logs.warn(logger, "arena_full", "store of chunk %s dropped: %s", chunk.key.to_str(), exc)
            return None

    def _plan_retrieve(self, tokens: TokenIds, mask: torch.Tensor, extra: ExtraKeys | None, owner: int | None = None,
                       lower_tiers: bool = True) -> _RetrievePlan:
        # Only chunks holding tokens the caller wants are read: those before the mask's first token
        # (already in the caller's cache) are skipped, not fetched and thrown away.
        chunks = self._chunks(tokens, True, extra)
        plan = _RetrievePlan()
        wanted = torch.nonzero(mask[:chunks[-1].end] if chunks else mask[:0]).flatten()
        if not wanted.numel():
            return plan
        cs = self.keys.chunk_size  # every chunk but the last is whole: chunk i starts at i * cs
        first, last = int(wanted[0]) // cs, int(wanted[-1]) // cs
        self._note_for_events(tokens, chunks[:last + 1], extra)  # read from below, it lands in L1
        chunks = chunks[first:last + 1]
        objs = self.storage.get([c.key for c in chunks], owner, lower_tiers, expected=self._specs(chunks),
                                tenant=tenant_of(extra))
        whole = self.layout.chunk_shape(self.keys.chunk_size)
        dtype = self.layout.geometry.dtype
        for chunk, obj in zip(chunks, objs):
            expected = whole if chunk.num_tokens == self.keys.chunk_size else self.layout.chunk_shape(chunk.num_tokens)
            if obj.shape != expected or obj.dtype != dtype:
                # Same key, different geometry: not this key's chunk. A miss, and dropped from L1 (else it
                # stays the most recently used entry and every request with this prefix fails on it again).
                metrics.inc("shape_mismatches")
                logs.warn(logger, "shape_mismatch", "chunk %s has shape %s %s, expected %s %s; dropped",
                          chunk.key.to_str(), tuple(obj.tensor.shape), obj.tensor.dtype, expected,
                          self.layout.geometry.dtype)
                self.storage.discard(chunk.key)
                break
            plan.chunks.append(chunk)
            plan.objs.append(obj)
        for obj in objs[len(plan.objs):]:
            obj.ref_down()
        return plan

    @staticmethod
    def _note_for_events(tokens: TokenIds, chunks: list[_Chunk], extra: ExtraKeys | None) -> None:
        """Parent digest and token ids of each chunk, for the KV events of the tiers it lands in; none for a
        request with extra keys (a router hashing its token ids would take it for plain text)."""
        if not kv_events.RECORDER.enabled or extra or not chunks:
            return
        data = token_bytes(tokens)
        parent = None
        for chunk in chunks:
            span = data[chunk.start * TOKEN_BYTES:chunk.end * TOKEN_BYTES]
            kv_events.note_chunk(chunk.key.digest, parent, bytes(span))
            parent = chunk.key.digest

    @staticmethod
    def _masked_slots(slot_mapping: torch.Tensor, mask: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The slots of tokens [start, end), -1 for those outside `mask` (the caller has their KV)."""
        slots = slot_mapping[start:end]
        span_mask = mask[start:end]
        if bool(span_mask.all()):
            return slots
        return torch.where(span_mask, slots, torch.full_like(slots, -1))

    @staticmethod
    def _slots_of(slot_mapping: torch.Tensor, chunks: list[_Chunk]) -> torch.Tensor:
        """The slots of `chunks`' tokens, chunk after chunk (one slice when they follow each other)."""
        if chunks[-1].end - chunks[0].start == sum(c.num_tokens for c in chunks):
            return slot_mapping[chunks[0].start:chunks[-1].end]
        return torch.cat([slot_mapping[c.start:c.end] for c in chunks])

    # ------------------------------------------------------------------ public API
    def lookup(self, tokens: TokenIds, extra: ExtraKeys | None = None) -> int:
        """Number of leading tokens whose KV is available in some tier (whole chunks; a partial last
        chunk only exists, so is only asked for, with `save_unfull_chunk`)."""
        return self.lookup_tiers(tokens, extra)[0]

    def lookup_tiers(self, tokens: TokenIds, extra: ExtraKeys | None = None) -> tuple[int, list[Tier]]:
        """`lookup`'s answer and the tier holding each chunk of it (where a load would read it from)."""
        chunks = self._chunks(tokens, self.config.save_unfull_chunk, extra)
        if not chunks:
            return 0, []
        tiers = self.storage.prefix_tiers([c.key for c in chunks])
        return (chunks[len(tiers) - 1].end if tiers else 0), tiers

    def lookup_and_hold(self, tokens: TokenIds, start: int = 0, extra: ExtraKeys | None = None,
                        peer: StorageBackend | None = None) -> HeldPrefix:
        """Phase one of a load: finds the chunks of `tokens` from the one holding token `start` on (the
        caller has the tokens before it) and holds them for the load (see `HeldPrefix`); reads from
        lower tiers into L1 start at once. Never waits on a lower tier: `located()` says when they
        answered. `peer`: a prefill instance holding this request's chunks (`storage/transfer/client.py`), read
        before the lower tiers; its partial last chunk is asked for too."""
        cs = self.keys.chunk_size
        first = max(0, start) // cs
        chunks = self._chunks(tokens, self.config.save_unfull_chunk or peer is not None, extra)
        self._note_for_events(tokens, chunks, extra)  # what the prefetch reads from below lands in L1
        chunks = chunks[first:]
        handle = self.storage.prefetch([c.key for c in chunks], peer=peer, expected=self._specs(chunks),
                                       tenant=tenant_of(extra))
        return HeldPrefix(handle, first * cs, [c.end for c in chunks])

    def hold_prefix(self, tokens: TokenIds, extra: ExtraKeys | None = None) -> tuple[list[str], list[MemoryObj]]:
        """The keys of every chunk of `tokens` (the partial last one included) and the L1 chunks of their
        longest prefix in L1, one reference each for the caller: what a prefill instance holds for the
        decode instance that will pull it."""
        keys = [c.key.to_str() for c in self._chunks(tokens, True, extra)]
        return keys, self.storage.pin_prefix(keys)

    def store(self, tokens: TokenIds, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
              mask: torch.Tensor | None = None, extra: ExtraKeys | None = None,
              include_partial: bool | None = None) -> int:
        """Stores the KV of `tokens` (only chunks whose tokens are all in `mask`). Returns tokens stored.
        `extra`: the request's extra keys (see `extra_keys.py`); every method here takes them.
        `include_partial`: store a partial last chunk (None: as `save_unfull_chunk` says)."""
        self._releases.reap()
        num_tokens = len(tokens)
        mask = _as_bool_mask(mask, num_tokens)
        slot_mapping = _check_slots(slot_mapping, num_tokens)
        stored = 0
        gathered: list[tuple[_Chunk, MemoryObj]] = []
        try:
            for chunk in self._store_chunks(tokens, mask, extra, include_partial):
                obj = self._allocate(chunk)
                if obj is None:
                    break
                gathered.append((chunk, obj))
            if gathered:  # every chunk in one compiled call
                self.layout.gather_chunks(kv_caches, self._slots_of(slot_mapping, [c for c, _ in gathered]),
                                          [obj.tensor for _, obj in gathered])
            Fence.record(_device(kv_caches)).wait()  # the chunks hold the KV now (a GPU enqueued the gathers)
            self.storage.put_many([chunk.key for chunk, _ in gathered], [obj for _, obj in gathered], tenant_of(extra))
            stored = sum(chunk.num_tokens for chunk, _ in gathered)
        finally:
            self._release_after(kv_caches, [obj for _, obj in gathered])
        self._count("stored", stored)
        return stored

    def retrieve(self, tokens: TokenIds, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                 mask: torch.Tensor | None = None, extra: ExtraKeys | None = None, owner: int | None = None,
                 lower_tiers: bool = True) -> torch.Tensor:
        """Loads the chunks holding `mask`ed tokens, from the first such chunk up to the first missing
        one, into the paged cache; returns the mask of tokens loaded. `owner` (a `HeldPrefix.owner`) takes
        the holds of that lookup over; `lower_tiers=False` reads memory only."""
        num_tokens = len(tokens)
        mask = _as_bool_mask(mask, num_tokens)
        slot_mapping = _check_slots(slot_mapping, num_tokens)
        loaded = torch.zeros(num_tokens, dtype=torch.bool)
        self._releases.reap()
        plan = self._plan_retrieve(tokens, mask, extra, owner, lower_tiers)
        try:
            if plan.chunks:  # consecutive chunks, every one in one compiled call
                start, end = plan.chunks[0].start, plan.chunks[-1].end
                self.layout.scatter_chunks([obj.tensor for obj in plan.objs], kv_caches,
                                           self._masked_slots(slot_mapping, mask, start, end))
                loaded[start:end] = mask[start:end]
        finally:  # the chunks go back once the (GPU) stream has read them
            self._release_after(kv_caches, plan.objs)
        self._count("loaded", int(loaded.sum()))
        return loaded

    def store_layer(self, tokens: TokenIds, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                    mask: torch.Tensor | None = None, extra: ExtraKeys | None = None,
                    include_partial: bool | None = None) -> Generator[int, None, int]:
        """Layerwise store: each `next()` copies one layer out of the paged cache (yielding its index);
        running the generator to its end commits the chunks to storage and returns the tokens stored.

        Call `next()` only after the layer's KV has been written by the model.
        """
        num_tokens = len(tokens)
        mask = _as_bool_mask(mask, num_tokens)
        slot_mapping = _check_slots(slot_mapping, num_tokens)
        chunks: list[_Chunk] = []
        objs: list[MemoryObj] = []
        for chunk in self._store_chunks(tokens, mask, extra, include_partial):
            obj = self._allocate(chunk)
            if obj is None:
                break
            chunks.append(chunk)
            objs.append(obj)
        try:
            copy = self.layout.layer_copier(True, kv_caches, self._slots_of(slot_mapping, chunks),
                                            [obj.tensor for obj in objs]) if chunks else None
            for layer in range(self.layout.num_layers):
                if copy is not None:
                    copy(layer)
                yield layer
            Fence.record(_device(kv_caches)).wait()  # one wait for all layers, at the commit
            self.storage.put_many([chunk.key for chunk in chunks], objs, tenant_of(extra))
            stored = sum(chunk.num_tokens for chunk in chunks)
            self._count("stored", stored)
            return stored
        finally:
            self._release_after(kv_caches, objs)

    def retrieve_layer(self, tokens: TokenIds, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                       mask: torch.Tensor | None = None, extra: ExtraKeys | None = None, owner: int | None = None,
                       lower_tiers: bool = True) -> Generator[torch.Tensor | int, None, None]:
        """Layerwise retrieve: the first `next()` fetches the chunks and yields the mask of tokens that
        will be loaded; each following `next()` loads one layer and yields its index."""
        num_tokens = len(tokens)
        mask = _as_bool_mask(mask, num_tokens)
        slot_mapping = _check_slots(slot_mapping, num_tokens)
        plan = self._plan_retrieve(tokens, mask, extra, owner, lower_tiers)
        try:
            loaded = torch.zeros(num_tokens, dtype=torch.bool)
            slots = slot_mapping[:0]
            if plan.chunks:
                start, end = plan.chunks[0].start, plan.chunks[-1].end
                loaded[start:end] = mask[start:end]
                slots = self._masked_slots(slot_mapping, mask, start, end)
            self._count("loaded", int(loaded.sum()))
            copy = self.layout.layer_copier(False, kv_caches, slots, [obj.tensor for obj in plan.objs]) \
                if plan.objs else None
            yield loaded
            for layer in range(self.layout.num_layers):
                if copy is not None:
                    copy(layer)
                yield layer
        finally:
            self._release_after(kv_caches, plan.objs)

    def chunk_keys(self, tokens: TokenIds, extra: ExtraKeys | None = None) -> list[CacheKey]:
        """The keys of the whole chunks of `tokens`: exactly what a request with these tokens and extra keys
        stores and loads (the management API resolves token ids with it)."""
        return [c.key for c in self._chunks(tokens, False, extra)]

    def warm(self, keys: Sequence[CacheKey], tenant: str = "",
             timeout: float = 60.0) -> "concurrent.futures.Future[list[bool]]":
        """Reads whole chunks `keys` that L1 lacks from the lower tiers (other instances' L1 through P2P too)
        into L1 and keeps them (`StorageManager.warm`); the future says which it brought."""
        shape = (tuple(self.layout.chunk_shape(self.keys.chunk_size)), self.layout.geometry.dtype)
        return self.storage.warm(keys, [shape] * len(keys), tenant, timeout)

    def wait_written(self, tokens: TokenIds, timeout: float, extra: ExtraKeys | None = None) -> bool:
        """Waits (at most `timeout` s) until the chunks of `tokens` are written to every lower tier
        (durable for another process to read); False if one is not (dropped, failed or still going)."""
        chunks = self._chunks(tokens, self.config.save_unfull_chunk, extra)
        return self.storage.wait_written([c.key for c in chunks], timeout)

    def clear(self, lower_tiers: bool = True) -> bool:
        """Empties L1 (and the lower tiers, unless `lower_tiers` is False); False if they did not finish."""
        return self.storage.clear(lower_tiers=lower_tiers)

    def close(self) -> None:
        self._releases.drain()
        if self._owns_storage:
            self.storage.close()
