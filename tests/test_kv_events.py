"""KV events from the real engine and tiers, as vLLM publishes its own: what each tier gains and loses, in
vLLM's blocks (integer hashes, one per block, complete token ids, parent before child, vLLM's fields and medium
names), decoded with vLLM's own msgspec classes beside the events of a real vLLM block pool, through vLLM's own
ZMQ publisher; and their release to vLLM once every TP rank reported them."""
from __future__ import annotations

import tempfile

import msgspec
import pytest
from test_engine import CHUNK, make_caches, make_engine, slots_for

from lmcache_vllm.observability import kv_events
from lmcache_vllm.storage.tier import Tier

pytest.importorskip("vllm")
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from lmcache_vllm.integration.vllm.events import (  # noqa: E402
    MAX_EVENTS_PER_BATCH,
    LMCacheWorkerReport,
    SchedulerEvents,
    VllmBlocks,
    block_id,
    take_worker_events,
    worker_report,
)

BLOCK = CHUNK // 2  # vLLM's block size in these tests: two blocks a chunk


def _ours(blocks: VllmBlocks | None = None) -> list:
    return take_worker_events(blocks or VllmBlocks(BLOCK, CHUNK))


def _vllms_own(tokens: list[int], num_blocks: int) -> BlockStored:
    """What a real vLLM block pool publishes when it caches `num_blocks` full blocks of a prompt."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request("r", list(tokens), SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    pool = BlockPool(num_blocks + 2, True, BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(num_blocks), 0, num_blocks, BLOCK, 0)
    (event,) = pool.take_events()
    return event


def _fields(event) -> set[str]:
    """The fields an event carries on the wire (vLLM's structs omit those left at their default)."""
    return set(msgspec.msgpack.decode(msgspec.msgpack.encode(event)))


def _round_trip(events: list) -> list:
    """Encoded as vLLM's publisher does, decoded with vLLM's typed decoder (strict: a wrong type fails)."""
    raw = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(raw).events


def test_off_by_default_records_nothing():
    engine = make_engine()
    try:
        engine.store(list(range(64)), make_caches(True), slots_for(64, seed=1))
        assert kv_events.RECORDER.take() == []
    finally:
        engine.close()


def test_stored_chunks_are_vllms_blocks_beside_vllms_own_events(tmp_path):
    """Two whole chunks and a partial one, in L1 and on disk: per chunk one BlockStored of its vLLM blocks, with
    64-bit integer hashes, the previous block as parent, complete token ids, vLLM's block size and exactly the
    fields vLLM's own block pool sets, plus the locality vLLM's CPU offload sets; decoded with vLLM's classes in
    one batch with a real block pool's event for the same prompt."""
    kv_events.RECORDER.enabled = True
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01, save_unfull_chunk=True)
    try:
        tokens = list(range(1000, 1000 + 2 * CHUNK + BLOCK + 3))  # the partial chunk: one whole block and 3 tokens
        engine.store(tokens, make_caches(True), slots_for(len(tokens), seed=1))
        assert engine.storage.flush()
        digests = [c.key.digest for c in engine._chunks(tokens, True, None)]
        vllms = _vllms_own(tokens, len(tokens) // BLOCK)
        decoded = _round_trip([vllms, *_ours()])
        assert decoded[0] == vllms
        ours = [e for e in decoded[1:] if isinstance(e, BlockStored)]
        assert len(ours) == len(decoded) - 1 == 6  # three chunks, two tiers, no other event
        seen: set[int] = set()  # parent before child: a router anchors a block on a block it already has
        for event in ours:  # (the disk's parallel writers finish in any order: L1 named every block first)
            assert event.parent_block_hash is None or event.parent_block_hash in seen
            seen.update(event.block_hashes)
        for medium in ("CPU", "STORAGE"):
            chunks = sorted((e for e in ours if e.medium == medium), key=lambda e: e.token_ids[0])
            assert [e.token_ids for e in chunks] == [tokens[:CHUNK], tokens[CHUNK:2 * CHUNK],
                                                     tokens[2 * CHUNK:2 * CHUNK + BLOCK]]
            assert [len(e.block_hashes) for e in chunks] == [2, 2, 1]
            assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for e in chunks for h in e.block_hashes)
            assert chunks[0].parent_block_hash is None  # parent before child: each names the block before it
            assert chunks[1].parent_block_hash == chunks[0].block_hashes[-1]
            assert chunks[2].parent_block_hash == chunks[1].block_hashes[-1]
            assert chunks[1].block_hashes[0] == int.from_bytes(block_id(digests[1], 0)[-8:], "big")
            for event in chunks:
                assert (event.block_size, event.group_idx, event.lora_id, event.lora_name) == (BLOCK, 0, None, None)
                assert event.extra_keys == [None] * len(event.block_hashes)  # as vLLM says "no extra keys"
                assert (event.locality, event.ownership) == ("LOCAL", None)
                assert _fields(event) == _fields(vllms) | {"locality"}
        assert len({h for e in ours for h in e.block_hashes}) == 5  # the same blocks in both tiers
    finally:
        engine.close()


