"""Layout adapters between an engine's paged KV cache and the stored chunk format, and `detect_layout`.

`detect_layout(kv_caches, backend=..., head_size=..., ...)` builds the adapter from the per-layer views
vLLM registers and what vLLM says about them (its `AttentionSpec`: head sizes, KV heads, block size; the
attention backend's name; the CPU attention isa):
- vLLM's CPU attention (`CPU_ATTN`) packs C per isa inside contiguous `[B, H, N, 2*head_size]` layers:
  `CpuVecLayout` (`vec`, `vec16`) or `CpuAmxLayout` (`amx`). Only that backend gets a packing adapter.
- every other backend (FLASH_ATTN, FLASHINFER, TRITON_ATTN, the MLA backends, CPU_MLA, ...): the strides of
  the `[B, H, N, C]` views decide, `StridedKVLayout`.
Anything else raises `UnsupportedLayoutError` naming what was found.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from lmcache_vllm.layouts.base import KVGeometry, PagedKVLayout
from lmcache_vllm.layouts.cpu import CpuAmxLayout, CpuVecLayout
from lmcache_vllm.layouts.errors import LayoutError, UnsupportedLayoutError
from lmcache_vllm.layouts.slots import SlotPlan, plan_slots
from lmcache_vllm.layouts.strided import OP_STRIDED, StridedKVLayout, ViewStrides

__all__ = ["KVGeometry", "LayoutError", "PagedKVLayout", "SlotPlan", "UnsupportedLayoutError", "plan_slots",
           "CpuVecLayout", "CpuAmxLayout", "StridedKVLayout", "ViewStrides", "OP_STRIDED", "detect_layout",
           "default_cpu_isa", "CPU_ATTENTION_BACKEND"]

CPU_ATTENTION_BACKEND = "CPU_ATTN"  # vLLM's CPU attention backend (`get_name()`), the one that packs C
_CPU_ISAS = {"vec": CpuVecLayout, "vec16": CpuVecLayout, "amx": CpuAmxLayout}


def default_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The isa vLLM's CPU backend picks on this host (mirrors its rule for x86; callers that can ask
    vLLM, e.g. the attention layer's `isa` attribute, should pass that instead)."""
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    amx_tiles = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx_tiles and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def detect_layout(kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
                  backend: str | None = None, head_size: int | None = None, head_size_v: int | None = None,
                  num_kv_heads: int | None = None, block_size: int | None = None,
                  cpu_isa: str | None = None, layout_name: str | None = None) -> PagedKVLayout:
    """Returns the adapter for `kv_caches` (one view per layer, in layer order).

    backend: the attention backend's name (`CPU_ATTN`, `FLASH_ATTN`, `FLASHMLA`, ...; None = unknown, which
    never selects a CPU packing); head_size / head_size_v: vLLM's `AttentionSpec` values (MLA:
    head_size_v = 0; when not given, a backend name containing "MLA" means MLA, otherwise K and V split C
    in halves); num_kv_heads, block_size: checked against the views (block_size may be a multiple of the
    views' kernel block size); cpu_isa: the CPU attention isa ("vec", "vec16", "amx", inferred as vLLM
    would when not given); layout_name: vLLM's resolved `KVCacheLayout` name, for messages.
    """
    caches = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not caches:
        raise LayoutError("detect_layout: no KV cache tensors given")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device \
                or cache.stride() != first.stride():
            raise LayoutError(f"detect_layout: layer {i} is {tuple(cache.shape)} {cache.dtype} {cache.device} "
                              f"strides {cache.stride()}, layer 0 is {tuple(first.shape)} {first.dtype} "
                              f"{first.device} strides {first.stride()}")
    name = (backend or "").upper()
    shape = tuple(first.shape)
    if first.dim() != 4:
        raise UnsupportedLayoutError(f"detect_layout: no adapter for a KV cache of shape {shape} {first.dtype} "
                                     f"(backend {backend!r}); vLLM 0.32+ registers 4-D [blocks, heads, tokens, "
                                     f"head_size + head_size_v] views")

    layout: PagedKVLayout
    if name == CPU_ATTENTION_BACKEND:
        isa = (cpu_isa or "").lower() or default_cpu_isa(first.dtype, shape[2], shape[3] // 2)
        if isa not in _CPU_ISAS:
            raise UnsupportedLayoutError(f"detect_layout: vLLM CPU attention isa '{isa}' is not supported "
                                         f"(supported: {sorted(_CPU_ISAS)}); cache shape {shape}")
        if head_size_v is not None and head_size is not None and head_size_v != head_size:
            raise UnsupportedLayoutError(f"detect_layout: CPU_ATTN with head_size {head_size} != head_size_v "
                                         f"{head_size_v} is not supported")
        if first.element_size() not in (2, 4):
            raise UnsupportedLayoutError(f"detect_layout: CPU_ATTN KV of dtype {first.dtype} (fp8 KV on the CPU "
                                         f"backend) is not supported: its packing is not verified")
        if not first.is_contiguous():
            raise UnsupportedLayoutError(f"detect_layout: CPU_ATTN packs [blocks, heads, tokens, 2*head_size] "
                                         f"layers contiguously (KVCacheLayout LBHNC); this view has strides "
                                         f"{first.stride()} ({ViewStrides.of(caches).order()})")
        layout = _CPU_ISAS[isa].from_caches(caches)
    else:
        mla = head_size_v == 0 or (head_size_v is None and "MLA" in name)
        if head_size is None:
            if not mla and shape[3] % 2:
                raise LayoutError(f"detect_layout: the view's last dim {shape[3]} is odd: give head_size and "
                                  f"head_size_v")
            head_size = shape[3] if mla else shape[3] // 2
        if head_size_v is None:
            head_size_v = 0 if mla else head_size
        layout = StridedKVLayout.from_views(caches, head_size, head_size_v, order=layout_name)

    g = layout.geometry
    if num_kv_heads is not None and num_kv_heads != g.num_kv_heads:
        raise LayoutError(f"detect_layout: {layout.name} cache {shape} has {g.num_kv_heads} kv heads, "
                          f"vLLM says {num_kv_heads}")
    if head_size is not None and head_size != g.head_size:
        raise LayoutError(f"detect_layout: {layout.name} cache {shape} has head_size={g.head_size}, "
                          f"vLLM says {head_size}")
    if block_size is not None and block_size % g.block_size:
        # The views' N is the kernel block size, which divides vLLM's block size when blocks are split.
        raise LayoutError(f"detect_layout: {layout.name} cache {shape} has {g.block_size}-token blocks, "
                          f"which do not divide vLLM's block_size={block_size}")
    return layout
