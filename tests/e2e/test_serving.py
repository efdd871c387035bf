"""Serving under load on real `lmcache-vllm serve` (multiprocess engine) with a real Redis and real files:

- a hit that lives only in Redis, asked for while Redis is frozen (DEBUG SLEEP) and another request
  decodes: the decode's inter-token gaps stay small (the step never waits on Redis), the waiting request
  gets its hit once Redis answers; an asynchronous load alone gives vLLM's own tokens for that split;
- a chunk file replaced by a FIFO (a read that would block until a writer appears) is refused at once:
  the request is answered with that chunk counted corrupt, the server keeps serving;
- disaggregated prefill through Redis: a consumer asked right after the producer answered always hits.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import e2e_harness as h
import pytest
import redis

from lmcache_vllm.integration.vllm.testing import openai_server as serving

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

SERVE_ARGS = ("--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
              "--no-enable-prefix-caching", "--enable-prompt-tokens-details")
HIT_PROMPT = h.random_tokens(90, 1300)  # 5 chunks: vLLM's prefix cache serves a repeat 1280 tokens too
DECODE_PROMPT = h.random_tokens(91, 300)
PAUSE_S = 2.5  # under lookup_timeout_ms (3 s): a longer freeze turns the waiting request's lookup into a miss
STORED = "lmcache_vllm:stored_chunks_total"


def server(tmp: Path, model: str, kv_transfer_config: dict):
    """`lmcache-vllm serve` with our connector, the e2e tests' thread binding, /reset_prefix_cache on."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(h.vllm_env(tmp, multiprocessing=True), VLLM_SERVER_DEV_MODE="1")
    args = [*SERVE_ARGS, "--kv-transfer-config", json.dumps(kv_transfer_config)]
    return serving.serve(model, args, tmp, env)


def completion(base: str, model: str, prompt: list[int], max_tokens: int = 8, timeout: float = 120) -> dict:
    return serving.post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0.0, "return_token_ids": True}, timeout)


CORRUPT_DISK = ("lmcache_vllm:corrupt_chunks_total", "local_disk")


def reset_l1(base: str) -> None:
    serving.reset_prefix_cache(base, timeout=60)  # an error status raises


NUDGE_PROMPT = h.random_tokens(93, 8)  # shorter than a chunk: nothing to look up or store (save_unfull_chunk off)


def stored_in(base: str, tier: str, at_least: float, nudge_model: str | None = None) -> dict:
    """Waits until `tier` counts `at_least` stored chunks. A write-through that ends after the request's last
    step is reported with the next step's stats (vLLM ships a connector's stats with a step's output), so an
    idle server is given a one-token request to step on (seen: the cold request's 5 writes to Redis ended after
    its last step, 1 run in 7, and the count never came). Not with save_unfull_chunk: the nudge would be stored."""
    def stored(scraped: dict) -> bool:
        if scraped.get((STORED, tier), 0) >= at_least:
            return True
        if nudge_model is not None:
            completion(base, nudge_model, NUDGE_PROMPT, max_tokens=1)
        return False

    got = serving.wait_for(base, stored, 30)
    assert got.get((STORED, tier), 0) >= at_least, f"write-through to {tier} did not land"
    return got


def freeze_redis(url: str, seconds: float) -> threading.Thread:
    client = redis.Redis.from_url(url)
    thread = threading.Thread(target=lambda: (client.execute_command("DEBUG", "SLEEP", seconds), client.close()),
                              daemon=True)
    thread.start()
    time.sleep(0.1)
    return thread


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """vLLM alone, multiprocess as the server, its own prefix cache: HIT_PROMPT cold, then a 1280 hit."""
    phases = [{"name": name, "prompts": [HIT_PROMPT], "max_tokens": 8} for name in ("first", "second")]
    job = h.reference_job({"model": tiny_model, "llm_kwargs": h.llm_kwargs(), "phases": phases})
    return h.run_job(tmp_path_factory.mktemp("e2e_serving_ref"), "reference", job, multiprocessing=True)


