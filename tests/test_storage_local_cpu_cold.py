"""The compressed cold part of L1 (`storage/local_cpu_cold.py`, `extra_config.local_cpu_cold_fraction`): with the
same `max_local_cpu_size`, more distinct chunks stay readable; an L1 eviction enters it coded (nothing slow on
the evicting thread), a hit leaves it, decoded exactly into L1 through the manager's asynchronous path; its
budget is kept."""
from __future__ import annotations

import time

import pytest
import torch
from test_storage_coders import kv_like

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.local_cpu_cold import ColdCPUBackend
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.registry import build_allocator

SHAPE = (2, 2, 64, 128)  # 64 KiB of bf16 per chunk
CHUNK_BYTES = 2 * 2 * 64 * 128 * 2
L1_BYTES = 32 * CHUNK_BYTES  # 2 MiB


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def config(fraction: float) -> LMCacheConfig:
    return LMCacheConfig(max_local_cpu_size=L1_BYTES / (1 << 30), blocking_timeout_secs=5.0,
                         extra_config={"local_cpu_cold_fraction": fraction, "close_drain_secs": 1.0})


def store(mgr: StorageManager, tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        obj = mgr.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        mgr.put(key(i), obj)
        obj.ref_down()
    assert mgr.flush(10)


def cold_of(mgr: StorageManager) -> ColdCPUBackend:
    (cold,) = [t for t in mgr.lower if isinstance(t, ColdCPUBackend)]
    return cold


def settled(cold: ColdCPUBackend) -> None:
    deadline = time.monotonic() + 10
    while cold._pending and time.monotonic() < deadline:  # the coding thread catches up with evictions
        time.sleep(0.01)


def readable(mgr: StorageManager, n: int) -> int:
    """How many of the first `n` keys L1 or the cold part can still serve (no read: membership only)."""
    in_l1 = mgr.contains([key(i) for i in range(n)])
    cold = cold_of(mgr) if any(isinstance(t, ColdCPUBackend) for t in mgr.lower) else None
    with (cold._lock if cold else _Null()):
        in_cold = [cold is not None and key(i) in cold._chunks for i in range(n)]
    return sum(a or b for a, b in zip(in_l1, in_cold))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_arena_gives_the_cold_part_its_share():
    assert build_allocator(config(0.5)).capacity == L1_BYTES // 2
    assert build_allocator(config(0.0)).capacity == L1_BYTES
    with pytest.raises(Exception, match="local_cpu_cold_fraction"):
        config(0.95)


def test_the_same_host_memory_holds_more_distinct_chunks():
    tensors = [kv_like(SHAPE, seed=i) for i in range(80)]
    held, in_cold, coded = {}, 0, 0
    for fraction in (0.0, 0.7):
        with StorageManager(config(fraction)) as mgr:
            store(mgr, tensors)
            if fraction:
                cold = cold_of(mgr)
                settled(cold)
                assert 0.9 * cold.budget <= cold.gauges()["used_bytes"] <= cold.budget  # filled, never over
                in_cold, coded = len(cold._chunks), cold.gauges()["used_bytes"]
            held[fraction] = readable(mgr, len(tensors))
    ratio = in_cold * CHUNK_BYTES / coded  # the codec's on these values (real bf16 KV: 1.47x)
    assert held[0.0] == 32 and ratio > 1.2
    # 0.3 of the memory raw, 0.7 coded: (0.3 + 0.7 x ratio) times the chunks (1.33x at 1.47x), less the arena's
    # page rounding
    assert held[0.7] >= (0.3 + 0.7 * ratio) * held[0.0] - 2, (held, ratio)


def test_a_cold_hit_comes_back_exactly_through_the_asynchronous_path_and_leaves_the_cold_part():
    tensors = [kv_like(SHAPE, seed=i) for i in range(24)]
    with StorageManager(config(0.5)) as mgr:  # the arena holds 16 chunks: the first 8 go cold
        store(mgr, tensors)
        cold = cold_of(mgr)
        settled(cold)
        assert not mgr.contains([key(0)])[0] and key(0) in cold._chunks
        assert metrics.value("stored_chunks", tier="local_cpu_cold") >= 8
        handle = mgr.prefetch([key(0), key(1)])
        handle.wait(10)
        objs = mgr.get([key(0), key(1)], owner=handle.owner, lower_tiers=False)
        assert len(objs) == 2
        for obj, t in zip(objs, tensors):
            assert torch.equal(obj.tensor, t)
            obj.ref_down()
        assert key(0) not in cold._chunks and mgr.contains([key(0)])[0]  # one copy: hot now
        assert metrics.value("chunk_hits", tier="local_cpu_cold") == 2
