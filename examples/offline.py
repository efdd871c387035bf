"""Offline inference with lmcache-vllm: the second request for the same long prompt skips its prefill.

    python examples/offline.py                        # builds a tiny local Llama first (no hub needed)
    python examples/offline.py --model DIR --config configs/cpu_disk.yaml

Run it twice with the disk config: the second process finds the first one's KV on disk.
On a CPU-only machine set VLLM_CPU_OMP_THREADS_BIND=0 (or another fixed binding) for runs you compare:
with a connector vLLM reserves one core for itself and would otherwise compute with a different
thread count than without one.
"""
from __future__ import annotations

import argparse
import os
import random
import time

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or name (default: build the tiny local model)")
    parser.add_argument("--config", default=None, help="lmcache-vllm YAML (default: configs/cpu_disk.yaml)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    args = parser.parse_args()

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("LMCACHE_CONFIG_FILE", args.config or os.path.join(root, "configs", "cpu_disk.yaml"))
    if args.model is None:
        from lmcache_vllm.integration.vllm.testing.local_model import build_model

        args.model = str(build_model("tiny"))

    llm = LLM(
        model=args.model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, seed=0,
        enable_prefix_caching=False,  # so that every hit below comes from lmcache-vllm
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnector", kv_connector_module_path="lmcache_vllm.integration.vllm",
            kv_role="kv_both"),
    )
    rng = random.Random(0)
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(4, 4000) for _ in range(args.prompt_tokens)])
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for attempt in ("first", "second"):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"{attempt}: {time.perf_counter() - t0:.3f}s, {out.num_cached_tokens} of "
              f"{args.prompt_tokens} prompt tokens from cache, output ids {list(out.outputs[0].token_ids)[:8]}...")


if __name__ == "__main__":
    main()
