"""The paged-KV layout contract: `KVGeometry`, `SlotPlan` and the `PagedKVLayout` ABC.

A layout adapter copies tokens between an engine's paged KV cache (one tensor per layer, addressed by
slot = block_id * block_size + offset) and the stored chunk format `[num_layers, planes, T, width]`
(planes = 2 for K/V, 1 for MLA; width = num_kv_heads * head_size). Slots < 0 are skipped: their chunk
rows are left as they are on gather and their cache slots are not written on scatter.

The base class does validation and planning; subclasses supply the torch copies for whole-block runs and
for single tokens. When a compiled op (`lmcache_vllm.ops`) exists for the layout and device, `gather` /
`scatter` hand all layers to it in one call instead.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_vllm import ops


class LayoutError(ValueError):
    """A KV cache, chunk or slot mapping does not fit the layout it is used with."""


class UnsupportedLayoutError(LayoutError):
    """`detect_layout` found a KV cache layout no adapter handles."""


@dataclass(frozen=True)
class KVGeometry:
    """Shape facts shared by every layer of one engine's paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_planes: int = 2  # 2 = K and V; 1 = MLA latent

    @property
    def token_width(self) -> int:
        """Elements per token per plane in the stored chunk."""
        return self.num_kv_heads * self.head_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SlotPlan:
    """How one slot mapping splits into whole-block runs and leftover tokens.

    `block_runs` holds (chunk_pos, first_block, num_blocks): chunk rows chunk_pos.. map to whole blocks
    first_block.. in order, so they can move with block-level copies. `token_pos` / `token_slots` are the
    remaining valid (slot >= 0) tokens, moved one row at a time by index.
    """

    num_tokens: int
    block_runs: tuple[tuple[int, int, int], ...]
    token_pos: torch.Tensor
    token_slots: torch.Tensor


def plan_slots(slots: torch.Tensor, block_size: int) -> SlotPlan:
    """Finds whole blocks in order inside `slots` (vectorised; a Python loop only over blocks)."""
    num_tokens = slots.numel()
    covered = torch.zeros(num_tokens, dtype=torch.bool, device=slots.device)
    runs: list[tuple[int, int, int]] = []
    if num_tokens >= block_size:
        span = num_tokens - block_size + 1
        steps = torch.zeros(num_tokens, dtype=torch.int64, device=slots.device)
        if num_tokens > 1:
            steps[1:] = ((slots[1:] - slots[:-1]) == 1).cumsum(0)
        # A block starts at p when its first slot is block-aligned and the next block_size-1 steps are +1.
        whole = ((steps[block_size - 1:] - steps[:span]) == block_size - 1) \
            & (slots[:span] >= 0) & (slots[:span] % block_size == 0)
        starts = whole.nonzero().flatten()
        if starts.numel():
            rows = (starts[:, None] + torch.arange(block_size, device=slots.device)).flatten()
            covered[rows] = True
            for pos, slot in zip(starts.tolist(), slots[starts].tolist()):
                block = slot // block_size
                if runs and runs[-1][0] + runs[-1][2] * block_size == pos and runs[-1][1] + runs[-1][2] == block:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((pos, block, 1))
    token_pos = ((~covered) & (slots >= 0)).nonzero().flatten()
    return SlotPlan(num_tokens, tuple(runs), token_pos, slots[token_pos])


