"""End to end with hybrid models: vLLM's hybrid KV cache manager stays on with our connector (SupportsHMA).

Sliding-window model (`tiny-swa`: layers 0, 2 full attention, 1, 3 a 512-token window; vLLM splits its KV
cache into a full-attention and a sliding-window group), 256-token chunks, host memory + local disk:
- `writer`: PROMPT cold, then again (a hit of 1024 tokens, longer than the window); SHORT (300 tokens)
  cold, then again (256: shorter); EQUAL's first 600 tokens cold, then its first 520 (512: equal to the
  window). Each compared like with like with vLLM's own prefix cache (the `reference` replays the phases
  without the connector; vLLM's sliding-window group keeps its blocks cached only near a prompt's end, so
  the twins of the shorter hits need prompts that end there). The sliding group loads only the blocks vLLM
  allocates for the window.
- `evicted` (fresh process, a copy of the disk tier): FRESH from disk (1024, like with like); EVICTED lost
  one chunk of the sliding group inside the window of a 1024 hit: the hit is 512, the longest every group
  can serve, never wrong tokens: the same tokens as `pruned`, a fresh process on a copy where EVICTED lost
  the full-attention chunk at the same place instead (512 by the full-attention prefix, the same bytes
  loaded with the same split).
Mamba hybrid (`tiny-mamba`, Granite-4 style): with the connector vLLM keeps its hybrid manager on and the
model starts and serves; vLLM's CPU backend runs it only without prefix caching (its Mamba2 prefill op
cannot return the intermediate states "align" mode keeps), so vLLM keeps no states at prefix boundaries and
the connector serves it uncached (docs/MODELS.md).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPT = h.random_tokens(80, 1100)
EQUAL = h.random_tokens(84, 600)
SHORT = h.random_tokens(85, 300)
FRESH = h.random_tokens(81, 1100)
EVICTED = h.random_tokens(82, 1100)
FULL_TAG, SLIDING_TAG = "full.l0.2", "swa512.l1.3"


@pytest.fixture(scope="module")
def swa_model() -> str:
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    return str(build_model("tiny-swa"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_hybrid")


def job(model: str, disk: Path | None, phases: list[dict]) -> dict[str, Any]:
    config = None if disk is None else h.connector({"local_disk": str(disk), "max_local_disk_size": 1,
                                                    "max_local_cpu_size": 0.25})
    return {"model": model, "llm_kwargs": h.llm_kwargs(), "phases": phases, "kv_transfer_config": config}


WRITER_PHASES = [{"name": "cold", "prompts": [PROMPT]}, {"name": "longer", "prompts": [PROMPT]},
                 {"name": "shorter_cold", "prompts": [SHORT]},
                 {"name": "shorter", "prompts": [SHORT]}, {"name": "equal_cold", "prompts": [EQUAL]},
                 {"name": "equal", "prompts": [EQUAL[:520]]},
                 {"name": "fresh_cold", "prompts": [FRESH]}, {"name": "evicted_cold", "prompts": [EVICTED]}]
FRESH_PHASES = [{"name": "fresh", "prompts": [FRESH]}]
EVICTED_PHASES = [{"name": "evicted", "prompts": [EVICTED]}]


def chunk_file(disk: Path, tokens: list[int], chunk: int, group: str) -> Path:
    """The L2 file of whole chunk `chunk` of `tokens` in KV cache group `group`."""
    from lmcache_vllm.storage.chunk_file import SUFFIX, filename_for, key_from_filename
    from lmcache_vllm.tokens import CacheKey, ChunkHasher

    digest = ChunkHasher(h.CHUNK).digests(tokens)[chunk]
    for path in disk.glob(f"*{SUFFIX}"):
        name = key_from_filename(path.name)
        if name is not None:
            key = CacheKey.from_str(name)
            if key.group == group and key.digest == digest:
                assert path.name == filename_for(name)
                return path
    raise AssertionError(f"chunk {chunk} of group {group} is not on disk")


@pytest.fixture(scope="module")
def written(swa_model, work) -> dict[str, Any]:
    """The writer and its like-with-like reference (two vLLM starts: fixtures of two starts each keep every
    setup well inside pytest's per-test timeout on a loaded machine)."""
    disk = work / "disk"
    writer_job = job(swa_model, disk, WRITER_PHASES)
    writer = h.run_job(work, "writer", writer_job)
    reference = h.run_job(work, "reference", h.replay(("writer", writer_job),
                                                      ("fresh", job(swa_model, None, FRESH_PHASES))))
    return {"writer": writer, "reference": reference, "disk": disk}


@pytest.fixture(scope="module")
def reloaded(swa_model, work, written) -> dict[str, dict]:
    """Fresh processes on two copies of what the writer stored: EVICTED loses its sliding-window chunk 2 in
    one and its full-attention chunk 2 in the other (a 1024 hit needs sliding chunks 2 and 3: 1024 - 511 ->
    block 4)."""
    evicted_disk, pruned_disk = work / "disk_evicted", work / "disk_pruned"
    shutil.copytree(written["disk"], evicted_disk)
    shutil.copytree(written["disk"], pruned_disk)
    chunk_file(evicted_disk, EVICTED, 2, SLIDING_TAG).unlink()
    chunk_file(pruned_disk, EVICTED, 2, FULL_TAG).unlink()
    evicted = h.run_job(work, "evicted", job(swa_model, evicted_disk, FRESH_PHASES + EVICTED_PHASES),
                        hash_seed=1)
    pruned = h.run_job(work, "pruned", job(swa_model, pruned_disk, EVICTED_PHASES), hash_seed=2)
    return {"evicted": evicted, "pruned": pruned}


def assert_hybrid_manager_on(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        kv = runs[name]["kv_cache"]
        assert kv["hybrid_manager"], name
        assert kv["groups"] == ["FullAttentionSpec", "SlidingWindowSpec"], name
        assert "Turning off hybrid kv cache manager" not in Path(runs[name]["log"]).read_text(), name


def test_vllm_keeps_its_hybrid_manager_on_with_our_connector(written):
    assert_hybrid_manager_on(written, "writer", "reference")


def test_hits_shorter_equal_and_longer_than_the_window_give_vllms_tokens(written):
    run, ref = written["writer"], written["reference"]
    for name, hit in (("longer", 1024), ("equal", 512), ("shorter", 256)):
        ours = h.phase(run, name)[0]
        assert ours["num_cached_tokens"] == hit, name
        h.assert_like_with_like(ours, h.phase(ref, "writer/" + name)[0], what=name)
    for name in ("cold", "shorter_cold", "equal_cold"):
        assert h.phase(run, name)[0]["num_cached_tokens"] == 0, name
        h.assert_like_with_like(h.phase(run, name)[0], h.phase(ref, "writer/" + name)[0], what=name)
    stats = run["stats"]
    # The full-attention group loaded every hit token, the sliding group only the blocks of each window:
    # 1024 -> from block 4 (512 tokens), 512 and 256 -> all of them.
    assert stats[f"group_loaded_tokens.{FULL_TAG}"] == 1024 + 512 + 256
    assert stats[f"group_loaded_tokens.{SLIDING_TAG}"] == 512 + 512 + 256
    assert stats["loaded_tokens"] == 1024 + 512 + 256


def test_chunks_of_each_group_are_stored_under_their_own_keys(written):
    for chunk in range(4):
        full = chunk_file(written["disk"], PROMPT, chunk, FULL_TAG)
        sliding = chunk_file(written["disk"], PROMPT, chunk, SLIDING_TAG)
        assert full != sliding


def test_a_fresh_process_loads_from_disk_like_with_like(written, reloaded):
    assert_hybrid_manager_on(reloaded, "evicted", "pruned")
    ours = h.phase(reloaded["evicted"], "fresh")[0]
    assert ours["num_cached_tokens"] == 1024
    h.assert_like_with_like(ours, h.phase(written["reference"], "fresh/fresh")[0], what="fresh")


def test_an_evicted_sliding_chunk_shortens_the_hit_and_never_gives_wrong_tokens(reloaded):
    evicted = h.phase(reloaded["evicted"], "evicted")[0]
    pruned = h.phase(reloaded["pruned"], "evicted")[0]
    assert evicted["num_cached_tokens"] == pruned["num_cached_tokens"] == 512
    assert reloaded["evicted"]["stats"][f"group_limited_hits.{SLIDING_TAG}"] == 1
    assert f"group_limited_hits.{SLIDING_TAG}" not in reloaded["pruned"]["stats"]
    # The same bytes loaded with the same split, reached by the sliding group's limit in one process and
    # by the full-attention prefix in the other.
    assert evicted["tokens"] == pruned["tokens"]


def test_a_mamba_hybrid_starts_and_serves_with_the_hybrid_manager_on(work):
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    model = str(build_model("tiny-mamba"))
    prompt = h.random_tokens(83, 600)
    config = {"model": model, "llm_kwargs": h.llm_kwargs(enable_prefix_caching=False),
              "phases": [{"name": "first", "prompts": [prompt]}, {"name": "again", "prompts": [prompt]}],
              "kv_transfer_config": h.connector({"max_local_cpu_size": 0.25})}
    run = h.run_job(work, "mamba", config)
    assert run["kv_cache"]["hybrid_manager"]
    assert run["kv_cache"]["groups"] == ["MambaSpec", "FullAttentionSpec"]
    first, again = h.phase(run, "first")[0], h.phase(run, "again")[0]
    assert len(first["tokens"]) == 8 and first["tokens"] == again["tokens"]
    assert again["num_cached_tokens"] == 0  # no states at boundaries without prefix caching: served uncached
    assert "does not cache this model" in Path(run["log"]).read_text()
