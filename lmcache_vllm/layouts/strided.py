"""`StridedKVLayout`: the adapter for every non-packed KV cache vLLM 0.32/0.33 hands a connector.

vLLM allocates one int8 buffer for all layers and gives each layer a 4-D `[B, H, N, C]` view of it
(`vllm/v1/kv_cache_interface.py: create_kv_cache_views`): B blocks (kernel blocks when a manager block is
split), H KV heads, N tokens per block, C = head_size + head_size_v elements (K then V of one head of one
token; MLA: one head and head_size_v = 0). The physical order is one global `KVCacheLayout`, a permutation
of [L, B, H, N, C] (LBNHC on CUDA by default, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC), with C innermost. So a
layer is fully described by its view's base address and the element strides of B, H and N, which this
adapter reads from the views themselves (`ViewStrides.of`); nothing is guessed from shapes or names.

A slot is `block * N + offset`. Kernel block splitting keeps that mapping: manager block b, offset o is
kernel block b*ratio + o // N, offset o % N, i.e. the same slot number.

Stored chunk: `[layers, planes, T, H*head_size]` (planes 2 = K, V; 1 = MLA latent). Each (layer, plane,
token, head) moves as one contiguous piece of head_size elements, on every path: the torch code here, the
compiled CPU op and the CUDA kernel (layout code `OP_STRIDED`), which take the strides from the views.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lmcache_vllm.layouts.base import KVGeometry, PagedKVLayout
from lmcache_vllm.layouts.errors import LayoutError, UnsupportedLayoutError

OP_STRIDED = 4  # layout code of the compiled ops (0, 1: CPU packings; 2, 3 were the old 5-D/3-D shapes)


@dataclass(frozen=True)
class ViewStrides:
    """Element strides of one layer's `[B, H, N, C]` view (equal for every layer) and the layer spacing."""

    block: int
    head: int
    token: int
    layer: int | None  # elements between consecutive layers' views, None if not uniform (or one layer)

    @staticmethod
    def of(caches: Sequence[torch.Tensor]) -> "ViewStrides":
        first = caches[0]
        if first.dim() != 4:
            raise UnsupportedLayoutError(
                f"expected vLLM's per-layer [blocks, heads, tokens, head_size + head_size_v] view, got shape "
                f"{tuple(first.shape)} (a raw buffer of a non-attention layer, or a vLLM older than 0.32)")
        if first.stride(3) != 1 and first.shape[3] > 1:
            raise UnsupportedLayoutError(f"the last dim of the KV view must be contiguous, strides {first.stride()}")
        item = first.element_size()
        gaps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(caches, caches[1:])}
        layer = None
        if len(gaps) == 1:
            gap = gaps.pop()
            layer = gap // item if gap % item == 0 else None
        return ViewStrides(first.stride(0), first.stride(1), first.stride(2), layer)

    def order(self) -> str:
        """The vLLM `KVCacheLayout` name these strides spell (ties, e.g. one head, read as the default)."""
        dims = [("B", self.block), ("H", self.head), ("N", self.token)]
        if self.layer:  # 0: layers share one view (vLLM's cross-layer KV sharing), no L position
            dims.append(("L", self.layer))
        else:
            dims.insert(0, ("L", max(d[1] for d in dims) + 1))
        rank = {"L": 0, "B": 1, "N": 2, "H": 3}  # tie-break toward LBNHC, vLLM's CUDA default
        return "".join(name for name, _ in sorted(dims, key=lambda d: (-d[1], rank[d[0]]))) + "C"


