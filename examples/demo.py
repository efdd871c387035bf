"""`make demo`: vLLM with lmcache-vllm serves a repeated prompt from the cache, in the same process and in a
fresh one, with the same output as vLLM without the connector.

Builds the tiny local model (no hub), then runs three vLLM processes on one ~1500-token prompt:
  1. vLLM without the connector (the reference output and cold TTFT),
  2. vLLM with the connector (host memory + disk): a cold request, then the same prompt again,
  3. a fresh vLLM process with the connector: the prompt is found on disk.
and prints what was loaded from where, how fast, and whether the output matches the reference.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from lmcache_vllm.testing.local_model import build_model
from lmcache_vllm.testing.vllm_jobs import connector_config, phase_results, random_tokens, run_job


def _tier(stats: dict) -> str:
    storage = stats.get("storage", {})
    if storage.get("redis.hits"):
        return "L3 redis"
    if storage.get("local_disk.hits"):
        return "L2 disk"
    if storage.get("local_cpu_hits"):
        return "L1 memory"
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "medium"], help="local model recipe")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
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
    cfg = connector_config({"chunk_size": 256, "max_local_cpu_size": 1, "local_disk": str(disk),
                            "max_local_disk_size": 2})

    def job(name, phases, with_connector, hash_seed=0):
        print(f"running: {name} ...", flush=True)
        spec = {"model": model, "llm_kwargs": llm_kwargs, "kv_transfer_config": cfg if with_connector else None,
                "phases": [{"name": p, "prompts": [prompt], "max_tokens": 16} for p in phases]}
        return run_job(work, name, spec, hash_seed=hash_seed)

    try:
        ref = job("reference", ["no connector"], with_connector=False)
        first = job("first-process", ["cold", "warm"], with_connector=True)
        fresh = job("fresh-process", ["fresh process"], with_connector=True, hash_seed=1)

        ref_tokens = phase_results(ref, "no connector")[0]["tokens"]
        rows = [("vLLM without connector", phase_results(ref, "no connector")[0], "-"),
                ("1st request (cold)", phase_results(first, "cold")[0], "-"),
                ("2nd request, same process", phase_results(first, "warm")[0], _tier(first["stats"])),
                ("3rd request, fresh process", phase_results(fresh, "fresh process")[0], _tier(fresh["stats"]))]
        print()
        print(f"{'request':<28} {'prompt':>7} {'from cache':>11} {'tier':>10} {'TTFT':>9}  same output")
        for label, res, tier in rows:
            ttft = f"{res['ttft_s']:.3f}s" if res.get("ttft_s") is not None else "n/a"
            same = "yes" if res["tokens"] == ref_tokens else "NO"
            print(f"{label:<28} {len(prompt):>7} {res['num_cached_tokens']:>11} {tier:>10} {ttft:>9}  {same}")
        print(f"\nstored on disk: {sum(1 for _ in disk.iterdir()) if disk.exists() else 0} chunk files in {disk}")
    finally:
        if args.keep:
            print(f"run directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
