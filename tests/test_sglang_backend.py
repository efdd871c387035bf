"""`LMCacheHiCacheStorage` (lmcache_vllm/integration/sglang) called the way SGLang 0.5.23's controller calls it,
with SGLang's own classes: its factory loads the backend by module path, its real host pools (every MHA and MLA
layout) hand over the pages, its `HiCacheFile` is the like-with-like reference of the v2 hit policies. The tier is
a real directory (and a real redis-server where named). The controller's own threads: test_sglang_controller.py.
"""
from __future__ import annotations

import glob
import os
import threading

import pytest
import sglang_support as S
import torch

S.import_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from lmcache_vllm.config import ConfigError  # noqa: E402
from lmcache_vllm.integration.sglang import LMCacheHiCacheStorage  # noqa: E402
from lmcache_vllm.integration.sglang.pages import UnsupportedPool  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402


@pytest.fixture(autouse=True)
def every_backend_closed():
    """A test that leaves a backend open (its storage thread, its share of the metrics export) fails."""
    from lmcache_vllm.integration.sglang import prometheus

    yield
    assert prometheus._export is None or prometheus._export.users == 0, "a backend was left open"


TOKENS = list(range(5000, 5000 + 4 * S.PAGE))
HASHES = S.page_hashes(TOKENS)


def disk(tmp_path, **more) -> dict:
    return {"local_cpu": False, "local_disk": str(tmp_path / "l3"), "max_local_disk_size": 1, **more}


def make(pool, extra, **config_kwargs) -> LMCacheHiCacheStorage:
    backend = LMCacheHiCacheStorage(S.storage_config(S.dynamic(extra), **config_kwargs), {})
    backend.register_mem_pool_host(pool)
    return backend


def store_and_load(backend, pool, hashes=HASHES):
    """Stores the pages at fresh slots, loads them into other fresh slots: (stored, loaded, written pages,
    read pages)."""
    src = pool.alloc(len(hashes) * pool.page_size)
    want = S.pages_of(pool, src)
    stored = backend.batch_set_v1(hashes, src)
    dst = pool.alloc(len(hashes) * pool.page_size)
    loaded = backend.batch_get_v1(hashes, dst)
    return stored, loaded, want, S.pages_of(pool, dst)


def test_sglang_factory_loads_the_backend_by_module_path_and_the_fault_injector_reaches_close(tmp_path, monkeypatch):
    pool = S.mha_pool()
    cfg = S.storage_config(S.dynamic(disk(tmp_path)))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, LMCacheHiCacheStorage)
    backend.close()
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0")
    wrapped = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(wrapped, HiCacheStorageFailureInjector)
    inner = wrapped._backend
    wrapped.close()  # SGLang forwards close() unconditionally on detach
    assert inner._closed and not inner.manager._thread.is_alive()


@pytest.mark.parametrize("kind,layout", [("mha", lay) for lay in S.MHA_LAYOUTS] +
                         [("mla", lay) for lay in S.MLA_LAYOUTS])
def test_v1_pages_of_every_host_layout_round_trip_bit_exact_through_the_disk_tier(tmp_path, kind, layout):
    pool = (S.mha_pool if kind == "mha" else S.mla_pool)(layout, seed=3)
    backend = make(pool, disk(tmp_path), mla=kind == "mla")
    try:
        stored, loaded, want, got = store_and_load(backend, pool)
        assert stored == [True] * 4 and loaded == [True] * 4
        assert backend.batch_exists(HASHES) == 4 and backend.exists(HASHES[0])
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert len(glob.glob(str(tmp_path / "l3" / "*.lmc"))) == 4  # one chunk file per page
        assert metrics.value("sglang_pages", op="get", outcome="ok") == 4
    finally:
        backend.close()


