"""The KV cache of a hybrid model built exactly as vLLM 0.32 / 0.33 builds it, for tests and benchmarks (needs
vLLM).

`vllm_hybrid_cache(case)` gives vLLM's own `KVCacheConfig` (`get_kv_cache_groups`,
`get_kv_cache_config_from_groups`: one group per layer kind, layers of different groups sharing the same
bytes) and the per-layer views `allocate_kv_cache` makes of it. `HybridCase` names the model: layers
alternate between full attention (even layers) and the other kind (odd layers): sliding-window attention
(`kind="sliding"`) or Mamba states in vLLM's "align" cache mode (`kind="mamba"`, state pages padded to the
attention page as vLLM does for hybrid models).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class HybridCase:
    kind: str = "sliding"  # "sliding" | "mamba"
    num_layers: int = 4
    num_blocks: int = 128
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 64
    window: int = 40  # sliding window in tokens
    dtype: torch.dtype = torch.bfloat16
    layout: str = "LBHNC"  # vLLM's CPU layout

    def with_(self, **changes: Any) -> "HybridCase":
        return replace(self, **changes)

    @property
    def attention_page_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype.itemsize

    def layer_name(self, index: int) -> str:
        if index % 2 and self.kind == "mamba":
            return f"model.layers.{index}.mixer"
        return f"model.layers.{index}.self_attn.attn"


def layer_specs(case: HybridCase) -> dict[str, Any]:
    """vLLM's KV cache spec of every layer of `case`, in layer order."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs: dict[str, Any] = {}
    for i in range(case.num_layers):
        name = case.layer_name(i)
        if i % 2 == 0:
            specs[name] = FullAttentionSpec(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                                            head_size=case.head_size, dtype=case.dtype)
        elif case.kind == "sliding":
            specs[name] = SlidingWindowSpec(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                                            head_size=case.head_size, dtype=case.dtype,
                                            sliding_window=case.window)
        else:
            specs[name] = MambaSpec(block_size=case.block_size, shapes=((3, 64), (2, 8, 8)),
                                    dtypes=(case.dtype, case.dtype), page_size_padded=case.attention_page_bytes,
                                    mamba_cache_mode="align")
    return specs


def vllm_hybrid_cache(case: HybridCase, device: torch.device | str = "cpu") -> tuple[Any, dict[str, torch.Tensor]]:
    """(vLLM's `KVCacheConfig`, the layer views in layer order) for `case`."""
    from vllm.config import CacheConfig, VllmConfig

    try:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    except ImportError:  # vLLM 0.33 moved them
        from vllm.v1.core.kv_cache_planning import (  # type: ignore[no-redef]
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cache_config = CacheConfig(block_size=case.block_size)
    cache_config.kv_cache_layout = case.layout
    vllm_config = VllmConfig(cache_config=cache_config)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    specs = layer_specs(case)
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    per_block = sum(g.kv_cache_spec.page_size_bytes for g in groups[:1]) * len(groups[0].layer_names)
    config = get_kv_cache_config_from_groups(vllm_config, groups, per_block * case.num_blocks)
    views = allocate_kv_cache(config, torch.device(device), KVCacheLayout[case.layout])
    return config, {name: views[name] for name in specs}


def fill_random(views: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Random finite values through every view (state views: random bytes)."""
    gen = torch.Generator().manual_seed(seed)
    for view in views.values():
        if view.dtype.is_floating_point:
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
        else:
            view.copy_(torch.randint(-128, 128, view.shape, generator=gen, dtype=torch.int8).view(view.dtype))
