"""Ordering and lifetime of the KV copies on a GPU (`layouts.streams`), and the pinned L1 arena (`pinned.py`).

CPU: fences pass at once, a deferred release waits for its fence, the arena is exactly the size asked; the
torch path's device staging (gather into a staging chunk, then only the rows of valid slots copied into the
host chunk; scatter from a staging copy) runs on CPU tensors and gives the direct path's bytes.
GPU (skipped without one): the issue's stream test — a "forward" on a non-blocking stream sleeps before it
writes the KV, then the connector's save path runs; the stored bytes must be the final KV. A retrieve's
chunks stay alive until the stream has read them, on the kernel path and on the torch fallback; the arena
is registered pinned memory of exactly the asked size; the torch path's staging memory is not reused before
the copy stream has copied it out, and a fence covers that copy; the CUDA extension's array of layer
pointers stays valid for a kernel still waiting on another stream while the array is evicted.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from lmcache_vllm import ops
from lmcache_vllm.config import load_config
from lmcache_vllm.engine import CacheEngine
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views
from lmcache_vllm.layouts import detect_layout
from lmcache_vllm.layouts.streams import DeferredRelease, Fence, SideStream, copy_stream, valid_runs
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.memory.pinned import PAGE, pinned_arena
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


def test_valid_runs():
    assert valid_runs(torch.tensor([-1, 3, 4, -1, -1, 9, 10, 11])) == [(1, 3), (5, 8)]
    assert valid_runs(torch.tensor([1, 2])) == [(0, 2)]
    assert valid_runs(torch.tensor([-1, -1])) == [] and valid_runs(torch.tensor([], dtype=torch.int64)) == []


@pytest.mark.parametrize("layout_name", ["LBNHC", "BLHNC"])
@pytest.mark.parametrize("holes", [False, True])
def test_staged_torch_path_gives_the_direct_bytes_on_cpu(layout_name, holes):
    """The code a GPU runs between its cache and host memory (staging chunk, copies of the valid rows only),
    run on CPU tensors: rows of skipped slots keep the chunk's own bytes, both directions as the direct path."""
    case = KVViewCase(layout=layout_name, num_layers=3, num_blocks=12, block_size=16, num_kv_heads=2, head_size=64)
    views = fill_known(kv_views(case), case, seed=1)
    layout = detect_layout(views, **case.describe())
    slots = torch.cat([torch.arange(32, 64), torch.arange(80, 90)])
    if holes:
        slots[[0, 5, 6, 7, 41]] = -1
    sentinel = torch.randint(0, 256, (*layout.chunk_shape(len(slots))[:-1], 64 * 2 * 2), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(2)).view(torch.bfloat16)
    sentinel = torch.nan_to_num(sentinel)
    direct, staged = sentinel.clone(), sentinel.clone()
    with ops.forced_torch():
        layout.torch_transfer(True, views, slots, direct)
        layout.stage_on_cpu = True
        layout.torch_transfer(True, views, slots, staged)
        assert torch.equal(staged.view(torch.uint8), direct.view(torch.uint8))
        assert torch.equal(staged[:, :, slots < 0], sentinel[:, :, slots < 0])  # never written
        into_staged, into_direct = fill_known(kv_views(case), case, 5), fill_known(kv_views(case), case, 5)
        layout.torch_transfer(False, into_staged, slots, sentinel)
        layout.stage_on_cpu = False
        layout.torch_transfer(False, into_direct, slots, sentinel)
    assert torch.equal(_raw(into_staged[0]), _raw(into_direct[0]))
    assert copy_stream(torch.device("cpu")) is None


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
    layout = detect_layout(views, **case.describe())
    layout.bind_kernel(views, "on")  # mode auto runs the kernel itself, never a silent fallback
    return case, views, CacheEngine(config, layout, keys)


def _raw(view: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


@gpu
@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_save_copies_the_kv_the_forward_wrote_on_its_own_stream(mode):
    pytest.importorskip("vllm", reason="the worker half's metadata is vLLM's (a GPU host may lack vLLM)")
    from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, SaveSpec
    from lmcache_vllm.integration.vllm.worker import WorkerHalf
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


@gpu
def test_torch_path_staging_is_not_reused_before_the_copy_stream_read_it():
    """Gather on the torch path into pinned memory while the copy stream is held up; the current stream then
    allocates and overwrites memory of the staging chunk's size. Without `record_stream` the allocator hands
    the staging block out at once and the copy reads the overwritten bytes (the cross-stream hazard)."""
    case, views, engine = _views_and_engine()
    engine.close()
    _raw(views[0]).copy_(torch.randint(1, 100, _raw(views[0]).shape, dtype=torch.uint8, device="cuda"))
    slots = torch.arange(64)
    layout = detect_layout(views, **case.describe())
    expected = torch.zeros(layout.chunk_shape(64), dtype=case.dtype, device="cuda")
    layout.gather(views, slots, expected)
    out = torch.zeros(layout.chunk_shape(64), dtype=case.dtype).pin_memory()
    with ops.forced_torch():
        with torch.cuda.stream(copy_stream(torch.device("cuda"))):
            torch.cuda._sleep(200_000_000)  # the copy stream is busy: the staging copy waits behind this
        layout.gather(views, slots, out)
        for _ in range(8):
            torch.full(expected.shape, 7.0, dtype=case.dtype, device="cuda")  # would take the staging block
    Fence.record(torch.device("cuda")).wait()  # the fence covers the copy stream too
    assert torch.equal(out, expected.cpu())


@gpu
def test_layer_pointer_array_outlives_its_eviction_while_a_kernel_waits():
    """Issue #22 item 9: a kernel on a held-up stream reads the cached device array of layer pointers; the
    array is evicted (more than 64 cache sets) and new arrays are made meanwhile. The kernel must still
    read the right layers."""
    ext = ops.cuda_ext()
    if ext is None:
        pytest.skip("lmcache_vllm._cuda_ops not built")
    case = KVViewCase(layout="LBNHC", num_layers=3, num_blocks=8, block_size=16, num_kv_heads=2, head_size=64)
    views = fill_known(kv_views(case, "cuda"), case, seed=1)
    others = [fill_known(kv_views(case, "cuda"), case, seed=2 + i) for i in range(70)]
    layout = detect_layout(views, **case.describe())
    slots = torch.arange(32, device="cuda")
    expected = torch.zeros(layout.chunk_shape(32), dtype=case.dtype, device="cuda")
    with ops.forced_torch():
        layout.gather(views, slots.cpu(), expected)
    scratch = torch.zeros_like(expected)
    assert ext.gather(views, slots, scratch, 4, 16) == ""  # the array for `views` exists now (default stream)
    out = torch.zeros_like(expected)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        assert ext.gather(views, slots, out, 4, 16) == ""  # reads the array when the stream gets there
    for other in others:  # evicts every array and makes new ones of the same size on the default stream
        assert ext.gather(other, slots, scratch, 4, 16) == ""
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
