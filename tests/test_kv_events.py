"""KV events from the real engine and tiers: what each tier gains and loses, with the parent digest and
token ids of each chunk; and their release to vLLM once every TP rank reported them."""
import pytest
from test_engine import CHUNK, make_caches, make_engine, slots_for

from lmcache_vllm.observability import kv_events


def _events(kind=None):
    return [(e.stored, e.tier, e.digest, e.parent, e.token_ids) for e in kv_events.RECORDER.take()]


def test_off_by_default_records_nothing():
    engine = make_engine()
    try:
        engine.store(list(range(64)), make_caches(True), slots_for(64, seed=1))
        assert kv_events.RECORDER.take() == []
    finally:
        engine.close()


def test_store_write_through_eviction_and_reset_are_events(tmp_path):
    kv_events.RECORDER.enabled = True
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        tokens = list(range(1000, 1000 + 2 * CHUNK))
        engine.store(tokens, make_caches(True), slots_for(2 * CHUNK, seed=1))
        assert engine.storage.flush()
        events = _events()
        digests = [c.key.digest for c in engine._chunks(tokens, False, None)]
        stored_cpu = [e for e in events if e[0] and e[1] == "local_cpu"]
        assert [(e[2], e[3], e[4]) for e in stored_cpu] == [
            (digests[0], None, tuple(tokens[:CHUNK])), (digests[1], digests[0], tuple(tokens[CHUNK:]))]
        assert sorted(e[2] for e in events if e[0] and e[1] == "local_disk") == sorted(digests)
        assert all(e[4] for e in events)  # token ids known: this process stored them

        assert engine.clear(lower_tiers=False)  # a reset of L1: removed from cpu only
        assert sorted((e[0], e[1], e[2]) for e in _events()) == sorted((False, "local_cpu", d) for d in digests)
        # a load from disk lands in L1 again: stored on cpu, with the token ids
        dst = make_caches(False)
        assert engine.retrieve(tokens, dst, slots_for(2 * CHUNK, seed=2)).all()
        assert [(e[0], e[1], e[4]) for e in _events()] == [(True, "local_cpu", tuple(tokens[:CHUNK])),
                                                          (True, "local_cpu", tuple(tokens[CHUNK:]))]
        assert engine.clear()
        removed = _events()
        assert {e[1] for e in removed} == {"local_cpu", "local_disk"} and not any(e[0] for e in removed)
    finally:
        engine.close()


def test_disk_reindex_at_start_reports_what_it_found(tmp_path):
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens = list(range(3 * CHUNK))
    engine.store(tokens, make_caches(True), slots_for(3 * CHUNK, seed=1))
    assert engine.storage.flush()
    engine.close()
    kv_events.RECORDER.enabled = True
    restarted = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        events = _events()
        assert len(events) == 3 and all(e[0] and e[1] == "local_disk" and e[4] == () for e in events)
    finally:
        restarted.close()


def test_events_name_vllms_medium_and_our_tier():
    """Routers filter on vLLM's mediums (GPU / CPU / STORAGE): L1 is CPU, disk and Redis STORAGE; our tier goes
    into `ownership`, vLLM's field for the secondary tier that produced an event."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored

    from lmcache_vllm.integration.vllm.events import to_vllm

    want = {"local_cpu": (MEDIUM_CPU, "LOCAL"), "local_disk": (MEDIUM_STORAGE, "LOCAL"),
            "redis": (MEDIUM_STORAGE, "REMOTE"), "mooncake": (MEDIUM_STORAGE, "REMOTE")}
    for tier, (medium, locality) in want.items():
        stored = to_vllm(kv_events.ChunkEvent(True, b"\x01" * 16, tier, b"\x00" * 16, (1, 2, 3)), 256)
        removed = to_vllm(kv_events.ChunkEvent(False, b"\x02" * 16, tier), 256)
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        for event in (stored, removed):
            assert (event.medium, event.locality, event.ownership) == (medium, locality, tier)
        assert stored.block_hashes == [b"\x01" * 16] and stored.parent_block_hash == b"\x00" * 16
        assert stored.token_ids == [1, 2, 3] and stored.block_size == 3 and stored.lora_id is None
    unknown_tokens = to_vllm(kv_events.ChunkEvent(True, b"\x03" * 16, "local_disk"), 256)
    assert unknown_tokens.token_ids == [] and unknown_tokens.block_size == 256


def test_scheduler_releases_an_event_once_every_rank_reported_it():
    """Workers hand their events over as connector worker metadata (what vLLM's MultiConnector forwards to each
    child); vLLM aggregates the ranks' metadata; a chunk counts once every rank reported it."""
    pytest.importorskip("vllm")

    from lmcache_vllm.integration.vllm.events import (
        LMCacheWorkerReport,
        SchedulerEvents,
        take_worker_events,
        to_vllm,
        worker_report,
    )

    a = to_vllm(kv_events.ChunkEvent(True, b"\x01" * 16, "local_cpu", None, (1, 2, 3)), 256)
    b = to_vllm(kv_events.ChunkEvent(False, b"\x02" * 16, "local_disk"), 256)

    def rank(*events):
        return LMCacheWorkerReport(list(events))

    sched = SchedulerEvents(world_size=2)
    sched.add(rank(a, b))  # rank 0, step 1 (rank 1 reported nothing yet)
    assert sched.take() == []
    sched.add(rank(a).aggregate(rank()))  # step 2: rank 1 stores a (a background save), rank 0 nothing
    assert sched.take() == [a]
    sched.add(rank().aggregate(rank(b)))
    assert sched.take() == [b]
    both = rank(a).aggregate(rank(a))  # one step, both ranks
    sched.add(both)
    assert sched.take() == [a]
    one = SchedulerEvents(world_size=1)
    one.add(rank(a))
    assert one.take() == [a] and one.take() == []
    one.add(None)  # a step without events
    assert one.take() == []

    kv_events.RECORDER.enabled = True
    assert take_worker_events(256) == [] and worker_report([], None) is None
    kv_events.RECORDER._add(_a_key(), "redis", True)
    taken = worker_report(take_worker_events(256), None)
    assert isinstance(taken, LMCacheWorkerReport) and len(taken.events) == 1
    assert (taken.events[0].medium, taken.events[0].ownership) == ("STORAGE", "redis")


def _a_key() -> str:
    from lmcache_vllm.tokens import CacheKey

    return CacheKey(model="m", world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=1, digest=b"\x05" * 16,
                    fingerprint="").to_str()


def test_holds_reports_join_ranks_with_the_smallest_cap():
    """A prefill instance's ranks report their ended holds and their cap in tokens (pd/scheduler.py's ledger):
    vLLM's aggregation keeps every ended hold and the smallest cap (0: a rank without one)."""
    pytest.importorskip("vllm")

    from lmcache_vllm.integration.vllm.events import HoldReport, LMCacheWorkerReport

    def rank(ended, cap):
        return LMCacheWorkerReport([], HoldReport(list(ended), cap))

    joined = rank(["a"], 3000).aggregate(rank(["a", "b"], 2000))
    assert joined.holds == HoldReport(["a", "a", "b"], 2000)
    assert rank([], 0).aggregate(rank(["c"], 500)).holds == HoldReport(["c"], 500)
    assert rank([], 0).aggregate(rank([], 0)).holds == HoldReport([], 0)
    assert LMCacheWorkerReport().aggregate(rank(["d"], 7)).holds == HoldReport(["d"], 7)
