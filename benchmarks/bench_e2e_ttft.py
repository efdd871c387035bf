"""End-to-end time to first token with real vLLM: cold, warm from host memory, warm from disk in a fresh
process, and vLLM's own prefix-cache hit as the limit; plus request throughput with 0 % reuse, with and
without the connector (what the cache costs when it never helps).

    python benchmarks/bench_e2e_ttft.py [--quick] [--json FILE] [--png FILE]

Full: the `medium` local Llama (8 layers, hidden 1024) and ~4K-token prompts. --quick: the `tiny` model
and ~1.5K-token prompts. Each configuration runs in its own vLLM process (in-process engine, one compute
thread bound to core 0 for every run, so all are comparable). TTFT is the wall time of a request with
max_tokens=1. Ratios (> 1 = lmcache-vllm better): `warm_l1_vs_prefix_cache_ratio` = vLLM prefix-cache
TTFT / our warm TTFT (target >= 1/1.2), `fresh_disk_speedup_ratio` = cold / fresh-process disk TTFT
(target >= 5), `zero_reuse_throughput_ratio` = requests/s with / without connector (target >= 0.98).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from _common import REPO_ROOT, parse_args, print_table, write_json

from lmcache_vllm.testing.vllm_jobs import CONNECTOR, random_tokens, run_job

def _tokens(seed: int, n: int) -> list[int]:
    return random_tokens(seed, n)


def _run(tmp: Path, name: str, job: dict, hash_seed: int = 0) -> dict:
    return run_job(tmp, name, job, hash_seed=hash_seed, kv_cache_gib=2)


def _walls(result: dict, prefix: str) -> list[float]:
    return [p["wall_s"] for p in result["phases"] if p["name"].startswith(prefix)]


def _cached(result: dict, prefix: str) -> list[int]:
    return [r["num_cached_tokens"] for p in result["phases"] if p["name"].startswith(prefix)
            for r in p["results"]]


def _tokens_of(result: dict, prefix: str) -> list[list[int]]:
    return [r["tokens"] for p in result["phases"] if p["name"].startswith(prefix) for r in p["results"]]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--png", default=os.path.join(REPO_ROOT, "bench_out", "e2e_ttft.png"), help="bar chart file"))
    size, prompt_len, repeats, batch = ("tiny", 1500, 2, 4) if args.quick else ("medium", 4000, 2, 4)
    from lmcache_vllm.testing.local_model import build_model

    model = str(build_model(size))
    kwargs = {"dtype": "bfloat16", "max_model_len": prompt_len + 256, "enforce_eager": True, "seed": 0,
              "max_num_batched_tokens": max(8192, batch * (prompt_len + 64)), "enable_prefix_caching": False}
    one = {"max_tokens": 1}
    cold_prompts = [_tokens(100 + i, prompt_len) for i in range(repeats)]
    batches = [[_tokens(1000 + 50 * b + i, prompt_len) for i in range(batch)] for b in range(2)]
    throughput_phases = [{"name": f"batch{b}", "prompts": p, "max_tokens": 16} for b, p in enumerate(batches)]

    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmpdir:
        tmp = Path(tmpdir)
        extra = {"chunk_size": 256, "max_local_cpu_size": 2.0, "local_disk": str(tmp / "l2"),
                 "max_local_disk_size": 4.0}
        ours = _run(tmp, "ours", {"model": model, "llm_kwargs": kwargs,
                                  "kv_transfer_config": dict(CONNECTOR, kv_connector_extra_config=extra),
                                  "phases": [{"name": f"cold{i}", "prompts": [p], **one} for i, p in enumerate(cold_prompts)]
                                  + [{"name": f"warm{r}", "prompts": [cold_prompts[0]], **one} for r in range(repeats)]
                                  + throughput_phases}, hash_seed=1)
        fresh = _run(tmp, "fresh", {"model": model, "llm_kwargs": kwargs,
                                    "kv_transfer_config": dict(CONNECTOR, kv_connector_extra_config=extra),
                                    "phases": [{"name": f"disk{i}", "prompts": [p], **one}
                                               for i, p in enumerate(cold_prompts)]}, hash_seed=2)
        vllm_pc = _run(tmp, "vllm_prefix_cache", {
            "model": model, "llm_kwargs": dict(kwargs, enable_prefix_caching=True),
            "phases": [{"name": "cold", "prompts": [cold_prompts[0]], **one}]
            + [{"name": f"hit{r}", "prompts": [cold_prompts[0]], **one} for r in range(repeats)]})
        plain = _run(tmp, "no_connector", {"model": model, "llm_kwargs": kwargs,
                                           "phases": [{"name": f"cold{i}", "prompts": [p], **one}
                                                      for i, p in enumerate(cold_prompts)] + throughput_phases})

    cold = statistics.median(_walls(ours, "cold"))
    cold_plain = statistics.median(_walls(plain, "cold"))
    warm = min(_walls(ours, "warm"))
    disk = min(_walls(fresh, "disk"))
    pc_hit = min(_walls(vllm_pc, "hit"))
    tput_ours = batch / min(_walls(ours, "batch"))
    tput_plain = batch / min(_walls(plain, "batch"))
    hit_expected = prompt_len - prompt_len % 256
    results = {
        "model": size, "prompt_tokens": prompt_len, "batch_requests": batch,
        "cold_ttft_s": cold, "cold_ttft_no_connector_s": cold_plain, "warm_l1_ttft_s": warm,
        "fresh_process_disk_ttft_s": disk, "vllm_prefix_cache_ttft_s": pc_hit,
        "warm_cached_tokens": min(_cached(ours, "warm")), "fresh_cached_tokens": min(_cached(fresh, "disk")),
        "zero_reuse_requests_per_s": tput_ours, "zero_reuse_requests_per_s_no_connector": tput_plain,
        "warm_l1_vs_prefix_cache_ratio": pc_hit / warm,
        "fresh_disk_speedup_ratio": cold / disk,
        "warm_l1_speedup_ratio": cold / warm,
        "zero_reuse_throughput_ratio": tput_ours / tput_plain,
        "cold_with_vs_without_connector_ratio": cold_plain / cold,
        "outputs_match_no_connector": _tokens_of(ours, "batch") == _tokens_of(plain, "batch"),
        "hits_complete": min(_cached(ours, "warm") + _cached(fresh, "disk")) >= hit_expected,
    }
    print_table(f"TTFT, {size} model, {prompt_len}-token prompt (s)", [
        ("cold (connector on)", cold, 1.0), ("cold (no connector)", cold_plain, cold_plain / cold),
        ("warm, host memory", warm, cold / warm), ("warm, fresh process from disk", disk, cold / disk),
        ("vLLM prefix-cache hit (limit)", pc_hit, cold / pc_hit)], ("case", "ttft_s", "speedup_vs_cold"))
    print_table(f"0 % reuse, {batch} requests x {prompt_len} tokens, 16 output tokens", [
        ("with connector", tput_ours), ("without connector", tput_plain)], ("case", "requests_per_s"))
    print(f"\nwarm L1 = {warm / pc_hit:.2f}x vLLM prefix-cache hit (target <= 1.2x)")
    print(f"fresh-process disk = {disk / cold:.3f}x cold (target <= 0.2x)")
    print(f"0 %-reuse throughput = {tput_ours / tput_plain:.3f}x without connector (target >= 0.98x)")
    for key, value in results.items():
        if key.endswith("_ratio"):
            print(f"{key} = {value:.3f}")
    _plot(args.png, results)
    write_json(args.json, results)


def _plot(path: str, r: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    labels = ["cold", "warm\nhost memory", "fresh process\ndisk", "vLLM prefix\ncache hit"]
    values = [r["cold_ttft_s"], r["warm_l1_ttft_s"], r["fresh_process_disk_ttft_s"], r["vllm_prefix_cache_ttft_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, values, color=["#999999", "#2b7bba", "#5aa05a", "#d98c1f"])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title(f"lmcache-vllm TTFT, {r['model']} model, {r['prompt_tokens']}-token prompt")
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.3f}s", ha="center", va="bottom")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
