"""KV events from the real engine and tiers: what each tier gains and loses, with the parent digest and
token ids of each chunk; and their release to vLLM once every TP rank reported them."""
import pytest
from test_engine import CHUNK, make_caches, make_engine, slots_for

from lmcache_vllm.observability import kv_events


def _events(kind=None):
    return [(e.stored, e.medium, e.digest, e.parent, e.token_ids) for e in kv_events.RECORDER.take()]


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
        stored_cpu = [e for e in events if e[0] and e[1] == "cpu"]
        assert [(e[2], e[3], e[4]) for e in stored_cpu] == [
            (digests[0], None, tuple(tokens[:CHUNK])), (digests[1], digests[0], tuple(tokens[CHUNK:]))]
        assert sorted(e[2] for e in events if e[0] and e[1] == "disk") == sorted(digests)
        assert all(e[4] for e in events)  # token ids known: this process stored them

        assert engine.clear(lower_tiers=False)  # a reset of L1: removed from cpu only
        assert sorted((e[0], e[1], e[2]) for e in _events()) == sorted((False, "cpu", d) for d in digests)
        # a load from disk lands in L1 again: stored on cpu, with the token ids
        dst = make_caches(False)
        assert engine.retrieve(tokens, dst, slots_for(2 * CHUNK, seed=2)).all()
        assert [(e[0], e[1], e[4]) for e in _events()] == [(True, "cpu", tuple(tokens[:CHUNK])),
                                                          (True, "cpu", tuple(tokens[CHUNK:]))]
        assert engine.clear()
        removed = _events()
        assert {e[1] for e in removed} == {"cpu", "disk"} and not any(e[0] for e in removed)
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
        assert len(events) == 3 and all(e[0] and e[1] == "disk" and e[4] == () for e in events)
    finally:
        restarted.close()


def test_scheduler_releases_an_event_once_every_rank_reported_it():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmcache_vllm.integration.vllm.events import LMCacheVllmKVEvents, SchedulerEvents, to_vllm

    stored = kv_events.ChunkEvent(True, b"\x01" * 16, "cpu", None, (1, 2, 3))
    removed = kv_events.ChunkEvent(False, b"\x02" * 16, "disk")
    a, b = to_vllm(stored, 256), to_vllm(removed, 256)
    assert isinstance(a, BlockStored) and a.block_hashes == [b"\x01" * 16] and a.block_size == 3
    assert a.medium == "cpu" and a.token_ids == [1, 2, 3] and a.parent_block_hash is None
    assert isinstance(b, BlockRemoved) and b.medium == "disk"

    def container(*events):
        c = LMCacheVllmKVEvents()
        c.add_events(list(events))
        return c

    sched = SchedulerEvents(world_size=2)
    sched.add(container(a, b))  # rank 0, step 1
    assert sched.take() == []
    step2 = container(a)  # rank 1 stores a one step later (background save)
    sched.add(step2)
    assert sched.take() == [a]
    sched.add(container(b))
    assert sched.take() == [b]
    one = SchedulerEvents(world_size=1)
    one.add(container(a))
    assert one.take() == [a] and one.take() == []
    one.add(None)  # a step without events
    assert one.take() == []
