"""What a prefill instance keeps pinned for decode instances (`storage/transfer/holds.py`), on a real arena:
the cap on held bytes (a request over it is refused and remembered as such, room comes back when holds end),
its default (half of L1), `fill` owning the references it is given whatever happens (a wire header that
cannot be made leaks nothing, also through the prefill worker), the lease a checkout reports, and a key
named twice in one PULL."""
from __future__ import annotations

import pytest
import torch

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.transfer.holds import DuplicateKey, HoldState, PeerHolds, max_held_bytes

SHAPE = (2, 2, 16, 64)  # 8 KiB of bf16


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def arena():
    alloc = HostAllocator(1 << 22)
    yield alloc
    assert alloc.used_bytes == 0  # every chunk went back
    alloc.close()


def chunks(arena: HostAllocator, n: int) -> list:
    return [arena.allocate(SHAPE, torch.bfloat16) for _ in range(n)]


def test_the_default_cap_is_half_of_l1_and_0_means_none():
    assert max_held_bytes(None, 8 << 30) == 4 << 30
    assert max_held_bytes(0, 8 << 30) == 0
    assert max_held_bytes(123, 8 << 30) == 123


def test_requests_over_the_cap_are_refused_and_room_comes_back(arena):
    one = 2 * 16 * 64 * 2 * 2
    holds = PeerHolds(30.0, max_bytes=3 * one)
    try:
        assert holds.expect("a") and holds.fill("a", [key(0), key(1)], chunks(arena, 2))
        assert holds.expect("b")
        assert not holds.fill("b", [key(2), key(3)], chunks(arena, 2))  # 4 chunks > 3: nothing of it held
        assert holds.checkout("b", [key(2)]).state == HoldState.FULL
        assert holds.expect("c") and holds.fill("c", [key(4)], chunks(arena, 1))  # exactly at the cap
        assert not holds.expect("d")  # at the cap: refused when registered
        assert holds.checkout("d", [key(5)]).state == HoldState.FULL
        assert holds.held_bytes == 3 * one and metrics.value("pd_held_bytes") == 3 * one
        assert metrics.value("pd_holds_refused") == 2
        holds.release("a")
        assert holds.held_bytes == one and holds.expect("e")
    finally:
        holds.close()


def test_fill_owns_its_references_when_a_header_cannot_be_made(arena):
    holds = PeerHolds(30.0)
    try:
        holds.expect("r")
        with pytest.raises(ValueError):  # a key longer than a chunk header takes
            holds.fill("r", ["m@" + "x" * 5000 + "@00"], chunks(arena, 1))
        assert arena.used_bytes == 0
        checkout = holds.checkout("r", [key(0)])  # answered at once: nothing is held
        assert checkout.state == HoldState.READY and checkout.objs == [] and checkout.first_held_key == ""
        with pytest.raises(ValueError):
            holds.fill("r", [key(0)], chunks(arena, 2))  # keys and chunks that do not pair
        assert not holds.fill("gone", [key(0)], chunks(arena, 1))  # never registered
    finally:
        holds.close()


def test_a_checkout_says_how_long_the_lease_has_left_and_refuses_a_repeated_key(arena):
    clock = Clock()
    holds = PeerHolds(10.0, clock=clock)
    try:
        holds.expect("r")
        holds.fill("r", [key(0), key(1)], chunks(arena, 2))
        clock.now = 4.0
        checkout = holds.checkout("r", iter([key(0), key(1), key(9)]))
        assert checkout.expires_in == pytest.approx(6.0) and checkout.keys == (key(0), key(1))
        holds.sent(checkout.objs)
        with pytest.raises(DuplicateKey):
            holds.checkout("r", [key(0), key(1), key(0)])
        clock.now = 10.0
        assert holds.expire() == ["r"] and holds.checkout("r", [key(0)]).state == HoldState.EXPIRED
    finally:
        holds.close()


def test_a_prefill_worker_leaks_no_reference_when_a_chunk_header_cannot_be_made():
    """Keys too long for a chunk header (a model name of 5000 characters): L1 stores them, the wire header
    fails; the hold's references must go back, or those chunks stay pinned in L1 for good."""
    pytest.importorskip("vllm")
    from test_engine import BLOCK, BLOCKS, CHUNK, DTYPE, HEAD, HEADS, LAYERS, make_caches
    from test_integration_pd import P_BLOCKS, TOKENS, pd_worker, prefill_step, wait_until

    from lmcache_vllm.config import load_config
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.layouts import CpuVecLayout
    from lmcache_vllm.layouts.base import KVGeometry
    from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, "extra_config": {"pd_host": "127.0.0.1"}})
    layout = CpuVecLayout(KVGeometry(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                                     head_size=HEAD, dtype=DTYPE))
    keys = KeyBuilder(model="m" * 5000, world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=1,
                      hasher=ChunkHasher(CHUNK))
    engine = CacheEngine(config, layout, keys)
    worker = pd_worker(engine, make_caches(True, seed=3), serve=True)
    try:
        assert len(P_BLOCKS) * BLOCK >= len(TOKENS)
        prefill_step(worker)
        assert wait_until(lambda: worker.pd.holds.checkout("p1", []).state == HoldState.READY)
        engine.storage.clear(lower_tiers=False)
        assert engine.storage.allocator.used_bytes == 0, "the hold's references leaked: chunks stay pinned"
        assert worker.pd.holds.held_bytes == 0
    finally:
        worker.shutdown()
        engine.close()
