"""A sliding-window model with our connector: KV memory per request with vLLM's hybrid KV cache manager on
(our connector is a `SupportsHMA` one) against the hybrid manager off (what a connector without
`SupportsHMA` makes vLLM do), and time to first token from our cache against a cold prefill.

    python benchmarks/bench_hybrid.py [--quick] [--json FILE]

Full: the `medium-swa` local Llama (8 layers, hidden 1024; odd layers a 1024-token window) and 3900-token
prompts; --quick: `tiny-swa` (4 layers, a 512-token window) and 1900-token prompts. Each configuration
runs in its own vLLM process (in-process engine, one compute thread), with our connector (host memory,
256-token chunks) and chunked prefill (512-token steps, so a sliding layer can let go of the blocks
behind its window while the prompt is still being computed):
- `hma`: vLLM decides (our connector keeps its hybrid manager on): a full-attention and a sliding-window
  KV cache group.
- `no_hma`: `disable_hybrid_kv_cache_manager=True`: every layer keeps every token.

KV memory per request: the blocks the request holds, read from vLLM's block pool after every engine step,
times the bytes of one block (all layers of its group); its peak, and what it holds while decoding.
`max_concurrency` is vLLM's own figure (`get_max_concurrency_for_kv_cache_config`): requests of
max_model_len tokens the KV cache holds at once. TTFT: the wall time of a request with max_tokens=1, cold
(a new prompt) and warm (the same prompt again: vLLM's prefix cache is off, so its prefix comes from our
host memory), best of the repeats (the shared machine's noise only adds time).

Ratios (> 1: better with the hybrid manager on / with our cache): `kv_bytes_peak_ratio` and
`kv_bytes_decode_ratio` = no_hma / hma bytes per request, `max_concurrency_ratio` = hma / no_hma,
`warm_speedup_ratio_<config>` = cold / warm TTFT.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO_ROOT, cpu_model, parse_args, print_table, write_json

from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, random_tokens, vllm_env

DECODE_TOKENS = 16


def _child(spec: dict) -> dict:
    """One configuration in this process (see the module docstring)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    llm = LLM(model=spec["model"], kv_transfer_config=KVTransferConfig(**spec["connector"]), **spec["llm_kwargs"])
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # VLLM_ENABLE_V1_MULTIPROCESSING=0
    kv_config = scheduler.kv_cache_config
    pool = scheduler.kv_cache_manager.block_pool
    block_bytes = kv_config.kv_cache_tensors[0].size // kv_config.num_blocks  # groups share one allocation
    out = {"groups": [type(g.kv_cache_spec).__name__ for g in kv_config.kv_cache_groups],
           "hybrid_manager": not engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
           "block_bytes": block_bytes, "num_blocks": kv_config.num_blocks,
           "max_concurrency": get_max_concurrency_for_kv_cache_config(engine.vllm_config, kv_config)}

    def used() -> int:
        return kv_config.num_blocks - 1 - pool.get_num_free_blocks()  # block 0 is the null block

    # Blocks one request holds, step by step.
    base = used()
    engine.add_request("memory", TokensPrompt(prompt_token_ids=spec["memory_prompt"]),
                       SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True))
    held, generated = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated = len(output.outputs[0].token_ids)
        if engine.has_unfinished_requests():
            held.append((generated, used() - base))
    out["peak_blocks"] = max(n for _, n in held)
    out["decode_blocks"] = max([n for g, n in held if g >= 2] or [0])

    one = SamplingParams(temperature=0.0, max_tokens=1)
    cold, warm, cached = [], [], []
    for prompt in spec["ttft_prompts"]:
        for into in (cold, warm):
            t0 = time.perf_counter()
            result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)[0]
            into.append(time.perf_counter() - t0)
        cached.append(int(result.num_cached_tokens or 0))
    out.update(cold_ttft_s=min(cold), warm_ttft_s=min(warm), warm_cached_tokens=min(cached))
    llm.llm_engine.engine_core.shutdown()
    return out


