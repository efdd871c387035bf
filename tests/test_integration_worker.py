"""WorkerHalf on plain tensors with a real CacheEngine: background saves, draining, load after save."""
import threading

import numpy as np
import pytest
import torch
from test_engine import BLOCK, BLOCKS, CHUNK, kv_of, make_caches, make_engine, worker_config

from lmcache_vllm.integration.vllm.lookup import LookupQuery
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, SaveSpec
from lmcache_vllm.integration.vllm.worker import WorkerHalf
from lmcache_vllm.observability import metrics


def _worker(engine, caches, async_save=True):
    worker = WorkerHalf(worker_config(engine, use_layerwise=False, async_save=async_save),
                        engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    return worker


def lookup(worker, tokens, req_id="q") -> int:
    """Tokens the worker reports cached for `tokens` (a lookup of request `req_id`, from token 0)."""
    return worker._lookup(LookupQuery(req_id, np.asarray(tokens, dtype=np.int64))).hit_tokens


def query(tokens, req_id="q") -> LookupQuery:
    return LookupQuery(req_id, np.asarray(tokens, dtype=np.int64))


def hold_stores(engine) -> threading.Event:
    """Makes the engine's stores (on the background save thread) wait until the returned event is set."""
    release = threading.Event()
    real_store = engine.store

    def slow_store(*args, **kwargs):
        release.wait(5)
        return real_store(*args, **kwargs)

    engine.store = slow_store
    return release


def _save_meta(tokens, block_ids):
    return LMCacheConnectorMetadata(saves=[SaveSpec(req_id="a", token_ids=tokens, block_ids=block_ids,
                                                    skip_leading=0, is_last=True)])


def test_background_save_then_load_round_trips():
    caches = make_caches(True, seed=3)
    worker = _worker(make_engine(), caches)
    try:
        tokens = list(range(500, 500 + 3 * CHUNK))
        blocks = list(range(10, 10 + 3 * CHUNK // BLOCK))
        worker.begin_step()
        worker.wait_for_save(_save_meta(tokens, blocks))
        assert worker.save.queue.executor is not None  # the save went to the background thread
        # A lookup waits for the pending save, so a prompt sent right after finds it.
        assert lookup(worker, tokens) == 3 * CHUNK
        assert metrics.value("stored_tokens") == 3 * CHUNK

        # Load into other blocks of the same caches, then compare the KV.
        new_blocks = list(range(40, 40 + 3 * CHUNK // BLOCK))
        worker.begin_step()
        worker.start_load_kv(LMCacheConnectorMetadata(loads=[LoadSpec(
            req_id="b", token_ids=tokens, block_ids=new_blocks, skip_leading=0, load_end=len(tokens))]))
        assert worker.take_load_errors() == set()
        old = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])
        new = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in new_blocks])
        engine = worker.engine
        assert torch.equal(kv_of(engine, caches, old), kv_of(engine, caches, new))
        # Time spent is counted: storing (background), loading (in the step).
        stats = metrics.flat(metrics.snapshot())
        assert stats["store_seconds.sum"] > 0 and stats["load_seconds.sum"] > 0
        assert stats["store_seconds.count"] == stats["load_seconds.count"] == 1
    finally:
        worker.shutdown()


def test_drain_waits_for_the_gather_before_blocks_are_reused():
    caches = make_caches(True, seed=4)
    engine = make_engine()
    worker = _worker(engine, caches)
    release = hold_stores(engine)
    try:
        tokens = list(range(900, 900 + 2 * CHUNK))
        blocks = list(range(0, 2 * CHUNK // BLOCK))
        expected = kv_of(engine, caches, torch.arange(2 * CHUNK))
        worker.wait_for_save(_save_meta(tokens, blocks))
        # An unrelated prompt's lookup does not wait for the pending save; one sharing its prefix does.
        assert lookup(worker, list(range(5000, 5000 + 2 * CHUNK)), "other") == 0
        hits = []
        threading.Thread(target=lambda: hits.append(lookup(worker, tokens)), daemon=True).start()
        drained = threading.Event()
        threading.Thread(target=lambda: (worker.drain_saves(), drained.set()), daemon=True).start()
        assert not drained.wait(0.2)  # the next step may not start while the gather is pending
        assert hits == []
        release.set()
        assert drained.wait(5)
        for _ in range(50):
            if hits:
                break
            threading.Event().wait(0.1)
        assert hits == [2 * CHUNK]
        for cache in caches:  # vLLM may now zero / reuse the blocks: what was stored is unaffected
            cache.zero_()
        fresh = make_caches(False)
        engine.retrieve(tokens, fresh, torch.arange(BLOCKS * BLOCK)[:len(tokens)])
        assert torch.equal(kv_of(engine, fresh, torch.arange(2 * CHUNK)), expected)
    finally:
        worker.shutdown()


def test_sync_save_stores_inside_the_step():
    caches = make_caches(True, seed=5)
    worker = _worker(make_engine(), caches, async_save=False)
    try:
        tokens = list(range(300, 300 + CHUNK))
        worker.wait_for_save(_save_meta(tokens, list(range(CHUNK // BLOCK))))
        assert worker.save.queue.executor is None and worker.save.queue._futures() == []
        assert worker.engine.lookup(tokens) == CHUNK
    finally:
        worker.shutdown()


def test_reset_command_empties_l1_after_pending_saves(tmp_path):
    from lmcache_vllm.integration.vllm.lookup import LookupClient, lookup_socket_path

    caches = make_caches(True, seed=6)
    address = lookup_socket_path("reset", 0, str(tmp_path))
    engine = make_engine()
    worker = WorkerHalf(worker_config(engine, use_layerwise=False, async_save=True), engine_factory=lambda _: engine,
                        block_size=BLOCK, lookup_address=address)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    client = LookupClient([address], timeout_ms=5000, direct=False)
    try:
        tokens = list(range(700, 700 + 2 * CHUNK))
        worker.begin_step()
        worker.wait_for_save(_save_meta(tokens, list(range(2 * CHUNK // BLOCK))))
        # The save still on the background thread lands first, then L1 is emptied: nothing is left.
        assert client.command("reset_l1") == [1]
        assert client.lookup(query(tokens, "r1")).hit_tokens == 0
        assert metrics.value("resident_chunks", tier="local_cpu") == 0
        worker.begin_step()
        worker.wait_for_save(_save_meta(tokens, list(range(2 * CHUNK // BLOCK))))
        assert client.lookup(query(tokens, "r2")) == (2 * CHUNK, ("local_cpu", "local_cpu"), 0, False, True)
    finally:
        client.close()
        worker.shutdown()


def _failure_step(worker, tokens, new_tokens, load_blocks, save_blocks, layerwise=False):
    """One step: load the stored `tokens`, then save `tokens + new_tokens` (the chunks after the load)."""
    meta = LMCacheConnectorMetadata(
        loads=[LoadSpec(req_id="r", token_ids=tokens, block_ids=load_blocks, skip_leading=0,
                        load_end=len(tokens))],
        saves=[SaveSpec(req_id="r", token_ids=tokens + new_tokens, block_ids=save_blocks,
                        skip_leading=len(tokens), is_last=True)])
    _run_step(worker, meta, layerwise)
    return meta


def _run_step(worker, meta, layerwise):
    """The worker-side calls of one vLLM step, in vLLM's order."""
    worker.begin_step()
    if meta.loads:
        worker.start_load_kv(meta)
    if layerwise:
        for name in worker.layer_index:
            worker.wait_for_layer_load(name)
            if meta.saves:
                worker.save_kv_layer(meta, name)
    worker.wait_for_save(meta)


@pytest.mark.parametrize("layerwise", [False, True])
def test_load_failed_on_another_tp_rank_stops_this_ranks_saves(layerwise):
    """The agreement stands in for the TP all-reduce (tested for real in tests/e2e/test_keys_tp.py): the
    load succeeded on this rank, failed on another; KV computed on top of it must not be stored here."""
    caches = make_caches(True, seed=6)
    votes = []

    def other_rank_failed(flags):
        votes.append(list(flags))
        return [True] * len(flags)

    engine = make_engine(use_layerwise=layerwise)
    worker = WorkerHalf(worker_config(engine, use_layerwise=layerwise, async_save=False),
                        engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None,
                        failure_agreement=other_rank_failed)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        tokens, new = list(range(700, 700 + CHUNK)), list(range(9000, 9000 + CHUNK))
        assert engine.store(tokens, caches, torch.arange(CHUNK)) == CHUNK
        _failure_step(worker, tokens, new, [0, 1], list(range(4)), layerwise)
        assert votes == [[False]]  # this rank's own load was fine
        assert worker.take_load_errors() == set()  # the failing rank reports its blocks, not this one
        assert engine.lookup(tokens + new) == CHUNK  # the chunk after the load was not stored
        assert metrics.value("loads_failed_on_other_rank") == 1
        assert metrics.value("stores_skipped_after_failed_load") == 1
        # A step without loads does not vote, and saves as usual.
        _run_step(worker, _save_meta(tokens + new, list(range(4))), layerwise)
        assert votes == [[False]] and engine.lookup(tokens + new) == 2 * CHUNK
    finally:
        worker.shutdown()


def test_layerwise_load_failing_at_a_later_layer_is_a_failed_load():
    caches = make_caches(True, seed=7)
    engine = make_engine(use_layerwise=True)
    worker = WorkerHalf(worker_config(engine, use_layerwise=True, async_save=False), engine_factory=lambda _: engine,
                        block_size=BLOCK, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        tokens, new = list(range(800, 800 + CHUNK)), list(range(9100, 9100 + CHUNK))
        assert engine.store(tokens, caches, torch.arange(CHUNK)) == CHUNK
        real_copier = engine.layout.layer_copier

        def scatter_fails_at_layer_1(gather, *args):
            copy = real_copier(gather, *args)

            def scatter(layer):
                if layer == 1:
                    raise RuntimeError("copy failed")
                copy(layer)
            return copy if gather else scatter

        engine.layout.layer_copier = scatter_fails_at_layer_1
        _failure_step(worker, tokens, new, [8, 9], [8, 9, 10, 11], layerwise=True)
        assert worker.take_load_errors() == {8, 9}  # the whole loaded range is recomputed
        assert engine.lookup(tokens + new) == CHUNK  # and nothing computed on top of it is stored
        assert metrics.value("failed_load_tokens") == CHUNK
    finally:
        worker.shutdown()


def test_finished_request_is_reported_once_its_background_save_is_over():
    caches = make_caches(True, seed=7)
    engine = make_engine()
    worker = _worker(engine, caches)
    release = hold_stores(engine)
    try:
        tokens = list(range(1500, 1500 + 2 * CHUNK))
        worker.begin_step()
        worker.wait_for_save(_save_meta(tokens, list(range(2 * CHUNK // BLOCK))))
        # "a" finished; vLLM keeps its blocks and tells us in the next step's metadata.
        step = LMCacheConnectorMetadata(delayed_free_req_ids=["a"])
        worker.begin_step()  # the step does not wait for the save
        assert worker.get_finished(step, {"a"}) == (None, None)  # still copying from its blocks
        release.set()
        worker.drain_saves()
        assert worker.get_finished(LMCacheConnectorMetadata(), set()) == ({"a"}, None)
        assert worker.get_finished(LMCacheConnectorMetadata(), set()) == (None, None)  # reported once
        # A preempted request's blocks are freed at once: its saves finish inside handle_preemptions.
        release.clear()
        worker.wait_for_save(_save_meta(tokens[:CHUNK], list(range(CHUNK // BLOCK))))
        threading.Timer(0.2, release.set).start()
        worker.handle_preemptions(LMCacheConnectorMetadata(preempted_req_ids=["a"]))
        assert worker.save.queue._futures() == []
    finally:
        release.set()
        worker.shutdown()
