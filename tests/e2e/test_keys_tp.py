"""End to end with tensor parallelism: a load that fails on ONE rank makes both ranks skip that request's
saves in that step (with TP the forward all-reduces activations, so KV computed on top of one rank's
hole is wrong on every rank, and the "already present" check would keep it for good).

Three TP=2 processes, two disk directories:
- `store`: P (600 tokens) stores its 2 whole chunks on both ranks. A copy of that directory, `clean`,
  loses P's chunk 1 on both ranks.
- rank 1's file of P's chunk 1 gets flipped payload bytes (its header still indexes, so the lookup
  promises 512 tokens; the load fails its checksum on rank 1 only).
- `fail`: R = P[:512] + 356 new tokens. Rank 1's load fails, vLLM recomputes from the failed block
  (token 256); the step that ran on top of the hole stores nothing on either rank; the recompute stores
  R's chunks.
- `clean`: R on the clean copy: 256 tokens from us, vLLM computes from token 256 -- the same prefill
  split, on the same loaded chunk 0, as the fail run's recompute. The chunks it stores are the like-with-
  like reference: the fail run's must be the same bytes (a chunk poisoned by the step on top of the hole
  would not be). Greedy tokens are not compared: rank 0 keeps P's chunk 1 while rank 1 rewrites it from
  the recompute, a mix of prefill splits no vLLM-only run reproduces.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

TP, BIND = 2, "0|1"
P = h.random_tokens(90, 600)
R = P[:512] + h.random_tokens(91, 356)  # 868 tokens: we and vLLM's prefix cache both serve 768 of it


def job(model: str, disk: Path | None, name: str, prompt: list[int]) -> dict[str, Any]:
    # Synchronous loads: a hit from disk would otherwise load asynchronously, and then a failure on one
    # rank rolls the request back before it computes anything (no step runs on top of the hole).
    config = None if disk is None else h.connector({"local_disk": str(disk), "max_local_disk_size": 1.0,
                                                      "max_local_cpu_size": 0.25, "enable_async_loading": False})
    return {"model": model, "kv_transfer_config": config, "phases": [{"name": name, "prompts": [prompt]}],
            "llm_kwargs": h.llm_kwargs(tensor_parallel_size=TP, distributed_executor_backend="mp")}


def run_tp(work: Path, name: str, spec: dict[str, Any], hash_seed: int) -> dict[str, Any]:
    return h.run_job(work, name, spec, hash_seed=hash_seed, timeout=900, multiprocessing=True,
                     threads_bind=BIND)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e_keys_tp")
    disk, clean = work / "l2", work / "l2-clean"
    out = {"store": run_tp(work, "store", job(tiny_model, disk, "p", P), hash_seed=1)}
    shutil.copytree(disk, clean)
    for rank in range(TP):
        h.chunk_files(clean, P, rank=rank)[1].unlink()
    victim = h.chunk_files(disk, P, rank=1)[1]
    h.flip_payload_bytes(victim)
    out["fail"] = run_tp(work, "fail", job(tiny_model, disk, "r", R), hash_seed=2)
    out["clean"] = run_tp(work, "clean", job(tiny_model, clean, "r", R), hash_seed=3)
    out["files_after"] = {rank: h.chunk_files(disk, R[:768], rank=rank) for rank in range(TP)}
    out["files_clean"] = {rank: h.chunk_files(clean, R[:768], rank=rank) for rank in range(TP)}
    return out


def test_a_load_failing_on_one_rank_stops_the_saves_of_both(runs):
    log = Path(runs["fail"]["log"]).read_text()
    assert "could not be loaded" in log  # rank 1: its copy of chunk 1 failed the checksum
    assert "its load failed on another tensor-parallel rank" in log  # rank 0 heard of it and saved nothing
    # After the recompute both ranks hold R's three whole chunks again (rank 1's chunk 1 rewritten).
    assert all(len(files) == 3 for files in runs["files_after"].values())


def test_what_was_stored_after_the_failure_is_vllms_kv(runs):
    assert h.phase(runs["clean"], "r")[0]["num_cached_tokens"] == 256
    assert all(len(files) == 3 for files in runs["files_clean"].values())
    # The chunks the recompute wrote: rank 1's chunk 1 and chunk 2 on both ranks (rank 0's chunk 1 is
    # still P's, which the clean copy no longer has).
    for rank, index in [(1, 1), (0, 2), (1, 2)]:
        ours = h.payload_bytes(runs["files_after"][rank][index])
        reference = h.payload_bytes(runs["files_clean"][rank][index])
        assert ours == reference, f"rank {rank}, chunk {index}: not the KV vLLM computes at this split"
