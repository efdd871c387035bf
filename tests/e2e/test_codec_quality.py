"""The quality gate of the lossy codec: requests served from fp8-coded KV against the same requests served from
raw KV, at the same prefill split, on real vLLM with the tiny local model.

Two vLLM processes (one per codec of the disk tier: `naive`, `fp8`), each with no L1 (`local_cpu: false`) and
vLLM's own prefix cache off, so the repeat of each prompt is served from the disk tier in both: the same
whole chunks loaded, the same tail computed. Per prompt, greedy tokens and the next-token log-probabilities
over the whole vocabulary at each generated position. Printed: the agreement of greedy tokens (the share of
positions before the first divergence, over all positions) and the mean KL divergence KL(raw || fp8) of the
next-token distributions where both runs saw the same tokens; the gate asserts the KL and the first tokens.
fp8 is never a default (tests/test_storage_codecs_tiers.py); this gate says what it costs on a model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import e2e_harness as h
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPTS = [h.random_tokens(420 + i, 600) for i in range(4)]  # 512 tokens from the disk tier, 88 computed
NEW_TOKENS = 8
# The gate. A random-weight model's next-token distributions are nearly flat (the top token has p ~ 0.01-0.07 of
# 4096), so greedy tokens flip on any perturbation, a bf16 rounding included: the measure that says how close
# fp8 KV is, is the KL of the distributions. Measured on AMD EPYC (2026-11-29): greedy agreement 0.375, mean KL
# 0.03 nats over 17 positions; first tokens 4 of 4. KV that is not the prompt's (another prompt's positions)
# gives KL 2-3 nats and first tokens agree by chance only (1/4096).
MAX_MEAN_KL = 0.1
MIN_FIRST_TOKENS = 0.5  # the first generated token (same context in both runs): at least half agree


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_codec_quality")


def run(model: str, work: Path, serde: str) -> dict[str, Any]:
    config = {"local_cpu": False, "local_disk": str(work / f"disk-{serde}"), "max_local_disk_size": 0.25,
              "extra_config": {"local_disk_serde": serde}}
    phases = [{"name": "store", "prompts": PROMPTS, "max_tokens": 1},
              {"name": "hit", "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "logprobs": -1, "flush_writes": True}]
    job = {"model": model, "llm_kwargs": h.llm_kwargs(max_logprobs=-1), "phases": phases,
           "kv_transfer_config": h.connector(config)}
    return h.run_job(work, serde, job)


@pytest.fixture(scope="module")
def runs(tiny_model, work) -> dict[str, dict[str, Any]]:
    return {serde: run(tiny_model, work, serde) for serde in ("naive", "fp8")}


def kl(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) of two full-vocabulary log-probability maps."""
    return sum(math.exp(lp) * (lp - q[token]) for token, lp in p.items())


def compare(raw: list[dict], coded: list[dict]) -> tuple[float, float, int]:
    """(greedy agreement, mean KL over positions with equal contexts, positions compared)."""
    agreed = total = 0
    divergences: list[float] = []
    for r, c in zip(raw, coded):
        total += len(r["tokens"])
        for position, (rt, ct) in enumerate(zip(r["tokens"], c["tokens"])):
            divergences.append(kl(r["logprobs"][position], c["logprobs"][position]))
            if rt != ct:
                break  # the contexts differ from here on: nothing more to compare
            agreed += 1
    return agreed / total, sum(divergences) / len(divergences), len(divergences)


def test_both_runs_serve_the_repeat_from_the_disk_tier_at_the_same_split(runs):
    for serde, result in runs.items():
        hits = h.phase(result, "hit")
        assert [r["num_cached_tokens"] for r in hits] == [h.floor_chunk(len(p)) for p in PROMPTS], serde
        assert result["stats"].get("chunk_hits.local_disk", 0) >= len(PROMPTS) * 2, serde
        assert result["stats"].get(f"coded_bytes.local_disk,{serde}", 0) > 0, serde


def test_fp8_kv_gives_the_tokens_and_next_token_distributions_of_raw_kv(runs):
    raw, coded = h.phase(runs["naive"], "hit"), h.phase(runs["fp8"], "hit")
    agreement, mean_kl, positions = compare(raw, coded)
    first = sum(r["tokens"][0] == c["tokens"][0] for r, c in zip(raw, coded)) / len(PROMPTS)
    print(f"\nfp8 quality gate (tiny model, {len(PROMPTS)} prompts x {NEW_TOKENS} tokens, {positions} positions with "
          f"the same context): greedy agreement {agreement:.3f} (first tokens {first:.2f}), mean KL(raw || fp8) "
          f"{mean_kl:.4f} nats")
    assert mean_kl <= MAX_MEAN_KL and first >= MIN_FIRST_TOKENS
