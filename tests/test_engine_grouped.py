"""The KV cache groups of a hybrid model over one storage (`engine/grouped.py`, `integration/vllm/groups.py`),
on KV caches built by vLLM's own code (`testing/hybrid_views.py`: layers of different groups share bytes,
block 0 is vLLM's null block): round trips per group, the hit every group can serve, a missing sliding
chunk or state shortening it, and never a chunk of one group read as another's."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from lmcache_vllm.config import load_config  # noqa: E402
from lmcache_vllm.engine.kv_groups import GroupKind  # noqa: E402
from lmcache_vllm.integration.vllm.groups import build_grouped_engine, load_parts, plan_groups, save_parts  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import LoadSpec, SaveSpec  # noqa: E402
from lmcache_vllm.integration.vllm.testing.hybrid_views import HybridCase, fill_random, vllm_hybrid_cache  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder  # noqa: E402

CHUNK = 32
BLOCK = 16
FAKE_VLLM = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}),
                            cache_config=SimpleNamespace(kv_cache_layout="LBHNC"))


def build(case: HybridCase, storage_config=None):
    kv_config, views = vllm_hybrid_cache(case)
    plan = plan_groups(kv_config, list(views))
    config = storage_config or load_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.05})
    keys = KeyBuilder("tiny", 1, 0, "bfloat16", 2, ChunkHasher(CHUNK), fingerprint="ab")
    engine = build_grouped_engine(config, FAKE_VLLM, views, kv_config, plan.groups, keys)
    return engine, views, plan.groups


class Pool:
    """Hands out block ids like vLLM's one pool: unique across groups, never 0 (the null block)."""

    def __init__(self, start: int = 1):
        self.next = start

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def tables_for(groups, num_tokens: int, pool: Pool, kept_until: int = 0) -> tuple[list[int], ...]:
    """A request's block tables: every position allocated, except blocks vLLM holds as null in a sliding or
    state group for a request with `kept_until` tokens (`KVGroup.kept_start`)."""
    tables = []
    for group in groups:
        n_blocks = -(-num_tokens // BLOCK)
        ids = pool.take(n_blocks)
        first_kept = group.kept_start(kept_until) // BLOCK if kept_until else 0
        tables.append([0 if i < first_kept else b for i, b in enumerate(ids)])
    return tuple(tables)


def tokens_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, 4000, n).astype(np.int64)


def token_kv(views, group, table, position: int) -> list[torch.Tensor]:
    """The KV of token `position` in every layer of `group` (a copy, the layout's own bytes)."""
    block, offset = table[position // BLOCK], position % BLOCK
    return [views[name][block, :, offset].clone() for name in group.layer_names]


def save(engine, groups, tokens, tables, skip=0):
    spec = SaveSpec("r", tokens, [], skip, is_last=True, group_block_ids=tables)
    engine.store(tokens, save_parts(groups, spec))


def test_round_trip_loads_full_chunks_and_only_the_window_of_sliding_layers():
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=1)
        tokens = tokens_of(200)
        pool = Pool()
        src = tables_for(groups, 200, pool)  # one step computed all 200: every block still allocated
        save(engine, groups, tokens, src)
        hold = engine.lookup_and_hold(tokens, 0)
        hit = hold.located(1.0)
        assert (hit.start, hit.end) == (0, 192)  # 6 whole chunks
        before = {name: v.clone() for name, v in views.items()}
        dst = tables_for(groups, 192, pool, kept_until=192)  # what vLLM allocates for a hit of 192
        spec = LoadSpec("r", tokens[:192], [], skip_leading=0, load_end=192, group_block_ids=dst)
        done = engine.retrieve(tokens[:192], load_parts(groups, spec), hold=hold)
        hold.release()
        assert done == {0: True, 1: True}
        full, sliding = groups
        for p in range(192):
            assert all(torch.equal(a, b) for a, b in zip(token_kv(views, full, dst[0], p),
                                                         token_kv(views, full, src[0], p)))
        kept = sliding.kept_start(192)  # 192 - 39 = 153 -> block 9 (144) on
        assert kept == 144
        for p in range(kept, 192):
            assert all(torch.equal(a, b) for a, b in zip(token_kv(views, sliding, dst[1], p),
                                                         token_kv(views, sliding, src[1], p)))
        # Nothing was written outside the blocks vLLM allocated: the null block and other blocks are untouched.
        touched = {b for t in dst for b in t if b}
        for name, view in views.items():
            for block in range(view.shape[0]):
                if block not in touched:
                    assert torch.equal(view[block], before[name][block]), (name, block)
    finally:
        engine.close()


def test_layers_sharing_bytes_across_groups_never_read_each_others_chunks():
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=2)
        tokens = tokens_of(64, seed=3)
        src = tables_for(groups, 64, Pool())
        save(engine, groups, tokens, src)
        # Two chunks per group, each under its group's key: the same prefix, four distinct entries.
        stored = [engine.engines[g.index].keys.keys(tokens)[i][0].to_str() for g in groups for i in range(2)]
        assert len(set(stored)) == 4 and all(engine.storage.contains(stored))
        # A chunk found under one group's key has that group's layers: loading group 0's keys into group 1's
        # blocks is impossible by construction, and the bytes differ (the layers share memory, not KV).
        a, b = engine.storage.get([stored[0]]), engine.storage.get([stored[2]])
        assert not torch.equal(a[0].tensor, b[0].tensor)
        for obj in a + b:
            obj.ref_down()
    finally:
        engine.close()


