"""End to end disaggregated prefill: a `kv_producer` vLLM (prefill node) stores a prompt's KV in the shared
Redis pool, a separate `kv_consumer` vLLM (decode node) loads it and only decodes.

Both processes run with the shipped configs, configs/pd_sender.yaml and configs/pd_receiver.yaml; only the
Redis address (the test's own server) and a fresh key prefix are replaced. Three processes:
- `reference`: no connector. The consumer loads all but PROMPT's last token and computes that token
  alone, which vLLM's prefix cache cannot reproduce (it hits whole 128-token blocks). So the prefill is
  split the same way in the producer and in the reference (`max_num_batched_tokens = len - 1`: all but
  the last token in one step, then the last token alone): the producer stores KV computed exactly as the
  reference computes it, and the consumer's single-token step is the reference's second step. UNSEEN
  (shorter than one step) is computed in one step by both.
- `producer`: kv_producer, the same split; prefills PROMPT (max_tokens=1, as a prefill node does) and
  again: a producer never loads, so the repeat is computed too.
- `consumer`: kv_consumer, fresh process; PROMPT loads everything but its last token from Redis;
  UNSEEN is computed; neither adds a single key to Redis.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest
import yaml

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPT = h.random_tokens(80, 700)  # 2 whole chunks and a partial one
UNSEEN = h.random_tokens(81, 600)


def pd_config(name: str, redis_url: str, prefix: str) -> dict[str, Any]:
    """configs/<name>.yaml as the connector's extra config, pointed at the test's Redis."""
    config = yaml.safe_load((h.REPO_ROOT / "configs" / f"{name}.yaml").read_text())
    config["remote_url"] = redis_url
    config.setdefault("extra_config", {})["remote_key_prefix"] = prefix
    return config


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_pd")


@pytest.fixture(scope="module")
def shared(redis_server) -> dict[str, str]:
    redis_server.ensure_running()
    return {"url": redis_server.url, "prefix": f"e2e-pd-{uuid.uuid4().hex[:8]}:"}


def redis_keys(shared: dict[str, str]) -> set[bytes]:
    import redis

    client = redis.Redis.from_url(shared["url"])
    try:
        return set(client.scan_iter(match=shared["prefix"] + "*"))
    finally:
        client.close()


def split_kwargs() -> dict[str, Any]:
    return h.llm_kwargs(max_num_batched_tokens=len(PROMPT) - 1, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def reference(tiny_model, work):
    kwargs = split_kwargs()
    phases = [{"name": "prompt", "prompts": [PROMPT]}, {"name": "unseen", "prompts": [UNSEEN]}]
    result = h.run_job(work, "reference", {"model": tiny_model, "llm_kwargs": kwargs, "phases": phases})
    return {name: h.phase(result, name)[0]["tokens"] for name in ("prompt", "unseen")}


@pytest.fixture(scope="module")
def producer(tiny_model, work, shared):
    config = pd_config("pd_sender", shared["url"], shared["prefix"])
    phases = [{"name": "prefill", "prompts": [PROMPT], "max_tokens": 1},
              {"name": "again", "prompts": [PROMPT], "max_tokens": 1}]
    result = h.run_job(work, "producer", {"model": tiny_model, "llm_kwargs": split_kwargs(),
                                          "kv_transfer_config": h.connector(config, role="kv_producer"),
                                          "phases": phases}, hash_seed=1)
    result["keys_after"] = redis_keys(shared)
    return result


@pytest.fixture(scope="module")
def consumer(tiny_model, work, shared, producer):
    config = pd_config("pd_receiver", shared["url"], shared["prefix"])
    phases = [{"name": "decode", "prompts": [PROMPT]}, {"name": "unseen", "prompts": [UNSEEN]}]
    result = h.run_job(work, "consumer", {"model": tiny_model, "llm_kwargs": h.llm_kwargs(),
                                          "kv_transfer_config": h.connector(config, role="kv_consumer"),
                                          "phases": phases}, hash_seed=2)
    result["keys_after"] = redis_keys(shared)
    return result


def test_producer_stores_every_chunk_and_never_loads(producer):
    # 256 + 256 + the partial 188 (save_unfull_chunk: the consumer then only computes the last token)
    assert len(producer["keys_after"]) == 3
    stats = producer["stats"]
    assert stats["stored_tokens"] == len(PROMPT)
    assert stats.get("lookups", 0) == 0
    assert h.phase(producer, "again")[0]["num_cached_tokens"] == 0
    assert stats.get("loaded_tokens", 0) == 0


def test_consumer_loads_the_prefill_and_decodes_like_the_reference(consumer, reference):
    decode = h.phase(consumer, "decode")[0]
    assert decode["num_cached_tokens"] == len(PROMPT) - 1  # vLLM needs the last token's logits
    assert decode["tokens"] == reference["prompt"]  # the same split: see the module docstring
    assert consumer["stats"]["loaded_tokens"] == len(PROMPT) - 1
    unseen = h.phase(consumer, "unseen")[0]
    assert unseen["num_cached_tokens"] == 0
    assert unseen["tokens"] == reference["unseen"]


def test_consumer_stores_nothing(producer, consumer):
    assert consumer["keys_after"] == producer["keys_after"]
    assert consumer["stats"].get("stored_tokens", 0) == 0
