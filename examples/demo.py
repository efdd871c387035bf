"""`make demo`: vLLM with lmcache-vllm serves a repeated prompt from the cache, in the same process and in a
fresh one, with the same output as vLLM's own prefix cache serving the same tokens.

Builds the tiny local model (no hub), then runs three vLLM processes on one ~1400-token prompt:
  1. vLLM without the connector, its own prefix cache on, the prompt twice: the cold run (reference for
     cold requests and cold TTFT) and vLLM's own prefix-cache hit (reference for cached requests),
  2. vLLM with the connector (host memory + disk): a cold request, then the same prompt again,
  3. a fresh vLLM process with the connector: the prompt is found on disk.
and prints what was loaded from where, how fast, and whether the output is the same as vLLM's at the same
prefill split ("same output"; see lmcache_vllm/integration/vllm/testing/reference.py for why only that comparison is
fair).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from lmcache_vllm.integration.vllm.testing.local_model import build_model
from lmcache_vllm.integration.vllm.testing.reference import hit_splits_agree, same_output
from lmcache_vllm.integration.vllm.testing.vllm_jobs import connector_config, phase_results, random_tokens, run_job


def _tier(stats: dict) -> str:
    if stats.get("chunk_hits.redis"):
        return "L3 redis"
    if stats.get("chunk_hits.local_disk"):
        return "L2 disk"
    if stats.get("chunk_hits.local_cpu"):
        return "L1 memory"
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "medium"], help="local model recipe")
    parser.add_argument("--prompt-tokens", type=int, default=1400,
                        help="prompt length; by default one where vLLM's prefix cache and our chunks (the "
                             "default: vLLM's block size) serve a repeat the same number of tokens")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, disk tier)")
    args = parser.parse_args()

    print(f"building/using the {args.size} local model ...", flush=True)
    model = str(build_model(args.size))
    work = Path(tempfile.mkdtemp(prefix="lmcache-vllm-demo-"))
    disk = work / "disk-tier"
    prompt = random_tokens(2024, args.prompt_tokens)
    llm_kwargs = {"dtype": "bfloat16", "max_model_len": max(2048, args.prompt_tokens + 64),
                  "enforce_eager": True, "seed": 0, "enable_prefix_caching": False,
                  "max_num_batched_tokens": 8192, "disable_log_stats": False}
    # The defaults a user gets: no chunk_size, so chunks of vLLM's block size (docs/CONFIG.md).
    cfg = connector_config({"max_local_cpu_size": 1, "local_disk": str(disk), "max_local_disk_size": 2})

    def job(name, phases, with_connector, hash_seed=0, **kwargs):
        print(f"running: {name} ...", flush=True)
        spec = {"model": model, "llm_kwargs": dict(llm_kwargs, **kwargs),
                "kv_transfer_config": cfg if with_connector else None,
                "phases": [{"name": p, "prompts": [prompt], "max_tokens": 16} for p in phases]}
        return run_job(work, name, spec, hash_seed=hash_seed)

    try:
        reference = job("vllm-alone", ["cold", "hit"], with_connector=False, enable_prefix_caching=True)
        first = job("first-process", ["cold", "warm"], with_connector=True)
        fresh = job("fresh-process", ["fresh process"], with_connector=True, hash_seed=1)

        cold_ref = phase_results(reference, "cold")[0]
        hit_ref = phase_results(reference, "hit")[0]
        references = [cold_ref, hit_ref]
        rows = [("vLLM without connector", cold_ref, "-", "reference"),
                ("vLLM's own prefix cache", hit_ref, "vLLM", "reference"),
                ("1st request (cold)", phase_results(first, "cold")[0], "-", None),
                ("2nd request, same process", phase_results(first, "warm")[0], _tier(first["stats"]), None),
                ("3rd request, fresh process", phase_results(fresh, "fresh process")[0], _tier(fresh["stats"]), None)]
        print()
        print(f"{'request':<28} {'prompt':>7} {'from cache':>11} {'tier':>10} {'TTFT':>9}  same output")
        for label, res, tier, same in rows:
            ttft = f"{res['ttft_s']:.3f}s" if res.get("ttft_s") is not None else "n/a"
            same = same or same_output(res, references)
            print(f"{label:<28} {len(prompt):>7} {res['num_cached_tokens']:>11} {tier:>10} {ttft:>9}  {same}")
        print("\nsame output = the same greedy tokens as vLLM at the same prefill split: a cold request against "
              "vLLM without the connector,\na cached one against vLLM's own prefix cache serving the same "
              "number of tokens.")
        if cold_ref["tokens"] != hit_ref["tokens"]:
            print("note: vLLM's own prefix-cache hit gives other tokens than its cold run: this random-weight "
                  "model's greedy tokens\nflip on the rounding of differently shaped prefill steps; it is "
                  "not the cache.")
        if not hit_splits_agree(len(prompt)):
            print(f"note: with {len(prompt)} prompt tokens vLLM's prefix cache (128-token blocks) and our "
                  f"128-token chunks serve\ndifferent numbers of tokens (a multiple of 128: vLLM computes the "
                  f"last token, its last block with it), so hits have no like-with-like reference ('n/a').")
        print(f"\nstored on disk: {sum(1 for _ in disk.iterdir()) if disk.exists() else 0} chunk files in {disk}")
    finally:
        if args.keep:
            print(f"run directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
