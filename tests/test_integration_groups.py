"""The connector halves for a model with several KV cache groups: the scheduler half on vLLM's real Request /
SchedulerOutput / KVConnectorBlockState objects (every group's table in the specs, states vLLM offers,
every load asynchronous), and the worker half on KV caches vLLM's own code builds (saves per group, an
asynchronous load into every group, a failed one reported as a failed receive, saves drained before a
step that may hand freed window blocks elsewhere)."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from test_engine_grouped import BLOCK, Pool, build, tables_for, token_kv  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.engine.kv_groups import GroupKind, KVGroup  # noqa: E402
from lmcache_vllm.integration.vllm.groups import SchedulerGroups  # noqa: E402
from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupQuery  # noqa: E402
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, SaveSpec  # noqa: E402
from lmcache_vllm.integration.vllm.scheduler import SchedulerHalf  # noqa: E402
from lmcache_vllm.integration.vllm.testing.hybrid_views import HybridCase, fill_random  # noqa: E402
from lmcache_vllm.integration.vllm.worker import WorkerHalf  # noqa: E402

FULL = KVGroup(0, GroupKind.FULL, ("l.0", "l.2"), (0, 2), 128)
SLIDING = KVGroup(1, GroupKind.SLIDING, ("l.1", "l.3"), (1, 3), 128, window=384, sliding_window=384)
STATE = KVGroup(1, GroupKind.STATE, ("l.1", "l.3"), (1, 3), 128)


class Hit:
    def __init__(self, end: int):
        self.end = end

    def lookup(self, query) -> LookupAnswer:
        return LookupAnswer(self.end, ("local_cpu",) * (self.end // 256), 0)


class Blocks:
    """vLLM's KVCacheBlocks as the scheduler half reads it (`get_block_ids`)."""

    def __init__(self, tables):
        self.tables = tables

    def get_block_ids(self):
        return self.tables


def half_for(groups, hit=0, chunk=256):
    config = LMCacheConfig(chunk_size=chunk)
    return SchedulerHalf(config, block_size=128, lookup_client=Hit(hit), can_load=True, can_save=True,
                         groups=SchedulerGroups(groups, chunk))


def step_with(req, tables, computed, scheduled, offers=None) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, tables)]
    out.scheduled_new_reqs[0].num_computed_tokens = computed
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids={req.request_id}, resolve_block_ids=lambda req_id: tables, boundary_state_offloads=offers or {})
    return out


def request(n: int, req_id: str = "a") -> Request:
    return Request(req_id, list(range(100, 100 + n)), SamplingParams(max_tokens=4), None)


def test_every_load_of_a_multi_group_model_is_asynchronous_with_every_table():
    half = half_for([FULL, SLIDING], hit=1024)
    req = request(1100)
    assert half.get_num_new_matched_tokens(req, 0) == (1024, True)  # in L1, still asynchronous
    tables = (list(range(1, 10)), [0, 0, 0, 0, 0, 20, 21, 22, 23])
    half.update_state_after_alloc(req, Blocks(tables), 1024)
    meta = half.build_connector_meta(SchedulerOutput.make_empty())
    (load,) = meta.loads
    assert load.is_async and load.block_ids == [] and load.group_block_ids == tables
    assert (load.skip_leading, load.load_end) == (0, 1024)


def test_saves_carry_every_table_as_vllm_holds_it_this_step():
    half = half_for([FULL, SLIDING])
    req = request(1100)
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    half.update_state_after_alloc(req, Blocks(([], [])), 0)
    # The step's resolved tables: the sliding group already holds the null block below its window.
    tables = (list(range(1, 10)), [0, 0, 0, 0, 0, 20, 21, 22, 23])
    meta = half.build_connector_meta(step_with(req, tables, computed=0, scheduled=1100))
    (save,) = meta.saves
    assert save.block_ids == [] and save.group_block_ids == tables
    assert (save.skip_leading, save.num_tokens, save.states) == (0, 1024, [])


def test_states_vllm_offers_at_chunk_boundaries_go_with_the_save():
    half = half_for([FULL, STATE])
    req = request(1100)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, Blocks(([], [])), 0)
    tables = (list(range(1, 10)), [0, 0, 0, 0, 0, 0, 0, 30, 31])
    offers = {"a": [(1, 30, 1024), (1, 31, 1100), (0, 5, 512), (1, 0, 768)]}  # only (1, 30, 1024) is a state here
    meta = half.build_connector_meta(step_with(req, tables, computed=0, scheduled=1100, offers=offers))
    (save,) = meta.saves
    assert save.states == [(1, 30, 1024)]
    # A step that stores no attention chunk still stores the state vLLM offers, in a save of its own.
    out = SchedulerOutput.make_empty()
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids={"a"}, resolve_block_ids=lambda _: tables, boundary_state_offloads={"a": [(1, 31, 768)]})
    meta = half.build_connector_meta(out)
    (save,) = meta.saves
    assert (save.skip_leading, save.num_tokens, save.states, save.group_block_ids) == (768, 768, [(1, 31, 768)],
                                                                                       tables)
    assert half.request_finished(req, [])[0]  # it saved: vLLM keeps its blocks until the saves are over


