"""The connector's own work on vLLM's step thread for a cached request, outside vLLM: what a hit and a store cost.

    python benchmarks/bench_hit_path.py [--quick] [--json FILE] [--rounds N]

The medium local model's geometry (8 layers, 4 KV heads, head size 64, bf16, vLLM's CPU `vec` packing, block 128),
a 3900-token prompt stored in L1 and asked for again (3840 tokens loaded, 30 chunks of 128), through the worker's
real `LoadPipeline` (lookup, load planning, copies) twice in the same process, rounds interleaved:
- `inline`: the load copies every layer before the forward (`overlap_loads: off`);
- `overlapped`: the load thread copies layer by layer beside the forward (`overlap_loads: on`); this process's
  thread is bound to the first CPU and our background threads to the others, as for an engine bound to core 0.
Before each layer's wait a stand-in for the forward's work on that layer runs (`--layer-ms`, default 1 ms of matmuls:
a conservative stand-in, the medium model's cached step spends ~12 ms per layer), so the load thread has time to
copy. Reported per hit: the step thread's time in the connector (lookup + starting the load + waiting
for layers), against a plain torch copy of the same bytes measured in the same rounds (what an inline load cannot
go below). `overlapped_vs_inline_step_ratio` < 1: the step gives less of its time to a hit.

Then stores into a full L1 (every store evicts, as in a server that ran a while): a 30-chunk store's time against
the compiled gather of the same chunks alone (`full_l1_store_vs_gather_ratio`: what allocation, eviction and
indexing add; before the eviction walk was bounded it was ~3.4x here).
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch
from _common import parse_args, print_table, write_json

from lmcache_vllm.config import load_config
from lmcache_vllm.cpu_affinity import set_background_cpus
from lmcache_vllm.engine import CacheEngine
from lmcache_vllm.integration.vllm.load_pipeline import LoadPipeline
from lmcache_vllm.integration.vllm.lookup import LookupQuery
from lmcache_vllm.integration.vllm.metadata import LMCacheConnectorMetadata, LoadSpec
from lmcache_vllm.layouts import detect_layout
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

LAYERS, HEADS, HEAD, BLOCK, PROMPT, CHUNK = 8, 4, 64, 128, 3900, 128
DTYPE = torch.bfloat16


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 40, --quick 10)")
    parser.add_argument("--layer-ms", type=float, default=1.0, help="the forward's stand-in work per layer (ms)")


def bind() -> str:
    """This thread on the first CPU, our background threads on the others (as for vLLM bound to core 0)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return f"one CPU ({cpus[0]}): the load thread shares it"
    os.sched_setaffinity(0, {cpus[0]})
    set_background_cpus(cpus[1:])
    return f"step thread on CPU {cpus[0]}, background threads on {cpus[1:]}"


def make_engine(l1_gib: float) -> tuple[CacheEngine, list[torch.Tensor]]:
    blocks = PROMPT // BLOCK + 8
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(blocks, HEADS, BLOCK, 2 * HEAD, generator=gen).to(DTYPE) for _ in range(LAYERS)]
    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": l1_gib}, environ={})
    layout = detect_layout(caches, backend="CPU_ATTN", cpu_isa="vec")
    keys = KeyBuilder("bench/model", 1, 0, DTYPE, 1, ChunkHasher(CHUNK, config.pre_caching_hash_algorithm))
    return CacheEngine(config, layout, keys), caches


def layer_work(ms: float):
    """A function that computes for about `ms` milliseconds (matmuls, the GIL let go as in the forward's ops)."""
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    repeat = max(1, round(ms * 1e-3 / per))
    return lambda: [a @ a for _ in range(repeat)]


