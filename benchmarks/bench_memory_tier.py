"""Memory-tier benchmark: chunk hashing, and L1 (host memory) store + retrieve through `CacheEngine`.

1. Hashing: `KeyBuilder.keys` in tokens/s over many 4096-token prompts, for every supported algorithm
   and input kind (list, numpy, tensor), and numpy with extra keys (LoRA + an image; ratio to plain).
2. L1 through the engine: vLLM's CPU paged layout (per layer `[num_blocks, num_kv_heads, block_size,
   2*head_size]`, block_size 128) with the `vec` packing and again with the `amx` packing (keys prefixed
   `amx_`), 32 layers, 8 KV heads, head size 128, bf16, chunks of 256 tokens = 32 MiB each, blocks in random
   order. Store = one copy out of the paged cache (plus hashing, allocation, indexing), retrieve = one copy
   back in; so store+retrieve is compared with two plain torch copies of the same number of bytes measured
   in the same run: `l1_store_retrieve_vs_copy_ratio = 2 * t_copy / (t_store + t_retrieve)` (1.0 = as fast
   as memcpy). Where a GPU and `lmcache_vllm._cuda_ops` are present, the same through a pinned L1 arena
   from vLLM's FLASH_ATTN views (LBNHC, block 16) on the GPU, against a raw pinned copy each way
   (`cuda_l1_*` keys).
3. L1 storage tier alone: StorageManager put (allocate + copy a chunk in + index) and get (lookup + copy
   out), in GB/s.
With `--vs-lmcache PYTHON` the peer script runs under that interpreter (LMCache 0.5.6, see
scripts/make_lmcache_venv.sh) on the same token ids and chunk geometry, and ratios to LMCache's
`ChunkedTokenDatabase` and `LocalCPUBackend` are reported (> 1 = lmcache-vllm faster).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from _common import best_of, gbps, parse_args, print_table, run_peer, write_json

from lmcache_vllm.config import load_config
from lmcache_vllm.engine import CacheEngine
from lmcache_vllm.extra_keys import ExtraKeys, ExtraSpan
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, kv_views
from lmcache_vllm.layouts import detect_layout
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.tokens import DEFAULT_HASH_ALGORITHM, SUPPORTED_HASH_ALGORITHMS, ChunkHasher, KeyBuilder

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, CHUNK = 32, 8, 128, 128, 256
DTYPE = torch.bfloat16
SEED = 0
MiB, GiB = 1 << 20, 1 << 30
EXTRA_KEYS = ExtraKeys(b"lora:adapter-name:" + bytes(32), (ExtraSpan(300, 876, b"mm:" + bytes(32)),))


def add_arguments(parser):
    parser.add_argument("--vs-lmcache", metavar="PYTHON",
                        help="interpreter with lmcache==0.5.6 (e.g. .venv-lmcache/bin/python)")
    parser.add_argument("--chunks", type=int, help="chunks of 32 MiB moved per run (default 4 quick, 8 full)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the copies and the baseline (default: torch's choice)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the L1 measurements (default 3 quick, "
                        "7 full)")


def token_ids(n: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 128_000, n)


def prompt_token_ids(num_prompts: int, prompt_tokens: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 128_000, (num_prompts, prompt_tokens))


def bench_hashing(num_prompts: int, prompt_tokens: int, repeats: int, results: dict) -> None:
    """Keys for `num_prompts` distinct prompts of `prompt_tokens` tokens each (a realistic prompt size
    rather than one huge sequence, so per-call costs count as they do in serving)."""
    prompts = prompt_token_ids(num_prompts, prompt_tokens)
    inputs = {"list": prompts.tolist(), "numpy": list(prompts),
              "tensor": list(torch.from_numpy(prompts))}
    total = num_prompts * prompt_tokens
    rows = []
    for algorithm in SUPPORTED_HASH_ALGORITHMS:
        builder = KeyBuilder("bench/model", 1, 0, DTYPE, 1, ChunkHasher(CHUNK, algorithm))
        row = [algorithm]
        for kind, batch in inputs.items():
            seconds = best_of(lambda b=builder, ps=batch: [b.keys(p) for p in ps], repeats)
            rate = total / seconds
            results[f"hash_{algorithm}_{kind}_tokens_per_s"] = rate
            row.append(rate / 1e6)
        # The same numpy prompts with extra keys (a LoRA adapter and an image over chunks 1-3).
        seconds = best_of(lambda b=builder: [b.keys(p, extra=EXTRA_KEYS) for p in inputs["numpy"]], repeats)
        results[f"hash_{algorithm}_numpy_extras_tokens_per_s"] = total / seconds
        row.append(total / seconds / 1e6)
        rows.append(tuple(row))
    results.update(hash_prompts=num_prompts, hash_prompt_tokens=prompt_tokens)
    default = DEFAULT_HASH_ALGORITHM
    results["hash_extras_vs_plain_ratio"] = (results[f"hash_{default}_numpy_extras_tokens_per_s"]
                                             / results[f"hash_{default}_numpy_tokens_per_s"])
    print_table(f"KeyBuilder.keys, {num_prompts} prompts x {prompt_tokens} tokens, chunk {CHUNK} "
                f"(Mtokens/s)", rows, ("algorithm", "list", "numpy", "tensor", "numpy+extras"))


def paged_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    if fill:
        return [torch.randn(shape, generator=gen).to(DTYPE) for _ in range(LAYERS)]
    return [torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)]


def bench_engine(num_chunks: int, repeats: int, results: dict, isa: str = "vec") -> None:
    num_tokens = num_chunks * CHUNK
    num_blocks = num_tokens // BLOCK_SIZE + 2
    chunk_bytes = LAYERS * 2 * CHUNK * KV_HEADS * HEAD_SIZE * DTYPE.itemsize
    total = num_chunks * chunk_bytes
    src, dst = paged_caches(num_blocks, True), paged_caches(num_blocks, False)
    gen = torch.Generator().manual_seed(SEED + 1)
    blocks = torch.randperm(num_blocks, generator=gen)[: num_tokens // BLOCK_SIZE]
    pos = torch.arange(num_tokens)
    slots = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    tokens = token_ids(num_tokens).tolist()

    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": (total + 64 * MiB) / GiB},
                         environ={})
    layout = detect_layout(src, backend="CPU_ATTN", cpu_isa=isa)
    keys = KeyBuilder("bench/model", 1, 0, DTYPE, 1, ChunkHasher(CHUNK, config.pre_caching_hash_algorithm))
    engine = CacheEngine(config, layout, keys)
    try:
        stored = engine.store(tokens, src, slots)
        if stored != num_tokens:
            raise RuntimeError(f"engine stored {stored} of {num_tokens} tokens")
        loaded = engine.retrieve(tokens, dst, slots)
        if not bool(loaded.all()) or not all(torch.equal(a[blocks], b[blocks]) for a, b in zip(src, dst)):
            raise RuntimeError("engine round trip did not reproduce the paged KV")
        # The machine is shared and noisy: interleave every measured operation round by round so that
        # a busy moment hits ours and the baseline alike, then keep each one's best round.
        chunk_outs = [torch.empty(layout.chunk_shape(CHUNK), dtype=DTYPE) for _ in range(num_chunks)]
        chunk_slots = [slots[i * CHUNK:(i + 1) * CHUNK] for i in range(num_chunks)]
        flat_src = torch.randn(total // DTYPE.itemsize).to(DTYPE)
        flat_dst = torch.empty_like(flat_src)
        ops = {
            "copy": (lambda: flat_dst.copy_(flat_src), None),
            "store": (lambda: engine.store(tokens, src, slots), engine.clear),
            "retrieve": (lambda: engine.retrieve(tokens, dst, slots), None),
            # The layout adapter's copies alone (no hashing, allocation, indexing): what the engine adds.
            "gather": (lambda: [layout.gather(src, s, o) for s, o in zip(chunk_slots, chunk_outs)], None),
            "scatter": (lambda: [layout.scatter(o, dst, s) for s, o in zip(chunk_slots, chunk_outs)], None),
        }
        samples: dict[str, list[float]] = {name: [] for name in ops}
        for round_ in range(repeats + 1):  # round 0 warms up (first touch of every buffer)
            for name, (fn, setup) in ops.items():
                seconds = best_of(fn, 1, warmup=0, setup=setup)
                if round_:
                    samples[name].append(seconds)
        best = {name: min(values) for name, values in samples.items()}
        copy_s, store_s, retrieve_s = best["copy"], best["store"], best["retrieve"]
        # The same ratio per round (ours and the copy a few ms apart, under the same load), median of rounds.
        median_ratio = statistics.median(2 * c / (st + rt) for c, st, rt in
                                         zip(samples["copy"], samples["store"], samples["retrieve"]))
        gather_s, scatter_s = best["gather"], best["scatter"]
    finally:
        engine.close()

    prefix = "" if isa == "vec" else f"{isa}_"
    results.update({prefix + key: value for key, value in dict(
        l1_chunk_bytes=chunk_bytes, l1_chunks=num_chunks, l1_store_gbps=gbps(total, store_s),
        l1_retrieve_gbps=gbps(total, retrieve_s), torch_copy_gbps=gbps(total, copy_s),
        layout_gather_gbps=gbps(total, gather_s), layout_scatter_gbps=gbps(total, scatter_s),
        l1_store_s=store_s, l1_retrieve_s=retrieve_s, torch_copy_s=copy_s,
        l1_store_vs_copy_ratio=copy_s / store_s, l1_retrieve_vs_copy_ratio=copy_s / retrieve_s,
        l1_store_retrieve_vs_copy_ratio=2 * copy_s / (store_s + retrieve_s),
        l1_store_retrieve_vs_copy_median_ratio=median_ratio).items()})
    print_table(f"CacheEngine L1, {num_chunks} chunks x {chunk_bytes // MiB} MiB "
                f"(vLLM CPU {isa} layout, {LAYERS} layers, {KV_HEADS} kv heads, head {HEAD_SIZE}, bf16)",
                [("store (paged -> L1)", store_s * 1e3, gbps(total, store_s), copy_s / store_s),
                 ("retrieve (L1 -> paged)", retrieve_s * 1e3, gbps(total, retrieve_s), copy_s / retrieve_s),
                 ("  layout gather alone", gather_s * 1e3, gbps(total, gather_s), copy_s / gather_s),
                 ("  layout scatter alone", scatter_s * 1e3, gbps(total, scatter_s), copy_s / scatter_s),
                 ("torch copy_ (baseline)", copy_s * 1e3, gbps(total, copy_s), 1.0),
                 ("store+retrieve vs 2 copies", (store_s + retrieve_s) * 1e3, gbps(2 * total, store_s + retrieve_s),
                  2 * copy_s / (store_s + retrieve_s)),
                 ("  same, median of the rounds' ratios", float("nan"), float("nan"), median_ratio)],
                ("operation", "ms", "GB/s", "ratio vs copy"))


def cpu_kernels(results: dict) -> None:
    """Which kernels the compiled CPU op ran (`LMCACHE_VLLM_CPU_ISA` forces a set; `ATEN_CPU_CAPABILITY` torch's
    copy: both `avx2` emulate a CPU without AVX-512) and the task shape its first call measured."""
    from lmcache_vllm import ops
    ext = ops.cpu_ext()
    if ext is None:
        return
    results.update(cpu_isa=ext.isa(), cpu_tasks=ext.tasks(), cpu_tasks_note=ext.tasks_note(),
                   aten_cpu_capability=torch.backends.cpu.get_cpu_capability())
    print(f"compiled CPU op: {ext.isa()} kernels, task shape {ext.tasks()} ({ext.tasks_note()}); torch's copy: "
          f"{torch.backends.cpu.get_cpu_capability()}")


def bench_engine_cuda(num_chunks: int, repeats: int, results: dict) -> None:
    """Engine store / retrieve between vLLM's FLASH_ATTN views on a GPU and the pinned L1 arena, against a
    raw pinned copy (cudaMemcpyAsync) of the same bytes each way, measured in the same run."""
    from lmcache_vllm import ops
    if not torch.cuda.is_available() or ops.cuda_ext() is None:
        print("\nCacheEngine L1 on CUDA: skipped (no GPU or lmcache_vllm._cuda_ops not built)")
        return
    dev = torch.device("cuda")
    gpu_block = 16
    num_tokens = num_chunks * CHUNK
    case = KVViewCase(layout="LBNHC", num_layers=LAYERS, num_blocks=num_tokens // gpu_block + 8,
                      block_size=gpu_block, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    src, dst = kv_views(case, dev), kv_views(case, dev)
    raw = torch.empty(0, dtype=torch.uint8, device=dev).set_(src[0].untyped_storage())
    raw.copy_(torch.randint(0, 100, raw.shape, dtype=torch.uint8, device=dev))
    gen = torch.Generator().manual_seed(SEED + 1)
    blocks = torch.randperm(case.num_blocks, generator=gen)[: num_tokens // gpu_block]
    pos = torch.arange(num_tokens)
    slots = blocks[pos // gpu_block] * gpu_block + pos % gpu_block
    tokens = token_ids(num_tokens).tolist()
    chunk_bytes = LAYERS * 2 * CHUNK * KV_HEADS * HEAD_SIZE * DTYPE.itemsize
    total = num_chunks * chunk_bytes
    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": (total + 64 * MiB) / GiB}, environ={})
    layout = detect_layout(src, **case.describe())
    keys = KeyBuilder("bench/model", 1, 0, DTYPE, 1, ChunkHasher(CHUNK, config.pre_caching_hash_algorithm))
    engine = CacheEngine(config, layout, keys)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device_bytes = torch.empty(total, dtype=torch.uint8, device=dev)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    try:
        assert engine.store(tokens, src, slots) == num_tokens
        engine.retrieve(tokens, dst, slots)
        torch.cuda.synchronize()
        if not all(torch.equal(a[blocks], b[blocks]) for a, b in zip(src, dst)):
            raise RuntimeError("engine round trip on CUDA did not reproduce the paged KV")
        ops_ = {"d2h_copy": (synced(lambda: host.copy_(device_bytes, non_blocking=True)), None),
                "h2d_copy": (synced(lambda: device_bytes.copy_(host, non_blocking=True)), None),
                "store": (synced(lambda: engine.store(tokens, src, slots)), engine.clear),
                "retrieve": (synced(lambda: engine.retrieve(tokens, dst, slots)), None)}
        best = {name: float("inf") for name in ops_}
        for round_ in range(repeats + 1):
            for name, (fn, setup) in ops_.items():
                seconds = best_of(fn, 1, warmup=0, setup=setup)
                if round_:
                    best[name] = min(best[name], seconds)
    finally:
        engine.close()
    store_ratio, retrieve_ratio = best["d2h_copy"] / best["store"], best["h2d_copy"] / best["retrieve"]
    results.update(cuda_device=torch.cuda.get_device_name(), cuda_l1_store_gbps=gbps(total, best["store"]),
                   cuda_l1_retrieve_gbps=gbps(total, best["retrieve"]),
                   cuda_pinned_d2h_gbps=gbps(total, best["d2h_copy"]),
                   cuda_pinned_h2d_gbps=gbps(total, best["h2d_copy"]),
                   cuda_l1_store_vs_pinned_copy_ratio=store_ratio,
                   cuda_l1_retrieve_vs_pinned_copy_ratio=retrieve_ratio)
    print_table(f"CacheEngine L1 on {torch.cuda.get_device_name()}, {num_chunks} chunks x {chunk_bytes // MiB} MiB "
                f"(LBNHC views, block {gpu_block}, pinned arena)",
                [("store (GPU -> L1)", gbps(total, best["store"]), store_ratio),
                 ("retrieve (L1 -> GPU)", gbps(total, best["retrieve"]), retrieve_ratio),
                 ("raw pinned D2H copy", gbps(total, best["d2h_copy"]), 1.0),
                 ("raw pinned H2D copy", gbps(total, best["h2d_copy"]), 1.0)],
                ("operation", "GB/s", "ratio vs raw copy"))


def bench_storage_l1(num_chunks: int, repeats: int, results: dict) -> None:
    """The L1 tier alone, same protocol as the LMCache peer: put = allocate + copy in + index,
    get = lookup + copy out."""
    shape = (LAYERS, 2, CHUNK, KV_HEADS * HEAD_SIZE)
    src = torch.randn((num_chunks, *shape)).to(DTYPE)
    dst = torch.empty_like(src)
    total = src.numel() * DTYPE.itemsize
    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": (total + 64 * MiB) / GiB},
                         environ={})
    builder = KeyBuilder("bench/model", 1, 0, DTYPE, 1, ChunkHasher(CHUNK))
    keys = [k.to_str() for k, _, _ in builder.keys(token_ids(num_chunks * CHUNK))]
    storage = StorageManager(config)

    def put_all():
        for i, key in enumerate(keys):
            obj = storage.allocate(shape, DTYPE)
            obj.tensor.copy_(src[i])
            storage.put(key, obj)
            obj.ref_down()

    def get_all():
        objs = storage.get(keys)
        for i, obj in enumerate(objs):
            dst[i].copy_(obj.tensor)
            obj.ref_down()

    try:
        put_s = best_of(put_all, repeats, setup=storage.clear)
        get_s = best_of(get_all, repeats)
        if not torch.equal(src, dst):
            raise RuntimeError("L1 returned different bytes")
    finally:
        storage.close()
    results.update(l1_put_gbps=gbps(total, put_s), l1_get_gbps=gbps(total, get_s))
    print_table(f"StorageManager L1 alone, {num_chunks} chunks", [("put", gbps(total, put_s)),
                                                                 ("get", gbps(total, get_s))],
                ("operation", "GB/s"))


def compare_with_lmcache(python: str, num_prompts: int, prompt_tokens: int, num_chunks: int,
                         repeats: int, results: dict) -> None:
    peer = run_peer(python, "lmcache_memory_peer.py",
                    ["--prompts", str(num_prompts), "--prompt-tokens", str(prompt_tokens), "--chunk-size", str(CHUNK),
                     "--seed", str(SEED),
                     "--repeats", str(repeats), "--chunks", str(num_chunks), "--layers", str(LAYERS),
                     "--kv-heads", str(KV_HEADS), "--head-size", str(HEAD_SIZE),
                     "--threads", str(torch.get_num_threads())])
    rows = []
    for key, value in peer.items():
        if isinstance(value, (int, float)):
            results[f"lmcache_{key}"] = value
    ours = f"hash_{load_config(environ={}).pre_caching_hash_algorithm}"
    for theirs in ("builtin", "sha256_cbor"):
        for kind in ("list", "tensor"):
            their_rate = peer.get(f"hash_{theirs}_{kind}_tokens_per_s")
            if their_rate:
                ratio = results[f"{ours}_{kind}_tokens_per_s"] / their_rate
                results[f"hash_vs_lmcache_{theirs}_{kind}_ratio"] = ratio
                rows.append((f"hash {kind}: ours {ours[5:]} vs LMCache {theirs}",
                             results[f"{ours}_{kind}_tokens_per_s"] / 1e6, their_rate / 1e6, ratio))
    for op in ("put", "get"):
        ratio = results[f"l1_{op}_gbps"] / peer[f"l1_{op}_gbps"]
        results[f"l1_{op}_vs_lmcache_ratio"] = ratio
        rows.append((f"L1 {op} (GB/s)", results[f"l1_{op}_gbps"], peer[f"l1_{op}_gbps"], ratio))
    print_table("lmcache-vllm vs LMCache 0.5.6 (hash rates in Mtokens/s)", rows,
                ("measure", "ours", "LMCache", "ratio"))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], add_arguments)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    num_chunks = args.chunks or (4 if args.quick else 8)
    num_prompts, prompt_tokens = (16 if args.quick else 64), 4096
    results: dict = {"quick": bool(args.quick), "torch_threads": torch.get_num_threads()}
    bench_hashing(num_prompts, prompt_tokens, repeats * 3, results)
    rounds = args.rounds or repeats
    bench_engine(num_chunks, rounds, results, "vec")
    cpu_kernels(results)
    bench_engine(num_chunks, rounds, results, "amx")
    bench_engine_cuda(num_chunks * 4, repeats, results)
    bench_storage_l1(num_chunks, repeats, results)
    if args.vs_lmcache:
        compare_with_lmcache(args.vs_lmcache, num_prompts, prompt_tokens, num_chunks, repeats, results)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