def test_frozen_redis_delays_only_the_request_that_waits_for_it(tiny_model, tmp_path, redis_server, reference):
    redis_server.ensure_running()
    extra = {"remote_url": redis_server.url, "max_local_cpu_size": 0.25,
             "extra_config": {"remote_key_prefix": f"e2e-serving-{uuid.uuid4().hex[:8]}:", "remote_timeout_secs": 10.0}}
    with server(tmp_path, tiny_model, h.connector(extra)) as (base, log):
        cold = completion(base, tiny_model, HIT_PROMPT)
        assert serving.cached_tokens(cold) == 0
        stored_in(base, "redis", 5, tiny_model)
        reset_l1(base)  # from now on the prompt's chunks are only in Redis

        decode_times: list[float] = []
        body = {"model": tiny_model, "prompt": DECODE_PROMPT, "max_tokens": 1500, "temperature": 0.0,
                "ignore_eos": True}
        decode = threading.Thread(target=serving.stream, args=(f"{base}/v1/completions", body, 120, decode_times),
                                  daemon=True)
        decode.start()
        deadline = time.monotonic() + 60
        while len(decode_times) < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(decode_times) >= 10, log.read_text()[-3000:]
        frozen = freeze_redis(redis_server.url, PAUSE_S)
        frozen_from = time.monotonic()
        asked = time.monotonic()
        waited = completion(base, tiny_model, HIT_PROMPT)
        waited_s = time.monotonic() - asked
        frozen.join(10)
        frozen_to = frozen_from + PAUSE_S
        decode.join(120)

        # The request whose chunks are in the frozen Redis waited for it, then got its whole hit ...
        assert serving.cached_tokens(waited) == 1280
        assert waited_s > PAUSE_S * 0.6
        # ... while the decode went on: no gap anywhere near the freeze (a step stalled on Redis would
        # show one of ~PAUSE_S; the normal gap here is tens of milliseconds, and up to about a second when
        # other processes take the 2 cores: seen once on a shared machine).
        gaps = [b - a for a, b in zip(decode_times, decode_times[1:]) if b >= frozen_from and a <= frozen_to]
        assert gaps and decode_times[-1] > frozen_to, "the decode did not span the freeze"
        assert max(gaps) < PAUSE_S / 2, f"largest inter-token gap during the freeze: {max(gaps):.2f}s"
        metrics = serving.wait_for(base, lambda m: m.get(("lmcache_vllm:async_load_requests_total", ""), 0) >= 1)
        assert metrics[("lmcache_vllm:async_load_requests_total", "")] >= 1
        assert metrics.get(("lmcache_vllm:pending_lookups_total", ""), 0) >= 1

        # An asynchronous load on its own (Redis answering) gives vLLM's own tokens for that split.
        reset_l1(base)
        alone = completion(base, tiny_model, HIT_PROMPT)
        assert serving.cached_tokens(alone) == 1280
        ours = {"tokens": alone["choices"][0]["token_ids"], "num_cached_tokens": 1280}
        h.assert_like_with_like(ours, h.phase(reference, "second")[0], what="async load")
        cold_ours = {"tokens": cold["choices"][0]["token_ids"], "num_cached_tokens": 0}
        h.assert_like_with_like(cold_ours, h.phase(reference, "first")[0], what="cold")


def _fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_a_fifo_chunk_is_a_miss_and_pd_consumer_always_hits(tiny_model, tmp_path, redis_server):
    redis_server.ensure_running()
    prefix = f"e2e-pd-serving-{uuid.uuid4().hex[:8]}:"
    shared = {"remote_url": redis_server.url, "save_unfull_chunk": True,
              "extra_config": {"remote_key_prefix": prefix}}
    disk = tmp_path / "disk"
    consumer_cfg = h.connector({**shared, "local_disk": str(disk), "max_local_disk_size": 1.0,
                                "blocking_timeout_secs": 30.0})
    with server(tmp_path / "consumer", tiny_model, consumer_cfg) as (base, log):
        # --- a FIFO in place of a chunk file (planted, or a broken disk): it used to hang the read; the disk
        #     tier now refuses anything but a regular file without blocking, so the request is served at once
        #     with that chunk counted corrupt. (Aborting a request while its load waits on a
        #     frozen tier: tests/test_async_loads.py::test_abort_while_waiting_releases_everything.)
        prompt = h.random_tokens(92, 600)
        before = set(disk.glob("*.lmc"))
        completion(base, tiny_model, prompt)
        stored_in(base, "local_disk", 3)  # 2 whole chunks + the partial one
        new = sorted(set(disk.glob("*.lmc")) - before, key=lambda p: p.stat().st_mtime)
        assert len(new) == 3
        reset_l1(base)
        _fifo_in_place_of(new[1])
        completion(base, tiny_model, prompt, timeout=120)
        # Answered (no read waited on the FIFO), the chunk counted corrupt.
        got = serving.wait_for(base, lambda m: m.get(CORRUPT_DISK, 0) >= 1)
        assert got.get(CORRUPT_DISK, 0) >= 1, {k: v for k, v in got.items() if "chunk" in k[0] or "fail" in k[0]}
        # The server serves on: nothing held, nothing waiting.
        assert serving.cached_tokens(completion(base, tiny_model, h.random_tokens(93, 400))) == 0
        idle = serving.wait_for(base, lambda m: m.get(("vllm:kv_cache_usage_perc", ""), 1) == 0)
        assert idle[("vllm:kv_cache_usage_perc", "")] == 0
        assert idle[("vllm:num_requests_waiting", "")] == 0

        # --- disaggregated prefill through Redis: the consumer asks right after the producer answered
        producer_cfg = h.connector(shared, role="kv_producer")
        with server(tmp_path / "producer", tiny_model, producer_cfg) as (producer, plog):
            for seed in range(94, 100):
                prompt = h.random_tokens(seed, 700)
                completion(producer, tiny_model, prompt, max_tokens=1)
                answer = completion(base, tiny_model, prompt)
                assert serving.cached_tokens(answer) == len(prompt) - 1, (seed, plog)