def test_an_l1_eviction_leaves_the_disk_copy_routable_and_a_full_clear_clears_all(tmp_path):
    kv_events.RECORDER.enabled = True
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        tokens = list(range(2000, 2000 + 2 * CHUNK))
        engine.store(tokens, make_caches(True), slots_for(2 * CHUNK, seed=1))
        assert engine.storage.flush()
        stored = [e for e in _round_trip(_ours()) if isinstance(e, BlockStored)]
        hashes = {m: [h for e in stored if e.medium == m for h in e.block_hashes] for m in ("CPU", "STORAGE")}
        assert sorted(hashes["CPU"]) == sorted(hashes["STORAGE"]) and len(hashes["CPU"]) == 4  # (disk: any order)

        assert engine.clear(lower_tiers=False)  # L1 only (vLLM's reset of L1): the disk copy stays routable
        removed = _round_trip(_ours())
        assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed), removed
        assert [h for e in removed for h in e.block_hashes] == hashes["CPU"]

        dst = make_caches(False)  # a load from disk lands in L1 again: stored in CPU, parent first
        assert engine.retrieve(tokens, dst, slots_for(2 * CHUNK, seed=2)).all()
        again = _round_trip(_ours())
        assert [(e.medium, e.token_ids) for e in again] == [("CPU", tokens[:CHUNK]), ("CPU", tokens[CHUNK:])]
        assert [h for e in again for h in e.block_hashes] == hashes["CPU"]

        assert engine.clear()  # every tier: each copy's removal, then vLLM's AllBlocksCleared
        events = _round_trip(_ours())
        assert isinstance(events[-1], AllBlocksCleared)
        gone = {m: sorted(h for e in events[:-1] if e.medium == m for h in e.block_hashes) for m in ("CPU", "STORAGE")}
        assert gone == {m: sorted(hashes[m]) for m in gone}
    finally:
        engine.close()


def test_a_chunk_whose_tokens_this_process_never_saw_is_removed_but_never_stored(tmp_path):
    """Found on disk at start (or stored for a request with extra keys): no BlockStored (a router needs the token
    ids), but its removal is published, for every block a whole chunk holds."""
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens = list(range(3 * CHUNK))
    engine.store(tokens, make_caches(True), slots_for(3 * CHUNK, seed=1))
    assert engine.storage.flush()
    engine.close()
    kv_events.RECORDER.enabled = True
    restarted = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    try:
        raw = kv_events.RECORDER.take()
        assert len(raw) == 3 and all(e.stored and e.tier == "local_disk" and e.tokens == b"" for e in raw)
        assert VllmBlocks(BLOCK, CHUNK).to_vllm(raw[0]) is None
        assert restarted.clear()
        removed = [e for e in _ours() if isinstance(e, BlockRemoved)]
        assert len(removed) == 3 and all(len(e.block_hashes) == 2 and e.medium == "STORAGE" for e in removed)
    finally:
        restarted.close()


def test_a_request_with_extra_keys_is_not_announced():
    from lmcache_vllm.extra_keys import ExtraKeys

    kv_events.RECORDER.enabled = True
    engine = make_engine()
    try:
        tokens = list(range(CHUNK))
        engine.store(tokens, make_caches(True), slots_for(CHUNK, seed=1), extra=ExtraKeys(prefix=b"lora:a"))
        assert _ours() == []
        engine.store(tokens, make_caches(True), slots_for(CHUNK, seed=1))
        assert [e.token_ids for e in _ours()] == [tokens]
    finally:
        engine.close()