class StridedKVLayout(PagedKVLayout):
    """Any `[B, H, N, C]` layer view with C contiguous: FLASH_ATTN, FLASHINFER, TRITON_ATTN, MLA backends,
    fp8 KV (uint8 views), kernel block splitting, every `KVCacheLayout`."""

    name = "strided"
    op_code = OP_STRIDED

    def __init__(self, geometry: KVGeometry, strides: ViewStrides, order: str | None = None):
        super().__init__(geometry)
        self.strides = strides
        self.order = order or strides.order()

    def __repr__(self) -> str:
        s = self.strides
        return (f"StridedKVLayout({self.order}, {self.geometry}, strides block={s.block} head={s.head} "
                f"token={s.token} layer={s.layer})")

    @classmethod
    def from_views(cls, caches: Sequence[torch.Tensor], head_size: int, head_size_v: int,
                   order: str | None = None) -> "StridedKVLayout":
        """`head_size`/`head_size_v` as in vLLM's `AttentionSpec` (MLA: head_size_v = 0)."""
        strides = ViewStrides.of(caches)
        blocks, heads, block_size, content = caches[0].shape
        if head_size <= 0 or head_size_v < 0 or head_size + head_size_v != content:
            raise LayoutError(f"strided: the view's last dim is {content}, but head_size {head_size} + "
                              f"head_size_v {head_size_v} = {head_size + head_size_v}")
        if head_size_v not in (0, head_size):
            raise UnsupportedLayoutError(f"strided: head_size {head_size} != head_size_v {head_size_v} (separate K "
                                         f"and V widths) is not supported by the stored chunk format")
        planes = 2 if head_size_v else 1
        geometry = KVGeometry(num_layers=len(caches), num_blocks=blocks, block_size=block_size,
                              num_kv_heads=heads, head_size=head_size, dtype=caches[0].dtype, kv_planes=planes)
        return cls(geometry, strides, order)

    # ---- validation ------------------------------------------------------------------------------------
    def expected_cache_shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (g.num_blocks, g.num_kv_heads, g.block_size, g.kv_planes * g.head_size)

    def _check_cache(self, index: int, cache: torch.Tensor) -> None:
        s = self.strides
        # The stride of a dim of size 1 (one head, one block) is never used: only the others must match.
        strides = [(got, want) for got, want, size in zip(cache.stride(), (s.block, s.head, s.token, 1), cache.shape)
                   if size > 1]
        if tuple(cache.shape) != self.expected_cache_shape() or cache.dtype != self.geometry.dtype \
                or any(got != want for got, want in strides):
            raise LayoutError(f"{self.name}: kv cache {index} is {tuple(cache.shape)} {cache.dtype} strides "
                              f"{cache.stride()}, registered {self.expected_cache_shape()} {self.geometry.dtype} "
                              f"strides {(s.block, s.head, s.token, 1)}")

    # ---- torch path (one layer) ------------------------------------------------------------------------
    def _parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The K (and V) parts of the last dim of `x`."""
        d = self.geometry.head_size
        return [x[..., p * d:(p + 1) * d] for p in range(self.geometry.kv_planes)]

    def _rows(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        g = self.geometry
        return rows.view(g.kv_planes, count, g.block_size, g.num_kv_heads, g.head_size)

    def _gather_blocks(self, cache, block, count, rows) -> None:
        src = cache[block:block + count].permute(0, 2, 1, 3)  # [count, N, H, C]
        for dst, part in zip(self._rows(rows, count), self._parts(src)):
            dst.copy_(part)

    def _scatter_blocks(self, rows, cache, block, count) -> None:
        dst = cache[block:block + count].permute(0, 2, 1, 3)
        for src, part in zip(self._rows(rows, count), self._parts(dst)):
            part.copy_(src)

    def _gather_tokens(self, cache, slots) -> torch.Tensor:
        n = self.geometry.block_size
        picked = cache[slots // n, :, slots % n, :]  # advanced indices around a slice: [T, H, C]
        return torch.stack([part.reshape(slots.numel(), -1) for part in self._parts(picked)])

    def _scatter_tokens(self, values, cache, slots) -> None:
        g = self.geometry
        blocks, offsets = slots // g.block_size, slots % g.block_size
        for p in range(g.kv_planes):
            cache[blocks, :, offsets, p * g.head_size:(p + 1) * g.head_size] = \
                values[p].view(-1, g.num_kv_heads, g.head_size)
