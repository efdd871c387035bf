"""CacheEngine round trips on plain tensors in vLLM's CPU paged layout (no vLLM needed)."""
import dataclasses

import pytest
import torch

from lmcache_vllm.config import load_config
from lmcache_vllm.engine import CacheEngine
from lmcache_vllm.layouts import CpuVecLayout
from lmcache_vllm.layouts.base import KVGeometry
from lmcache_vllm.observability import metrics
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 2, 2, 64, 16, 64
CHUNK = 32
DTYPE = torch.bfloat16


def make_caches(fill: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(LAYERS):
        t = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=DTYPE)
        if fill:
            t.copy_(torch.randn(t.shape, generator=gen).to(DTYPE))
        caches.append(t)
    return caches


def slots_for(num_tokens: int, seed: int) -> torch.Tensor:
    """Token i → slot in a random (but fixed per seed) order of blocks, like vLLM's allocator."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(BLOCKS, generator=gen)[: (num_tokens + BLOCK - 1) // BLOCK]
    pos = torch.arange(num_tokens)
    return blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def make_engine(**overrides):
    cfg = load_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, **overrides})
    layout = CpuVecLayout(KVGeometry(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK,
                                     num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE))
    keys = KeyBuilder(model="test/model", world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=1,
                      hasher=ChunkHasher(CHUNK, cfg.pre_caching_hash_algorithm))
    return CacheEngine(cfg, layout, keys)


def worker_config(engine, *, use_layerwise=False, async_save=True, load_timeout_s=None):
    """The engine's configuration with the worker settings a test picks (WorkerHalf reads them there)."""
    extra = dataclasses.replace(engine.config.extra_config, async_save=async_save)
    timeout = engine.config.blocking_timeout_secs if load_timeout_s is None else load_timeout_s
    return dataclasses.replace(engine.config, use_layerwise=use_layerwise, blocking_timeout_secs=timeout,
                               extra_config=extra)


def kv_of(engine, caches, slots):
    out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=DTYPE)
    engine.layout.gather(caches, slots, out)
    return out


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


def test_round_trip_into_fresh_cache(engine):
    tokens = list(range(1000, 1100))  # 3 full chunks + 4 tokens
    src, src_slots = make_caches(True), slots_for(100, seed=1)
    assert engine.store(tokens, src, src_slots) == 96
    assert engine.lookup(tokens) == 96

    dst, dst_slots = make_caches(False), slots_for(100, seed=2)
    loaded = engine.retrieve(tokens, dst, dst_slots)
    assert loaded[:96].all() and not loaded[96:].any()
    assert torch.equal(kv_of(engine, dst, dst_slots[:96]), kv_of(engine, src, src_slots[:96]))
    # The trailing partial chunk was not stored, so its slots in the fresh cache are untouched.
    assert not kv_of(engine, dst, dst_slots[96:]).any()


def test_unused_slots_are_untouched(engine):
    tokens = list(range(64))
    engine.store(tokens, make_caches(True), slots_for(64, seed=1))
    dst, dst_slots = make_caches(False), slots_for(64, seed=2)
    engine.retrieve(tokens, dst, dst_slots)
    touched = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
    touched[dst_slots] = True
    untouched = (~touched).nonzero().flatten()
    assert not kv_of(engine, dst, untouched).any()


def test_partial_prefix_and_divergence(engine):
    tokens = list(range(96))
    engine.store(tokens, make_caches(True), slots_for(96, seed=1))
    diverged = tokens[:40] + [7] * 56  # differs inside the second chunk
    assert engine.lookup(diverged) == 32
    assert engine.lookup(tokens[:70]) == 64
    assert engine.lookup(tokens[:31]) == 0
    assert engine.lookup([]) == 0
    loaded = engine.retrieve(diverged, make_caches(False), slots_for(96, seed=3))
    assert int(loaded.sum()) == 32


def test_mask_skips_tokens_caller_already_has(engine):
    tokens = list(range(96))
    src, src_slots = make_caches(True), slots_for(96, seed=1)
    engine.store(tokens, src, src_slots)
    dst, dst_slots = make_caches(False), slots_for(96, seed=2)
    mask = torch.ones(96, dtype=torch.bool)
    mask[:40] = False  # e.g. vLLM's own prefix cache computed these
    loaded = engine.retrieve(tokens, dst, dst_slots, mask=mask)
    assert not loaded[:40].any() and loaded[40:].all()
    assert not kv_of(engine, dst, dst_slots[:40]).any()
    assert torch.equal(kv_of(engine, dst, dst_slots[40:]), kv_of(engine, src, src_slots[40:]))


def test_store_mask_and_dedup(engine):
    tokens = list(range(96))
    src, slots = make_caches(True), slots_for(96, seed=1)
    mask = torch.ones(96, dtype=torch.bool)
    mask[:32] = False  # first chunk not to be stored
    assert engine.store(tokens, src, slots, mask=mask) == 64
    assert engine.lookup(tokens) == 0  # no prefix without chunk 0
    assert engine.store(tokens, src, slots) == 32  # only the missing chunk is written
    assert metrics.value("store_skipped_tokens") == 64
    assert engine.lookup(tokens) == 96


