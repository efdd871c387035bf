"""Loads copied on the load thread beside the forward (`extra_config.overlap_loads`), on plain tensors with a real
CacheEngine: each layer is in before vLLM's forward reads it, failures and a stuck thread are recomputed."""
import dataclasses
import os
import threading

import pytest
import torch
from test_engine import BLOCK, CHUNK, kv_of, make_caches, make_engine, worker_config

from lmcache_vllm.cpu_affinity import set_background_cpus
from lmcache_vllm.integration.vllm.load_thread import LoadThread, overlap_wanted
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec, SaveSpec
from lmcache_vllm.integration.vllm.worker import WorkerHalf
from lmcache_vllm.layouts import CpuVecLayout
from lmcache_vllm.observability import metrics


def _worker(engine, caches, overlap="on", load_timeout_s=None):
    config = worker_config(engine, async_save=False, load_timeout_s=load_timeout_s)
    config = dataclasses.replace(config, extra_config=dataclasses.replace(config.extra_config, overlap_loads=overlap))
    worker = WorkerHalf(config, engine_factory=lambda _: engine, block_size=BLOCK, lookup_address=None)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    return worker


def _stored(engine, caches, tokens):
    assert engine.store(tokens, caches, torch.arange(len(tokens))) == len(tokens)


def _load_meta(tokens, blocks, save_tokens=None):
    meta = LMCacheConnectorMetadata(loads=[LoadSpec(req_id="r", token_ids=tokens, block_ids=blocks, skip_leading=0,
                                                    load_end=len(tokens))])
    if save_tokens is not None:
        meta.saves.append(SaveSpec(req_id="r", token_ids=save_tokens, block_ids=blocks + [b + 20 for b in blocks],
                                   skip_leading=len(tokens), is_last=True))
    return meta


def _slots(blocks):
    return torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])


def _recording_scatter(engine, gate=None):
    """Records (layer, thread name) of every layer copy of a load; `gate(layer)` runs before the copy."""
    calls = []
    real = engine.layout.layer_copier

    def layer_copier(gather, *args):
        copy = real(gather, *args)
        if gather:
            return copy

        def scatter(layer):
            if gate is not None:
                gate(layer)
            calls.append((layer, threading.current_thread().name))
            copy(layer)
        return scatter

    engine.layout.layer_copier = layer_copier
    return calls


