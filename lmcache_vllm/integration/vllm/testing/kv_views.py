"""Per-layer KV cache views built exactly as vLLM 0.32/0.33 builds them, for tests and benchmarks.

- `vllm_kv_views(case, device)` calls vLLM's own `get_kv_cache_config_from_groups` and
  `allocate_kv_cache` (which calls `create_kv_cache_views`): one int8 buffer, one `[B, H, N, C]`
  `as_strided` view per layer, ordered by a `KVCacheLayout`.
- `kv_views(case, device)` is a copy of that construction for one attention group, without vLLM (a CUDA
  test host may not have vLLM); `tests/test_kv_views.py` checks on CPU that both give the same views for
  every case, so the copy cannot drift from vLLM.

`KVViewCase` names one configuration: the layout, an attention spec like FLASH_ATTN's (K and V of
`head_size`) or MLA's (one head, `head_size_v = 0`), the dtype (fp8 KV is `torch.uint8`, as vLLM stores it),
and an optional kernel block size (blocks split for the attention kernel). `describe()` gives what the
connector reads from vLLM for `layouts.detect_layout`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

# vLLM's KVCacheLayout members: stride permutation of the logical [L, B, H, N, C] dims, outermost first.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


@dataclass(frozen=True)
class KVViewCase:
    layout: str = "LBNHC"
    num_layers: int = 3
    num_blocks: int = 12
    block_size: int = 32
    kernel_block_size: int | None = None
    num_kv_heads: int = 2
    head_size: int = 64
    mla: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_size_v(self) -> int:
        return 0 if self.mla else self.head_size

    @property
    def heads(self) -> int:
        return 1 if self.mla else self.num_kv_heads

    @property
    def backend(self) -> str:
        return "FLASHMLA" if self.mla else "FLASH_ATTN"

    @property
    def page_bytes(self) -> int:
        """Bytes of one (manager) block of one layer."""
        return self.heads * self.block_size * (self.head_size + self.head_size_v) * self.dtype.itemsize

    def with_(self, **changes) -> "KVViewCase":
        return replace(self, **changes)

    def describe(self) -> dict:
        """`detect_layout` keyword arguments, as the connector reads them from vLLM."""
        return {"backend": self.backend, "head_size": self.head_size, "head_size_v": self.head_size_v,
                "num_kv_heads": self.heads, "block_size": self.block_size, "layout_name": self.layout}

    def __str__(self) -> str:
        kind = "mla" if self.mla else "kv"
        split = f"-k{self.kernel_block_size}" if self.kernel_block_size else ""
        return f"{self.layout}-{kind}-{str(self.dtype).replace('torch.', '')}-b{self.block_size}{split}"


def layer_names(case: KVViewCase) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(case.num_layers)]


def vllm_kv_views(case: KVViewCase, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The views vLLM itself builds for `case` (needs vLLM importable)."""
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    try:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:  # vLLM 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # type: ignore[no-redef]

    cache_config = CacheConfig(block_size=case.block_size)
    cache_config.kv_cache_layout = case.layout
    vllm_config = VllmConfig(cache_config=cache_config)
    spec: FullAttentionSpec  # MLAAttentionSpec is one
    if case.mla:
        spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1, head_size=case.head_size,
                                dtype=case.dtype)
    else:
        spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                                 head_size=case.head_size, dtype=case.dtype)
    names = layer_names(case)
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(names, spec)],
                                             spec.page_size_bytes * case.num_layers * case.num_blocks)
    kernel_sizes = None if case.kernel_block_size is None else [case.kernel_block_size]
    views = allocate_kv_cache(config, torch.device(device), KVCacheLayout[case.layout], kernel_sizes)
    return [views[name] for name in names]


def _layout_strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple[int | None, ...]) -> list[int]:
    """Byte strides of the logical [L, B, H, N, C] dims laid out in `order` (vLLM's compute_layout_strides
    for unpadded pages); `fixed` strides are kept."""
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def kv_views(case: KVViewCase, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The same views as `vllm_kv_views`, built without vLLM (one attention group, unpadded pages)."""
    order = LAYOUTS[case.layout]
    block_outermost = order[0] == _B
    content = (case.head_size + case.head_size_v) * case.dtype.itemsize
    layers = case.num_layers
    # Placement (get_kv_cache_config_from_groups): bytes per block across the group's layers, the number of
    # blocks that fit, and the layer / block strides of the one KVCacheTensor.
    bytes_per_block = layers * case.page_bytes
    num_blocks = case.num_blocks
    manager_shape = (layers, num_blocks, case.heads, case.block_size, content)
    layer_stride, block_stride = _layout_strides(
        manager_shape, order, (None, bytes_per_block if block_outermost else None, None, None, None))[:2]
    raw = torch.zeros(bytes_per_block * num_blocks, dtype=torch.int8, device=device)

    # View creation (create_kv_cache_views), with kernel block splitting.
    kernel = case.kernel_block_size or case.block_size
    if case.block_size % kernel:
        raise ValueError(f"Kernel block size {kernel} must divide KV cache block size {case.block_size}.")
    ratio = case.block_size // kernel
    if ratio > 1:
        if block_stride != case.page_bytes:
            raise ValueError(f"The resolved KV cache layout ({case.layout}) does not store blocks as dense, "
                             f"unpadded pages (block stride {block_stride} != page {case.page_bytes})")
        block_stride //= ratio
    shape = (layers, num_blocks * ratio, case.heads, kernel, content)
    strides = _layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
    view = torch.as_strided(raw, size=shape, stride=strides, storage_offset=raw.storage_offset())
    return [view[layer].view(case.dtype) for layer in range(layers)]


def all_cases(include_refused: bool = False) -> list[KVViewCase]:
    """Every `KVCacheLayout` with a FLASH_ATTN-like and an MLA spec, bf16 and fp8 (uint8), and kernel
    block splitting (16-token kernel blocks in 32-token blocks). vLLM refuses splitting where a block is
    not one dense page (e.g. block-outermost layouts); those cases are left out unless `include_refused`."""
    cases = []
    for layout in LAYOUTS:
        for mla in (False, True):
            for dtype in (torch.bfloat16, torch.uint8):
                cases.append(KVViewCase(layout=layout, mla=mla, dtype=dtype, head_size=576 if mla else 64))
            cases.append(KVViewCase(layout=layout, mla=mla, head_size=576 if mla else 64, kernel_block_size=16))
    return [c for c in cases if include_refused or not refuses(c)]


def refuses(case: KVViewCase) -> bool:
    """Whether vLLM refuses to build `case` (kernel block splitting of a block that is not a dense page)."""
    try:
        kv_views(case.with_(num_blocks=1, num_layers=min(case.num_layers, 2)), "meta")
    except ValueError:
        return True
    return False


def fill_known(views: list[torch.Tensor], case: KVViewCase, seed: int = 0) -> list[torch.Tensor]:
    """Writes random values through each view (so every byte a view addresses is set); returns the
    views. Values are raw bits (uint8 for fp8), so comparisons are bit-exact."""
    gen = torch.Generator().manual_seed(seed)
    for view in views:
        bits = torch.randint(0, 256, (math.prod(view.shape) * view.element_size(),), generator=gen,
                             dtype=torch.uint8)
        values = bits.view(view.dtype).view(view.shape)
        if view.dtype.is_floating_point:  # no NaN patterns: torch.equal must see equal bits as equal
            values = torch.nan_to_num(values, nan=0.0, posinf=1.0, neginf=-1.0)
        view.copy_(values.to(view.device))
    return views