def test_generic_flat_pages_and_v1_pages_are_the_same_stored_bytes(tmp_path):
    pool = S.mha_pool("page_first", seed=4)
    backend = make(pool, disk(tmp_path))
    try:
        src = pool.alloc(4 * S.PAGE)
        starts = src[::S.PAGE].tolist()
        flats = [pool.get_data_page(s, flat=True) for s in starts]
        assert backend.batch_set(HASHES[:2], flats[:2]) and backend.set(HASHES[2], flats[2])
        assert backend.batch_set_v1(HASHES[3:], src[3 * S.PAGE:]) == [True]
        dst = pool.alloc(4 * S.PAGE)
        assert backend.batch_get_v1(HASHES, dst) == [True] * 4  # v1 reads what the generic path wrote
        assert all(torch.equal(a, b) for a, b in zip(S.pages_of(pool, src), S.pages_of(pool, dst)))
        targets = [pool.get_dummy_flat_data_page() for _ in HASHES]
        got = backend.batch_get(HASHES, targets)  # and the generic path what v1 wrote
        assert all(g is t for g, t in zip(got, targets))
        assert all(torch.equal(t, f.reshape(-1)) for t, f in zip(targets, flats))
        assert backend.get(S.page_hashes(list(range(16)))[0], pool.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


def test_keys_name_the_model_rank_layout_and_dtype_and_mla_ranks_share_pages(tmp_path):
    pool = S.mha_pool("page_first", seed=5)
    backend = make(pool, disk(tmp_path))
    src = pool.alloc(4 * S.PAGE)
    assert backend.batch_set_v1(HASHES, src) == [True] * 4
    backend.close()
    others = [
        (S.mha_pool("page_first", seed=5), {"model_name": "other-model"}),
        (S.mha_pool("layer_first", seed=5), {}),
        (S.mha_pool("page_first", seed=5, dtype=torch.float16), {}),
        (S.mha_pool("page_first", seed=5), {"tp_rank": 1, "tp_size": 2}),
        (S.mha_pool("page_first", seed=5, heads=2), {}),
    ]
    for other_pool, kwargs in others:
        other = make(other_pool, disk(tmp_path), **kwargs)
        try:
            assert other.batch_exists(HASHES) == 0, kwargs or other_pool.layout
        finally:
            other.close()
    namespaced = make(pool, disk(tmp_path, extra_config={"cache_namespace": "v2"}))
    try:
        assert namespaced.batch_exists(HASHES) == 0
    finally:
        namespaced.close()
    mla = S.mla_pool("page_first", seed=6)
    rank0 = make(mla, disk(tmp_path), mla=True, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(HASHES, mla.alloc(4 * S.PAGE)) == [True] * 4
    rank0.close()
    rank1 = make(S.mla_pool("page_first"), disk(tmp_path), mla=True, tp_rank=1, tp_size=2)
    try:
        assert rank1.batch_exists(HASHES) == 4  # MLA: one copy for every TP rank, as SGLang writes it once
    finally:
        rank1.close()


def test_a_corrupt_page_is_a_miss_and_never_reaches_sglangs_pool(tmp_path):
    pool = S.mha_pool("page_first", seed=7)
    backend = make(pool, disk(tmp_path))
    try:
        src = pool.alloc(4 * S.PAGE)
        assert backend.batch_set_v1(HASHES, src) == [True] * 4
        victim = next(p for p in glob.glob(str(tmp_path / "l3" / "*.lmc")) if HASHES[2] in p)
        with open(victim, "r+b") as f:  # one payload byte flipped
            f.seek(os.path.getsize(victim) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        dst = pool.alloc(4 * S.PAGE)
        sentinel = torch.full_like(pool.get_data_page(int(dst[0]), flat=False), 7.0)
        for s in dst[::S.PAGE].tolist():
            pool.get_data_page(s, flat=False).copy_(sentinel)
        assert backend.batch_get_v1(HASHES, dst) == [True, True, False, False]
        got = S.pages_of(pool, dst)
        assert all(torch.equal(a, b) for a, b in zip(S.pages_of(pool, src)[:2], got[:2]))
        assert torch.equal(got[2], sentinel) and torch.equal(got[3], sentinel)  # untouched
        assert metrics.value("corrupt_chunks", tier="local_disk") == 1 and not os.path.exists(victim)
        assert backend.batch_exists(HASHES) == 2
    finally:
        backend.close()


def test_arguments_that_are_not_pages_of_the_pool_are_refused_and_counted(tmp_path):
    pool = S.mha_pool("page_first")
    backend = make(pool, disk(tmp_path))
    try:
        src = pool.alloc(4 * S.PAGE)
        assert backend.batch_set_v1(HASHES, src[:-1]) == [False] * 4  # not one slot per token
        assert backend.batch_get_v1(HASHES, src + 1) == [False] * 4  # pages not on a page boundary
        assert backend.batch_set_v1(["not-a-hash", *HASHES[1:]], src) == [False, True, True, True]
        assert backend.batch_exists(["not-a-hash", *HASHES[1:]]) == 0
        assert backend.batch_set(HASHES[:1], [torch.zeros(3)]) is False  # a flat page of another size
        assert metrics.value("sglang_pages", op="set", outcome="refused") == 4
        assert metrics.value("sglang_pages", op="get", outcome="refused") == 4
    finally:
        backend.close()


def test_configuration_errors_name_every_key_and_sglangs_extra_config(tmp_path):
    with pytest.raises(ConfigError) as err:
        LMCacheHiCacheStorage(S.storage_config(S.dynamic({"local_dsik": "/x", "max_local_disk_size": -1})), {})
    text = str(err.value)
    assert "local_dsik" in text and "max_local_disk_size" in text and "hicache-storage-backend-extra-config" in text
    with pytest.raises(ConfigError, match="needs a tier"):
        LMCacheHiCacheStorage(S.storage_config(S.dynamic({"local_cpu": False})), {})
    with pytest.raises(ValueError, match="tp_lcm_size"):
        cfg = S.storage_config(S.dynamic(disk(tmp_path)))
        cfg.should_split_heads = True
        LMCacheHiCacheStorage(cfg, {})


def test_a_host_layout_without_addressable_pages_is_refused_at_registration(tmp_path):
    backend = LMCacheHiCacheStorage(S.storage_config(S.dynamic(disk(tmp_path))), {})
    try:
        with pytest.raises(UnsupportedPool, match="page_unified"):
            backend.register_mem_pool_host(S.mha_pool("page_unified"))
        assert backend.batch_exists(HASHES) == 0 and backend.batch_get_v1(HASHES, torch.arange(64)) == [False] * 4
    finally:
        backend.close()


def test_get_stats_gives_sglang_its_storage_metrics_only_when_it_asks(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = S.mha_pool("page_first")
    backend = make(pool, disk(tmp_path), metrics=True)
    quiet = make(pool, disk(tmp_path))
    try:
        store_and_load(backend, pool)
        stats = backend.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]
        assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
        assert backend.get_stats().backup_pgs == []  # since the last ask
        assert quiet.get_stats() is None
        assert metrics.snapshot()["histograms"]["sglang_call_seconds"]["set"]["count"] >= 1
    finally:
        backend.close()
        quiet.close()


def test_clear_empties_the_tier_and_close_is_clean_and_final(tmp_path):
    pool = S.mha_pool("page_first")
    backend = make(pool, disk(tmp_path))
    store_and_load(backend, pool)
    assert backend.clear() is True and backend.batch_exists(HASHES) == 0
    assert not glob.glob(str(tmp_path / "l3" / "*.lmc"))
    backend.close()
    backend.close()
    assert not backend.manager._thread.is_alive()
    assert not [t for t in threading.enumerate() if t is backend.manager._thread]
    src = pool.alloc(4 * S.PAGE)
    assert backend.batch_set_v1(HASHES, src) == [False] * 4 and backend.batch_exists(HASHES) == 0
    assert backend.batch_get_v1(HASHES, src) == [False] * 4 and backend.clear() is False


def _v2_pools():
    kv = S.mha_pool("page_first", seed=8)
    swa = S.mha_pool("page_first", seed=9, heads=2)
    return kv, swa


def _transfer(name, hashes, host, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(name=name, host_indices=host, keys=list(hashes), hit_policy=policy)


@pytest.mark.parametrize("policy", [PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
def test_v2_sidecar_pools_round_trip_and_answer_hits_as_sglangs_file_backend_does(tmp_path, policy):
    kv, swa = _v2_pools()
    ours = LMCacheHiCacheStorage(S.storage_config(S.dynamic(disk(tmp_path))), {})
    reference = HiCacheFile(S.storage_config({}), file_path=str(tmp_path / "hicache-file"))
    for backend in (ours, reference):
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    try:
        kv_src, swa_src = kv.alloc(4 * S.PAGE), swa.alloc(4 * S.PAGE)
        # KV for all four pages; the sidecar only for pages 0, 1 and 3 (page 2's state was never written)
        keep = [0, 1, 3]
        swa_host = torch.cat([swa_src[i * S.PAGE:(i + 1) * S.PAGE] for i in keep])
        assert ours.batch_set_v1(HASHES, kv_src) == [True] * 4
        assert reference.batch_set(HASHES, [kv.get_data_page(int(s)) for s in kv_src[::S.PAGE]])
        for backend in (ours, reference):
            written = backend.batch_set_v2([_transfer(PoolName.SWA, [HASHES[i] for i in keep], swa_host)])
            assert written == {PoolName.SWA: [True] * 3}
        for window in (1, 2):
            query = [_transfer(PoolName.SWA, HASHES[:window], None, policy)]
            got, want = ours.batch_exists_v2(HASHES, query), reference.batch_exists_v2(HASHES, query)
            assert (got.kv_hit_pages, dict(got.extra_pool_hit_pages), got.restorable_prefix_pages) == \
                (want.kv_hit_pages, dict(want.extra_pool_hit_pages), want.restorable_prefix_pages), window
        dst = swa.alloc(3 * S.PAGE)
        read = ours.batch_get_v2([_transfer(PoolName.SWA, [HASHES[i] for i in keep], dst)])
        assert read == {PoolName.SWA: [True] * 3}
        assert all(torch.equal(a, b) for a, b in zip(S.pages_of(swa, swa_host), S.pages_of(swa, dst)))
        blocks = [_transfer(PoolName.SWA, HASHES, None, PoolHitPolicy.BLOCK_GROUPS)]
        assert ours.batch_exists_v2(HASHES, blocks).kv_hit_pages == 0  # not stored by us: no hit, no error
        assert ours.batch_get_v2([_transfer("mamba", HASHES[:1], dst[:S.PAGE])]) == {"mamba": [False]}
    finally:
        ours.close()


def test_a_batch_larger_than_the_write_queue_and_the_arena_is_stored_and_read_whole(tmp_path):
    pool = S.mha_pool("page_first", seed=10)
    page_bytes = pool.get_data_page(0, flat=False).numel() * 2
    small = disk(tmp_path, extra_config={"write_queue_depth": 2, "staging_buffer_size": 3 * page_bytes / 2**30})
    backend = make(pool, small)
    try:
        hashes = S.page_hashes(list(range(12 * S.PAGE)))
        stored, loaded, want, got = store_and_load(backend, pool, hashes)
        assert stored == [True] * 12 and loaded == [True] * 12
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert metrics.value("dropped_stores", reason="queue_full") == 0
    finally:
        backend.close()


def test_our_metrics_reach_prometheus_labelled_with_the_model_and_rank_and_the_export_ends_with_the_backend(tmp_path):
    from lmcache_vllm.integration.sglang import prometheus

    pool = S.mha_pool("page_first")
    backend = make(pool, disk(tmp_path), model_name="prom-model", tp_rank=0)
    try:
        store_and_load(backend, pool)
        registry = prometheus.flush()
        labels = {"model_name": "prom-model", "tp_rank": "0"}
        assert registry.get_sample_value("lmcache_vllm:sglang_pages_total", {**labels, "op": "get",
                                                                              "outcome": "ok"}) == 4
        assert registry.get_sample_value("lmcache_vllm:chunk_hits_total", {**labels, "tier": "local_disk"}) == 4
        assert registry.get_sample_value("lmcache_vllm:sglang_call_seconds_count", {**labels, "op": "set"}) == 1
    finally:
        backend.close()
    assert not [t for t in threading.enumerate() if t.name == "lmcache-sglang-metrics"]
