"""End to end across vLLM instances through the Redis tier, and what happens when Redis misbehaves.

Four vLLM processes (one compute thread each, see `e2e_harness`), all on one real `redis-server`, and a
reference that replays their phases without the connector, with vLLM's own prefix cache: each request is
compared with the reference request computed with the same prefill split.
- `writer` (process A): host memory + Redis, no disk; answers LONG and GARBLED, which stores their
  whole chunks in Redis (its shutdown drains the queued writes).
- `reader` (process B): a fresh process with another PYTHONHASHSEED and its own empty host memory, same
  Redis: LONG comes from Redis; GARBLED's first chunk was overwritten with garbage bytes before B
  started, so it is a miss that B recomputes (the garbage is deleted; B stores the chunk afresh).
- `no_redis`: after the Redis server was killed, a fresh process with the same config still answers
  LONG correctly, with 0 hits and within a bounded time.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

LONG = h.random_tokens(70, 600)
GARBLED = h.random_tokens(71, 600)
GARBAGE = b"\x00not a chunk\xff" * 1000
NO_REDIS_BUDGET_S = 90.0  # the whole job, start-up included, when Redis is down (normally ~15-25 s)
NO_REDIS_REQUEST_BUDGET_S = 15.0  # one 600-token request; a cold one takes ~1-3 s here


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_tiers")


@pytest.fixture(scope="module")
def redis_config(redis_server) -> dict[str, Any]:
    redis_server.ensure_running()
    # L1 + Redis, no disk: whatever a fresh process finds came from Redis. Short Redis timeouts so the
    # dead-server run below is quick; a fresh key prefix so counts are this module's own.
    return {"remote_url": redis_server.url, "max_local_cpu_size": 0.25,
            "extra_config": {"remote_key_prefix": f"e2e-tiers-{uuid.uuid4().hex[:8]}:",
                             "remote_timeout_secs": 1.0}}


def redis_client(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url)


def redis_key(client, config: dict[str, Any], tokens: list[int], chunk: int) -> str:
    """The Redis key of whole chunk `chunk` of `tokens`, found among the stored keys by its digest."""
    prefix = config["extra_config"]["remote_key_prefix"]
    stored = [k.decode()[len(prefix):] for k in client.scan_iter(match=prefix + "*")]
    return prefix + h.chunk_keys(stored, tokens)[chunk]


def _decodes(value: bytes) -> str:
    from lmcache_vllm.storage.codec import CorruptEntry, parse_header

    try:
        header = parse_header(value)
    except CorruptEntry as exc:
        return f"undecodable: {exc!r}"
    return "valid chunk" if header.header_len + header.payload_len == len(value) else "wrong length"


PHASES = [{"name": "long", "prompts": [LONG]}, {"name": "garbled", "prompts": [GARBLED]}]


def job(model: str, config: dict[str, Any] | None, phases: list[dict] = PHASES) -> dict[str, Any]:
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "phases": phases,
            "kv_transfer_config": h.connector(config) if config is not None else None}


@pytest.fixture(scope="module")
def reference(tiny_model, work):
    """writer, reader and no_redis replayed by vLLM alone with its prefix cache."""
    return h.run_job(work, "reference", h.replay(("writer", job(tiny_model, None)), ("reader", job(tiny_model, None)),
                                                 ("no_redis", job(tiny_model, None, PHASES[:1]))))


def like_reference(result: dict, reference: dict, run: str, name: str) -> None:
    """`name` of `run` gave the tokens of the reference request with the same split: the prefix-cache
    hit of this run's replay, or the writer's cold first occurrence."""
    h.assert_like_with_like(h.phase(result, name)[0], h.phase(reference, f"{run}/{name}")[0],
                            h.phase(reference, f"writer/{name}")[0], what=f"{run}/{name}")


@pytest.fixture(scope="module")
def writer(tiny_model, work, redis_config):
    return h.run_job(work, "writer", job(tiny_model, redis_config), hash_seed=1)


@pytest.fixture(scope="module")
def reader(tiny_model, work, redis_server, redis_config, writer):
    client = redis_client(redis_server)
    try:
        for tokens in (LONG, GARBLED):
            for chunk in range(len(tokens) // h.CHUNK):
                redis_key(client, redis_config, tokens, chunk)  # process A stored every whole chunk
        garbage_key = redis_key(client, redis_config, GARBLED, 0)
        client.set(garbage_key, GARBAGE)
    finally:
        client.close()
    # Its lookups wait for Redis's reads (up to 1 s, well past a loopback read): each hit loads inside its step
    # (tests/e2e/test_serving.py checks hits that load asynchronously).
    config = {**redis_config, "extra_config": {**redis_config["extra_config"], "lookup_read_wait_ms": 1000}}
    result = h.run_job(work, "reader", job(tiny_model, config), hash_seed=2)
    client = redis_client(redis_server)
    try:
        value = client.get(garbage_key)
        result["garbage_left"] = value == GARBAGE
        # B deletes the garbage, recomputes the chunk and stores it again: a valid chunk or nothing.
        result["garbage_key_now"] = "absent" if value is None else "garbage" if value == GARBAGE else \
            _decodes(value)
    finally:
        client.close()
    return result


@pytest.fixture(scope="module")
def no_redis(tiny_model, work, redis_server, redis_config, reader):
    redis_server.kill()
    try:
        started = time.monotonic()
        result = h.run_job(work, "no_redis", job(tiny_model, redis_config, PHASES[:1]), hash_seed=3, timeout=300)
        result["job_s"] = time.monotonic() - started
        return result
    finally:
        redis_server.ensure_running()  # a fresh empty server on the same port for later tests


def test_writer_matches_reference(writer, reference):
    like_reference(writer, reference, "writer", "long")
    like_reference(writer, reference, "writer", "garbled")
    assert writer["stats"]["stored_tokens"] == h.floor_chunk(len(LONG)) + h.floor_chunk(len(GARBLED))


def test_fresh_process_hits_from_redis(reader, reference):
    long = h.phase(reader, "long")[0]
    assert long["num_cached_tokens"] == h.floor_chunk(len(LONG)) == 512
    like_reference(reader, reference, "reader", "long")
    stats = reader["stats"]
    assert stats["loaded_tokens"] >= 512
    assert stats.get("chunk_hits.redis", 0) >= 2, stats  # its own L1 started empty
    # LONG's Redis hit was read while its lookup waited: a load inside the step. GARBLED's read brought
    # nothing (its first chunk is garbage), so it was not ready and loaded asynchronously: its only async load.
    assert stats.get("lookup_read_waits.ready", 0) >= 1, stats
    waited_in_vain = stats.get("lookup_read_waits.failed", 0) + stats.get("lookup_read_waits.late", 0)
    assert waited_in_vain == 1 and stats.get("async_load_requests") == 1, stats


def test_garbage_bytes_in_redis_are_a_miss(reader, reference):
    stats = reader["stats"]
    assert stats["corrupt_chunks.redis"] >= 1
    assert stats["failed_load_tokens"] >= 1
    # Its first chunk is the garbage: whatever the lookup promised, every token was computed. Its load is
    # asynchronous (the read failed, so the lookup's answer was not ready), which reports what arrived; the
    # subtraction also covers a synchronous one, for which vLLM reports the hit it planned.
    garbled = h.phase(reader, "garbled")[0]
    computed = dict(garbled, num_cached_tokens=max(0, garbled["num_cached_tokens"]
                                                   - stats["failed_load_tokens"]))
    assert computed["num_cached_tokens"] == 0
    h.assert_like_with_like(computed, h.phase(reference, "writer/garbled")[0], what="reader/garbled")
    assert not reader["garbage_left"]
    assert reader["garbage_key_now"] in ("absent", "valid chunk"), reader["garbage_key_now"]


def test_dead_redis_is_a_bounded_miss(no_redis, reference):
    long = h.phase(no_redis, "long")[0]
    assert long["num_cached_tokens"] == 0
    like_reference(no_redis, reference, "no_redis", "long")
    assert no_redis["stats"].get("failed_reads.redis", 0) >= 1  # Redis was tried and failed
    assert no_redis["job_s"] < NO_REDIS_BUDGET_S, no_redis["job_s"]
    # the request itself (lookup, prefill of 700 tokens, 8 decode steps) must not wait out timeouts
    assert no_redis["phases"][0]["wall_s"] < NO_REDIS_REQUEST_BUDGET_S, no_redis["phases"][0]["wall_s"]
