"""The device checks itself before it trusts the kernel: `choose_kernel`, `self_check`, `compare_paths`.

A CUDA kernel that compiled is not a kernel that is right on this GPU, toolkit and driver (the last kernels
that ran on an H100 failed 11 of their own tests). So before a layout hands its copies to the compiled
kernel, `choose_kernel` (called through `PagedKVLayout.bind_kernel`, at registration or on the first copy)
runs the kernel and the layout's torch code on a scratch copy of the live cache's layout (`scratch_views`:
the same dtype, view shape except the number of blocks, element strides, layer placement and address
alignment; never the live cache) and compares every byte:
- gather of every layer in one call, and of each layer alone (the layerwise path), into a chunk that
  starts with random bytes (rows of skipped slots must keep them);
- scatter of every layer and of each layer alone into copies of the scratch allocation (no other byte of
  it may change);
for slot mappings with whole blocks, an unaligned partial block, holes (-1), a repeated slot (gather only:
two writers of one slot race on a GPU) and scattered slots, and a single token; into device memory and into
pinned host memory (the L1 path) on a GPU.

Policy (`extra_config.cuda_kernel`): "auto" uses the kernel only if every byte matches; otherwise it logs
one error naming the layout and what differed, counts `cuda_kernel_fallbacks`, and the layout's copies take
the torch path. "on" makes a mismatch or a missing kernel an error. "off" never uses the kernel.

The logic here is plain Python on tensors: CI runs it on the CPU against the kernel source compiled for the
host (`lmcache_vllm.integration.vllm.testing.cuda_host`), a GPU against the real kernel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from lmcache_vllm import ops
from lmcache_vllm.layouts.errors import LayoutError
from lmcache_vllm.observability import metrics


class CheckedLayout(Protocol):
    """What the self-check needs of a layout. `base.PagedKVLayout` provides it and calls this module: a
    protocol, so this module does not import the base layout back."""

    name: str
    op_code: int | None
    geometry: Any

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]: ...

    def kernel_transfer(self, ext: Any, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                        chunk: torch.Tensor) -> None: ...

    def torch_transfer(self, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                       chunk: torch.Tensor) -> None: ...

logger = logging.getLogger(__name__)

POLICIES = ("auto", "on", "off")
SCRATCH_BLOCKS = 6
_ALIGN = 256  # scratch layer bases keep the live bases' address modulo this (the kernel's unit width needs 16)

ChunkFactory = Callable[[torch.Tensor], torch.Tensor]  # host bytes -> a chunk holding them on its target memory


@dataclass(frozen=True)
class KernelVerdict:
    """What `choose_kernel` decided for one layout on one device."""

    layout: str
    device: str
    policy: str
    use_kernel: bool
    reason: str
    bound: bool = True  # False: nothing decided here (not a GPU and no kernel given): the usual CPU choice


def choose_kernel(layout: CheckedLayout, caches: list[torch.Tensor], policy: str,
                  ext: Any = None) -> tuple[KernelVerdict, Any]:
    """The verdict for `layout` on `caches`' device and the kernel to use (None: the torch path)."""
    if policy not in POLICIES:
        raise ValueError(f"cuda_kernel policy must be one of {POLICIES}, got {policy!r}")
    device = caches[0].device
    name = repr(layout)

    def verdict(use: bool, reason: str, bound: bool = True) -> KernelVerdict:
        return KernelVerdict(name, str(device), policy, use, reason, bound)

    if ext is None:
        if device.type != "cuda":
            return verdict(False, "not a CUDA device: the compiled CPU op or torch, as lmcache_vllm.ops picks",
                           bound=False), None
        ext = ops.cuda_ext()
    if policy == "off":
        logger.info("KV layout %s on %s: extra_config.cuda_kernel is off, copies use the torch path", name, device)
        return verdict(False, "extra_config.cuda_kernel is off"), None
    if ext is None or layout.op_code not in getattr(ext, "SUPPORTED_LAYOUTS", ()):
        reason = ("the CUDA extension lmcache_vllm._cuda_ops is not built" if ext is None
                  else f"the kernel has no code for layout {layout.name} (op code {layout.op_code})")
        if policy == "on":
            raise LayoutError(f"extra_config.cuda_kernel is on, but {reason} ({name})")
        metrics.inc("cuda_kernel_fallbacks", reason="not_built")
        logger.warning("KV layout %s on %s: %s; copies use the torch path", name, device, reason)
        return verdict(False, reason), None
    try:
        problem, kind = self_check(layout, caches, ext), "mismatch"
    except Exception as exc:  # a kernel that fails to run is a kernel we do not use
        problem, kind = f"the check raised {type(exc).__name__}: {exc}", "error"
    if problem is None:
        logger.info("KV layout %s on %s: the CUDA kernel gave the torch path's bytes on a scratch copy of this "
                    "layout; copies use the kernel", name, device)
        return verdict(True, "the kernel matches the torch path"), ext
    metrics.inc("cuda_kernel_fallbacks", reason=kind)
    if policy == "on":
        raise LayoutError(f"extra_config.cuda_kernel is on, but the CUDA kernel failed its self-check on "
                          f"KV layout {name}: {problem}")
    logger.error("CUDA kernel self-check failed for KV layout %s on %s: %s; this layout's copies use the torch "
                 "path (extra_config.cuda_kernel: auto)", name, device, problem)
    return verdict(False, problem), None


