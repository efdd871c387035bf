"""KV cache groups: tags in keys, which tokens a group keeps and needs (against vLLM's own managers), and how
vLLM's hybrid KV cache configs are read (`integration/vllm/groups.py`)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from lmcache_vllm.engine.kv_groups import GroupKind, KVGroup, layer_part
from lmcache_vllm.tokens import CacheKey, ChunkHasher, KeyBuilder


def test_layer_part_names_runs_and_stays_short():
    assert layer_part((0, 2)) == "l0.2"
    assert layer_part((3, 0, 1, 2, 6, 7)) == "l0-3.6-7"
    long = layer_part(tuple(range(0, 200, 3)))
    assert long.startswith("n67h") and len(long) < 20
    assert long != layer_part(tuple(range(1, 200, 3)))


def test_group_tags_name_kind_window_and_layers():
    full = KVGroup(0, GroupKind.FULL, ("a.0", "a.2"), (0, 2), 16)
    sliding = KVGroup(1, GroupKind.SLIDING, ("a.1", "a.3"), (1, 3), 16, window=4096, sliding_window=4096)
    state = KVGroup(1, GroupKind.STATE, ("a.1", "a.3"), (1, 3), 16)
    assert (full.tag, sliding.tag, state.tag) == ("full.l0.2", "swa4096.l1.3", "state.l1.3")
    with pytest.raises(ValueError, match="window"):
        KVGroup(1, GroupKind.SLIDING, ("a",), (1,), 16)


def test_a_key_without_group_reads_as_before_and_groups_never_alias():
    plain = KeyBuilder("m", 1, 0, "bfloat16", 2, ChunkHasher(4), fingerprint="ab")
    key = plain.keys(range(8))[1][0]
    # The string of a single-group model's key is exactly what it was before groups existed.
    assert key.to_str() == f"m@ab@tp1.0@pp1.0@bfloat16@v2@{key.digest.hex()}"
    full = plain.for_group("full.l0.2").keys(range(8))[1][0]
    sliding = plain.for_group("swa384.l1.3").keys(range(8))[1][0]
    assert full.digest == sliding.digest == key.digest  # same prefix ...
    assert len({key.to_str(), full.to_str(), sliding.to_str()}) == 3  # ... three chunks, never aliased
    assert full.to_str() == f"m@ab@tp1.0@pp1.0@bfloat16@v2@g-full.l0.2@{key.digest.hex()}"
    for k in (key, full, sliding):
        assert CacheKey.from_str(k.to_str()) == k
    with pytest.raises(ValueError):
        dataclasses.replace(key, group="Bad@Tag")


@pytest.mark.parametrize("window,block", [(40, 16), (384, 128), (4096, 128), (7, 4)])
def test_kept_start_is_vllms_sliding_window_rule(window, block):
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    group = KVGroup(1, GroupKind.SLIDING, ("x",), (1,), block, window=window, sliding_window=window)
    for n in range(0, 3 * window + 2 * block):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, n)
        assert group.kept_start(n) == skipped // block * block, n


def test_kept_start_is_vllms_mamba_rule():
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    group = KVGroup(1, GroupKind.STATE, ("x",), (1,), 256)
    for n in range(1, 2000, 7):
        assert group.kept_start(n) == MambaManager.get_num_skipped_tokens(None, n) // 256 * 256


def test_chunks_needed_shorter_equal_and_longer_than_the_window():
    cs = 256
    full = KVGroup(0, GroupKind.FULL, ("x",), (0,), 128)
    sliding = KVGroup(1, GroupKind.SLIDING, ("y",), (1,), 128, window=384, sliding_window=384)
    state = KVGroup(2, GroupKind.STATE, ("z",), (2,), 256)
    assert list(full.chunks_needed(1024, 0, cs)) == [0, 1, 2, 3]
    assert list(full.chunks_needed(1024, 512, cs)) == [2, 3]
    # A hit shorter than the window needs every chunk, one equal to it too (the next token sees all of it) ...
    assert list(sliding.chunks_needed(256, 0, cs)) == [0]
    assert list(sliding.chunks_needed(384, 0, cs)) == [0, 1]
    # ... a longer one only those overlapping the blocks vLLM keeps: 1024 - 383 = 641 -> block 5 (640) on.
    assert list(sliding.chunks_needed(1024, 0, cs)) == [2, 3]
    assert list(sliding.chunks_needed(1023, 0, cs)) == [2, 3]  # a full-prompt hit loads all but its last token
    assert list(sliding.chunks_needed(1024, 768, cs)) == [3]
    assert list(state.chunks_needed(1024, 0, cs)) == [3]
    assert list(state.chunks_needed(1000, 0, cs)) == []  # no state between chunk boundaries


def test_plan_groups_reads_vllms_hybrid_configs():
    pytest.importorskip("vllm")
    from lmcache_vllm.integration.vllm.groups import plan_groups
    from lmcache_vllm.integration.vllm.testing.hybrid_views import HybridCase, vllm_hybrid_cache

    config, views = vllm_hybrid_cache(HybridCase(kind="sliding", window=40))
    plan = plan_groups(config, list(views))
    assert plan.disabled is None and plan.multi
    assert [(g.kind, g.tag, g.window) for g in plan.groups] == [(GroupKind.FULL, "full.l0.2", 0),
                                                              (GroupKind.SLIDING, "swa40.l1.3", 40)]
    config, views = vllm_hybrid_cache(HybridCase(kind="mamba"))
    plan = plan_groups(config, list(views))
    assert [(g.kind, g.tag) for g in plan.groups] == [(GroupKind.FULL, "full.l0.2"), (GroupKind.STATE, "state.l1.3")]
    # Without prefix caching vLLM keeps no states at boundaries: nothing of such a model can be served.
    spec = config.kv_cache_groups[1].kv_cache_spec
    config.kv_cache_groups[1] = dataclasses.replace(config.kv_cache_groups[1],
                                                    kv_cache_spec=dataclasses.replace(spec, mamba_cache_mode="none"))
    plan = plan_groups(config, list(views))
    assert plan.groups == () and "mamba_cache_mode 'none'" in plan.disabled
