"""Cost of the default chunk digest (sha256) against xxh3_128 on the hit path.

What a lookup and a load compute for a request: the keys of one long prompt (`KeyBuilder.keys`, the prefix-chain
digests of its chunks at the default chunk size, 128 tokens) and their strings (`CacheKey.to_str`, the names every
tier is asked by). Timed for each supported digest, best of N, in this one process (no thread binding involved);
`<algorithm>_vs_xxh3_ratio = t_xxh3_128 / t_algorithm` (< 1: slower than xxh3_128), and the extra time per
prompt and per 1000 chunks, which is what the cryptographic default costs every request.

    python benchmarks/bench_chunk_digest.py [--quick] [--tokens 32768] [--chunk 128] [--json FILE]
"""
from __future__ import annotations

import numpy as np
from _common import best_of, parse_args, print_table, write_json

from lmcache_vllm.tokens import SUPPORTED_HASH_ALGORITHMS, ChunkHasher, KeyBuilder

BASELINE = "xxh3_128"


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    parser.add_argument("--chunk", type=int, default=128, help="chunk size (default 128, ours on vLLM's CPU)")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], add_arguments)
    tokens = args.tokens if not args.quick else min(args.tokens, 8192)
    repeats = 5 if args.quick else 50
    prompt = np.random.default_rng(0).integers(0, 150_000, tokens).tolist()  # a list, as vLLM hands it over
    chunks = tokens // args.chunk
    seconds: dict[str, float] = {}
    for algorithm in SUPPORTED_HASH_ALGORITHMS:
        builder = KeyBuilder("llama", 1, 0, "bfloat16", 2, ChunkHasher(args.chunk, algorithm), fingerprint="ab" * 16)
        seconds[algorithm] = best_of(lambda b=builder: [key.to_str() for key, _, _ in b.keys(prompt)], repeats)
    base = seconds[BASELINE]
    results: dict[str, float] = {"tokens": tokens, "chunk_size": args.chunk, "chunks": chunks}
    rows = []
    for algorithm, t in seconds.items():
        ratio = base / t
        extra_per_1000 = (t - base) / chunks * 1000
        results[f"{algorithm}_us"] = t * 1e6
        results[f"{algorithm}_vs_xxh3_ratio"] = ratio
        results[f"{algorithm}_extra_us_per_1000_chunks"] = extra_per_1000 * 1e6
        rows.append((algorithm, f"{t * 1e6:.0f}", f"{t / chunks * 1e9:.0f}", f"{ratio:.2f}",
                     f"{(t - base) * 1e6:+.0f}", f"{extra_per_1000 * 1e6:+.0f}"))
    print_table(f"keys of one {tokens}-token prompt ({chunks} chunks of {args.chunk}), best of {repeats}", rows,
                ("digest", "us / prompt", "ns / chunk", f"{BASELINE} / it (<1: slower)", "extra us / prompt",
                 "extra us / 1000 chunks"))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