def test_unfull_chunk_saved_when_configured():
    eng = make_engine(save_unfull_chunk=True)
    try:
        tokens = list(range(100))
        src, src_slots = make_caches(True), slots_for(100, seed=1)
        assert eng.store(tokens, src, src_slots) == 100
        assert eng.lookup(tokens) == 100
        dst, dst_slots = make_caches(False), slots_for(100, seed=2)
        assert eng.retrieve(tokens, dst, dst_slots).all()
        assert torch.equal(kv_of(eng, dst, dst_slots), kv_of(eng, src, src_slots))
        # A longer prompt with the same first 100 tokens: the 4-token tail chunk is not a prefix of it.
        assert eng.lookup(tokens + [5] * 28) == 96
    finally:
        eng.close()


def test_eviction_under_small_arena():
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * HEAD * 2
    eng = make_engine(max_local_cpu_size=3.5 * chunk_bytes / 1e9)
    try:
        src = make_caches(True)
        for i in range(6):  # six independent single-chunk prompts into room for three
            tokens = list(range(i * 1000, i * 1000 + CHUNK))
            assert eng.store(tokens, src, slots_for(CHUNK, seed=i)) == CHUNK
        present = [eng.lookup(list(range(i * 1000, i * 1000 + CHUNK))) == CHUNK for i in range(6)]
        assert present == [False, False, False, True, True, True]  # least recently used went first
        dst, dst_slots = make_caches(False), slots_for(CHUNK, seed=9)
        assert eng.retrieve(list(range(5000, 5000 + CHUNK)), dst, dst_slots).all()
        assert torch.equal(kv_of(eng, dst, dst_slots), kv_of(eng, src, slots_for(CHUNK, seed=5)))
    finally:
        eng.close()


def test_layerwise_matches_whole(engine):
    tokens = list(range(64))
    src, src_slots = make_caches(True), slots_for(64, seed=1)
    gen = engine.store_layer(tokens, src, src_slots)
    assert [next(gen) for _ in range(LAYERS)] == list(range(LAYERS))
    assert engine.lookup(tokens) == 0  # nothing committed before the generator finishes
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == 64
    assert engine.lookup(tokens) == 64

    dst, dst_slots = make_caches(False), slots_for(64, seed=2)
    gen = engine.retrieve_layer(tokens, dst, dst_slots)
    loaded = next(gen)
    assert loaded.all()
    assert next(gen) == 0
    # After layer 0 only layer 0 holds the KV.
    assert torch.equal(kv_of(engine, dst, dst_slots)[0], kv_of(engine, src, src_slots)[0])
    assert not kv_of(engine, dst, dst_slots)[1].any()
    assert list(gen) == list(range(1, LAYERS))
    assert torch.equal(kv_of(engine, dst, dst_slots), kv_of(engine, src, src_slots))


def test_bad_arguments_raise_clear_errors(engine):
    with pytest.raises(ValueError, match="slot_mapping"):
        engine.store(list(range(64)), make_caches(True), torch.arange(10))
    with pytest.raises(ValueError, match="mask"):
        engine.retrieve(list(range(64)), make_caches(False), slots_for(64, 1), mask=torch.ones(3))


def test_no_refs_leak(engine):
    tokens = list(range(96))
    engine.store(tokens, make_caches(True), slots_for(96, seed=1))
    for _ in range(3):
        engine.retrieve(tokens, make_caches(False), slots_for(96, seed=2))
    assert metrics.value("resident_chunks", tier="local_cpu") == 3
    assert metrics.value("used_bytes", tier="local_cpu") > 0
    # Only the cache's own reference is left on each object: clearing frees every byte.
    engine.clear()
    assert engine.lookup(tokens) == 0
    assert metrics.value("used_bytes", tier="local_cpu") == 0


def test_extra_keys_separate_stored_kv(engine):
    from lmcache_vllm.extra_keys import ExtraKeys, ExtraSpan

    tokens = list(range(2000, 2096))  # 3 chunks
    image_a = ExtraKeys(spans=(ExtraSpan(40, 50, b"mm:image-a"),))  # in chunk 1
    src, slots = make_caches(True), slots_for(96, seed=1)
    assert engine.store(tokens, src, slots, extra=image_a) == 96
    assert engine.lookup(tokens, extra=image_a) == 96
    # Same placeholder tokens, another image: only the chunk before the image is shared.
    assert engine.lookup(tokens, extra=ExtraKeys(spans=(ExtraSpan(40, 50, b"mm:image-b"),))) == CHUNK
    assert engine.lookup(tokens) == CHUNK  # tokens alone never reach the image's chunks
    assert engine.lookup(tokens, extra=ExtraKeys(b"salt")) == 0  # a salt changes chunk 0 and all after
    dst = make_caches(False)
    loaded = engine.retrieve(tokens, dst, slots, extra=image_a)
    assert loaded.all() and torch.equal(kv_of(engine, dst, slots), kv_of(engine, src, slots))
