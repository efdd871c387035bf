"""Serving under load, on plain tensors with real tiers (files, a real redis-server): lookups that hold
what they promise, asynchronous loads from slower tiers that never stall the step, aborts while waiting,
and retrieves that read only the chunks vLLM does not hold."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
import torch
from test_engine import BLOCK, CHUNK, kv_of, make_caches, make_engine, worker_config

from lmcache_vllm.integration.vllm.loads import FIRST_ANSWER_WAIT_S, IDLE_STEP_WAIT_S
from lmcache_vllm.integration.vllm.lookup import LookupQuery
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, SaveSpec
from lmcache_vllm.integration.vllm.worker import WorkerHalf
from lmcache_vllm.observability import metrics

# What one worker call may take while a tier is slow (it does no tier I/O). Generous for a loaded 2-core
# runner, yet below every pause of a tier below (>= PAUSE_S), so a call that waited for the tier still fails.
STEP_BUDGET_S = 0.4
PAUSE_S = 1.5


def make_worker(engine, caches, load_timeout_s=10.0):
    worker = WorkerHalf(worker_config(engine, async_save=False, load_timeout_s=load_timeout_s),
                        engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    return worker


def zero_blocks(caches, blocks) -> None:
    for cache in caches:
        cache[list(blocks)] = 0


def slots(blocks) -> torch.Tensor:
    return torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])


def store_prompt(worker, first_token: int, num_chunks: int, dst_block: int):
    """Stores a prompt of `num_chunks` chunks from blocks 0.. into the lower tier only (L1 emptied);
    returns its tokens, those source blocks, and zeroed destination blocks from `dst_block` on."""
    tokens = list(range(first_token, first_token + num_chunks * CHUNK))
    src = list(range(num_chunks * CHUNK // BLOCK))
    dst = list(range(dst_block, dst_block + num_chunks * CHUNK // BLOCK))
    worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec(
        req_id="writer", token_ids=np.asarray(tokens), block_ids=src, skip_leading=0)]))
    storage = worker.engine.storage
    assert storage.flush(10)
    storage.l1.clear_sync()  # what follows comes from the lower tier
    zero_blocks(worker.kv_caches, dst)
    return tokens, src, dst


def ask(worker, req_id, tokens, start=0):
    return worker._lookup(LookupQuery(req_id, np.asarray(tokens, dtype=np.int64), start))


def ask_until_answered(worker, req_id, tokens, deadline_s=10.0):
    result = ask(worker, req_id, tokens)
    end = time.monotonic() + deadline_s
    while result.pending and time.monotonic() < end:
        time.sleep(0.01)
        result = ask(worker, req_id, tokens)
    return result


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def finish_async(worker, meta, deadline_s=10.0) -> tuple[set[str], float]:
    """Steps (get_finished) until some request is reported finished receiving; returns it and the
    longest single call."""
    longest = 0.0
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        (_, recving), took = timed(worker.get_finished, meta, set())
        longest = max(longest, took)
        if recving:
            return recving, longest
        time.sleep(0.005)
    raise AssertionError("asynchronous load never reported")


def test_async_load_from_disk_reads_only_chunks_vllm_lacks(tmp_path):
    caches = make_caches(True, seed=7)
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker = make_worker(engine, caches)
    try:
        tokens, src, dst = store_prompt(worker, 700, 4, 20)
        # vLLM holds the first chunk itself: only chunks 1-3 are looked up, held and read.
        result = ask(worker, "r", tokens, start=CHUNK)
        assert (result.start, result.hit_tokens) == (CHUNK, 4 * CHUNK)
        assert result.chunk_tiers == ("local_disk",) * 3 and not result.in_l1
        spec = LoadSpec("r", np.asarray(tokens), dst, skip_leading=CHUNK, load_end=4 * CHUNK - 1,
                        is_async=True)
        meta = LMCacheConnectorMetadata(loads=[spec])
        _, took = timed(worker.start_load_kv, meta)
        assert took < STEP_BUDGET_S
        done, longest = finish_async(worker, meta)
        assert done == {"r"} and longest < STEP_BUDGET_S
        assert worker.take_load_errors() == set()
        assert metrics.value("chunk_hits", tier="local_disk") == 3  # chunk 0 was never read
        wanted = torch.arange(CHUNK, 4 * CHUNK - 1)
        assert torch.equal(kv_of(engine, caches, slots(dst)[wanted]), kv_of(engine, caches, slots(src)[wanted]))
        assert not kv_of(engine, caches, slots(dst)[:CHUNK]).any()  # vLLM's own part left alone
        assert metrics.value("prefetch_held_chunks") == 0
        assert worker.get_finished(meta, set()) == (None, None)  # reported exactly once
    finally:
        worker.shutdown()


def test_hit_read_within_the_lookup_is_ready_and_loads_inside_the_step(tmp_path):
    """A disk hit whose reads end while the first ask waits is answered `ready`: the scheduler plans it as
    a load inside the step (`is_async=False`), which copies it at once with no tier read left."""
    caches = make_caches(True, seed=9)
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker = make_worker(engine, caches)
    worker.load.requests.read_wait_s = 10.0  # any read ends within it: the outcome is tested, not the timing
    try:
        tokens, src, dst = store_prompt(worker, 1100, 3, 20)
        result = ask(worker, "r", tokens)
        assert result.chunk_tiers == ("local_disk",) * 3 and result.ready and result.loads_now
        assert metrics.value("lookup_read_waits", result="ready") == 1
        spec = LoadSpec("r", np.asarray(tokens), dst, skip_leading=0, load_end=3 * CHUNK - 1)
        meta = LMCacheConnectorMetadata(loads=[spec])
        worker.begin_step()
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.take_load_errors() == set()
        wanted = torch.arange(3 * CHUNK - 1)
        assert torch.equal(kv_of(engine, caches, slots(dst)[wanted]), kv_of(engine, caches, slots(src)[wanted]))
        deadline = time.monotonic() + 5
        while not worker.load.requests.read_pace.per_chunk and time.monotonic() < deadline:
            time.sleep(0.01)  # the pace is learnt on the storage loop, once the reads are over
        assert worker.load.requests.read_pace.per_chunk > 0
    finally:
        worker.shutdown()


def test_hit_whose_read_fails_within_the_lookup_is_not_ready(tmp_path):
    """A tier that lists a chunk it can no longer give (its files are gone, as a dead Mooncake host's
    chunks are): the reads end within the lookup's wait but bring nothing, so the hit is not `ready`
    (a load inside the step would fail, and vLLM would still count those tokens as cached). It loads
    asynchronously, which reports the failed blocks before the request is scheduled."""
    caches = make_caches(True, seed=11)
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker = make_worker(engine, caches)
    worker.load.requests.read_wait_s = 10.0
    try:
        tokens, _, dst = store_prompt(worker, 1300, 2, 20)
        files = [f for f in tmp_path.rglob("*") if f.is_file()]
        assert files
        for f in files:
            f.unlink()
        result = ask(worker, "r", tokens)
        assert result.hit_tokens == 2 * CHUNK and not result.ready and not result.loads_now
        assert metrics.value("lookup_read_waits", result="failed") == 1
        spec = LoadSpec("r", np.asarray(tokens), dst, skip_leading=0, load_end=2 * CHUNK - 1, is_async=True)
        meta = LMCacheConnectorMetadata(loads=[spec])
        worker.start_load_kv(meta)
        done, _ = finish_async(worker, meta)
        assert done == {"r"} and worker.take_load_errors()  # its blocks are recomputed
    finally:
        worker.shutdown()


def test_slow_reads_are_not_waited_for_by_the_lookup(tmp_path, monkeypatch):
    """Reads that do not end within the lookup's wait are answered not ready (loaded asynchronously), and
    once the pace says reads are slow a lookup does not wait for them at all."""
    from lmcache_vllm.storage import chunk_file

    caches = make_caches(True, seed=10)
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker = make_worker(engine, caches)
    release = threading.Event()
    real_read = chunk_file.read_chunk

    def slow_read(path, key, alloc, mac=None):
        release.wait(30)
        return real_read(path, key, alloc, mac)

    monkeypatch.setattr(chunk_file, "read_chunk", slow_read)
    try:
        tokens, _, _ = store_prompt(worker, 1500, 2, 20)
        result, took = timed(ask, worker, "late", tokens)
        assert result.hit_tokens == 2 * CHUNK and not result.ready and not result.loads_now
        wait_s = worker.config.extra_config.lookup_read_wait_ms / 1000
        assert worker.load.requests.read_wait_s == wait_s > 0  # the default waits
        assert wait_s <= took < FIRST_ANSWER_WAIT_S + wait_s + STEP_BUDGET_S
        assert metrics.value("lookup_read_waits", result="late") == 1
        worker.load.requests.read_pace.observe(1.0, 1)  # reads of a second a chunk, as a slow tier's
        result, took = timed(ask, worker, "slow", tokens)
        assert not result.ready and took < STEP_BUDGET_S
        assert metrics.value("lookup_read_waits", result="late") == 1  # not waited for
    finally:
        release.set()
        worker.shutdown()


def test_read_pace_follows_the_recent_reads():
    from lmcache_vllm.integration.vllm.loads import ReadPace

    pace = ReadPace()
    assert pace.expected(10) == 0.0  # unknown: a first read is waited for
    pace.observe(0.02, 10)
    assert pace.expected(10) == pytest.approx(0.02)  # the first read sets it
    pace.observe(0.10, 10)
    assert pace.expected(10) == pytest.approx(0.04)  # later ones move it a quarter of the way


def test_retrieve_reads_only_the_masked_chunks(tmp_path):
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    try:
        tokens = list(range(4 * CHUNK))
        src, dst = make_caches(True, seed=3), make_caches(False)
        engine.store(tokens, src, torch.arange(4 * CHUNK))
        assert engine.storage.flush(10)
        engine.storage.l1.clear_sync()
        mask = torch.zeros(4 * CHUNK, dtype=torch.bool)
        mask[3 * CHUNK + 5:] = True  # vLLM holds everything before
        loaded = engine.retrieve(tokens, dst, torch.arange(4 * CHUNK), mask)
        assert torch.equal(loaded, mask)
        assert metrics.value("chunk_hits", tier="local_disk") == 1
        assert torch.equal(kv_of(engine, dst, torch.arange(3 * CHUNK + 5, 4 * CHUNK)),
                           kv_of(engine, src, torch.arange(3 * CHUNK + 5, 4 * CHUNK)))
    finally:
        engine.close()


def test_held_hit_survives_an_l1_full_of_new_stores():
    chunk_bytes = 2 * 2 * CHUNK * 128 * 2  # layers, K/V, tokens, heads*head_size, bf16
    for hold in (True, False):
        caches = make_caches(True, seed=11)
        engine = make_engine(max_local_cpu_size=24 * chunk_bytes / (1 << 30))
        worker = make_worker(engine, caches)
        try:
            tokens = list(range(100, 100 + 4 * CHUNK))
            worker.wait_for_save(LMCacheConnectorMetadata(saves=[SaveSpec(
                "a", np.asarray(tokens), list(range(4 * CHUNK // BLOCK)), 0)]))
            result = ask(worker, "a", tokens)
            assert result.hit_tokens == 4 * CHUNK and result.in_l1
            if not hold:
                worker.load.requests.release(["a"])
            for i in range(6):  # other requests' stores: 48 chunks through an L1 of 24
                other = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * CHUNK))
                engine.store(other, caches, torch.arange(8 * CHUNK))
            assert engine.storage.allocator.num_evictions > 0
            dst = list(range(40, 40 + 4 * CHUNK // BLOCK))
            worker.start_load_kv(LMCacheConnectorMetadata(loads=[LoadSpec(
                "a", np.asarray(tokens), dst, skip_leading=0, load_end=4 * CHUNK)]))
            errors = worker.take_load_errors()
            assert (errors == set()) == hold, errors  # without the hold the hit became a failed load
        finally:
            worker.shutdown()


@pytest.fixture
def redis_engine(redis_server, redis_prefix):
    engine = make_engine(remote_url=redis_server.url,
                         extra_config={"remote_key_prefix": redis_prefix, "remote_timeout_secs": 5.0})
    yield engine
    redis_server.ensure_running()


def pause_redis(url: str, seconds: float) -> threading.Thread:
    """Freezes the real redis-server for `seconds` (DEBUG SLEEP), returning once the pause has begun."""
    client = redis.Redis.from_url(url)
    thread = threading.Thread(target=lambda: (client.execute_command("DEBUG", "SLEEP", seconds),
                                              client.close()), daemon=True)
    thread.start()
    time.sleep(0.05)
    return thread


def test_paused_redis_makes_lookups_pending_and_never_stalls_a_step(redis_server, redis_engine):
    caches = make_caches(True, seed=5)
    worker = make_worker(redis_engine, caches)
    try:
        tokens, src, dst = store_prompt(worker, 300, 3, 30)
        pause = pause_redis(redis_server.url, PAUSE_S)
        result, took = timed(ask, worker, "r", tokens)
        assert result.pending and took < FIRST_ANSWER_WAIT_S + STEP_BUDGET_S
        result, took = timed(ask, worker, "r", tokens)  # asked again next step: no wait at all
        assert result.pending and took < STEP_BUDGET_S
        # ... unless that step computed nothing: then vLLM loops over empty steps, and each ask waits a little
        # for the answer instead (IDLE_STEP_WAIT_S), sparing the CPU that spinning took
        worker.get_finished(LMCacheConnectorMetadata(idle=True), set())
        result, took = timed(ask, worker, "r", tokens)
        assert result.pending and IDLE_STEP_WAIT_S <= took < IDLE_STEP_WAIT_S + STEP_BUDGET_S
        worker.get_finished(LMCacheConnectorMetadata(idle=False), set())  # a step that computed: no wait again
        result = ask_until_answered(worker, "r", tokens)
        assert result.hit_tokens == 3 * CHUNK and result.chunk_tiers == ("redis",) * 3
        pause.join(10)
        spec = LoadSpec("r", np.asarray(tokens), dst, skip_leading=0, load_end=3 * CHUNK - 1, is_async=True)
        meta = LMCacheConnectorMetadata(loads=[spec])
        pause = pause_redis(redis_server.url, PAUSE_S)  # the reads may still be in flight: slow them too
        _, took = timed(worker.start_load_kv, meta)
        assert took < STEP_BUDGET_S
        done, longest = finish_async(worker, meta)
        assert done == {"r"} and longest < STEP_BUDGET_S and worker.take_load_errors() == set()
        wanted = torch.arange(3 * CHUNK - 1)
        assert torch.equal(kv_of(redis_engine, caches, slots(dst)[wanted]),
                           kv_of(redis_engine, caches, slots(src)[wanted]))
        pause.join(10)
    finally:
        worker.shutdown()


def test_abort_while_waiting_releases_everything(redis_server, redis_engine):
    caches = make_caches(True, seed=6)
    worker = make_worker(redis_engine, caches)
    storage = redis_engine.storage
    try:
        tokens, _, dst = store_prompt(worker, 900, 3, 30)
        # 1. aborted while its lookup is still pending: its holds go, nothing is reported
        pause = pause_redis(redis_server.url, PAUSE_S)
        assert ask(worker, "early", tokens).pending
        assert worker.get_finished(None, {"early"}) == (None, None)
        pause.join(10)
        # 2. aborted while its asynchronous load waits: reported finished (vLLM frees its blocks then),
        #    nothing copied into its blocks, no load errors, every hold and read released
        assert ask_until_answered(worker, "late", tokens).hit_tokens == 3 * CHUNK
        spec = LoadSpec("late", np.asarray(tokens), dst, 0, 3 * CHUNK - 1, is_async=True)
        pause = pause_redis(redis_server.url, PAUSE_S)
        worker.start_load_kv(LMCacheConnectorMetadata(loads=[spec]))
        (_, recving), took = timed(worker.get_finished, None, {"late"})
        assert recving == {"late"} and took < STEP_BUDGET_S
        assert worker.take_load_errors() == set()
        assert worker.get_finished(None, set()) == (None, None)  # never reported twice
        pause.join(10)
        deadline = time.monotonic() + 10
        while (metrics.value("prefetch_held_chunks") or storage.allocator.num_live != len(storage.l1)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metrics.value("prefetch_held_chunks") == 0
        assert storage.allocator.num_live == len(storage.l1)  # read chunks stay in L1 or are freed
        assert not kv_of(redis_engine, caches, slots(dst)).any()
        assert worker.load.requests.pending_async() == 0 and not worker.load.requests._lookups
    finally:
        worker.shutdown()


def test_async_load_stuck_on_disk_times_out_as_a_failed_load_not_a_hang(tmp_path, monkeypatch):
    """A disk read that hangs (as on a hung network file system): the load gives up after its timeout and
    reports the missing tokens for recompute; the step never waits. (A FIFO in place of the chunk file
    used to make a real hang; the disk tier now refuses anything but a regular file without blocking, so
    the hang is made by holding the chunk's read.)"""
    from lmcache_vllm.storage import chunk_file

    caches = make_caches(True, seed=8)
    engine = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker = make_worker(engine, caches, load_timeout_s=1.0)  # > STEP_BUDGET_S
    release = threading.Event()
    try:
        tokens, _, dst = store_prompt(worker, 1300, 2, 30)
        stuck_key = engine.keys.keys(tokens)[1][0].to_str()
        real_read = chunk_file.read_chunk

        def stuck_read(path, key, alloc, mac=None):
            if key == stuck_key:
                release.wait(30)
            return real_read(path, key, alloc, mac)

        monkeypatch.setattr(chunk_file, "read_chunk", stuck_read)
        result = ask(worker, "r", tokens)
        assert result.hit_tokens == 2 * CHUNK  # the index knows the chunk; reading it will hang
        spec = LoadSpec("r", np.asarray(tokens), dst, 0, 2 * CHUNK - 1, is_async=True)
        meta = LMCacheConnectorMetadata(loads=[spec])
        _, took = timed(worker.start_load_kv, meta)
        t0 = time.monotonic()
        done, longest = finish_async(worker, meta)
        assert done == {"r"} and 0.9 < time.monotonic() - t0 < 5.0
        assert max(took, longest) < STEP_BUDGET_S
        # The prefix before the stuck chunk could have been loaded, but the prefetch holds its reads as
        # one run: the whole load is reported for recompute, in the same step it is reported done.
        assert worker.take_load_errors() == set(dst)
        assert metrics.value("async_load_timeouts") == 1
    finally:
        release.set()  # let the stuck reader go
        worker.shutdown()


def test_store_with_redis_paused_does_not_delay_the_next_step(redis_server, redis_engine):
    """The store path touches L1 only: with Redis frozen, a save and the next step's wait for it take
    a copy's time; the write to Redis lands once Redis is back."""
    caches = make_caches(True, seed=9)
    worker = WorkerHalf(worker_config(redis_engine), engine_factory=lambda _: redis_engine, block_size=BLOCK,
                        lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        tokens = list(range(5000, 5000 + 4 * CHUNK))
        meta = LMCacheConnectorMetadata(saves=[SaveSpec("s", np.asarray(tokens), list(range(4 * CHUNK // BLOCK)), 0)])
        pause = pause_redis(redis_server.url, 1.5)
        started = time.monotonic()
        worker.begin_step()
        worker.wait_for_save(meta)  # hands the save to the save thread
        worker.begin_step()  # the next step does not wait for it at all ...
        worker.drain_saves()  # ... and the save itself (its copy into L1) does not wait on Redis either
        took = time.monotonic() - started
        assert took < STEP_BUDGET_S, f"a save took {took:.2f}s with Redis frozen"
        assert redis_engine.lookup(tokens) == 4 * CHUNK  # in L1 already
        pause.join(10)
        assert redis_engine.storage.flush(10)
        redis_engine.storage.l1.clear_sync()
        assert redis_engine.lookup(tokens) == 4 * CHUNK  # and in Redis once it answered again
    finally:
        worker.shutdown()


def test_producer_answers_only_once_its_chunks_are_in_redis(redis_server, redis_engine):
    """A PD producer (durable saves): the step that completes a prompt returns only once every chunk is
    in Redis, so a consumer looking the prompt up right after the producer answered finds it."""
    caches = make_caches(True, seed=10)
    worker = WorkerHalf(worker_config(redis_engine), engine_factory=lambda _: redis_engine, block_size=BLOCK,
                        lookup_address=None, durable_saves=True)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    try:
        tokens = list(range(7000, 7000 + 3 * CHUNK))
        meta = LMCacheConnectorMetadata(saves=[SaveSpec("p", np.asarray(tokens), list(range(3 * CHUNK // BLOCK)),
                                                        0, is_last=True)])
        pause = pause_redis(redis_server.url, PAUSE_S)  # the write to Redis has to wait for it
        (_, took) = timed(worker.wait_for_save, meta)
        assert 0.3 < took < 5.0
        raw = redis.Redis.from_url(redis_server.url)
        prefix = redis_engine.config.extra_config.remote_key_prefix
        keys = [prefix + key.to_str() for key, _, _ in redis_engine.keys.keys(tokens)]
        assert raw.exists(*keys) == 3  # in Redis the moment the step returned
        raw.close()
        pause.join(10)
    finally:
        worker.shutdown()
