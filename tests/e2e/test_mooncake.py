"""End to end through a real Mooncake Store (a `mooncake_master` and one `mooncake_client` storage host on free
loopback ports, tests/mooncake_servers.py), configured as LMCache configures it: `remote_url:
mooncakestore://host:port` and LMCache's Mooncake keys.

- `writer` (an offline vLLM job, multiprocess engine as a server runs it) answers SHARED and LOST: their whole
  chunks go to the storage host (the writer itself gives the pool no memory: global_segment_size 0), and the
  writer exits.
- A fresh `lmcache-vllm serve` (another PYTHONHASHSEED, empty host memory) answers SHARED with 512 of its 600
  tokens from Mooncake. Then the storage host is SIGKILLed: the master still lists LOST's chunks, which no
  longer read back; the server recomputes LOST (counted misses), with unchanged output.

Like with like (lmcache_vllm/integration/vllm/testing/reference.py): the reference is vLLM alone (multiprocess
engine, the same thread binding) with its own prefix cache, asked SHARED twice (cold, then 512 tokens cached:
the split the server loads) and LOST once (cold: the server's split once the chunks are lost).
"""
from __future__ import annotations

import json
import uuid

import e2e_harness as h
import pytest
from mooncake_servers import MooncakeStore

from lmcache_vllm.integration.vllm.testing.openai_server import cached_tokens, post, scrape, serve

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

SHARED = h.random_tokens(430, 600)
LOST = h.random_tokens(431, 600)
MAX_TOKENS = 8
PREFIX = f"e2e-mooncake-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    deployment = MooncakeStore(tmp_path_factory.mktemp("e2e_mooncake_store"), segment="256MB")
    try:
        yield deployment.start()
    finally:
        deployment.stop()


def config(store: MooncakeStore) -> dict:
    return {"remote_url": store.url, "max_local_cpu_size": 0.25,
            "extra_config": {"remote_key_prefix": PREFIX, "local_hostname": "127.0.0.1",
                             "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0, "protocol": "tcp"}}


def phases(*names_prompts) -> list[dict]:
    return [{"name": name, "prompts": [prompt], "max_tokens": MAX_TOKENS} for name, prompt in names_prompts]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    job = h.reference_job({"model": tiny_model, "llm_kwargs": h.llm_kwargs(),
                           "phases": phases(("shared", SHARED), ("shared_again", SHARED), ("lost", LOST))})
    result = h.run_job(tmp_path_factory.mktemp("e2e_mooncake_ref"), "reference", job, multiprocessing=True)
    return {name: h.phase(result, name)[0] for name in ("shared", "shared_again", "lost")}


@pytest.fixture(scope="module")
def writer(tiny_model, tmp_path_factory, store, reference):
    job = {"model": tiny_model, "llm_kwargs": h.llm_kwargs(), "kv_transfer_config": h.connector(config(store)),
           "phases": phases(("shared", SHARED), ("lost", LOST))}
    result = h.run_job(tmp_path_factory.mktemp("e2e_mooncake_writer"), "writer", job, hash_seed=1,
                       multiprocessing=True)
    assert store.key_count() == 4, result["log"]  # two whole chunks of each prompt, in the storage host
    # (the stats of a multiprocess engine stay in its worker: the master's count is the proof)
    return result


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, store, writer):
    tmp = tmp_path_factory.mktemp("e2e_mooncake_serve")
    args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(h.connector(config(store)))]
    with serve(tiny_model, args, tmp, h.vllm_env(tmp, multiprocessing=True, hash_seed=2)) as (base, log):
        yield base, log


def complete(base: str, model: str, prompt: list[int]) -> dict:
    answer = post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                             "temperature": 0.0, "return_token_ids": True})
    return {"tokens": answer["choices"][0]["token_ids"], "num_cached_tokens": cached_tokens(answer)}


def metric(base: str, model: str, name: str, tier: str = "") -> float:
    """A metric of the server after a tiny request (our stats reach vLLM's API server with engine steps)."""
    post(f"{base}/v1/completions", {"model": model, "prompt": h.random_tokens(5, 4), "max_tokens": 1})
    return scrape(base).get((f"lmcache_vllm:{name}", tier), 0.0)


def test_writer_stores_into_the_storage_host(writer, reference):
    for name in ("shared", "lost"):
        got = h.phase(writer, name)[0]
        assert got["num_cached_tokens"] == 0
        h.assert_like_with_like(got, reference[name], what=f"writer/{name}")


def test_fresh_server_loads_a_prompt_another_process_stored(server, reference, tiny_model):
    base, log = server
    got = complete(base, tiny_model, SHARED)
    assert got["num_cached_tokens"] == 512, log
    h.assert_like_with_like(got, reference["shared_again"], what="server/shared from Mooncake")
    assert metric(base, tiny_model, "hit_tokens_total", "mooncake") == 512


def test_storage_host_killed_its_chunks_are_recomputed(server, store, reference, tiny_model):
    base, log = server
    store.hosts[0].kill()  # the master lists LOST's chunks until the host's lease ends; they read back nothing
    got = complete(base, tiny_model, LOST)
    assert got["num_cached_tokens"] == 0, log
    h.assert_like_with_like(got, reference["lost"], what="server/lost, recomputed")
    # read once and removed: the next lookup does not find them (else vLLM would fail the load again every
    # second until the host's lease ends)
    assert metric(base, tiny_model, "lost_chunks_total", "mooncake") == 2
