"""Adapters for token-major paged layouts: vLLM's flash-attention cache and MLA's latent cache.

- `CudaFlashLayout`: per layer `[2, num_blocks, block_size, num_kv_heads, head_size]`; a slot is one
  contiguous row of num_kv_heads*head_size elements per plane, so whole-block runs are plain slices.
- `MlaLayout`: per layer `[num_blocks, block_size, dim]` (dim = kv_lora_rank + rope dim), stored as
  `[num_layers, 1, T, dim]`.

Both work on any device (the names say where vLLM uses them); the CUDA kernels in `cuda_ops/` take over
on GPU when built.
"""
from __future__ import annotations

import torch

from lmcache_vllm.layouts.base import KVGeometry, LayoutError, PagedKVLayout


class _RowLayout(PagedKVLayout):
    """A cache viewable as `[planes, num_slots, width]`: gathers are row copies."""

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        return cache.view(g.kv_planes, g.num_slots, g.token_width)

    def _gather_blocks(self, cache, block, count, rows) -> None:
        bs = self.geometry.block_size
        rows.copy_(self._rows(cache)[:, block * bs:(block + count) * bs])

    def _scatter_blocks(self, rows, cache, block, count) -> None:
        bs = self.geometry.block_size
        self._rows(cache)[:, block * bs:(block + count) * bs].copy_(rows)

    def _gather_tokens(self, cache, slots) -> torch.Tensor:
        return self._rows(cache).index_select(1, slots)

    def _scatter_tokens(self, values, cache, slots) -> None:
        self._rows(cache).index_copy_(1, slots, values)


class CudaFlashLayout(_RowLayout):
    """vLLM flash-attention layout `[2, num_blocks, block_size, num_kv_heads, head_size]` per layer."""

    name = "cuda_flash"
    op_code = 2

    def expected_cache_shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_size)

    @classmethod
    def from_caches(cls, kv_caches) -> "CudaFlashLayout":
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise LayoutError(f"cuda_flash: expected [2, num_blocks, block_size, num_kv_heads, head_size], "
                              f"got {tuple(first.shape)}")
        _, num_blocks, block_size, heads, head_size = first.shape
        return cls(KVGeometry(num_layers=len(kv_caches), num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=heads, head_size=head_size, dtype=first.dtype))


class MlaLayout(_RowLayout):
    """MLA latent cache `[num_blocks, block_size, dim]` per layer; one plane in the stored chunk."""

    name = "mla"
    op_code = 3

    def expected_cache_shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (g.num_blocks, g.block_size, g.head_size)

    @classmethod
    def from_caches(cls, kv_caches) -> "MlaLayout":
        first = kv_caches[0]
        if first.dim() != 3:
            raise LayoutError(f"mla: expected [num_blocks, block_size, dim], got {tuple(first.shape)}")
        num_blocks, block_size, dim = first.shape
        return cls(KVGeometry(num_layers=len(kv_caches), num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=1, head_size=dim, dtype=first.dtype, kv_planes=1))