class PagedKVLayout(ABC):
    """Adapter between one engine's paged KV cache layout and the stored chunk format."""

    name: str = "abstract"
    op_code: int | None = None  # layout id understood by the compiled ops; None = torch only

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry
        # (slot mapping, its plan) of the last call, replaced as one tuple so threads never see a mixed pair.
        self._last_plan: tuple[torch.Tensor, SlotPlan] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.geometry})"

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        g = self.geometry
        return (g.num_layers, g.kv_planes, num_tokens, g.token_width)

    # ---- subclass hooks (one layer, torch) -------------------------------------------------------
    @abstractmethod
    def expected_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""

    @abstractmethod
    def _gather_blocks(self, cache: torch.Tensor, block: int, count: int, rows: torch.Tensor) -> None:
        """Copies `count` whole blocks from `block` on into rows [planes, count*block_size, width]."""

    @abstractmethod
    def _scatter_blocks(self, rows: torch.Tensor, cache: torch.Tensor, block: int, count: int) -> None:
        """Inverse of `_gather_blocks`."""

    @abstractmethod
    def _gather_tokens(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Returns [planes, len(slots), width] for the given valid slots."""

    @abstractmethod
    def _scatter_tokens(self, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Writes values [planes, len(slots), width] into the given valid slots."""

    # ---- public API ------------------------------------------------------------------------------
    def gather(self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
        """Copies the slots' KV of every layer into `out` (`chunk_shape(len(slot_mapping))`)."""
        caches = self._check_caches(kv_caches)
        slots = self._check_slots(slot_mapping, caches[0].device)
        self._check_chunk(out, slots.numel(), self.num_layers, "out")
        ext = ops.compiled_for(caches[0].device, self.op_code)
        if ext is not None:
            ext.gather(caches, slots, out, self.op_code, self.geometry.block_size)
            return
        plan = self._plan_for(slots)
        staged = out if out.device == caches[0].device else torch.empty_like(out, device=caches[0].device)
        for layer, cache in enumerate(caches):
            self._gather_planned(cache, plan, staged[layer])
        if staged is not out:
            out.copy_(staged)

    def scatter(self, chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Copies every layer of `chunk` into the slots of the paged caches."""
        caches = self._check_caches(kv_caches)
        slots = self._check_slots(slot_mapping, caches[0].device)
        self._check_chunk(chunk, slots.numel(), self.num_layers, "chunk")
        ext = ops.compiled_for(caches[0].device, self.op_code)
        if ext is not None:
            ext.scatter(chunk, caches, slots, self.op_code, self.geometry.block_size)
            return
        plan = self._plan_for(slots)
        chunk = chunk.to(caches[0].device, non_blocking=True)
        for layer, cache in enumerate(caches):
            self._scatter_planned(chunk[layer], cache, plan)

    def gather_layer(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     out_layer: torch.Tensor) -> None:
        """One layer of `gather`: out_layer is `chunk_shape(T)[1:]`."""
        self._check_layer_index(layer)
        cache = self._check_caches([kv_cache])[0]
        slots = self._check_slots(slot_mapping, cache.device)
        self._check_chunk(out_layer.unsqueeze(0), slots.numel(), 1, "out_layer")
        ext = ops.compiled_for(cache.device, self.op_code)
        if ext is not None:
            ext.gather([cache], slots, out_layer.unsqueeze(0), self.op_code, self.geometry.block_size)
            return
        staged = out_layer if out_layer.device == cache.device else torch.empty_like(out_layer, device=cache.device)
        self._gather_planned(cache, self._plan_for(slots), staged)
        if staged is not out_layer:
            out_layer.copy_(staged)

    def scatter_layer(self, chunk_layer: torch.Tensor, layer: int, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """One layer of `scatter`: chunk_layer is `chunk_shape(T)[1:]`."""
        self._check_layer_index(layer)
        cache = self._check_caches([kv_cache])[0]
        slots = self._check_slots(slot_mapping, cache.device)
        self._check_chunk(chunk_layer.unsqueeze(0), slots.numel(), 1, "chunk_layer")
        ext = ops.compiled_for(cache.device, self.op_code)
        if ext is not None:
            ext.scatter(chunk_layer.unsqueeze(0), [cache], slots, self.op_code, self.geometry.block_size)
            return
        self._scatter_planned(chunk_layer.to(cache.device, non_blocking=True), cache, self._plan_for(slots))

    # ---- internals -------------------------------------------------------------------------------
    def _gather_planned(self, cache: torch.Tensor, plan: SlotPlan, out_layer: torch.Tensor) -> None:
        bs = self.geometry.block_size
        for pos, block, count in plan.block_runs:
            self._gather_blocks(cache, block, count, out_layer[:, pos:pos + count * bs])
        if plan.token_pos.numel():
            out_layer.index_copy_(1, plan.token_pos, self._gather_tokens(cache, plan.token_slots))

    def _scatter_planned(self, chunk_layer: torch.Tensor, cache: torch.Tensor, plan: SlotPlan) -> None:
        bs = self.geometry.block_size
        for pos, block, count in plan.block_runs:
            self._scatter_blocks(chunk_layer[:, pos:pos + count * bs], cache, block, count)
        if plan.token_pos.numel():
            self._scatter_tokens(chunk_layer.index_select(1, plan.token_pos), cache, plan.token_slots)

    def _plan_for(self, slots: torch.Tensor) -> SlotPlan:
        # Layerwise callers pass the same mapping once per layer: reuse the plan when the contents match.
        last = self._last_plan
        if last is not None and last[0].shape == slots.shape and last[0].device == slots.device \
                and torch.equal(last[0], slots):
            return last[1]
        plan = plan_slots(slots, self.geometry.block_size)
        self._last_plan = (slots.clone(), plan)
        return plan

    def _check_layer_index(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"{self.name}: layer {layer} out of range [0, {self.num_layers})")

    def _check_caches(self, kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        caches = list(kv_caches)
        expected = self.expected_cache_shape()
        for i, cache in enumerate(caches):
            if tuple(cache.shape) != expected or cache.dtype != self.geometry.dtype:
                raise LayoutError(f"{self.name}: kv cache {i} is {tuple(cache.shape)} {cache.dtype}, "
                                  f"expected {expected} {self.geometry.dtype}")
            if not cache.is_contiguous():
                raise LayoutError(f"{self.name}: kv cache {i} is not contiguous (strides {cache.stride()})")
            if cache.device != caches[0].device:
                raise LayoutError(f"{self.name}: kv caches are on different devices")
        return caches

    def _check_slots(self, slot_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
        if slot_mapping.dim() != 1:
            raise LayoutError(f"{self.name}: slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
        if slot_mapping.dtype not in (torch.int64, torch.int32):
            raise LayoutError(f"{self.name}: slot_mapping must be int64, got {slot_mapping.dtype}")
        slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
        if slots.numel() and int(slots.max()) >= self.geometry.num_slots:
            raise LayoutError(f"{self.name}: slot {int(slots.max())} beyond the cache's "
                              f"{self.geometry.num_slots} slots")
        return slots

    def _check_chunk(self, chunk: torch.Tensor, num_tokens: int, num_layers: int, what: str) -> None:
        expected = (num_layers,) + self.chunk_shape(num_tokens)[1:]
        if tuple(chunk.shape) != expected or chunk.dtype != self.geometry.dtype:
            raise LayoutError(f"{self.name}: {what} is {tuple(chunk.shape)} {chunk.dtype}, "
                              f"expected {expected} {self.geometry.dtype}")
        if not chunk.is_contiguous():
            raise LayoutError(f"{self.name}: {what} must be contiguous")
