"""SGLang's own classes on a CPU-only machine, for the tests and benchmarks of the SGLang integration.

- `import_sglang()`: `import sglang` after a small stand-in for `torchvision` (SGLang's model configs import
  `torchvision.transforms` at import time; the only torchvision wheel is CUDA-built and fails to load on torch+cpu).
  The stand-in exists only here, never in the package: it is installed after `transformers` has looked for the
  real one, so transformers never takes it for torchvision. It also sets SGLang's parallel state to one rank.
- `mha_pool(layout)` / `mla_pool(layout)`: SGLang's real host pools (`MHATokenToKVPoolHost`,
  `MLATokenToKVPoolHost`) in host memory (`pin_memory=False`, no CUDA), filled with random bytes.
- `storage_config(...)`: SGLang's `HiCacheStorageConfig` as its controller builds it.
- `Controller`: SGLang's real `HiCacheController` (or `HybridCacheController`) with a storage backend attached by
  SGLang's factory, its backup and prefetch threads running; `backup(...)` and `prefetch(...)` play SGLang's
  scheduler (the radix tree's part: which host slots, which page hashes), waiting on the controller's own ack
  queues with a bound.
- `page_hashes(tokens)`: SGLang's own page hashes (`get_storage_hash_str`, its native C++ hash: compiled once
  per machine by torch's extension loader, about 10 s, cached under ~/.cache/torch_extensions).
"""
from __future__ import annotations

import enum
import sys
import threading
import time
import types
from queue import Empty
from typing import Any, Optional

import torch

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 8, 16
DEVICE_TOKENS = 256
MLA_DIM = 24
MODULE_PATH = "lmcache_vllm.integration.sglang"
CLASS_NAME = "LMCacheHiCacheStorage"
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

_ready = False


def _torchvision_stand_in() -> None:
    if "torchvision" in sys.modules:
        return
    import transformers  # noqa: F401  (looks for torchvision first: it must not find the stand-in)
    from transformers import AutoProcessor  # noqa: F401

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]
    root.__version__ = "0+stand-in"  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


def import_sglang() -> None:
    """Makes SGLang's host pools and controllers importable here (see the module docstring)."""
    global _ready
    if _ready:
        return
    import warnings

    _torchvision_stand_in()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Only CUDA ... support AWQ / GGUF" at import
        from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
        from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0,
                                        attn_dcp_size=1)
    _ready = True


def _budget() -> Any:
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    return host_memory_budget_scope(1 << 30)  # else: free RAM minus a 10 GiB reserve, negative here


def _fill_random(pool: Any, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    buffer = pool.kv_buffer
    buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.dtype))
    return pool


def mha_pool(layout: str = "page_first", *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
             layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM, page: int = PAGE,
             device_tokens: int = DEVICE_TOKENS, ratio: float = 2.0) -> Any:
    import_sglang()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    # The device rows only fill SGLang's pointer tables here (nothing moves to a device): two pages suffice; the
    # host pool's size follows device_tokens * ratio.
    k = tuple(torch.zeros(2 * page, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(2 * page, heads, head_dim, dtype=dtype) for _ in range(layers))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
                         device=torch.device("cpu"))
    with _budget():
        pool = MHATokenToKVPoolHost(info, ratio, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    pool.test_device = (k, v)  # keeps the device tensors the pointer tables name alive
    return _fill_random(pool, seed)


def mla_pool(layout: str = "page_first", *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
             layers: int = LAYERS, page: int = PAGE, device_tokens: int = DEVICE_TOKENS) -> Any:
    import_sglang()
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    rows = tuple(torch.zeros(2 * page, 1, MLA_DIM, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=rows, data_ptrs=torch.tensor([r.data_ptr() for r in rows], dtype=torch.uint64),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
                         kv_lora_rank=MLA_DIM - 8, qk_rope_head_dim=8, kv_cache_dim=MLA_DIM, dtype=dtype,
                         device=torch.device("cpu"))
    with _budget():
        pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)
    pool.test_device = rows
    return _fill_random(pool, seed)


def storage_config(extra: Optional[dict[str, Any]] = None, *, model_name: str = "test-model",
                   tp_rank: int = 0, tp_size: int = 1, mla: bool = False, metrics: bool = False) -> Any:
    import_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=False, model_name=model_name,
                                extra_config=dict(extra or {}))


