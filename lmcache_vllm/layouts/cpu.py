"""Adapters for vLLM's CPU attention backend (`CPU_ATTN`) KV caches.

Each layer's cache is `[num_blocks, num_kv_heads, block_size, 2*head_size]`, but the last two dims are
not "K then V of a token": per (block, head) the memory holds a K region of block_size*head_size elements
followed by a V region of the same size, packed per the attention isa vLLM picked:

- `vec` / `vec16`: K transposed `[head_size, block_size]`, V `[block_size, head_size]`.
- `amx` (bf16 only): K as `[block_size/16, head_size/2, 16, 2]` (token = i*16+j, dim = k*2+l, stored
  [i, k, j, l]) and V as `[head_size/16, block_size/2, 16, 2]` (dim = i*16+j, token = k*2+l, stored
  [i, k, j, l]) — VNNI pairs for the AMX tiles.

Both packings were derived from, and are tested against, vLLM's own `cpu_attn_reshape_and_cache`.
"""
from __future__ import annotations

import torch

from lmcache_vllm.layouts.base import KVGeometry, PagedKVLayout
from lmcache_vllm.layouts.errors import LayoutError


class _CpuAttnLayout(PagedKVLayout):
    """Shared shape handling of the CPU backend's `[blocks, heads, block_size, 2*head_size]` tensor."""

    cpu_task_shapes = True  # the AVX-512 vec / amx kernels: strip or plane tasks, `auto` timed at binding

    def expected_cache_shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size)

    @classmethod
    def from_caches(cls, kv_caches) -> "_CpuAttnLayout":
        first = kv_caches[0]
        if first.dim() != 4 or first.shape[3] % 2:
            raise LayoutError(f"{cls.name}: expected [num_blocks, num_kv_heads, block_size, 2*head_size], "
                              f"got {tuple(first.shape)}")
        num_blocks, heads, block_size, two_d = first.shape
        geometry = KVGeometry(num_layers=len(kv_caches), num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=heads, head_size=two_d // 2, dtype=first.dtype)
        return cls(geometry)

    def _regions(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        kv = cache.view(g.num_blocks, g.num_kv_heads, 2, g.block_size * g.head_size)
        return kv[:, :, 0], kv[:, :, 1]


class CpuVecLayout(_CpuAttnLayout):
    """vLLM CPU backend, isa `vec` (and `vec16`, which packs the same way)."""

    name = "cpu_vec"
    op_code = 0

    def _kv(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        k, v = self._regions(cache)
        return k.unflatten(-1, (g.head_size, g.block_size)), v.unflatten(-1, (g.block_size, g.head_size))

    def _token_rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        g = self.geometry
        return rows.view(2, count, g.block_size, g.num_kv_heads, g.head_size)

    def _gather_blocks(self, cache, block, count, rows) -> None:
        k, v = self._kv(cache)
        dst = self._token_rows(rows, count)
        dst[0].copy_(k[block:block + count].permute(0, 3, 1, 2))  # [n, H, D, bs] -> [n, bs, H, D]
        dst[1].copy_(v[block:block + count].permute(0, 2, 1, 3))  # [n, H, bs, D] -> [n, bs, H, D]

    def _scatter_blocks(self, rows, cache, block, count) -> None:
        k, v = self._kv(cache)
        src = self._token_rows(rows, count)
        k[block:block + count].copy_(src[0].permute(0, 2, 3, 1))
        v[block:block + count].copy_(src[1].permute(0, 2, 1, 3))

    def _gather_tokens(self, cache, slots) -> torch.Tensor:
        k, v = self._kv(cache)
        blocks, offsets = slots // self.geometry.block_size, slots % self.geometry.block_size
        # Advanced indices on non-adjacent dims put the token dim first: [T, H, D].
        return torch.stack((k[blocks, :, :, offsets], v[blocks, :, offsets, :])).flatten(2)

    def _scatter_tokens(self, values, cache, slots) -> None:
        g = self.geometry
        k, v = self._kv(cache)
        blocks, offsets = slots // g.block_size, slots % g.block_size
        values = values.view(2, -1, g.num_kv_heads, g.head_size)
        k[blocks, :, :, offsets] = values[0]
        v[blocks, :, offsets, :] = values[1]


class CpuAmxLayout(_CpuAttnLayout):
    """vLLM CPU backend, isa `amx` (bf16, block_size a multiple of 16, head_size a multiple of 16)."""

    name = "cpu_amx"
    op_code = 1

    def __init__(self, geometry: KVGeometry):
        if geometry.block_size % 16 or geometry.head_size % 16 or geometry.dtype.itemsize != 2:
            raise LayoutError(f"cpu_amx: needs a 2-byte dtype, block_size and head_size multiples of 16; "
                              f"got {geometry}")
        super().__init__(geometry)

    def _kv(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        k, v = self._regions(cache)
        k = k.unflatten(-1, (g.block_size // 16, g.head_size // 2, 16, 2))
        v = v.unflatten(-1, (g.head_size // 16, g.block_size // 2, 16, 2))
        return k, v

    def _gather_blocks(self, cache, block, count, rows) -> None:
        g = self.geometry
        k, v = self._kv(cache)
        rows_k = rows[0].view(count, g.block_size // 16, 16, g.num_kv_heads, g.head_size // 2, 2)
        rows_v = rows[1].view(count, g.block_size // 2, 2, g.num_kv_heads, g.head_size // 16, 16)
        rows_k.copy_(k[block:block + count].permute(0, 2, 4, 1, 3, 5))
        rows_v.copy_(v[block:block + count].permute(0, 3, 5, 1, 2, 4))

    def _scatter_blocks(self, rows, cache, block, count) -> None:
        g = self.geometry
        k, v = self._kv(cache)
        rows_k = rows[0].view(count, g.block_size // 16, 16, g.num_kv_heads, g.head_size // 2, 2)
        rows_v = rows[1].view(count, g.block_size // 2, 2, g.num_kv_heads, g.head_size // 16, 16)
        k[block:block + count].copy_(rows_k.permute(0, 3, 1, 4, 2, 5))
        v[block:block + count].copy_(rows_v.permute(0, 3, 4, 1, 5, 2))

    def _gather_tokens(self, cache, slots) -> torch.Tensor:
        k, v = self._kv(cache)
        offsets = slots % self.geometry.block_size
        blocks = slots // self.geometry.block_size
        keys = k[blocks, :, offsets // 16, :, offsets % 16, :]     # [T, H, D/2, 2]
        values = v[blocks, :, :, offsets // 2, :, offsets % 2]     # [T, H, D/16, 16]
        return torch.stack((keys.flatten(1), values.flatten(1)))

    def _scatter_tokens(self, values, cache, slots) -> None:
        g = self.geometry
        k, v = self._kv(cache)
        offsets = slots % g.block_size
        blocks = slots // g.block_size
        count = slots.numel()
        k[blocks, :, offsets // 16, :, offsets % 16, :] = values[0].view(count, g.num_kv_heads, g.head_size // 2, 2)
        v[blocks, :, :, offsets // 2, :, offsets % 2] = values[1].view(count, g.num_kv_heads, g.head_size // 16, 16)
