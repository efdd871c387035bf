"""What vLLM says about the KV caches it registers, turned into a layout adapter.

`layout_for(vllm_config, kv_cache_config, kv_caches)` reads, for the registered layers: their
`AttentionSpec` in the `KVCacheConfig` the connector was built with (head_size, head_size_v: 0 for MLA,
KV heads, block size), the `KVCacheLayout` the engine core resolved, the attention backend's name and, on
vLLM's CPU attention, its isa; `layouts.detect_layout` then builds the adapter from the views' own strides.
A layer that is not attention (a raw buffer of a Mamba-like spec), mixed specs, or a layout no adapter
handles is a `layouts.UnsupportedLayoutError` at start-up that names what was found.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from lmcache_vllm.layouts import PagedKVLayout, UnsupportedLayoutError, detect_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def attention_hints(vllm_config: "VllmConfig", layer_name: str) -> dict[str, Any]:
    """The attention backend's name and the CPU attention isa of `layer_name`, where vLLM has them."""
    hints: dict[str, Any] = {}
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    isa = getattr(layer, "isa", None)
    if isinstance(isa, str):
        hints["cpu_isa"] = isa
    try:
        if layer is not None:
            hints["backend"] = layer.get_attn_backend().get_name()
    except Exception:  # not every layer type exposes its backend (or none is bound yet): the views decide
        pass
    return hints


def spec_of(kv_cache_config: "KVCacheConfig | None", layer_name: str):
    """The `KVCacheSpec` vLLM allocated `layer_name` with, or None when the config does not list it."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        if layer_name in group.layer_names:
            spec = group.kv_cache_spec
            per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            return per_layer.get(layer_name, spec) if isinstance(per_layer, dict) else spec
    return None


def _spec_facts(spec, layer_name: str) -> dict[str, Any]:
    if not all(hasattr(spec, name) for name in ("head_size", "head_size_v", "num_kv_heads", "block_size")):
        raise UnsupportedLayoutError(f"layer {layer_name}: KV cache spec {type(spec).__name__} is not attention; "
                                     f"lmcache-vllm stores attention KV only")
    return {"head_size": spec.head_size, "head_size_v": spec.head_size_v,
            "num_kv_heads": getattr(spec, "num_heads", spec.num_kv_heads), "block_size": spec.block_size}


def layout_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None",
               kv_caches: dict[str, torch.Tensor]) -> PagedKVLayout:
    """The adapter for vLLM's registered `kv_caches` (layer name -> view, in forward order)."""
    names = list(kv_caches)
    facts = [(name, spec_of(kv_cache_config, name)) for name in names]
    known = {name: _spec_facts(spec, name) for name, spec in facts if spec is not None}
    if known:
        first = next(iter(known.values()))
        for name, other in known.items():
            if other != first:
                raise UnsupportedLayoutError(f"layers with different KV specs ({names[0]}: {first}, {name}: "
                                             f"{other}) are not supported")
        hints = dict(first)
    else:  # no spec (a config without groups): what the model config says
        model_config = vllm_config.model_config
        hints = {"head_size": model_config.get_head_size(), "block_size": vllm_config.cache_config.block_size,
                 "num_kv_heads": model_config.get_num_kv_heads(vllm_config.parallel_config)}
        if getattr(model_config, "use_mla", False):
            hints.update(head_size_v=0, num_kv_heads=1)
    layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    layout = detect_layout([kv_caches[name] for name in names], layout_name=layout_name,
                           **hints, **attention_hints(vllm_config, names[0]))
    logger.info("KV layout of %d layers: %r (vLLM layout %s)", len(names), layout, layout_name)
    return layout