def _a_key(digest: bytes = b"\x05" * 16, group: str = "") -> str:
    from lmcache_vllm.tokens import CacheKey

    return CacheKey(model="m", world_size=1, rank=0, kv_dtype="bfloat16", fmt_version=1, digest=digest,
                    fingerprint="", group=group).to_str()


def test_each_tier_in_vllms_words_and_a_peers_copy_not_at_all():
    """L1 is vLLM's CPU, the disk STORAGE (both LOCAL, no owner, like vLLM's own CPU and file tiers); a shared pool
    (Redis, Mooncake) STORAGE, REMOTE, owned by "redis" / "mooncake" (a router's external copy); L1's compressed
    cold part is host memory too (a chunk is in one of the two, and leaves one before it enters the other); a
    peer's L1 is that peer's to publish."""
    kv_events.RECORDER.enabled = True
    kv_events.note_chunk(b"\x05" * 16, None, _le(list(range(CHUNK))))
    for tier in Tier:
        kv_events.stored(_a_key(), tier)
        kv_events.removed(_a_key(), tier)
    kv_events.stored(_a_key(group="full.0-3"), Tier.LOCAL_CPU)  # one group's chunk of a hybrid model: none
    events = _round_trip(_ours())
    named = [(type(e).__name__, e.medium, e.locality, e.ownership) for e in events]
    assert named == [("BlockStored", "CPU", "LOCAL", None), ("BlockRemoved", "CPU", "LOCAL", None),
                     ("BlockStored", "STORAGE", "LOCAL", None), ("BlockRemoved", "STORAGE", "LOCAL", None),
                     ("BlockStored", "STORAGE", "REMOTE", "redis"), ("BlockRemoved", "STORAGE", "REMOTE", "redis"),
                     ("BlockStored", "STORAGE", "REMOTE", "mooncake"),
                     ("BlockRemoved", "STORAGE", "REMOTE", "mooncake"),
                     ("BlockStored", "CPU", "LOCAL", None), ("BlockRemoved", "CPU", "LOCAL", None)]
    assert [t for t in Tier if t.event_names is None] == [Tier.PEER, Tier.P2P]
    assert all(_fields(e) == {"type", "block_hashes", "medium", "group_idx", "locality"} | (
        {"ownership"} if e.ownership else set()) for e in events if isinstance(e, BlockRemoved))


def test_hashes_are_vllms_bytes_when_vllm_publishes_bytes(monkeypatch):
    kv_events.RECORDER.enabled = True
    kv_events.note_chunk(b"\x05" * 16, b"\x04" * 16, bytes(8 * CHUNK))
    kv_events.stored(_a_key(), Tier.LOCAL_CPU)
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    (event,) = _round_trip(_ours())
    assert event.block_hashes == [block_id(b"\x05" * 16, 0), block_id(b"\x05" * 16, 1)]
    assert event.parent_block_hash == block_id(b"\x04" * 16, 1) and len(event.parent_block_hash) == 32


def test_a_chunk_size_routers_cannot_count_in_vllms_blocks_is_refused():
    with pytest.raises(ValueError, match=r"chunk_size \(192\) to be a multiple of vLLM's block size \(128\)"):
        VllmBlocks(128, 192)
    with pytest.raises(ValueError, match="multiple"):
        VllmBlocks(128, 64)
    assert VllmBlocks(128, 256).per_chunk == 2


def test_ours_and_vllms_events_reach_a_subscriber_through_vllms_publisher():
    """vLLM's own ZMQ publisher (as its scheduler uses it) sends one batch of a block pool's event and ours; a
    subscriber decodes it with vLLM's classes."""
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    kv_events.RECORDER.enabled = True
    tokens = list(range(500, 500 + CHUNK))
    kv_events.note_chunk(b"\x07" * 16, None, _le(tokens))
    kv_events.stored(_a_key(b"\x07" * 16), Tier.LOCAL_CPU)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='lmv-ev-')}/events.sock"
    publisher = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                            endpoint=endpoint, topic="kv"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    try:
        batch = KVEventBatch(ts=1.0, events=[_vllms_own(tokens, 2), *_ours()])
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = None
        for _ in range(100):  # a subscriber only gets what is published after it joined
            publisher.publish(batch)
            if sub.poll(100):
                got = decoder.decode(sub.recv_multipart()[-1])
                break
        assert got is not None and [e.medium for e in got.events] == ["GPU", "CPU"]
        assert got.events[1].token_ids == tokens == got.events[0].token_ids
    finally:
        sub.close(linger=0)
        publisher.shutdown()


