"""End to end: cache keys follow what decides the KV, not only token ids and not the model path.

- `server`: `lmcache-vllm serve` with two LoRA adapters built for the tiny model (`sql`, `chat`); the same
  prompt with another `cache_salt` or another adapter gets 0 tokens from us, the same salt / adapter a hit.
- Offline, over one disk directory: a `writer` process stores a prompt; a `reader` with another
  PYTHONHASHSEED and the same model copied to another path hits it (keys carry a fingerprint of the
  model's effective config and weights, not its path) and gives the tokens vLLM gives when its own prefix
  cache serves the same split; a process whose copy has another `rope_theta` in config.json finds nothing.
- `prompt_embeds` requests are cached under their embeddings: the same embeddings hit, other embeddings
  of the same length (the same placeholder token ids) get nothing.
vLLM's prefix caching is off in every run with the connector, so every hit counted is ours.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import e2e_harness as h
import pytest

from lmcache_vllm.integration.vllm.testing.local_lora import build_lora
from lmcache_vllm.integration.vllm.testing.openai_server import cached_tokens, post, serve

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

SALTED = h.random_tokens(80, 600)
ADAPTED = h.random_tokens(81, 600)
SHARED = h.random_tokens(82, 600)  # 600 % 256 = 88: vLLM's blocks and our chunks both serve 512 tokens


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_keys")


@pytest.fixture(scope="module")
def server(tiny_model, work):
    sql = build_lora(tiny_model, work / "lora-sql", seed=1)
    chat = build_lora(tiny_model, work / "lora-chat", seed=2)
    args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"sql={sql}", f"chat={chat}",
            "--kv-transfer-config", json.dumps(h.connector())]
    with serve(tiny_model, args, work, h.vllm_env(work / "serve", multiprocessing=True)) as (base, _):
        yield base, tiny_model


def complete(server, prompt, **fields) -> dict:
    base, model = server
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    return post(f"{base}/v1/completions", {**body, **fields})


def test_cache_salt_keeps_tenants_apart(server):
    hits = [cached_tokens(complete(server, SALTED, **salt)) for salt in
            ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {},
             {"cache_salt": "tenant-b"})]
    # a cold, a again: a hit; b never sees a's KV; no salt neither; b's own repeat hits.
    assert hits == [0, 512, 0, 0, 512]


def test_lora_adapters_have_their_own_keys(server):
    base, model = server
    answers = {}
    hits = []
    for name in ("sql", "sql", "chat", model, "chat"):
        answer = complete(server, ADAPTED, model=name)
        answers.setdefault(name, answer["choices"][0]["token_ids"])
        hits.append(cached_tokens(answer))
    assert hits == [0, 512, 0, 0, 512]
    assert answers["sql"] != answers["chat"] != answers[model]  # the adapters really change the KV


def copy_model(src: str, dst: Path, **config_changes) -> str:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        for key, value in config_changes.items():
            if key == "rope_theta" and "rope_parameters" in config:  # transformers 5 nests it
                config["rope_parameters"]["rope_theta"] = value
            else:
                config[key] = value
        (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def shared_disk_job(model: str, disk: Path | None) -> dict:
    config = None if disk is None else h.connector({"local_disk": str(disk), "max_local_disk_size": 1.0,
                                                      "max_local_cpu_size": 0.25})
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "kv_transfer_config": config,
            "phases": [{"name": "shared", "prompts": [SHARED]}]}


@pytest.fixture(scope="module")
def shared_disk_runs(tiny_model, work):
    disk = work / "l2"
    model_a = copy_model(tiny_model, work / "host-a" / "tiny")
    model_b = copy_model(tiny_model, work / "host-b" / "same-model-other-name")
    model_c = copy_model(tiny_model, work / "host-c" / "tiny", rope_theta=20000.0)
    runs = {
        "writer": h.run_job(work, "writer", shared_disk_job(model_a, disk), hash_seed=1),
        "reader": h.run_job(work, "reader", shared_disk_job(model_b, disk), hash_seed=2),
        "changed": h.run_job(work, "changed", shared_disk_job(model_c, disk), hash_seed=3),
    }
    # vLLM alone replaying writer then reader (same model bytes): the reader's repeat is a prefix-cache hit.
    runs["reference"] = h.run_job(work, "reference", h.replay(("writer", shared_disk_job(model_a, None)),
                                                              ("reader", shared_disk_job(model_a, None))))
    return runs


def test_same_model_at_another_path_and_hash_seed_hits(shared_disk_runs):
    writer = h.phase(shared_disk_runs["writer"], "shared")[0]
    reader = h.phase(shared_disk_runs["reader"], "shared")[0]
    assert writer["num_cached_tokens"] == 0 and reader["num_cached_tokens"] == 512
    assert h.hit_splits_agree(len(SHARED))
    h.assert_like_with_like(reader, h.phase(shared_disk_runs["reference"], "reader/shared")[0], what="reader")


def test_changed_config_finds_nothing_of_the_old_model(shared_disk_runs):
    assert h.phase(shared_disk_runs["changed"], "shared")[0]["num_cached_tokens"] == 0


def test_prompt_embeds_are_keyed_by_their_embeddings(tiny_model, work):
    a, b = {"embeds_seed": 1, "len": 600}, {"embeds_seed": 2, "len": 600}
    phases = [{"name": name, "prompts": [p]} for name, p in (("a", a), ("a_again", a), ("b", b), ("b_again", b))]
    run = h.run_job(work, "embeds", {"model": tiny_model, "llm_kwargs": h.llm_kwargs(enable_prompt_embeds=True),
                                     "kv_transfer_config": h.connector(), "phases": phases})
    hits = [h.phase(run, name)[0]["num_cached_tokens"] for name in ("a", "a_again", "b", "b_again")]
    assert hits == [0, 512, 0, 512]
    assert h.phase(run, "a")[0]["tokens"] != h.phase(run, "b")[0]["tokens"]  # the embeddings matter