def dynamic(extra: dict[str, Any], interface_v1: bool = True) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config` naming our backend, plus `extra` (our keys)."""
    return {"backend_name": "lmcache", "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "interface_v1": int(interface_v1), **extra}


def page_hashes(tokens: list[int], page: int = PAGE, salt: Optional[str] = None) -> list[str]:
    import_sglang()
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(tokens, cache_salt=salt) if salt is not None else tokens
    hashes = get_storage_hash_str(key, None, page_size=page)
    assert isinstance(hashes, list)
    return hashes


class _DevicePool:
    """What SGLang's controller asks of the device KV pool when it only moves pages host <-> storage."""

    def __init__(self, layers: int):
        self.device = torch.device("cpu")
        self.layer_num = layers

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


class _DeviceAllocator:
    def __init__(self, layers: int):
        self._pool = _DevicePool(layers)

    def get_kvcache(self) -> _DevicePool:
        return self._pool


class Controller:
    """SGLang's `HiCacheController` over `pool` with the dynamic backend `extra` names attached by SGLang's
    factory (`backend="file"`: SGLang's own HiCacheFile instead; `hybrid=True`: `HybridCacheController` over a
    one-entry `HostPoolGroup`, what 0.5.23 builds for a dense model)."""

    def __init__(self, pool: Any, extra: dict[str, Any], *, hybrid: bool = False, metrics: bool = False,
                 model_name: str = "test-model", layers: int = LAYERS, backend: str = "dynamic"):
        import_sglang()
        self.pool = pool
        self.page = pool.page_size
        self.hybrid = hybrid
        allocator = _DeviceAllocator(layers)
        kwargs = dict(page_size=self.page, tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
                      storage_backend=backend, model_name=model_name, storage_backend_extra_config=dict(extra),
                      enable_storage_metrics=metrics)
        if hybrid:
            from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
            from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
            entry = PoolEntry(name=_pool_name("KV"), host_pool=pool, device_pool=allocator.get_kvcache(),
                              layer_mapper=lambda layer_id: layer_id, is_primary_index_anchor=True)
            self.ctl = HybridCacheController(allocator, HostPoolGroup([entry]), **kwargs)
        else:
            from sglang.srt.managers.cache_controller import HiCacheController
            self.ctl = HiCacheController(allocator, pool, **kwargs)
        self.backend = self.ctl.storage_backend

    def backup(self, host_indices: torch.Tensor, hashes: list[str], timeout: float = 60.0) -> int:
        """Stores the pages at `host_indices` under `hashes` through the backup thread; tokens it reports done."""
        tokens = [0] * host_indices.numel()
        op_id = self.ctl.write_storage(host_indices, tokens, hash_value=list(hashes))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                op = self.ctl.ack_backup_queue.get(timeout=0.5)
            except Empty:
                continue
            if op.id == op_id:
                return int(op.completed_tokens)
        raise TimeoutError(f"no backup ack within {timeout}s")

    def prefetch(self, tokens: list[int], rid: str = "r", salt: Optional[str] = None,
                 timeout: float = 60.0) -> tuple[int, torch.Tensor]:
        """Asks storage for `tokens` (page hashes by SGLang), allocates host slots for the hit and reads it
        through the prefetch threads, like the scheduler does: (tokens read, host slots of the hit)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(tokens, cache_salt=salt) if salt is not None else tokens
        if self.hybrid:  # the hybrid controller takes the scheduler's request handle
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
            operation = self.ctl.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), key)
        else:
            operation = self.ctl.prefetch(rid, key)
        deadline = time.monotonic() + timeout
        op = _take(self.ctl.prefetch_hit_queue, deadline)
        if op.storage_hit_count == 0:
            return 0, torch.empty(0, dtype=torch.int64)
        host_indices = self.pool.alloc(op.storage_hit_count)
        if host_indices is None:
            raise RuntimeError("the host pool has no room for the prefetch")
        operation.host_indices = host_indices
        self.ctl.prefetch_buffer.put(operation)
        completed = 0
        while True:
            ack = _take(self.ctl.ack_prefetch_queue, deadline)
            if ack.rid != rid:
                continue
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
            if ack.completed_req:
                return completed, host_indices

    def close(self) -> None:
        self.ctl.detach_storage_backend()


def _pool_name(name: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName
    return getattr(PoolName, name)


def _take(queue: Any, deadline: float) -> Any:
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.2)
        except Empty:
            continue
    raise TimeoutError("the controller did not answer in time")


def pages_of(pool: Any, host_indices: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the pages at `host_indices` (one per page, in the pool's own layout)."""
    return [pool.get_data_page(int(s), flat=False).clone() for s in host_indices[::pool.page_size].tolist()]
