"""The connector's scheduler half on vLLM's real Request / SchedulerOutput objects: hit accounting,
load and save specs under chunked prefill, preemption, rollback, roles."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.integration.vllm.metadata import slot_mapping_for  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402

CHUNK, BLOCK = 256, 128


class PrefixStore:
    """Stands in for the workers' lookup servers: answers from a set of stored prefixes."""

    def __init__(self, hit: int = 0):
        self.hit = hit
        self.calls = 0
        self.extras = []

    def lookup(self, tokens, extra=None) -> int:
        self.calls += 1
        self.extras.append(extra)
        return min(self.hit, len(tokens))


def make_half(hit=0, *, can_load=True, can_save=True, unfull=False, decode=False):
    store = PrefixStore(hit)
    half = SchedulerHalf(chunk_size=CHUNK, block_size=BLOCK, lookup_client=store, can_load=can_load,
                         can_save=can_save, save_unfull_chunk=unfull, save_decode_cache=decode)
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
    assert half.get_num_new_matched_tokens(req, 384) == (128, False)
    assert half.get_num_new_matched_tokens(req, 512) == (0, False)
    assert store.calls == 3


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
    seen = []
    store.lookup = lambda tokens, extra: seen.append(tokens) or 512
    req = make_request("a", 700)
    n, _ = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, None, n)
    meta = half.build_connector_meta(new_step(req, list(range(6)), computed=512, scheduled=188))
    (lookup_tokens,) = seen
    (load,) = meta.loads
    assert lookup_tokens.dtype == np.int64 and lookup_tokens.tolist() == list(req.all_token_ids)
    assert np.shares_memory(load.token_ids, lookup_tokens)
    half.get_num_new_matched_tokens(req, 0)  # asked again (e.g. after preemption): no new conversion
    assert seen[1] is lookup_tokens


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


def test_hit_sources_split_the_planned_load_by_the_tier_of_each_chunk():
    from lmcache_vllm import metrics
    from lmcache_vllm.integration.vllm.lookup import LookupAnswer

    half, store = make_half()
    store.lookup = lambda tokens, extra=None: LookupAnswer(768, ("local_cpu", "local_disk", "redis"))
    req = make_request("a", 800)
    # vLLM's own prefix cache has the first 128 tokens: our load is [128, 768).
    assert half.get_num_new_matched_tokens(req, 128) == (640, False)
    half.update_state_after_alloc(req, None, 640)
    assert half.hit_sources("a") == {"local_cpu": 128, "local_disk": 256, "redis": 256}
    assert metrics.value("hit_tokens", tier="local_disk") == 256
    # A lookup that does not say where (an older worker, or a plain count) is "unknown".
    store.lookup = lambda tokens, extra=None: 512
    req_b = make_request("b", 600)
    assert half.get_num_new_matched_tokens(req_b, 0) == (512, False)
    half.update_state_after_alloc(req_b, None, 512)
    assert half.hit_sources("b") == {"unknown": 512}
    half.update_state_after_alloc(req_b, None, 0)  # vLLM decided not to load
    assert half.hit_sources("b") == {}
