"""Peer of benchmarks/bench_memory_tier.py, run under an interpreter with LMCache 0.5.6 installed.

Measures on the same tokens and chunk geometry as the main benchmark:
- LMCache's `ChunkedTokenDatabase.process_tokens` (keys for every full chunk) in tokens/s, with its default
  hash ("builtin") and vLLM's "sha256_cbor", for token ids given as a list and as a tensor;
- its `LocalCPUBackend`: put = allocate + copy one chunk in + `submit_put_task`; get = `get_blocking` +
  copy the chunk out; in GB/s.
Prints one JSON object as its last stdout line. Does not import lmcache_vllm.
"""

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch


def best_of(fn, repeats, setup=None):
    best = float("inf")
    for i in range(repeats + 1):  # the first run is a warm-up
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i:
            best = min(best, elapsed)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

    import lmcache
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

    out = {"lmcache_version": getattr(lmcache, "__version__", "0.5.6")}
    prompts = np.random.default_rng(args.seed).integers(0, 128_000, (args.prompts, args.prompt_tokens))
    inputs = {"list": prompts.tolist(), "tensor": list(torch.from_numpy(prompts))}
    total_tokens = args.prompts * args.prompt_tokens
    shape = (args.layers, 2, args.chunk_size, args.kv_heads * args.head_size)
    kv_shape = (args.layers, 2, args.chunk_size, args.kv_heads, args.head_size)
    metadata = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=kv_shape)
    for algorithm in ("builtin", "sha256_cbor"):
        config = LMCacheEngineConfig.from_defaults(chunk_size=args.chunk_size,
                                                   pre_caching_hash_algorithm=algorithm)
        try:
            db = ChunkedTokenDatabase(config, metadata)
        except Exception as exc:  # e.g. vLLM's hash function missing
            out[f"hash_{algorithm}_error"] = repr(exc)
            continue
        for kind, batch in inputs.items():
            seconds = best_of(lambda d=db, ps=batch: [list(d.process_tokens(tokens=p)) for p in ps], 3 * args.repeats)
            out[f"hash_{algorithm}_{kind}_tokens_per_s"] = total_tokens / seconds

    chunk_bytes = int(np.prod(shape)) * 2
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_size, local_cpu=True,
        max_local_cpu_size=(args.chunks + 2) * chunk_bytes / (1 << 30))
    backend = LocalCPUBackend(config, metadata)
    db = ChunkedTokenDatabase(config, metadata)
    chunk_tokens = torch.from_numpy(np.random.default_rng(args.seed).integers(
        0, 128_000, args.chunks * args.chunk_size))
    keys = [k for _, _, k in db.process_tokens(tokens=chunk_tokens)]
    src = torch.randn((args.chunks, *shape)).to(torch.bfloat16)
    dst = torch.empty_like(src)

    def put_all():
        for i, key in enumerate(keys):
            obj = backend.allocate(torch.Size(shape), torch.bfloat16)
            obj.tensor.copy_(src[i])
            backend.submit_put_task(key, obj)
            obj.ref_count_down()

    def get_all():
        for i, key in enumerate(keys):
            obj = backend.get_blocking(key)
            dst[i].copy_(obj.tensor)
            obj.ref_count_down()

    def clear():
        for key in keys:
            backend.remove(key)

    put_s = best_of(put_all, args.repeats, setup=clear)
    if backend.get_blocking(keys[0]) is None:
        raise SystemExit("LMCache LocalCPUBackend lost the chunks it was given")
    get_s = best_of(get_all, args.repeats)
    if not torch.equal(src, dst):
        raise SystemExit("LMCache LocalCPUBackend returned different bytes")
    total = args.chunks * chunk_bytes
    out.update(l1_put_gbps=total / put_s / 1e9, l1_get_gbps=total / get_s / 1e9,
               l1_put_s=put_s, l1_get_s=get_s, l1_bytes=total)
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
