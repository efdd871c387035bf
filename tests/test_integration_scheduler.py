"""The connector's scheduler half on vLLM's real Request / SchedulerOutput objects: hit accounting,
load and save specs under chunked prefill, preemption, rollback, roles."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.config import ConfigError, LMCacheConfig  # noqa: E402
from lmcache_vllm.integration.vllm.lookup import LookupAnswer  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import slot_mapping_for  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.observability import metrics  # noqa: E402

CHUNK, BLOCK = 256, 128


class PrefixStore:
    """Stands in for the workers' lookup servers: a stored prefix of `hit` tokens, the first `in_l1` of
    them in L1 (all by default) and the rest on disk; `pending` answers "ask again"."""

    def __init__(self, hit: int = 0, in_l1: int | None = None):
        self.hit = hit
        self.in_l1 = in_l1
        self.pending = False
        self.calls = 0
        self.queries = []

    def lookup(self, query) -> LookupAnswer:
        self.calls += 1
        self.queries.append(query)
        if self.pending:
            return LookupAnswer(0, pending=True)
        start = query.start - query.start % CHUNK
        end = min(self.hit, len(query.token_ids))
        if end <= start:
            return LookupAnswer(0, start=start)
        in_l1 = end if self.in_l1 is None else self.in_l1
        tiers = tuple("local_cpu" if c < in_l1 else "local_disk" for c in range(start, end, CHUNK))
        return LookupAnswer(end, tiers, start)


def make_half(hit=0, *, can_load=True, can_save=True, unfull=False, decode=False, in_l1=None, min_retrieve=0):
    store = PrefixStore(hit, in_l1)
    config = LMCacheConfig(chunk_size=CHUNK, save_unfull_chunk=unfull, save_decode_cache=decode,
                           min_retrieve_tokens=min_retrieve)
    half = SchedulerHalf(config, block_size=BLOCK, lookup_client=store, can_load=can_load, can_save=can_save)
    return half, store


def make_request(req_id: str, n: int) -> Request:
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(max_tokens=4), None)


def new_step(req: Request, blocks: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
    out.scheduled_new_reqs[0].num_computed_tokens = computed
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def cached_step(req: Request, new_blocks, computed: int, scheduled: int, resumed=False) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[req.request_id], resumed_req_ids={req.request_id} if resumed else set(),
        new_token_ids=[[]], all_token_ids={}, new_block_ids=[(new_blocks,) if new_blocks else None],
        num_computed_tokens=[computed], num_output_tokens=[0])
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def test_hits_beyond_vllm_prefix_cache_in_whole_chunks():
    half, store = make_half(hit=512)
    req = make_request("a", 700)
    assert half.get_num_new_matched_tokens(req, 0) == (512, False)
    # vLLM asks again each step while the request waits for blocks: the answer is reused
    assert half.get_num_new_matched_tokens(req, 384) == (128, False)
    assert half.get_num_new_matched_tokens(req, 512) == (0, False)
    assert store.calls == 1
    assert (store.queries[0].req_id, store.queries[0].start) == ("a", 0)
    # a request whose vLLM hit is larger asks only about chunks from there on
    half.get_num_new_matched_tokens(make_request("b", 700), 384)
    assert store.queries[1].start == 384


def test_full_prompt_hit_leaves_last_token():
    half, _ = make_half(hit=512)
    assert half.get_num_new_matched_tokens(make_request("a", 512), 0) == (511, False)


def test_short_prompt_and_producer_role_do_not_ask():
    half, store = make_half(hit=512)
    assert half.get_num_new_matched_tokens(make_request("a", 100), 0) == (0, False)
    producer, store2 = make_half(hit=512, can_load=False)
    assert producer.get_num_new_matched_tokens(make_request("b", 700), 0) == (0, False)
    assert store.calls == store2.calls == 0


def test_load_spec_then_saves_only_new_chunks():
    half, _ = make_half(hit=512)
    req = make_request("a", 1100)
    n, _ = half.get_num_new_matched_tokens(req, 128)  # vLLM's own cache has one block
    assert n == 384
    half.update_state_after_alloc(req, None, n)
    blocks = list(range(10, 19))
    meta = half.build_connector_meta(new_step(req, blocks, computed=512, scheduled=588))
    (load,) = meta.loads
    assert (load.skip_leading, load.load_end, len(load.token_ids)) == (128, 512, 512)
    assert load.block_ids == blocks[:4]
    (save,) = meta.saves
    assert (save.skip_leading, len(save.token_ids)) == (512, 1024)  # chunks 2 and 3; 1024..1100 partial
    assert list(save.token_ids) == list(req.all_token_ids[:1024])


def test_chunked_prefill_saves_each_chunk_once_and_partial_tail_on_request():
    for unfull in (False, True):
        half, _ = make_half(hit=0, unfull=unfull)
        req = make_request("a", 700)
        half.get_num_new_matched_tokens(req, 0)
        half.update_state_after_alloc(req, None, 0)
        meta1 = half.build_connector_meta(new_step(req, [1, 2], computed=0, scheduled=256))
        meta2 = half.build_connector_meta(cached_step(req, [3, 4], computed=256, scheduled=256))
        meta3 = half.build_connector_meta(cached_step(req, [5, 6], computed=512, scheduled=188))
        meta4 = half.build_connector_meta(cached_step(req, None, computed=700, scheduled=1))  # decode
        assert [(s.skip_leading, s.num_tokens) for s in meta1.saves] == [(0, 256)]
        assert [(s.skip_leading, s.num_tokens) for s in meta2.saves] == [(256, 512)]
        assert meta2.saves[0].block_ids == [1, 2, 3, 4]
        tail = [(s.skip_leading, s.num_tokens, s.is_last) for s in meta3.saves]
        assert tail == ([(512, 700, True)] if unfull else [])
        assert meta4.saves == []  # decode KV is not saved by default


def test_decode_cache_saved_when_enabled():
    half, _ = make_half(hit=0, decode=True)
    req = make_request("a", 250)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, 0)
    half.build_connector_meta(new_step(req, [1, 2], computed=0, scheduled=250))
    for tok in range(10):  # the engine appends generated tokens to the request
        req.append_output_token_ids(7 + tok)
    meta = half.build_connector_meta(cached_step(req, None, computed=259, scheduled=1))
    assert [(s.skip_leading, s.num_tokens) for s in meta.saves] == [(0, 256)]
    # the cached token array grew with the generated tokens: 250 prompt ids, then 7, 8, ...
    assert list(meta.saves[0].token_ids) == list(req.all_token_ids[:256])


def test_token_ids_are_converted_once_per_request():
    """Lookup, load and save specs share one int64 array per request (hashing from numpy is fast)."""
    half, store = make_half(hit=512)
    req = make_request("a", 700)
    n, _ = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, n)
    meta = half.build_connector_meta(new_step(req, list(range(6)), computed=512, scheduled=188))
    (lookup_tokens,) = [q.token_ids for q in store.queries]
    (load,) = meta.loads
    assert lookup_tokens.dtype == np.int64 and lookup_tokens.tolist() == list(req.all_token_ids)
    assert np.shares_memory(load.token_ids, lookup_tokens)
    half.get_num_new_matched_tokens(req, 0)  # asked again (e.g. after preemption): no new conversion
    assert store.queries[1].token_ids is lookup_tokens


def test_preempted_request_resumes_with_new_blocks_and_loads_again():
    half, store = make_half(hit=0)
    req = make_request("a", 600)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, 0)
    meta = half.build_connector_meta(new_step(req, [1, 2, 3, 4, 5], computed=0, scheduled=600))
    assert [(s.skip_leading, s.num_tokens) for s in meta.saves] == [(0, 512)]
    # Preempted, then rescheduled: the store now has the first two chunks.
    store.hit = 512
    n, _ = half.get_num_new_matched_tokens(req, 0)
    assert n == 512
    half.update_state_after_alloc(req, None, n)
    meta = half.build_connector_meta(cached_step(req, [20, 21, 22, 23, 24], computed=512, scheduled=88,
                                                 resumed=True))
    (load,) = meta.loads
    assert load.block_ids == [20, 21, 22, 23] and load.load_end == 512
    assert meta.saves == []


def test_rollback_after_failed_load_saves_again():
    half, _ = make_half(hit=512)
    req = make_request("a", 800)
    n, _ = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, n)
    meta = half.build_connector_meta(new_step(req, list(range(7)), computed=512, scheduled=288))
    assert [(s.skip_leading, s.num_tokens) for s in meta.saves] == [(512, 768)]
    # The worker reported the load of tokens 256.. as failed: vLLM recomputes from 256.
    meta = half.build_connector_meta(cached_step(req, None, computed=256, scheduled=544))
    assert [(s.skip_leading, s.num_tokens) for s in meta.saves] == [(256, 768)]


def test_consumer_role_never_saves_and_finished_requests_are_forgotten():
    half, _ = make_half(hit=0, can_save=False)
    req = make_request("a", 600)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, 0)
    assert half.build_connector_meta(new_step(req, [1, 2, 3, 4, 5], 0, 600)).saves == []
    assert half.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)
    assert half.build_connector_meta(cached_step(req, None, 600, 1)).is_empty()


def test_slot_mapping_follows_block_ids():
    slots = slot_mapping_for([7, 3], 4, 6)
    assert slots.tolist() == [28, 29, 30, 31, 12, 13]
    with pytest.raises(ValueError):
        slot_mapping_for([7], 4, 6)


def vllm_blocks(block_ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))


def test_pending_lookup_is_none_then_asked_again():
    half, store = make_half(hit=512)
    store.pending = True
    req = make_request("a", 700)
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)  # vLLM skips it this step
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)
    store.pending = False
    assert half.get_num_new_matched_tokens(req, 0) == (512, False)
    assert half.get_num_new_matched_tokens(req, 0) == (512, False)
    assert store.calls == 3 and metrics.value("pending_lookups") == 2


def test_hit_needing_a_slower_tier_loads_asynchronously_into_the_allocated_blocks():
    half, store = make_half(hit=768, in_l1=256)
    req = make_request("a", 800)
    assert half.get_num_new_matched_tokens(req, 128) == (640, True)
    blocks = list(range(30, 37))
    half.update_state_after_alloc(req, vllm_blocks(blocks), 640)
    # The request now waits in WAITING_FOR_REMOTE_KVS: scheduled nowhere, its load goes out anyway.
    meta = half.build_connector_meta(SchedulerOutput.make_empty())
    (load,) = meta.loads
    assert load.is_async and load.req_id == "a"
    assert (load.skip_leading, load.load_end, len(load.token_ids)) == (128, 768, 768)
    assert load.block_ids == blocks[:6] and meta.saves == [] and meta.idle
    assert half.build_connector_meta(SchedulerOutput.make_empty()).loads == []  # emitted once
    # Once loaded, vLLM schedules it as a new request computing from 768: only new chunks are saved.
    meta = half.build_connector_meta(new_step(req, blocks, computed=768, scheduled=32))
    assert meta.loads == [] and [(s.skip_leading, s.num_tokens) for s in meta.saves] == []
    # All in L1, or async loading off: synchronous.
    assert make_half(hit=768)[0].get_num_new_matched_tokens(make_request("b", 800), 0) == (768, False)
    off, _ = make_half(hit=768, in_l1=0)
    off.async_loading = False
    assert off.get_num_new_matched_tokens(make_request("c", 800), 0) == (768, False)
    # Read from disk already while the lookup waited (ready): synchronous, counted as a disk hit.
    read, store = make_half(hit=768, in_l1=0)
    answer = store.lookup
    store.lookup = lambda q: answer(q)._replace(ready=True)
    req = make_request("d", 800)
    assert read.get_num_new_matched_tokens(req, 0) == (768, False)
    read.update_state_after_alloc(req, vllm_blocks(list(range(7))), 768)
    assert read.hit_sources("d") == {"local_disk": 768}
    assert read.build_connector_meta(SchedulerOutput.make_empty()).loads == []  # not an asynchronous load


def test_lookups_that_load_nothing_are_released_and_shrunk_hits_asked_again():
    half, store = make_half(hit=512)
    req = make_request("a", 700)
    assert half.get_num_new_matched_tokens(req, 0) == (512, False)
    half.update_state_after_alloc(req, None, 0)  # vLLM chose not to load (e.g. its own hit won)
    assert half.build_connector_meta(new_step(req, list(range(6)), 512, 188)).release_req_ids == ["a"]
    assert half.build_connector_meta(SchedulerOutput.make_empty()).release_req_ids == []
    # vLLM's own hit shrank below the run the first answer started at: ask again from there
    req = make_request("b", 700)
    assert half.get_num_new_matched_tokens(req, 300) == (212, False)
    assert half.get_num_new_matched_tokens(req, 0) == (512, False)
    assert [q.start for q in store.queries if q.req_id == "b"] == [300, 0]


def test_min_retrieve_tokens_skips_short_loads_and_lets_their_holds_go():
    """LMCache's min_retrieve_tokens: a hit loading fewer new tokens than it is not loaded (counted), its
    lookup's hold is released; a longer one loads as usual."""
    half, store = make_half(hit=512, min_retrieve=256)
    short = make_request("short", 700)
    assert half.get_num_new_matched_tokens(short, 384) == (0, False)  # 128 new tokens < 256
    half.update_state_after_alloc(short, None, 0)
    assert half.build_connector_meta(new_step(short, list(range(6)), 384, 316)).release_req_ids == ["short"]
    assert half.get_num_new_matched_tokens(make_request("long", 700), 0) == (512, False)
    assert metrics.value("retrieves_below_minimum") == 1
    with pytest.raises(ConfigError, match="min_retrieve_tokens"):
        LMCacheConfig(min_retrieve_tokens=-1)