def _run(tmp: Path, name: str, spec: dict) -> dict:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = vllm_env(tmp / f"{name}.env", kv_cache_gib=2)
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path), str(out_path)], cwd=REPO_ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); log tail:\n{log_path.read_text()[-4000:]}")
    return json.loads(out_path.read_text())


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    size, prompt_len, repeats = ("tiny-swa", 1900, 2) if args.quick else ("medium-swa", 3900, 3)
    from lmcache_vllm.integration.vllm.testing.local_model import RECIPES, build_model

    model = str(build_model(size))
    kwargs = {"dtype": "bfloat16", "max_model_len": prompt_len + 128, "enforce_eager": True, "seed": 0,
              "enable_prefix_caching": False, "max_num_batched_tokens": 512, "enable_chunked_prefill": True}
    connector = dict(CONNECTOR, kv_connector_extra_config={"chunk_size": 256, "max_local_cpu_size": 2.0})
    spec = {"model": model, "connector": connector, "memory_prompt": random_tokens(1, prompt_len),
            "ttft_prompts": [random_tokens(10 + i, prompt_len) for i in range(repeats)]}
    with tempfile.TemporaryDirectory(prefix="bench_hybrid_") as tmpdir:
        tmp = Path(tmpdir)
        hma = _run(tmp, "hma", dict(spec, llm_kwargs=kwargs))
        no_hma = _run(tmp, "no_hma", dict(spec, llm_kwargs=dict(kwargs, disable_hybrid_kv_cache_manager=True)))

    results: dict = {"model": size, "sliding_window": RECIPES[size].sliding_window, "prompt_tokens": prompt_len,
                     "cpu": cpu_model()}
    rows = []
    for name, run in (("hma", hma), ("no_hma", no_hma)):
        peak, decode = run["peak_blocks"] * run["block_bytes"], run["decode_blocks"] * run["block_bytes"]
        results.update({f"{name}_{k}": v for k, v in run.items() if not isinstance(v, list)})
        results.update({f"{name}_groups": "+".join(run["groups"]), f"{name}_kv_bytes_peak": peak,
                        f"{name}_kv_bytes_decode": decode,
                        f"warm_speedup_ratio_{name}": run["cold_ttft_s"] / run["warm_ttft_s"]})
        rows.append((name, "on" if run["hybrid_manager"] else "off", "+".join(run["groups"]), peak / 2**20,
                     decode / 2**20, run["max_concurrency"], run["cold_ttft_s"], run["warm_ttft_s"],
                     run["warm_cached_tokens"]))
    results["kv_bytes_peak_ratio"] = results["no_hma_kv_bytes_peak"] / results["hma_kv_bytes_peak"]
    results["kv_bytes_decode_ratio"] = results["no_hma_kv_bytes_decode"] / results["hma_kv_bytes_decode"]
    results["max_concurrency_ratio"] = hma["max_concurrency"] / no_hma["max_concurrency"]
    print_table(f"{size} (window {results['sliding_window']}), {prompt_len}-token prompt, {results['cpu']}", rows,
                ("config", "hybrid mgr", "groups", "KV MiB peak", "KV MiB decode", "max concurrency",
                 "cold TTFT s", "warm TTFT s", "warm cached"))
    print(f"\nKV bytes per request, no_hma / hma: peak {results['kv_bytes_peak_ratio']:.2f}x, decode "
          f"{results['kv_bytes_decode_ratio']:.2f}x; max concurrency hma / no_hma "
          f"{results['max_concurrency_ratio']:.2f}x; warm from our cache vs cold: "
          f"{results['warm_speedup_ratio_hma']:.2f}x (hma), {results['warm_speedup_ratio_no_hma']:.2f}x (no_hma)")
    write_json(args.json, results)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        result = _child(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        main()