def bench_hits(rounds: int, layer_ms: float, results: dict) -> None:
    engine, caches = make_engine(0.5)
    tokens = np.random.default_rng(1).integers(0, 30000, PROMPT)
    block_ids = list(range(2, 2 + -(-PROMPT // BLOCK)))
    slots = torch.tensor([block_ids[i // BLOCK] * BLOCK + i % BLOCK for i in range(PROMPT)])
    engine.store(tokens, caches, slots)
    hit = PROMPT // CHUNK * CHUNK
    names = {f"layer.{i}": i for i in range(LAYERS)}
    pipes = {mode: LoadPipeline(engine, caches, names, block_size=BLOCK, use_layerwise=False, timeout_s=5.0,
                                overlap=mode == "overlapped") for mode in ("inline", "overlapped")}
    work = layer_work(layer_ms)
    flat = torch.randn(LAYERS * 2 * hit * HEADS * HEAD).to(DTYPE)
    flat_out = torch.empty_like(flat)
    count = [0]

    def one_hit(pipe: LoadPipeline) -> float:
        count[0] += 1
        req = f"r{count[0]}"
        t0 = time.perf_counter()
        pipe.lookup(LookupQuery(req, tokens, 0))
        pipe.begin_step()
        pipe.start(LMCacheConnectorMetadata(loads=[LoadSpec(req_id=req, token_ids=tokens[:hit], block_ids=block_ids,
                                                            skip_leading=0, load_end=hit)]), False)
        spent = time.perf_counter() - t0
        for name in names:
            work()  # the forward's work before this layer's attention
            t1 = time.perf_counter()
            pipe.wait_for_layer(name)
            spent += time.perf_counter() - t1
        pipe.finish_layers()
        if pipe.take_load_errors():
            raise RuntimeError("a load failed")
        return spent

    samples: dict[str, list[float]] = {"inline": [], "overlapped": [], "copy": []}
    try:
        for round_ in range(rounds + 2):  # two warm-up rounds
            for mode, pipe in pipes.items():
                seconds = one_hit(pipe)
                if round_ >= 2:
                    samples[mode].append(seconds)
            t0 = time.perf_counter()
            flat_out.copy_(flat)
            if round_ >= 2:
                samples["copy"].append(time.perf_counter() - t0)
    finally:
        for pipe in pipes.values():
            pipe.close()
        engine.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    results.update({f"hit_step_{k}_ms": v * 1e3 for k, v in med.items()},
                   overlapped_vs_inline_step_ratio=med["overlapped"] / med["inline"],
                   overlapped_vs_inline_step_median_ratio=statistics.median(
                       o / i for o, i in zip(samples["overlapped"], samples["inline"])),
                   inline_step_vs_copy_ratio=med["inline"] / med["copy"])
    print_table(f"step thread per hit, {hit} tokens from L1 ({LAYERS} layers x {HEADS} heads x {HEAD}, bf16), "
                f"medians of {rounds} rounds", [
                    ("inline: lookup + load before the forward", med["inline"] * 1e3),
                    ("overlapped: lookup + plan + waits for the load thread", med["overlapped"] * 1e3),
                    ("plain copy of the same bytes (baseline)", med["copy"] * 1e3)], ("case", "ms"))


def bench_full_l1_store(rounds: int, results: dict) -> None:
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * HEAD * DTYPE.itemsize
    engine, caches = make_engine(600 * chunk_bytes / (1 << 30))  # ~600 chunks: a full L1 of a small server
    block_ids = list(range(2, 2 + -(-PROMPT // BLOCK)))
    slots = torch.tensor([block_ids[i // BLOCK] * BLOCK + i % BLOCK for i in range(PROMPT)])
    rng = np.random.default_rng(2)
    hit = PROMPT // CHUNK * CHUNK
    outs = [torch.empty(engine.layout.chunk_shape(CHUNK), dtype=DTYPE) for _ in range(hit // CHUNK)]
    stores, gathers = [], []
    try:
        for _ in range(25):  # fill L1: from now on every store evicts
            engine.store(rng.integers(0, 30000, PROMPT), caches, slots)
        for _ in range(rounds):
            prompt = rng.integers(0, 30000, PROMPT)
            t0 = time.perf_counter()
            engine.store(prompt, caches, slots)
            stores.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.layout.gather_chunks(caches, slots[:hit], outs)
            gathers.append(time.perf_counter() - t0)
        evictions = engine.storage.l1.allocator.num_evictions
    finally:
        engine.close()
    store, gather = statistics.median(stores), statistics.median(gathers)
    results.update(full_l1_store_ms=store * 1e3, full_l1_gather_ms=gather * 1e3,
                   full_l1_store_vs_gather_ratio=store / gather)
    print_table(f"a {hit // CHUNK}-chunk store into a full L1 ({evictions} evictions, medians of {rounds})",
                [("store (hash, allocate + evict, gather, index)", store * 1e3),
                 ("compiled gather alone", gather * 1e3)], ("case", "ms"))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], add_arguments)
    torch.set_num_threads(1)
    rounds = args.rounds or (10 if args.quick else 40)
    results: dict = {"binding": bind()}
    print(results["binding"])
    bench_hits(rounds, args.layer_ms, results)
    bench_full_l1_store(rounds, results)
    for key, value in results.items():
        if key.endswith("_ratio"):
            print(f"{key} = {value:.3f}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
