"""`StatePageLayout`: whole state pages of a Mamba / linear-attention KV cache group <-> one stored chunk.

vLLM 0.32 gives each layer of such a group a `[blocks, 1, 1, state bytes]` int8 view of the shared KV
allocation (`v1/kv_cache_interface.py: create_kv_cache_views` with a `MambaSpec`, which has no dtype of its
own): block b holds the layer's recurrent state (conv state, then SSM state, packed by the layer itself) of
one prefix. A state is only ever copied whole, so the stored chunk is `[layers, state bytes]` uint8: the
bytes of one block of every layer of the group, in the group's layer order. Padding behind the state
(`page_size_padded`) is not part of the view and is not stored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_vllm.layouts.errors import LayoutError


@dataclass(frozen=True)
class StatePageLayout:
    """The state pages of `num_layers` layers, `page_bytes` each, in caches of `num_blocks` blocks."""

    num_layers: int
    num_blocks: int
    page_bytes: int

    name = "state_pages"

    @classmethod
    def from_views(cls, caches: Sequence[torch.Tensor]) -> "StatePageLayout":
        if not caches:
            raise LayoutError("state_pages: no layer views")
        first = caches[0]
        for i, cache in enumerate(caches):
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise LayoutError(f"state_pages: layer {i} is {tuple(cache.shape)} {cache.dtype}, layer 0 "
                                  f"{tuple(first.shape)} {first.dtype}")
        if first.dim() < 2:
            raise LayoutError(f"state_pages: expected [blocks, ...] views, got {tuple(first.shape)}")
        page_bytes = first[0].numel() * first.element_size()
        return cls(len(caches), first.shape[0], page_bytes)

    def chunk_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.page_bytes)

    def _page(self, cache: torch.Tensor, block: int) -> torch.Tensor:
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"state_pages: block {block} outside [0, {self.num_blocks})")
        page = cache[block]
        if not page.is_contiguous():
            raise LayoutError(f"state_pages: the page of block {block} is not contiguous "
                              f"(strides {cache.stride()})")
        return page.reshape(-1).view(torch.uint8)

    def _check(self, caches: Sequence[torch.Tensor], chunk: torch.Tensor) -> None:
        if len(caches) != self.num_layers:
            raise LayoutError(f"state_pages: {len(caches)} layer views, the layout has {self.num_layers}")
        if tuple(chunk.shape) != self.chunk_shape() or chunk.dtype != torch.uint8:
            raise LayoutError(f"state_pages: chunk is {tuple(chunk.shape)} {chunk.dtype}, expected "
                              f"{self.chunk_shape()} uint8")

    def gather(self, caches: Sequence[torch.Tensor], block: int, out: torch.Tensor) -> None:
        """Copies block `block` of every layer into `out` (`chunk_shape()`, uint8)."""
        self._check(caches, out)
        for layer, cache in enumerate(caches):
            out[layer].copy_(self._page(cache, block), non_blocking=True)

    def scatter(self, chunk: torch.Tensor, caches: Sequence[torch.Tensor], block: int) -> None:
        """Writes `chunk` into block `block` of every layer."""
        self._check(caches, chunk)
        for layer, cache in enumerate(caches):
            self._page(cache, block).copy_(chunk[layer], non_blocking=True)
