"""The CUDA kernel against the layouts' torch path, case by case: `kernel_cases()` and `run_case`.

A `KernelCase` is one vLLM KV cache configuration (its views built by vLLM's own `create_kv_cache_views`
through `allocate_kv_cache` where vLLM is importable, by the checked copy in `kv_views.py` otherwise, e.g. on
a GPU host without vLLM), one slot mapping, one chunk target and one build of the kernel. `run_case` fills
the views with random bits, then `layouts.kernel_check.compare_paths` compares the kernel with the torch path
byte for byte: gather and scatter, all layers at once and layer by layer, rows of skipped slots untouched,
no other byte of the cache allocation written.

The cases (`kernel_cases()`, about 90) cover every vLLM 0.32 `KVCacheLayout` a CUDA backend takes (LBNHC,
LBHNC, BLNHC, BLHNC) with FLASH_ATTN, FLASHINFER and TRITON_ATTN views (their kernel block splitting where
vLLM allows it), MLA (head 576, no V), fp8 (uint8 views), bf16 / fp16 / fp32, head sizes 64 / 80 / 96 /
128 / 256 and narrow ones (2, 4, 8 bytes), block sizes 16 / 32 / 64 / 128, slot mappings with holes,
repeats, unaligned starts, one token, all holes and a full 256-token chunk, chunks aliasing an arena (the
pinned L1 path) at aligned and unaligned offsets, and the small-grid build where every thread strides.

`scripts/check_cuda_kernels.py` runs them against the host build (CI, `make check-cuda`) or the real kernel
(a GPU host).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views, refuses, vllm_kv_views
from lmcache_vllm.layouts import detect_layout
from lmcache_vllm.layouts.kernel_check import check_slot_mappings, compare_paths

CUDA_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
FULL_CHUNK = 256


@dataclass(frozen=True)
class KernelCase:
    view: KVViewCase
    backend: str = "FLASH_ATTN"
    slots: str = "mixed"  # see slot_pattern
    chunk: str = "plain"  # "plain" (device memory) or "arena+<byte offset>" (a view into a pinned arena)
    variant: str = "as_built"  # build of the kernel source for the host (testing.cuda_host.VARIANTS)
    what: tuple[str, ...] = field(default=(), compare=False)  # what the case is there for (for listings)

    def __str__(self) -> str:
        return f"{self.view} {self.backend} slots={self.slots} chunk={self.chunk} build={self.variant}"


def _view(layout: str, **changes: Any) -> KVViewCase:
    base = KVViewCase(layout=layout, num_layers=3, num_blocks=24, block_size=16, num_kv_heads=4, head_size=128)
    return replace(base, **changes)


def _split_if_allowed(view: KVViewCase, kernel_block_size: int) -> KVViewCase:
    """vLLM splits a block into kernel blocks only where a block is one dense page (layer-outermost)."""
    split = view.with_(kernel_block_size=kernel_block_size)
    return view if kernel_block_size >= view.block_size or refuses(split) else split


def kernel_cases() -> list[KernelCase]:
    cases: list[KernelCase] = []
    for layout in CUDA_LAYOUTS:
        # The three CUDA backends of vLLM 0.32 over one global layout: FlashInfer and Triton split vLLM's
        # blocks into 16-token kernel blocks where the layout allows it.
        cases.append(KernelCase(_view(layout), "FLASH_ATTN", what=("layout", "backend")))
        cases.append(KernelCase(_split_if_allowed(_view(layout, block_size=32), 16), "FLASHINFER",
                                what=("layout", "backend", "kernel blocks")))
        cases.append(KernelCase(_split_if_allowed(_view(layout, block_size=64), 16), "TRITON_ATTN",
                                what=("layout", "backend", "kernel blocks")))
        for dtype in (torch.float16, torch.float32, torch.uint8):
            cases.append(KernelCase(_view(layout, dtype=dtype), what=("dtype",)))
        for head_size in (64, 80, 96, 256):
            cases.append(KernelCase(_view(layout, head_size=head_size), what=("head size",)))
        for block_size in (32, 64, 128):
            cases.append(KernelCase(_view(layout, block_size=block_size, num_blocks=8), what=("block size",)))
        for dtype in (torch.bfloat16, torch.uint8):
            cases.append(KernelCase(_view(layout, mla=True, head_size=576, dtype=dtype), "FLASHMLA", what=("mla",)))
        for offset in (64, 2):  # a chunk inside the L1 arena: 16-byte units, then 2-byte units
            cases.append(KernelCase(_view(layout), chunk=f"arena+{offset}", what=("pinned arena",)))
        cases.append(KernelCase(_view(layout), slots="full_chunk", variant="small_grid", what=("grid stride",)))
    for layout in ("LBNHC", "BLHNC"):
        for slots in ("one_token", "full_chunk", "holes", "repeats", "unaligned", "all_holes"):
            cases.append(KernelCase(_view(layout), slots=slots, what=("slots",)))
        for head_size in (2, 4, 8):  # fp8 pieces of 2, 4, 8 bytes: the narrow units
            cases.append(KernelCase(_view(layout, head_size=head_size, dtype=torch.uint8), what=("narrow",)))
        cases.append(KernelCase(_view(layout, mla=True, head_size=576), "FLASHMLA", slots="full_chunk",
                                variant="small_grid", what=("mla", "grid stride")))
    return cases


def slot_pattern(name: str, num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """The case's slot mapping over `num_blocks` blocks of `block_size` (the views' kernel blocks)."""
    n = block_size
    if name == "mixed":
        return check_slot_mappings(num_blocks, n, gen)[0]
    if name == "one_token":
        return torch.tensor([3 * n + n // 2 + 1])
    if name == "all_holes":
        return torch.full((5,), -1, dtype=torch.int64)
    if name == "unaligned":  # starts mid-block, crosses two block boundaries
        return torch.arange(3 * n + 5, 3 * n + 5 + 2 * n + 3)
    blocks = torch.randperm(num_blocks, generator=gen)[:-(-FULL_CHUNK // n)]  # whole blocks, out of order
    full = torch.cat([torch.arange(b * n, (b + 1) * n) for b in blocks.tolist()])[:FULL_CHUNK]
    if name == "full_chunk":
        return full
    if name == "holes":
        full = full.clone()
        full[::7] = -1
        full[40:60] = -1
        return full
    if name == "repeats":
        return torch.cat([full[:20], full[5:9], full[:3], full[100:110]])
    raise ValueError(f"unknown slot pattern {name!r}")


def chunk_factory(target: str, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Host bytes -> a chunk holding them: device memory, or a view at a byte offset into an arena (pinned
    host memory on a GPU, which the kernel reaches through its device alias)."""
    if target == "plain":
        return lambda host: host.to(device, copy=True)
    offset = int(target.split("+")[1])

    def in_arena(host: torch.Tensor) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        arena = torch.empty(nbytes + offset + 64, dtype=torch.uint8, pin_memory=device.type == "cuda")
        shift = (-arena.data_ptr()) % 64 + offset  # `offset` bytes past a 64-byte line
        chunk = arena[shift:shift + nbytes].view(host.dtype).view(host.shape)
        return chunk.copy_(host)
    return in_arena