def self_check(layout: CheckedLayout, caches: Sequence[torch.Tensor], ext: Any) -> str | None:
    """Kernel `ext` against the torch path on a scratch copy of `caches`' layout: None when every byte
    matches, else what differed first."""
    device = caches[0].device
    gen = torch.Generator().manual_seed(20261123)
    views = scratch_views(caches, SCRATCH_BLOCKS, gen)
    targets: dict[str, ChunkFactory] = {"device memory": lambda host: host.to(device, copy=True)}
    if device.type == "cuda":  # the L1 arena's path: the kernel writes pinned host memory over its alias
        targets["pinned host memory"] = lambda host: torch.empty_like(host).pin_memory().copy_(host)
    for slots in check_slot_mappings(views[0].shape[0], layout.geometry.block_size, gen):
        for target, new_chunk in targets.items():
            problem = compare_paths(layout, views, slots, ext, new_chunk, gen)
            if problem is not None:
                return f"{problem} ({len(slots)} slots into {target})"
    return None


def check_slot_mappings(num_blocks: int, block_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Slot mappings that reach every branch of a copy: a whole aligned block, a partial block from an
    unaligned start, holes, a repeated slot, scattered slots; and a single token."""
    n, total = block_size, num_blocks * block_size
    whole = torch.arange((1 % num_blocks) * n, (1 % num_blocks + 1) * n)
    first = (2 % num_blocks) * n + min(1, n - 1)
    partial = torch.arange(first, first + max(1, n - 2))
    scattered = torch.randperm(total, generator=gen)[:5]
    hole = torch.tensor([-1])
    mixed = torch.cat([whole, hole, partial, scattered[:3], whole[n // 2:n // 2 + 1], hole, scattered[3:]])
    return [mixed, scattered[:1]]


def first_occurrences(slots: torch.Tensor) -> torch.Tensor:
    """`slots` with every repeat of a slot replaced by -1 (a scatter writes each slot once)."""
    seen: set[int] = set()
    out = []
    for slot in slots.tolist():
        out.append(-1 if slot >= 0 and slot in seen else slot)
        seen.add(slot)
    return torch.tensor(out, dtype=torch.int64)


def compare_paths(layout: CheckedLayout, views: list[torch.Tensor], slots: torch.Tensor, ext: Any,
                  new_chunk: ChunkFactory, gen: torch.Generator) -> str | None:
    """Gather and scatter of `slots` over `views` through `ext` and through the torch path, all layers at
    once and layer by layer: None when both give the same bytes, else the first difference."""
    shape, dtype = layout.chunk_shape(len(slots)), layout.geometry.dtype
    sentinel = random_bits(shape, dtype, gen)
    reference = new_chunk(sentinel)
    layout.torch_transfer(True, views, slots, reference)
    gathered = {what: new_chunk(sentinel) for what in ("gather", "layerwise gather")}
    for what, chunk in gathered.items():
        _through_kernel(layout, ext, True, views, slots, chunk, layerwise=what != "gather")
    _sync(views[0].device)
    for what, chunk in gathered.items():
        problem = _chunk_difference(chunk, reference, slots)
        if problem is not None:
            return f"{what}: {problem}"

    unique = first_occurrences(slots)
    source = new_chunk(random_bits(shape, dtype, gen))
    expected = clone_views(views)
    layout.torch_transfer(False, expected, unique, source)
    written = {what: clone_views(views) for what in ("scatter", "layerwise scatter")}
    for what, into in written.items():
        _through_kernel(layout, ext, False, into, unique, source, layerwise=what != "scatter")
    _sync(views[0].device)
    for what, into in written.items():
        problem = _backing_difference(into, expected)
        if problem is not None:
            return f"{what}: {problem}"
    return None


def _through_kernel(layout: CheckedLayout, ext: Any, gather: bool, views: list[torch.Tensor],
                    slots: torch.Tensor, chunk: torch.Tensor, layerwise: bool) -> None:
    """One call for every layer, or one call per layer (the kernel's single-layer path)."""
    if not layerwise:
        layout.kernel_transfer(ext, gather, views, slots, chunk)
        return
    for layer, view in enumerate(views):
        layout.kernel_transfer(ext, gather, [view], slots, chunk[layer:layer + 1])


# ---- scratch copies of a layout -----------------------------------------------------------------------------

def scratch_views(caches: Sequence[torch.Tensor], num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Views like `caches` (dtype, element strides, sizes but at most `num_blocks` blocks, every layer, layers
    interleaved the same way, each base at the live base's address modulo 256) into a new allocation on their
    device, filled with random values (no NaN patterns)."""
    first = caches[0]
    item = first.element_size()
    strides = first.stride()
    shape = (max(1, min(num_blocks, first.shape[0])), *first.shape[1:])
    span = item * (1 + sum((size - 1) * stride for size, stride in zip(shape, strides)))
    live_span = item * (1 + sum((size - 1) * stride for size, stride in zip(first.shape, strides)))
    gaps = [cache.data_ptr() - first.data_ptr() for cache in caches]
    if all(0 <= gap < live_span for gap in gaps) and len(set(gaps)) == len(gaps):
        offsets = gaps  # layers interleave inside one span (block-outermost layouts): keep their placement
    else:  # layers apart (or aliasing one view): one span each, in order, each base's alignment kept
        room = -(-span // _ALIGN) * _ALIGN + _ALIGN
        offsets = [layer * room + (gap % _ALIGN) for layer, gap in enumerate(gaps)]
    total = -(-(max(offsets) + span) // item) * item
    lead = first.data_ptr() % _ALIGN
    raw = torch.empty(total + 2 * _ALIGN, dtype=torch.uint8, device=first.device)
    start = (-raw.data_ptr()) % _ALIGN + lead
    typed = raw[start:start + total].view(first.dtype)
    fill_random(typed, gen)
    return [torch.as_strided(typed, shape, strides, typed.storage_offset() + offset // item) for offset in offsets]


def random_bits(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A host tensor of random bits (float dtypes: no NaN or infinity patterns, so any copy keeps them)."""
    out = torch.empty(tuple(shape), dtype=dtype)
    fill_random(out, gen)
    return out


def fill_random(tensor: torch.Tensor, gen: torch.Generator) -> None:
    raw = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=gen, dtype=torch.uint8)
    values = raw.view(tensor.dtype).view(tensor.shape)
    if tensor.dtype.is_floating_point:
        values = torch.nan_to_num(values, nan=0.5, posinf=1.0, neginf=-1.0)
    tensor.copy_(values)


def backing(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation `view` lives in."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def clone_views(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The same views (sizes, strides, offsets) into copies of their allocations."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for view in views:
        key = view.untyped_storage().data_ptr()
        if key not in copies:
            copies[key] = backing(view).clone()
        out.append(torch.empty(0, dtype=view.dtype, device=view.device).set_(
            copies[key].untyped_storage(), view.storage_offset(), view.shape, view.stride()))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunk_difference(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor) -> str | None:
    a = got.detach().cpu().contiguous().view(torch.uint8)
    b = want.detach().cpu().contiguous().view(torch.uint8)
    if torch.equal(a, b):
        return None
    rows = (a != b).view(*got.shape[:3], -1).any(-1).nonzero()
    layer, plane, token = (int(v) for v in rows[0])
    return (f"{len(rows)} (layer, plane, token) rows differ, first layer {layer} plane {plane} token {token} "
            f"(slot {int(slots[token])})")


def _backing_difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> str | None:
    for g, w in zip(got, want):
        a, b = backing(g).cpu(), backing(w).cpu()
        if not torch.equal(a, b):
            where = (a != b).nonzero().flatten()
            return f"{where.numel()} bytes of the cache allocation differ, first at byte {int(where[0])}"
    return None
