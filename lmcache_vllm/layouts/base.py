"""The paged-KV layout contract: `KVGeometry`, `SlotPlan` and the `PagedKVLayout` ABC.

A layout adapter copies tokens between an engine's paged KV cache (one tensor per layer, addressed by
slot = block_id * block_size + offset) and the stored chunk format `[num_layers, planes, T, width]`
(planes = 2 for K/V, 1 for MLA; width = num_kv_heads * head_size). Slots < 0 are skipped: their chunk
rows are left as they are on gather and their cache slots are not written on scatter.

The base class does validation and planning; subclasses supply the torch copies for whole-block runs and
for single tokens. When a compiled op (`lmcache_vllm.ops`) exists for the layout and device, `gather` /
`scatter` hand all layers to it in one call instead. On a GPU that op (the CUDA kernel) is used only after
`bind_kernel` found it agrees with the torch path on a scratch copy of the cache's layout
(`layouts.kernel_check`; done on the first copy unless the connector did it at registration).

The torch path between a GPU's cache and a chunk in host memory goes through a device staging chunk: the
gather fills it on the current stream and `streams.copy_to_host` moves it into the host chunk in one
non-blocking copy on the copy stream; a scatter copies the host chunk into a staging chunk on the current
stream first. `stage_on_cpu = True` runs the same staging on CPU tensors (tests, benchmarks).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lmcache_vllm import ops
from lmcache_vllm.layouts.errors import LayoutError
from lmcache_vllm.layouts.slots import SlotPlan, plan_slots
from lmcache_vllm.layouts.streams import copy_to_host, valid_runs

if TYPE_CHECKING:
    from lmcache_vllm.layouts.kernel_check import KernelVerdict




@dataclass(frozen=True)
class KVGeometry:
    """Shape facts shared by every layer of one engine's paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_planes: int = 2  # 2 = K and V; 1 = MLA latent

    @property
    def token_width(self) -> int:
        """Elements per token per plane in the stored chunk."""
        return self.num_kv_heads * self.head_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class PagedKVLayout(ABC):
    """Adapter between one engine's paged KV cache layout and the stored chunk format."""

    name: str = "abstract"
    op_code: int | None = None  # layout id understood by the compiled ops; None = torch only
    cpu_task_shapes = False  # the compiled CPU op splits this layout's calls by a task shape it measures

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry
        # (slot mapping, its plan, the slots on the caches' device, the stream that copied them there) of the
        # last call, replaced as one tuple so threads never see a mixed set.
        self._last_plan: tuple[torch.Tensor, SlotPlan | None, torch.Tensor, object] | None = None
        # (device, the kernel `bind_kernel` chose for it or None for the torch path, the verdict)
        self._bound: tuple[torch.device, Any, "KernelVerdict"] | None = None
        self._bind_lock = threading.RLock()
        self.stage_on_cpu = False  # run the torch path's device staging on CPU tensors too

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.geometry})"

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        g = self.geometry
        return (g.num_layers, g.kv_planes, num_tokens, g.token_width)

    # ---- subclass hooks (one layer, torch) -------------------------------------------------------
    @abstractmethod
    def expected_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""

    @abstractmethod
    def _gather_blocks(self, cache: torch.Tensor, block: int, count: int, rows: torch.Tensor) -> None:
        """Copies `count` whole blocks from `block` on into rows [planes, count*block_size, width]."""

    @abstractmethod
    def _scatter_blocks(self, rows: torch.Tensor, cache: torch.Tensor, block: int, count: int) -> None:
        """Inverse of `_gather_blocks`."""

    @abstractmethod
    def _gather_tokens(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Returns [planes, len(slots), width] for the given valid slots."""

    @abstractmethod
    def _scatter_tokens(self, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Writes values [planes, len(slots), width] into the given valid slots."""

    # ---- public API ------------------------------------------------------------------------------
    # Slot mappings are expected on the CPU (vLLM's block ids are host data): they are checked there, and
    # moved to a GPU only through pinned memory, asynchronously. A GPU slot mapping is accepted, at the cost
    # of a copy to the host.
    def gather(self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
        """Copies the slots' KV of every layer into `out` (`chunk_shape(len(slot_mapping))`).

        On a GPU the copy is only enqueued on the current stream: `out` (host memory) holds the KV once
        that stream has passed this point (`streams.Fence`)."""
        self.gather_chunks(kv_caches, slot_mapping, [out])

    def scatter(self, chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Copies every layer of `chunk` into the slots of the paged caches (on a GPU: enqueued on the
        current stream; `chunk` must stay untouched until the stream has passed this point)."""
        self.scatter_chunks([chunk], kv_caches, slot_mapping)

    def gather_chunks(self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                      outs: Sequence[torch.Tensor]) -> None:
        """`gather` into several chunks in one call: `outs[i]` (`chunk_shape(T_i)`) takes the next T_i slots
        of `slot_mapping` (whose length is the sum of the T_i): a save's chunks, one compiled call."""
        caches = self._check_caches(kv_caches)
        slots = self._check_slots(slot_mapping)
        self._check_chunks(outs, slots.numel(), self.num_layers, "out")
        self._transfer(True, caches, slots, list(outs))

    def scatter_chunks(self, chunks: Sequence[torch.Tensor], kv_caches: Sequence[torch.Tensor],
                       slot_mapping: torch.Tensor) -> None:
        """`scatter` of several chunks in one call, chunk i holding the next T_i slots of `slot_mapping`: a
        load's chunks, one compiled call."""
        caches = self._check_caches(kv_caches)
        slots = self._check_slots(slot_mapping)
        self._check_chunks(chunks, slots.numel(), self.num_layers, "chunk")
        self._transfer(False, caches, slots, list(chunks))

    def gather_layer(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     out_layer: torch.Tensor) -> None:
        """One layer of `gather`: out_layer is `chunk_shape(T)[1:]`."""
        self.gather_layer_chunks(layer, kv_cache, slot_mapping, [out_layer])

    def scatter_layer(self, chunk_layer: torch.Tensor, layer: int, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """One layer of `scatter`: chunk_layer is `chunk_shape(T)[1:]`."""
        self.scatter_layer_chunks([chunk_layer], layer, kv_cache, slot_mapping)

    def gather_layer_chunks(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            out_layers: Sequence[torch.Tensor]) -> None:
        """One layer of `gather_chunks`: each out_layer is `chunk_shape(T_i)[1:]`."""
        self._layer_transfer(True, layer, kv_cache, slot_mapping, out_layers, "out_layer")

    def scatter_layer_chunks(self, chunk_layers: Sequence[torch.Tensor], layer: int, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
        """One layer of `scatter_chunks`: each chunk_layer is `chunk_shape(T_i)[1:]`."""
        self._layer_transfer(False, layer, kv_cache, slot_mapping, chunk_layers, "chunk_layer")

    def layer_copier(self, gather: bool, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                     chunks: Sequence[torch.Tensor]) -> Callable[[int], None]:
        """`copy(layer)`: that layer of `gather_chunks` (`gather`) or `scatter_chunks`, for a layerwise store or
        load. The inputs are checked once, here; with the compiled CPU op each call is then one call of it with
        no per-chunk Python (the layer views are made in C++), else one `*_layer_chunks` call."""
        caches = self._check_caches(kv_caches)
        slots = self._check_slots(slot_mapping)
        self._check_chunks(chunks, slots.numel(), self.num_layers, "out" if gather else "chunk")
        ext = self._kernel_for(caches)
        name = "gather_layers" if gather else "scatter_layers"
        if ext is None or caches[0].device.type != "cpu" or not hasattr(ext, name) or self.op_code is None:
            if gather:
                return lambda layer: self.gather_layer_chunks(layer, caches[layer], slots, [c[layer] for c in chunks])
            return lambda layer: self.scatter_layer_chunks([c[layer] for c in chunks], layer, caches[layer], slots)
        run, chunk_list, op_code, block_size = getattr(ext, name), list(chunks), self.op_code, self.geometry.block_size

        def copy(layer: int) -> None:
            error = run(caches, slots, chunk_list, op_code, block_size, layer, 1) if gather else \
                run(chunk_list, caches, slots, op_code, block_size, layer, 1)
            if error:
                raise LayoutError(f"{self.name}: {error}")
        return copy

    def _layer_transfer(self, gather: bool, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        chunk_layers: Sequence[torch.Tensor], what: str) -> None:
        self._check_layer_index(layer)
        cache = self._check_caches([kv_cache])[0]
        slots = self._check_slots(slot_mapping)
        chunks = [chunk.unsqueeze(0) for chunk in chunk_layers]
        self._check_chunks(chunks, slots.numel(), 1, what)
        self._transfer(gather, [cache], slots, chunks)

    # ---- which path moves the data ---------------------------------------------------------------
    def bind_kernel(self, kv_caches: Sequence[torch.Tensor], policy: str = "auto",
                    ext: Any = None) -> "KernelVerdict":
        """Decides, once, whether the compiled kernel moves this layout's data on the caches' device:
        `policy` "auto" (after a self-check on a scratch copy of the caches' layout; a mismatch is logged,
        counted and the torch path used), "on" (the same check; a mismatch or a missing kernel is an error),
        "off" (torch path). `ext`: the kernel to check (default: the CUDA extension on a GPU; tests give the
        kernel source compiled for the host). Without `ext`, caches off a GPU keep the compiled CPU op,
        which CI tests directly."""
        from lmcache_vllm.layouts.kernel_check import choose_kernel  # it builds on this module
        caches = self._check_caches(kv_caches)
        with self._bind_lock:
            verdict, chosen = choose_kernel(self, caches, policy, ext)
            self._bound = (caches[0].device, chosen, verdict) if verdict.bound else None
        if ext is None and caches[0].device.type == "cpu":
            self._choose_cpu_tasks(caches)
        return verdict

    def _choose_cpu_tasks(self, caches: list[torch.Tensor]) -> None:
        """The compiled CPU op picks its task shape by timing both on its first call (`_cpu_ops.tasks`): that
        call is made here, at start-up (a gather of one block into a scratch chunk), not in a request's step."""
        ext = ops.compiled_for(caches[0].device, self.op_code) if self.cpu_task_shapes else None
        if ext is None or not hasattr(ext, "tasks_note"):
            return
        if ext.tasks() == "auto":
            bs = self.geometry.block_size
            out = torch.empty(self.chunk_shape(bs), dtype=self.geometry.dtype)
            self.gather(caches, torch.arange(bs), out)
        ops.log_cpu_tasks(ext)

    def _kernel_for(self, caches: list[torch.Tensor]) -> Any:
        """The compiled op for this copy, or None for the torch path."""
        device = caches[0].device
        if ops.mode() == "torch":
            return None
        bound = self._bound
        if device.type == "cuda" and (bound is None or bound[0] != device):
            with self._bind_lock:  # first copy on this GPU: the kernel is trusted only after its check (once)
                if self._bound is None or self._bound[0] != device:
                    self.bind_kernel(caches)
            bound = self._bound
        if bound is not None and bound[0] == device:
            return bound[1]
        return ops.compiled_for(device, self.op_code)

    # ---- internals -------------------------------------------------------------------------------
    def _transfer(self, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                  chunks: list[torch.Tensor]) -> None:
        device = caches[0].device
        ext = self._kernel_for(caches)
        if ext is not None and device.type != "cpu" and any(c.device.type == "cpu" and not c.is_pinned()
                                                           for c in chunks):
            ext = None  # the kernels reach host memory only through a pinned chunk's device alias
        if ext is not None:
            self.kernel_transfer_chunks(ext, gather, caches, slots, chunks)
        else:
            self.torch_transfer_chunks(gather, caches, slots, chunks)

    def kernel_transfer(self, ext: Any, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                        chunk: torch.Tensor) -> None:
        """One gather (caches -> chunk) or scatter of checked inputs through the compiled op `ext`."""
        self.kernel_transfer_chunks(ext, gather, caches, slots, [chunk])

    def kernel_transfer_chunks(self, ext: Any, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                               chunks: list[torch.Tensor]) -> None:
        """`kernel_transfer` of several chunks (chunk i: the next T_i slots), one call where the op allows."""
        if self.op_code is None:
            raise LayoutError(f"{self.name}: no compiled op moves this layout")
        _, device_slots = self._plan_for(slots, caches[0].device, need_plan=False)
        error = ops.transfer_chunks(ext, gather, caches, device_slots, chunks, self.op_code, self.geometry.block_size)
        if error:
            raise LayoutError(f"{self.name}: {error}")

    def torch_transfer_chunks(self, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                              chunks: list[torch.Tensor]) -> None:
        """`torch_transfer` of each chunk in turn (chunk i: the next T_i slots)."""
        if len(chunks) == 1:
            self.torch_transfer(gather, caches, slots, chunks[0])
            return
        first = 0
        for chunk in chunks:
            count = chunk.shape[2]
            self.torch_transfer(gather, caches, slots[first:first + count], chunk)
            first += count

    def torch_transfer(self, gather: bool, caches: list[torch.Tensor], slots: torch.Tensor,
                       chunk: torch.Tensor) -> None:
        """The same through the layout's torch code (via a device staging chunk between a GPU and host
        memory)."""
        device = caches[0].device
        plan, device_slots = self._plan_for(slots, device, need_plan=True)
        if plan is None:
            raise AssertionError("_plan_for(need_plan=True) gave no plan")
        pos, token_slots = plan.token_pos.to(device), device_slots.index_select(0, plan.token_pos.to(device))
        staged = chunk.device != device or self.stage_on_cpu
        if gather:
            target = torch.empty(chunk.shape, dtype=chunk.dtype, device=device) if staged else chunk
            for cache, out_layer in zip(caches, target):
                self._gather_planned(cache, plan, pos, token_slots, out_layer)
            if staged:  # rows of skipped slots are not copied: they keep the chunk's own bytes
                copy_to_host(target, chunk, valid_runs(slots) if plan.has_holes else None)
        else:
            source = chunk
            if staged:  # on the current stream, before the scatters that read it
                source = torch.empty(chunk.shape, dtype=chunk.dtype, device=device)
                source.copy_(chunk, non_blocking=True)
            for cache, chunk_layer in zip(caches, source):
                self._scatter_planned(chunk_layer, cache, plan, pos, token_slots)

    def _gather_planned(self, cache: torch.Tensor, plan: SlotPlan, pos: torch.Tensor, token_slots: torch.Tensor,
                        out_layer: torch.Tensor) -> None:
        bs = self.geometry.block_size
        for start, block, count in plan.block_runs:
            self._gather_blocks(cache, block, count, out_layer[:, start:start + count * bs])
        if pos.numel():
            out_layer.index_copy_(1, pos, self._gather_tokens(cache, token_slots))

    def _scatter_planned(self, chunk_layer: torch.Tensor, cache: torch.Tensor, plan: SlotPlan, pos: torch.Tensor,
                         token_slots: torch.Tensor) -> None:
        bs = self.geometry.block_size
        for start, block, count in plan.block_runs:
            self._scatter_blocks(chunk_layer[:, start:start + count * bs], cache, block, count)
        if pos.numel():
            self._scatter_tokens(chunk_layer.index_select(1, pos), cache, token_slots)

    def _plan_for(self, slots: torch.Tensor, device: torch.device,
                  need_plan: bool) -> tuple[SlotPlan | None, torch.Tensor]:
        """The plan of `slots` (torch path) and the slots on `device`. Layerwise callers pass the same
        mapping once per layer: both are reused while the contents (and, on a GPU, the stream) match."""
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        last = self._last_plan
        if last is not None and last[0].shape == slots.shape and last[2].device == device and last[3] == stream \
                and torch.equal(last[0], slots) and (last[1] is not None or not need_plan):
            return last[1], last[2]
        plan = plan_slots(slots, self.geometry.block_size) if need_plan else None
        if device.type == "cpu":
            on_device = slots
        else:  # through pinned memory, without waiting: the stream orders the copy before the kernels
            on_device = slots.pin_memory().to(device, non_blocking=True)
        self._last_plan = (slots.clone(), plan, on_device, stream)
        return plan, on_device

    def _check_layer_index(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"{self.name}: layer {layer} out of range [0, {self.num_layers})")

    def _check_caches(self, kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        caches = list(kv_caches)
        for i, cache in enumerate(caches):
            self._check_cache(i, cache)
            if cache.device != caches[0].device:
                raise LayoutError(f"{self.name}: kv caches are on different devices")
        return caches

    def _check_cache(self, index: int, cache: torch.Tensor) -> None:
        """Raises `LayoutError` unless `cache` is a layer cache this layout was made for."""
        expected = self.expected_cache_shape()
        if tuple(cache.shape) != expected or cache.dtype != self.geometry.dtype:
            raise LayoutError(f"{self.name}: kv cache {index} is {tuple(cache.shape)} {cache.dtype}, "
                              f"expected {expected} {self.geometry.dtype}")
        if not cache.is_contiguous():
            raise LayoutError(f"{self.name}: kv cache {index} is not contiguous (strides {cache.stride()})")

    def _check_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The slot mapping as a contiguous int64 CPU tensor, every slot < the cache's slots."""
        if slot_mapping.dim() != 1:
            raise LayoutError(f"{self.name}: slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
        if slot_mapping.dtype not in (torch.int64, torch.int32):
            raise LayoutError(f"{self.name}: slot_mapping must be int64, got {slot_mapping.dtype}")
        slots = slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
        if slots.numel() and int(slots.max()) >= self.geometry.num_slots:
            raise LayoutError(f"{self.name}: slot {int(slots.max())} beyond the cache's "
                              f"{self.geometry.num_slots} slots")
        return slots

    def _check_chunks(self, chunks: Sequence[torch.Tensor], num_tokens: int, num_layers: int, what: str) -> None:
        """Each chunk is `[num_layers, planes, T_i, width]` of the layout's dtype, contiguous, and the T_i add up
        to the slot mapping's `num_tokens`."""
        if not chunks:
            raise LayoutError(f"{self.name}: no {what} given")
        g = self.geometry
        total = 0
        for chunk in chunks:
            shape = chunk.shape
            if len(shape) != 4 or shape[0] != num_layers or shape[1] != g.kv_planes or shape[3] != g.token_width \
                    or chunk.dtype != g.dtype:
                expected = (num_layers, g.kv_planes, "T", g.token_width)
                raise LayoutError(f"{self.name}: {what} is {tuple(shape)} {chunk.dtype}, "
                                  f"expected {expected} {g.dtype}")
            if not chunk.is_contiguous():
                raise LayoutError(f"{self.name}: {what} must be contiguous")
            total += shape[2]
        if total != num_tokens:
            if len(chunks) == 1:
                expected_one = (num_layers,) + self.chunk_shape(num_tokens)[1:]
                raise LayoutError(f"{self.name}: {what} is {tuple(chunks[0].shape)} {chunks[0].dtype}, "
                                  f"expected {expected_one} {g.dtype}")
            raise LayoutError(f"{self.name}: the {len(chunks)} {what}s hold {total} tokens, the slot mapping "
                              f"has {num_tokens}")