def build_views(view: KVViewCase, device: torch.device | str) -> list[torch.Tensor]:
    """vLLM's own views where vLLM is importable, the checked copy otherwise."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return kv_views(view, device)
    return vllm_kv_views(view, device)


def run_case(case: KernelCase, kernel: Any, device: torch.device | str = "cpu", seed: int = 0) -> str | None:
    """None when `kernel` gives the torch path's bytes on `case`, else what differed."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    views = fill_known(build_views(case.view, device), case.view, seed=seed)
    hints = case.view.describe()
    hints["backend"] = case.backend
    layout = detect_layout(views, **hints)
    slots = slot_pattern(case.slots, views[0].shape[0], views[0].shape[2], gen)
    if hasattr(kernel, "with_chunk_path"):  # the host build: the pinned path goes through the mapped alias
        kernel = kernel.with_chunk_path(case.chunk != "plain")
    return compare_paths(layout, views, slots, kernel, chunk_factory(case.chunk, device), gen)


def unit_bytes(case: KernelCase, kernel: Any) -> int:
    """The width of the units the host build moves for `case` (which branch of the kernel it exercises)."""
    views = kv_views(case.view, "cpu")  # geometry and addresses only: the checked copy is enough
    layout = detect_layout(views, **case.view.describe())
    slots = torch.zeros(1, dtype=torch.int64)
    chunk = chunk_factory(case.chunk, torch.device("cpu"))(torch.zeros(layout.chunk_shape(1), dtype=case.view.dtype))
    width: int = kernel.with_chunk_path(case.chunk != "plain").unit_bytes(views, slots, chunk, views[0].shape[2])
    return width