def test_each_layer_is_copied_on_the_load_thread_before_the_forward_reads_it():
    caches = make_caches(True, seed=11)
    engine = make_engine()
    worker = _worker(engine, caches)
    layer1 = threading.Event()
    calls = _recording_scatter(engine, gate=lambda layer: layer1.wait(5) if layer == 1 else None)
    try:
        assert worker.load.overlapped
        tokens = list(range(100, 100 + 2 * CHUNK))
        _stored(engine, caches, tokens)
        blocks = list(range(30, 30 + 2 * CHUNK // BLOCK))
        worker.begin_step()
        worker.start_load_kv(_load_meta(tokens, blocks))  # returns before the copies are done
        worker.wait_for_layer_load("layer.0")
        assert calls == [(0, calls[0][1])] and calls[0][1].startswith("lmcache-load")
        assert torch.equal(kv_of(engine, caches[:1] * 2, _slots(blocks))[0],
                           kv_of(engine, caches[:1] * 2, torch.arange(2 * CHUNK))[0])
        waited = threading.Event()
        threading.Thread(target=lambda: (worker.wait_for_layer_load("layer.1"), waited.set()), daemon=True).start()
        assert not waited.wait(0.2)  # the forward may not read layer 1 before it is copied
        layer1.set()
        assert waited.wait(5)
        worker.wait_for_save(LMCacheConnectorMetadata())
        assert [layer for layer, _ in calls] == [0, 1]
        assert all(name.startswith("lmcache-load") for _, name in calls)
        assert worker.take_load_errors() == set()
        assert torch.equal(kv_of(engine, caches, _slots(blocks)), kv_of(engine, caches, torch.arange(2 * CHUNK)))
        assert metrics.value("load_wait_seconds") > 0 and metrics.value("overlapped_loads") == 1
    finally:
        layer1.set()
        worker.shutdown()


def test_layers_the_forward_never_announced_are_in_when_the_step_ends():
    caches = make_caches(True, seed=12)
    engine = make_engine()
    worker = _worker(engine, caches)
    try:
        tokens = list(range(200, 200 + CHUNK))
        _stored(engine, caches, tokens)
        blocks = list(range(40, 40 + CHUNK // BLOCK))
        worker.begin_step()
        worker.start_load_kv(_load_meta(tokens, blocks))
        worker.wait_for_save(LMCacheConnectorMetadata())  # no wait_for_layer_load at all
        assert worker.take_load_errors() == set()
        assert torch.equal(kv_of(engine, caches, _slots(blocks)), kv_of(engine, caches, torch.arange(CHUNK)))
    finally:
        worker.shutdown()


def test_a_layer_copy_failing_on_the_load_thread_is_a_failed_load():
    caches = make_caches(True, seed=13)
    engine = make_engine()
    worker = _worker(engine, caches)

    def fail_layer_1(layer):
        if layer == 1:
            raise RuntimeError("copy failed")

    _recording_scatter(engine, gate=fail_layer_1)
    try:
        tokens, new = list(range(300, 300 + CHUNK)), list(range(9300, 9300 + CHUNK))
        _stored(engine, caches, tokens)
        blocks = [50, 51]
        meta = _load_meta(tokens, blocks, save_tokens=tokens + new)
        worker.begin_step()
        worker.start_load_kv(meta)
        thread = worker.load._thread
        for _ in range(500):  # the thread failed and ended before the forward asked for any layer
            if not thread.running:
                break
            threading.Event().wait(0.01)
        for name in worker.layer_index:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(meta)
        assert worker.take_load_errors() == {50, 51}  # the whole loaded range is recomputed
        assert engine.lookup(tokens + new) == CHUNK  # nothing computed on top of the hole is stored
        assert metrics.value("failed_load_tokens") == CHUNK
    finally:
        worker.shutdown()


def test_a_load_thread_past_the_timeout_is_stopped_copies_nothing_more_and_is_recomputed():
    caches = make_caches(True, seed=14) + make_caches(True, seed=15)  # four layers
    engine = make_engine()
    engine.layout = CpuVecLayout(dataclasses.replace(engine.layout.geometry, num_layers=4))
    worker = _worker(engine, caches, load_timeout_s=1.0)
    stuck = worker.load._thread

    def layer_1_until_stopped(layer):
        for _ in range(500):  # a copy that takes longer than the timeout (until the step gave up on it)
            if layer != 1 or stuck._cancel:
                return
            threading.Event().wait(0.01)

    calls = _recording_scatter(engine, gate=layer_1_until_stopped)
    try:
        tokens = list(range(400, 400 + CHUNK))
        _stored(engine, caches, tokens)
        worker.begin_step()
        worker.start_load_kv(_load_meta(tokens, [60, 61]))
        for name in worker.layer_index:
            worker.wait_for_layer_load(name)
        assert worker.take_load_errors() == {60, 61}
        assert [layer for layer, _ in calls] == [0, 1]  # layers 2 and 3 were never written
        assert metrics.value("load_thread_timeouts") == 1
        assert not stuck.running
    finally:
        worker.shutdown()


def test_a_copy_stuck_past_both_waits_is_recomputed_and_later_loads_too_until_it_ends():
    caches = make_caches(True, seed=16) + make_caches(True, seed=17)  # four layers
    engine = make_engine()
    engine.layout = CpuVecLayout(dataclasses.replace(engine.layout.geometry, num_layers=4))
    worker = _worker(engine, caches, load_timeout_s=1.0)
    stuck, unstuck = threading.Event(), threading.Event()

    def layer_1_of_the_first_load_ignores_the_stop(layer):
        if layer == 1 and not stuck.is_set():
            stuck.set()
            unstuck.wait(30)  # a copy that cannot be interrupted

    calls = _recording_scatter(engine, gate=layer_1_of_the_first_load_ignores_the_stop)

    def step(tokens, blocks):
        done = []

        def forward():
            worker.begin_step()
            worker.start_load_kv(_load_meta(tokens, blocks))
            stuck.wait(30)  # layer 0 copied, layer 1 stuck (in the first step)
            for name in worker.layer_index:
                worker.wait_for_layer_load(name)
            done.append(worker.take_load_errors())
        thread = threading.Thread(target=forward, daemon=True)
        thread.start()
        thread.join(30)  # a hang guard: every wait of the step is bounded
        assert done, "the step did not return"
        return done[0]

    try:
        a, b, c = (list(range(n, n + CHUNK)) for n in (600, 700, 800))
        for tokens in (a, b, c):
            _stored(engine, caches, tokens)
        calls.clear()
        assert step(a, [40, 41]) == {40, 41}  # the stuck load: recomputed although its copy has not ended
        assert metrics.value("load_thread_stuck") == 1
        assert step(b, [42, 43]) == {42, 43}  # while it is stuck: refused, not queued behind it
        assert [layer for layer, _ in calls] == [0]
        unstuck.set()
        for _ in range(500):
            if not worker.load._thread.running:
                break
            threading.Event().wait(0.01)
        assert [layer for layer, _ in calls] == [0, 1]  # it stopped before layer 2
        assert step(c, [44, 45]) == set()  # the thread serves again
        assert torch.equal(kv_of(engine, caches, _slots([44, 45])), kv_of(engine, caches, torch.arange(CHUNK)))
        assert metrics.value("load_thread_stuck") == 1
    finally:
        unstuck.set()
        worker.shutdown()


def test_closing_beside_a_stuck_copy_returns_and_reports_it():
    thread = LoadThread(num_layers=2, timeout_s=0.2)
    copying, unstuck, released = threading.Event(), threading.Event(), threading.Event()

    def load():
        try:
            copying.set()
            unstuck.wait(30)  # layer 0's copy, which cannot be interrupted
            yield
            yield
        finally:
            released.set()
    failures = []

    def stop_then_close():
        thread.start([("r", load())])
        copying.wait(30)
        failures.extend((tag, layer) for tag, _, layer in thread.stop())
        thread.close()
    closed = threading.Thread(target=stop_then_close, daemon=True)
    closed.start()
    closed.join(30)  # a hang guard: stop and close wait (bounded) for the stop only
    assert not closed.is_alive()
    assert failures == [("r", 0)] and thread.stop() == []  # reported failed, once
    assert not released.is_set()
    unstuck.set()
    assert released.wait(30)  # its chunks are let go when the copy ends


def test_overlap_is_on_only_where_the_load_thread_runs_beside_the_step():
    assert overlap_wanted("on", "cpu") and not overlap_wanted("off", "cpu")
    cpus = sorted(os.sched_getaffinity(0))
    answers = {}

    def in_a_thread_bound_to_the_first_cpu():
        # An engine in this process: vLLM 0.32 binds nothing, the step thread may run on any CPU.
        set_background_cpus(set(cpus[-1:]))
        answers["unbound step"] = overlap_wanted("auto", "cpu")
        os.sched_setaffinity(0, {cpus[0]})  # this thread only, as vLLM's OpenMP binding pins a worker's
        for name, background in (("beside", set(cpus[1:])), ("same", {cpus[0]}), ("none", None)):
            set_background_cpus(background)
            answers[name] = overlap_wanted("auto", "cpu")
        answers["gpu"] = overlap_wanted("auto", "cuda")

    thread = threading.Thread(target=in_a_thread_bound_to_the_first_cpu)
    try:
        thread.start()
        thread.join()
    finally:
        set_background_cpus(None)
    two = len(cpus) > 1
    assert answers == {"unbound step": two, "beside": two, "same": False, "none": False, "gpu": False}


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_overlapped_and_inline_loads_give_the_same_cache(overlap):
    caches = make_caches(True, seed=15)
    engine = make_engine()
    worker = _worker(engine, caches, overlap=overlap)
    try:
        assert worker.load.overlapped == (overlap == "on")
        tokens = list(range(500, 500 + 3 * CHUNK))
        _stored(engine, caches, tokens)
        blocks = list(range(20, 20 + 3 * CHUNK // BLOCK))
        worker.begin_step()
        worker.start_load_kv(_load_meta(tokens, blocks))
        for name in worker.layer_index:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(LMCacheConnectorMetadata())
        assert worker.take_load_errors() == set()
        assert torch.equal(kv_of(engine, caches, _slots(blocks)), kv_of(engine, caches, torch.arange(3 * CHUNK)))
    finally:
        worker.shutdown()