def test_hit_sources_split_the_planned_load_by_the_tier_of_each_chunk():
    half, store = make_half()
    store.lookup = lambda q: LookupAnswer(768, ("local_cpu", "local_disk", "redis"))
    half.async_loading = False
    req = make_request("a", 800)
    # vLLM's own prefix cache has the first 128 tokens: our load is [128, 768).
    assert half.get_num_new_matched_tokens(req, 128) == (640, False)
    half.update_state_after_alloc(req, None, 640)
    assert half.hit_sources("a") == {"local_cpu": 128, "local_disk": 256, "redis": 256}
    assert metrics.value("hit_tokens", tier="local_disk") == 256
    # A run that starts after chunk 0 (vLLM holds the first 256 tokens): its tiers count from there.
    store.lookup = lambda q: LookupAnswer(768, ("local_disk", "local_cpu"), 256)
    req_c = make_request("c", 800)
    assert half.get_num_new_matched_tokens(req_c, 256) == (512, False)
    half.update_state_after_alloc(req_c, None, 512)
    assert half.hit_sources("c") == {"local_disk": 256, "local_cpu": 256}
    # A lookup that does not say where (an older worker, or a plain count) is "unknown".
    store.lookup = lambda q: 512
    req_b = make_request("b", 600)
    assert half.get_num_new_matched_tokens(req_b, 0) == (512, False)
    half.update_state_after_alloc(req_b, None, 512)
    assert half.hit_sources("b") == {"unknown": 512}
    half.update_state_after_alloc(req_b, None, 0)  # vLLM decided not to load
    assert half.hit_sources("b") == {}


def test_finished_request_with_saves_keeps_its_blocks_until_the_workers_report_them():
    half, _ = make_half(hit=0)
    req = make_request("a", 600)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, 0)
    assert half.build_connector_meta(new_step(req, [1, 2, 3, 4, 5], 0, 600)).saves
    assert half.request_finished(req, [1, 2, 3, 4, 5]) == (True, None)  # its save may still be copying
    out = SchedulerOutput.make_empty()
    out.finished_req_ids = {"a"}
    out.preempted_req_ids = {"p"}
    meta = half.build_connector_meta(out)
    assert meta.delayed_free_req_ids == ["a"] and meta.preempted_req_ids == ["p"]
    assert half.build_connector_meta(SchedulerOutput.make_empty()).delayed_free_req_ids == []
    # A request that saved nothing (here: shorter than a chunk) is freed at once.
    short = make_request("b", 100)
    half.get_num_new_matched_tokens(short, 0)
    half.update_state_after_alloc(short, None, 0)
    assert not half.build_connector_meta(new_step(short, [9], 0, 100)).saves
    assert half.request_finished(short, [9]) == (False, None)