def worker_for(case: HybridCase, async_save: bool = True):
    engine, views, groups = build(case)
    config = dataclasses.replace(engine.config, extra_config=dataclasses.replace(engine.config.extra_config,
                                                                                  async_save=async_save))
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None)
    worker.register_kv_caches(views)
    return worker, engine, views, groups


def test_worker_saves_every_group_and_loads_asynchronously_into_every_group():
    worker, engine, views, groups = worker_for(HybridCase(kind="sliding", window=40))
    try:
        fill_random(views, seed=21)
        tokens = np.arange(1000, 1200, dtype=np.int64)
        pool = Pool()
        src = tables_for(groups, 200, pool)
        worker.begin_step()
        worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec("a", tokens, [], 0, True,
                                                                      group_block_ids=src)]))
        assert worker._lookup(LookupQuery("b", tokens)).hit_tokens == 192
        dst = tables_for(groups, 192, pool, kept_until=192)
        meta = LMCacheConnectorMetadata(loads=[LoadSpec("b", tokens[:192], [], 0, 192, is_async=True,
                                                        group_block_ids=dst)])
        worker.handle_preemptions(meta)
        worker.begin_step()
        worker.start_load_kv(meta)
        sending, recving = worker.get_finished(meta, set())
        assert recving == {"b"} and worker.take_failed_recving() == set() and worker.take_load_errors() == set()
        for p in range(groups[1].kept_start(192), 192):
            for group, table, source in ((groups[0], dst[0], src[0]), (groups[1], dst[1], src[1])):
                assert all(torch.equal(a, b) for a, b in zip(token_kv(views, group, table, p),
                                                             token_kv(views, group, source, p)))
    finally:
        worker.shutdown()


def test_a_failed_grouped_load_is_a_failed_receive_never_a_block_error():
    worker, engine, views, groups = worker_for(HybridCase(kind="sliding", window=40))
    try:
        fill_random(views, seed=22)
        tokens = np.arange(2000, 2128, dtype=np.int64)
        pool = Pool()
        src = tables_for(groups, 128, pool)
        worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec("a", tokens, [], 0, True, group_block_ids=src)]))
        assert worker._lookup(LookupQuery("b", tokens)).hit_tokens == 128
        # The sliding chunks vanish between the lookup and the load (evicted, the lookup's hold expired): the
        # load cannot be complete.
        for key, _, _ in engine.engines[1].keys.keys(tokens):
            engine.storage.l1.remove_sync(key.to_str())
        engine.storage._holds.release_all()
        dst = tables_for(groups, 127, pool, kept_until=127)
        meta = LMCacheConnectorMetadata(loads=[LoadSpec("b", tokens, [], 0, 127, is_async=True,
                                                        group_block_ids=dst)])
        worker.begin_step()
        worker.start_load_kv(meta)
        _, recving = worker.get_finished(meta, set())
        assert recving == {"b"}  # reported done (so vLLM stops waiting) ...
        assert worker.take_failed_recving() == {"b"}  # ... and failed: vLLM recomputes it
        assert worker.take_load_errors() == set()  # never block ids: vLLM 0.32 refuses them for such a model
    finally:
        worker.shutdown()


def test_a_step_starts_only_after_saves_reading_window_blocks_are_over():
    worker, engine, views, groups = worker_for(HybridCase(kind="sliding", window=40))
    release = threading.Event()
    real_store = engine.store

    def slow_store(*args, **kwargs):
        release.wait(5)
        return real_store(*args, **kwargs)

    engine.store = slow_store
    try:
        fill_random(views, seed=23)
        tokens = np.arange(3000, 3064, dtype=np.int64)
        src = tables_for(groups, 64, Pool())
        worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec("a", tokens, [], 0, True, group_block_ids=src)]))
        started = threading.Event()
        done = threading.Event()

        def next_step():
            started.set()
            worker.handle_preemptions(LMCacheConnectorMetadata())  # vLLM's first call of a step
            done.set()

        thread = threading.Thread(target=next_step)
        thread.start()
        started.wait(5)
        assert not done.wait(0.3)  # the step waits: the save still reads blocks vLLM may have freed
        release.set()
        assert done.wait(5)
        thread.join()
    finally:
        release.set()
        worker.shutdown()


def test_vllm_keeps_its_hybrid_manager_on_with_our_connector_and_not_with_one_lacking_supports_hma():
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    model = str(build_model("tiny-swa"))

    def hybrid_manager_off(kv_connector: str, module: str | None = None) -> bool:
        transfer = KVTransferConfig(kv_connector=kv_connector, kv_connector_module_path=module, kv_role="kv_both")
        config = VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=2048),
                            kv_transfer_config=transfer)
        return bool(config.scheduler_config.disable_hybrid_kv_cache_manager)

    assert not hybrid_manager_off("LMCacheConnector", "lmcache_vllm.integration.vllm")
    assert hybrid_manager_off("ExampleConnector")  # vLLM's own example connector lacks SupportsHMA