def test_a_missing_sliding_chunk_in_the_window_shortens_the_hit_one_outside_does_not():
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=4)
        tokens = tokens_of(256, seed=5)
        src = tables_for(groups, 256, Pool())
        save(engine, groups, tokens, src)
        sliding_keys = engine.engines[1].keys.keys(tokens)
        # A hit of 256 needs sliding chunks 6 and 7 (tokens 217.. -> block 13 at 208 -> chunk 6 on).
        assert list(groups[1].chunks_needed(255, 0, CHUNK)) == [6, 7]
        engine.storage.l1.remove_sync(sliding_keys[2][0].to_str())  # outside the window: not needed
        limited = metrics.value("group_limited_hits", group="swa40.l1.3")
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 256
        hold.release()
        engine.storage.l1.remove_sync(sliding_keys[6][0].to_str())  # inside it: the hit ends before chunk 6
        hold = engine.lookup_and_hold(tokens, 0)
        hit = hold.located(1.0)
        hold.release()
        # 192 needs chunks 4 and 5 (kept from block 9 = token 144 -> chunk 4): both there.
        assert hit.end == 192
        assert metrics.value("group_limited_hits", group="swa40.l1.3") == limited + 1
        # With chunks 2 and 6 gone, 96's window needs chunks 1..2 and 64's chunk 0..1: 64 is served.
        engine.storage.l1.remove_sync(sliding_keys[4][0].to_str())
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 64
        hold.release()
    finally:
        engine.close()


def test_a_released_hold_takes_no_new_prefetch_holds():
    """A lookup released (its request ended) before its hit was asked for: asking then must not start the
    other groups' prefetches, whose chunks nobody would ever release."""
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=6)
        tokens = tokens_of(256, seed=7)
        save(engine, groups, tokens, tables_for(groups, 256, Pool()))
        hold = engine.lookup_and_hold(tokens, 0)
        hold.release()
        assert engine.storage._holds.num_held() == 0
        hit = hold.located(1.0)
        assert engine.storage._holds.num_held() == 0 and metrics.value("prefetch_held_chunks") == 0
        assert hit is not None and hit.end == 0  # nothing is held for it any more
        hold.release()
    finally:
        engine.close()


def test_a_lookup_from_vllms_own_hit_needs_only_chunks_after_it():
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=6)
        tokens = tokens_of(160, seed=7)
        src = tables_for(groups, 160, Pool())
        save(engine, groups, tokens, src)
        sliding_keys = engine.engines[1].keys.keys(tokens)
        engine.storage.l1.remove_sync(sliding_keys[1][0].to_str())
        hold = engine.lookup_and_hold(tokens, 96)  # vLLM holds 96 tokens (and the window before them) itself
        hit = hold.located(1.0)
        hold.release()
        assert (hit.start, hit.end) == (96, 160)
    finally:
        engine.close()


def test_states_are_stored_per_chunk_boundary_and_a_missing_one_shortens_the_hit():
    case = HybridCase(kind="mamba")
    engine, views, groups = build(case)
    try:
        full, state = groups
        assert state.kind == GroupKind.STATE
        fill_random(views, seed=8)
        tokens = tokens_of(200, seed=9)
        pool = Pool()
        src = tables_for(groups, 200, pool)
        # vLLM offers the state of each chunk boundary in the block at index boundary / block - 1.
        states = [(state.index, src[1][b // BLOCK - 1], b) for b in range(CHUNK, 200, CHUNK)]
        spec = SaveSpec("r", tokens, [], 0, is_last=True, group_block_ids=src, states=states)
        engine.store(tokens, save_parts(groups, spec))
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 192
        hold.release()
        engine.storage.l1.remove_sync(engine.engines[1].keys.keys(tokens)[5][0].to_str())  # the state at 192
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 160
        dst = tables_for(groups, 160, pool, kept_until=160)
        assert dst[1][:9] == [0] * 9 and dst[1][9] != 0  # the state of 160 tokens lives in block index 9
        load = LoadSpec("r", tokens[:160], [], skip_leading=0, load_end=160, group_block_ids=dst)
        done = engine.retrieve(tokens[:160], load_parts(groups, load), hold=hold)
        hold.release()
        assert done == {0: True, 1: True}
        for name in state.layer_names:
            assert torch.equal(views[name][dst[1][9]], views[name][src[1][9]])
    finally:
        engine.close()


def test_a_whole_prompt_hit_is_never_served_by_a_state_group():
    case = HybridCase(kind="mamba")
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=10)
        tokens = tokens_of(192, seed=11)  # six whole chunks: the last boundary is the prompt's end
        src = tables_for(groups, 192, Pool())
        states = [(1, src[1][b // BLOCK - 1], b) for b in range(CHUNK, 193, CHUNK)]
        engine.store(tokens, save_parts(groups, SaveSpec("r", tokens, [], 0, True, group_block_ids=src,
                                                         states=states)))
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 160  # vLLM computes the prompt's last token: the state at 191 is none
        hold.release()
    finally:
        engine.close()


def test_a_load_without_the_blocks_it_needs_fails_instead_of_guessing():
    case = HybridCase(kind="sliding", window=40)
    engine, views, groups = build(case)
    try:
        fill_random(views, seed=12)
        tokens = tokens_of(128, seed=13)
        pool = Pool()
        save(engine, groups, tokens, tables_for(groups, 128, pool))
        hold = engine.lookup_and_hold(tokens, 0)
        assert hold.located(1.0).end == 128
        dst = tables_for(groups, 127, pool, kept_until=127)
        dst[1][7] = 0  # a block of the window vLLM did not give: the sliding part cannot be complete
        spec = LoadSpec("r", tokens, [], skip_leading=0, load_end=127, group_block_ids=dst)
        assert engine.retrieve(tokens, load_parts(groups, spec), hold=hold) == {0: True, 1: False}
        hold.release()
    finally:
        engine.close()
