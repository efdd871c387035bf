"""Layout adapters between an engine's paged KV cache and the stored chunk format, and `detect_layout`.

`detect_layout(kv_caches, ...)` picks the adapter from the per-layer tensor shape and the hints the
caller knows (attention backend name, CPU attention isa, block size, heads, head size), and raises
`UnsupportedLayoutError` naming any layout it cannot handle.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from lmcache_vllm.layouts.base import (KVGeometry, LayoutError, PagedKVLayout, SlotPlan,
                                       UnsupportedLayoutError, plan_slots)
from lmcache_vllm.layouts.cpu import CpuAmxLayout, CpuVecLayout
from lmcache_vllm.layouts.cuda import CudaFlashLayout, MlaLayout

__all__ = ["KVGeometry", "LayoutError", "PagedKVLayout", "SlotPlan", "UnsupportedLayoutError", "plan_slots",
           "CpuVecLayout", "CpuAmxLayout", "CudaFlashLayout", "MlaLayout", "detect_layout",
           "default_cpu_isa"]

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


def _isa_from_hint(hint: str) -> str | None:
    for sep in (":", "/", "-"):
        if sep in hint:
            return hint.rsplit(sep, 1)[1]
    return None


def detect_layout(kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], *,
                  backend_hint: str | None = None, block_size: int | None = None,
                  num_kv_heads: int | None = None, head_size: int | None = None,
                  cpu_isa: str | None = None) -> PagedKVLayout:
    """Returns the adapter for `kv_caches` (one tensor per layer, in layer order).

    backend_hint: e.g. "CPU_ATTN", "cpu:amx", "FLASH_ATTN", "FLASHMLA"; cpu_isa: vLLM's CPU attention
    isa ("vec", "vec16", "amx"); when neither names the isa it is inferred as vLLM would on this host.
    """
    caches = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not caches:
        raise LayoutError("detect_layout: no KV cache tensors given")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise LayoutError(f"detect_layout: layer {i} is {tuple(cache.shape)} {cache.dtype} {cache.device}, "
                              f"layer 0 is {tuple(first.shape)} {first.dtype} {first.device}")
    hint = (backend_hint or "").lower()
    shape = tuple(first.shape)

    if "flashinfer" in hint:  # [num_blocks, 2, block_size, heads, head_size]: another token order
        raise UnsupportedLayoutError(f"detect_layout: the {backend_hint} KV layout {shape} is not supported "
                                     f"(supported: CPU_ATTN vec/vec16/amx, FLASH_ATTN, MLA)")
    if "mla" in hint or (first.dim() == 3 and not hint.startswith("cpu")):
        layout: PagedKVLayout = MlaLayout.from_caches(caches)
    elif first.dim() == 5 and shape[0] == 2 and not hint.startswith("cpu"):
        layout = CudaFlashLayout.from_caches(caches)
    elif first.dim() == 4 and (hint == "" or hint.startswith("cpu")):
        isa = (cpu_isa or _isa_from_hint(hint) or "").lower()
        if not isa:
            isa = default_cpu_isa(first.dtype, shape[2], shape[3] // 2)
        if isa not in _CPU_ISAS:
            raise UnsupportedLayoutError(f"detect_layout: vLLM CPU attention isa '{isa}' is not supported "
                                         f"(supported: {sorted(_CPU_ISAS)}); cache shape {shape}")
        layout = _CPU_ISAS[isa].from_caches(caches)
    else:
        raise UnsupportedLayoutError(f"detect_layout: no adapter for KV cache shape {shape} {first.dtype} "
                                     f"with backend hint {backend_hint!r}")

    g = layout.geometry
    for what, hinted, actual in (("block_size", block_size, g.block_size),
                                 ("num_kv_heads", num_kv_heads, g.num_kv_heads),
                                 ("head_size", head_size, g.head_size)):
        if hinted is not None and hinted != actual:
            raise LayoutError(f"detect_layout: {layout.name} cache {shape} has {what}={actual}, caller says {hinted}")
    return layout
