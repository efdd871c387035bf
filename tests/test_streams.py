"""Ordering and lifetime of the KV copies on a GPU (`layouts.streams`), and the pinned L1 arena (`pinned.py`).

CPU: fences pass at once, a deferred release waits for its fence, the arena is exactly the size asked.
GPU (skipped without one): the issue's stream test — a "forward" on a non-blocking stream sleeps before it
writes the KV, then the connector's save path runs; the stored bytes must be the final KV. A retrieve's
chunks stay alive until the stream has read them, on the kernel path and on the torch fallback; the arena
is registered pinned memory of exactly the asked size.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.config import load_config
from lmcache_vllm.engine import CacheEngine
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, SaveSpec
from lmcache_vllm.integration.vllm.worker import WorkerHalf
from lmcache_vllm.layouts import detect_layout
from lmcache_vllm.layouts.streams import DeferredRelease, Fence, SideStream
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.memory.pinned import PAGE, pinned_arena
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, kv_views
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class HeldFence(Fence):
    """A fence that passes when the test says so (a GPU stream's position cannot be held on the CPU)."""

    def __init__(self):
        super().__init__(None)
        self.passed = threading.Event()

    def done(self) -> bool:
        return self.passed.is_set()

    def wait(self) -> None:
        assert self.passed.wait(5)


def test_cpu_fences_pass_at_once_and_side_stream_is_a_no_op():
    fence = Fence.record(torch.device("cpu"))
    assert fence.done()
    fence.wait()
    side = SideStream(torch.device("cpu"))
    assert side.stream is None and side.mark() is None
    with side.after(None):
        pass
    released = []
    DeferredRelease().add(fence, [lambda: released.append(1)])
    assert released == [1]  # nothing in flight on the CPU: released at once


def test_deferred_release_waits_for_its_fence():
    releases = DeferredRelease()
    held, other = HeldFence(), HeldFence()
    released = []
    releases.add(held, [lambda: released.append("a"), lambda: released.append("b")])
    releases.add(other, [lambda: released.append("c")])
    releases.reap()
    assert released == [] and len(releases) == 2
    other.passed.set()  # fences of different streams pass in any order
    releases.reap()
    assert released == ["c"] and len(releases) == 1
    threading.Timer(0.05, held.passed.set).start()
    releases.drain()  # waits
    assert released == ["c", "a", "b"] and len(releases) == 0


def test_pinned_arena_is_exactly_the_size_asked():
    arena, registered = pinned_arena(3 * PAGE + 100)
    assert arena.numel() == 3 * PAGE + 100 and arena.data_ptr() % PAGE == 0
    assert registered == torch.cuda.is_available()
    arena.fill_(7)
    assert int(arena[-1]) == 7
    with pytest.raises(ValueError):
        pinned_arena(0)


# ---- on a GPU --------------------------------------------------------------------------------------------

def _views_and_engine(num_blocks=16, chunk=64, l1_gib=0.05):
    case = KVViewCase(layout="LBNHC", num_layers=4, num_blocks=num_blocks, block_size=16, num_kv_heads=2,
                      head_size=64)
    views = kv_views(case, "cuda")
    config = load_config({"chunk_size": chunk, "max_local_cpu_size": l1_gib}, environ={})
    keys = KeyBuilder(model="test/model", world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=1,
                      hasher=ChunkHasher(chunk, config.pre_caching_hash_algorithm))
    return case, views, CacheEngine(config, detect_layout(views, **case.describe()), keys)


def _raw(view: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


@gpu
@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_save_copies_the_kv_the_forward_wrote_on_its_own_stream(mode):
    case, views, engine = _views_and_engine()
    config = dataclasses.replace(engine.config, use_layerwise=False)
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=case.block_size, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": v for i, v in enumerate(views)})
    tokens = list(range(100, 164))
    final = torch.randint(1, 100, _raw(views[0]).shape, dtype=torch.uint8, device="cuda")
    forward = torch.cuda.Stream()  # vLLM's forward runs on a non-blocking stream of its own
    previous = ops.mode()
    ops.set_mode(mode)
    try:
        with torch.cuda.stream(forward):
            torch.cuda._sleep(200_000_000)  # the forward is still computing when the step ends...
            _raw(views[0]).copy_(final)  # ...then writes the KV
            worker.begin_step()
            worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec(
                req_id="a", token_ids=tokens, block_ids=[0, 1, 2, 3], skip_leading=0, is_last=True)]))
        worker.drain_saves()
        fresh = kv_views(case, "cuda")
        engine.retrieve(tokens, fresh, torch.arange(len(tokens)))
        torch.cuda.synchronize()
        slots = torch.arange(len(tokens))
        stored = torch.zeros(engine.layout.chunk_shape(len(tokens)), dtype=case.dtype, device="cuda")
        expected = torch.zeros_like(stored)
        engine.layout.gather(fresh, slots, stored)
        engine.layout.gather(views, slots, expected)
        torch.cuda.synchronize()
        assert bool(expected.ne(0).any()) and torch.equal(stored, expected)
    finally:
        ops.set_mode(previous)
        worker.shutdown()


@gpu
@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_retrieved_chunks_stay_alive_until_the_stream_has_read_them(mode):
    """The arena holds one chunk: if the retrieve released it before its copy ran, the next store would take
    the same bytes and the loaded KV would be the wrong one."""
    case, views, engine = _views_and_engine(chunk=64, l1_gib=(4 * 2 * 64 * 128 * 2 + 8192) / (1 << 30))
    previous = ops.mode()
    ops.set_mode(mode)
    try:
        _raw(views[0]).copy_(torch.randint(1, 100, _raw(views[0]).shape, dtype=torch.uint8, device="cuda"))
        slots = torch.arange(64)
        assert engine.store(list(range(64)), views, slots) == 64
        expected = torch.zeros(engine.layout.chunk_shape(64), dtype=case.dtype, device="cuda")
        engine.layout.gather(views, slots, expected)
        fresh = kv_views(case, "cuda")
        torch.cuda._sleep(200_000_000)  # the load's copy waits behind this on the stream
        engine.retrieve(list(range(64)), fresh, slots)
        engine.clear()
        _raw(views[0]).zero_()
        engine.store(list(range(1000, 1064)), views, slots)  # would reuse the chunk's bytes if released
        torch.cuda.synchronize()
        loaded = torch.zeros_like(expected)
        engine.layout.gather(fresh, slots, loaded)
        torch.cuda.synchronize()
        assert torch.equal(loaded, expected)
    finally:
        ops.set_mode(previous)
        engine.close()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@gpu
def test_l1_arena_is_registered_pinned_memory_of_the_asked_size():
    before = torch.cuda.memory.host_memory_stats().get("allocated_bytes.all.current", 0) \
        if hasattr(torch.cuda.memory, "host_memory_stats") else 0
    rss = _status_kib("VmRSS")
    size = 256 << 20
    alloc = HostAllocator(size + 100, pin_memory=True)
    assert alloc.pinned_arena and alloc.arena.is_pinned() and alloc.capacity == size + 128
    assert alloc.arena.data_ptr() % PAGE == 0
    grown_kib = _status_kib("VmRSS") - rss
    assert size // 1024 <= grown_kib <= size // 1024 + 64 * 1024, grown_kib  # resident, not rounded to 512 MiB
    if hasattr(torch.cuda.memory, "host_memory_stats"):  # PyTorch's caching host allocator was not used
        assert torch.cuda.memory.host_memory_stats().get("allocated_bytes.all.current", 0) == before