def _le(tokens: list[int]) -> bytes:
    from lmcache_vllm.tokens import token_bytes

    return bytes(token_bytes(tokens))


def test_scheduler_releases_an_event_once_every_rank_reported_it():
    """Workers hand their events over as connector worker metadata (what vLLM's MultiConnector forwards to each
    child); vLLM aggregates the ranks' metadata; a chunk counts once every rank reported it, a clear too."""
    blocks = VllmBlocks(BLOCK, CHUNK)
    a = blocks.to_vllm(kv_events.ChunkEvent(True, b"\x01" * 16, "local_cpu", None, _le(list(range(CHUNK)))))
    b = blocks.to_vllm(kv_events.ChunkEvent(False, b"\x02" * 16, "local_disk"))
    cleared = blocks.to_vllm(kv_events.Cleared())
    assert isinstance(a, BlockStored) and isinstance(b, BlockRemoved) and isinstance(cleared, AllBlocksCleared)

    def rank(*events):
        return LMCacheWorkerReport(list(events))

    sched = SchedulerEvents(world_size=2)
    sched.add(rank(a, b))  # rank 0, step 1 (rank 1 reported nothing yet)
    assert sched.take() == []
    sched.add(rank(a).aggregate(rank()))  # step 2: rank 1 stores a (a background save), rank 0 nothing
    assert sched.take() == [a]
    sched.add(rank().aggregate(rank(b)))
    assert sched.take() == [b]
    sched.add(rank(a).aggregate(rank(a)))  # one step, both ranks
    assert sched.take() == [a]
    sched.add(rank(cleared))
    assert sched.take() == []
    sched.add(rank(AllBlocksCleared()))
    assert [type(e) for e in sched.take()] == [AllBlocksCleared]
    one = SchedulerEvents(world_size=1)
    one.add(rank(a))
    assert one.take() == [a] and one.take() == []
    many = [blocks.to_vllm(kv_events.ChunkEvent(False, i.to_bytes(16, "little"), "local_cpu")) for i in range(5000)]
    one.add(rank(*many))  # a clear of a large tier: at most MAX_EVENTS_PER_BATCH a step (vllm-router takes 4096)
    assert [len(one.take()) for _ in range(4)] == [MAX_EVENTS_PER_BATCH, MAX_EVENTS_PER_BATCH, 904, 0]
    one.add(None)  # a step without events
    assert one.take() == []

    kv_events.RECORDER.enabled = True
    assert take_worker_events(blocks) == [] and worker_report([], None) is None
    kv_events.RECORDER.stored(_a_key(), "redis")  # a chunk never noted here: nothing to publish
    kv_events.RECORDER.removed(_a_key(), "a tier this version does not know")  # left out, never raised
    kv_events.RECORDER.removed(_a_key(), "redis")
    taken = worker_report(take_worker_events(blocks), None)
    assert isinstance(taken, LMCacheWorkerReport) and len(taken.events) == 1
    assert (taken.events[0].medium, taken.events[0].ownership) == ("STORAGE", "redis")


def test_holds_reports_join_ranks_with_the_smallest_cap():
    """A prefill instance's ranks report their ended holds and their cap in tokens (pd/scheduler.py's ledger):
    vLLM's aggregation keeps every ended hold and the smallest cap (0: a rank without one)."""
    from lmcache_vllm.integration.vllm.events import HoldReport

    def rank(ended, cap):
        return LMCacheWorkerReport([], HoldReport(list(ended), cap))

    joined = rank(["a"], 3000).aggregate(rank(["a", "b"], 2000))
    assert joined.holds == HoldReport(["a", "a", "b"], 2000)
    assert rank([], 0).aggregate(rank(["c"], 500)).holds == HoldReport(["c"], 500)
    assert rank([], 0).aggregate(rank([], 0)).holds == HoldReport([], 0)
    assert LMCacheWorkerReport().aggregate(rank(["d"], 7)).holds == HoldReport(["d"], 7)
