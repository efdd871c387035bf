"""Microbenchmark of the KV transfer ops: compiled CPU op vs the layouts' torch fallback vs a plain torch
copy of the same bytes (the baseline, measured in the same run, interleaved round by round so machine
noise hits every contender alike; the best round of each is reported).

Shape (the engine's target case): 32 layers, 8 KV heads, head size 128, bf16, 256 tokens, block 128, for
vLLM's CPU `vec` and `amx` packings; plus a mid-block start (partial blocks at both ends) and a
scattered-slots case (random slots with holes and -1) where the per-token path runs. Then a whole cached
prompt of the medium local model (head size 64, 3840 tokens in 128- or 256-token chunks, whole blocks or
starting 5 tokens into a block) moved as a load and a save move it: every chunk in one call, and one call per
chunk (`one_call_vs_per_chunk_ratio`: how much faster the one call is). On a CUDA machine with
`lmcache_vllm._cuda_ops` built it also times the strided kernel on vLLM's FLASH_ATTN views (LBNHC, block 16)
into device memory and into pinned host memory against a device-to-device copy and a raw pinned copy
(cudaMemcpyAsync) of the same bytes, `calls` back-to-back operations between two CUDA events.

    python benchmarks/bench_ops.py [--quick] [--json FILE] [--threads N] [--isa auto|avx512|avx2|sse2|scalar]
                                   [--clock wall|cpu]
Ratios (`*_ratio`, best rounds; `*_median_ratio`: median of same-round ratios): op_vs_torch = torch time / op time
(target >= 2); op_vs_copy = copy time / op time
(target >= 0.9), for gather (store), scatter (retrieve) and both together.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable

import torch
from _common import add_clock_argument, clock, set_clock

from lmcache_vllm import ops
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views
from lmcache_vllm.layouts import detect_layout


def timed(fn: Callable[[], None], calls: int) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def interleaved(contenders: dict[str, Callable[[], None]], rounds: int, calls: int,
                samples_out: dict[str, list[float]] | None = None) -> dict[str, float]:
    for fn in contenders.values():
        fn()  # warm up: first touch of pages, plan cache
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(timed(fn, calls))
    if samples_out is not None:
        samples_out.update(samples)
    # Best of the rounds: on a shared, noisy machine the minimum is the uncontended speed.
    return {name: min(values) for name, values in samples.items()}


def with_mode(mode: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        previous = ops.mode()
        ops.set_mode(mode)
        try:
            fn()
        finally:
            ops.set_mode(previous)
    return run


def bench_cpu(isa: str, slots_kind: str, rounds: int, calls: int, results: dict) -> None:
    layers, heads, head_size, block_size, tokens, blocks = 32, 8, 128, 128, 256, 64
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(blocks, heads, block_size, 2 * head_size, generator=gen).to(torch.bfloat16)
              for _ in range(layers)]
    if slots_kind == "blocks":
        slots = torch.arange(10 * block_size, 10 * block_size + tokens)
    elif slots_kind == "midblock":  # starts 5 tokens into a block: partial, whole, partial
        slots = torch.arange(10 * block_size + 5, 10 * block_size + 5 + tokens)
    else:
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        slots[::17] = -1
    layout = detect_layout(caches, backend="CPU_ATTN", cpu_isa=isa)
    chunk = torch.empty(layout.chunk_shape(tokens), dtype=torch.bfloat16)
    layout.gather(caches, slots, chunk)
    copy_src, copy_dst = chunk.clone(), torch.empty_like(chunk)
    contenders = {"copy": lambda: copy_dst.copy_(copy_src),
                  "torch_gather": with_mode("torch", lambda: layout.gather(caches, slots, chunk)),
                  "torch_scatter": with_mode("torch", lambda: layout.scatter(chunk, caches, slots))}
    if ops.cpu_ext() is not None:
        contenders["op_gather"] = with_mode("auto", lambda: layout.gather(caches, slots, chunk))
        contenders["op_scatter"] = with_mode("auto", lambda: layout.scatter(chunk, caches, slots))
    samples: dict[str, list[float]] = {}
    t = interleaved(contenders, rounds, calls, samples)
    tag = f"cpu_{isa}_{slots_kind}"
    gib = chunk.numel() * chunk.element_size() / 2**30
    print(f"\n{tag}: {layers} layers x {heads} heads x {head_size} x {tokens} tokens bf16 ({gib * 1024:.0f} MiB)")
    print(f"  {'contender':<15}{'ms':>9}{'GiB/s':>9}")
    for name, seconds in t.items():
        print(f"  {name:<15}{seconds * 1e3:>9.3f}{gib / seconds:>9.2f}")
        results[f"{tag}_{name}_ms"] = round(seconds * 1e3, 4)
    ratios = {"torch_vs_copy_gather_ratio": t["copy"] / t["torch_gather"],
              "torch_vs_copy_scatter_ratio": t["copy"] / t["torch_scatter"],
              "torch_vs_copy_store_retrieve_ratio": 2 * t["copy"] / (t["torch_gather"] + t["torch_scatter"])}
    if "op_gather" in t:
        ratios.update({
            "op_vs_torch_gather_ratio": t["torch_gather"] / t["op_gather"],
            "op_vs_torch_scatter_ratio": t["torch_scatter"] / t["op_scatter"],
            "op_vs_copy_gather_ratio": t["copy"] / t["op_gather"],
            "op_vs_copy_scatter_ratio": t["copy"] / t["op_scatter"],
            "op_vs_copy_store_retrieve_ratio": 2 * t["copy"] / (t["op_gather"] + t["op_scatter"]),
            # Same round only (ours and the copy saw the same machine load), median over the rounds.
            "op_vs_copy_store_retrieve_median_ratio": statistics.median(
                2 * c / (g + s) for c, g, s in zip(samples["copy"], samples["op_gather"], samples["op_scatter"])),
        })
    for name, value in ratios.items():
        print(f"  {name:<40}{value:>7.2f}")
        results[f"{tag}_{name}"] = round(value, 3)


def bench_cpu_load(isa: str, chunk_tokens: int, start: int, rounds: int, calls: int, results: dict) -> None:
    """A whole cached prompt of the medium local model (8 layers, 4 KV heads, head size 64, bf16, block 128): 3840
    tokens in chunks of `chunk_tokens`, as a load scatters them and a save gathers them: every chunk in one
    compiled call (`scatter_chunks` / `gather_chunks`) and, for comparison, one call per chunk. `start`: the
    block offset of the first token (0: whole blocks; else partial blocks at both ends)."""
    layers, heads, head_size, block_size, tokens = 8, 4, 64, 128, 3840
    blocks = tokens // block_size + 2
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(blocks, heads, block_size, 2 * head_size, generator=gen).to(torch.bfloat16)
              for _ in range(layers)]
    slots = torch.arange(start, start + tokens)
    layout = detect_layout(caches, backend="CPU_ATTN", cpu_isa=isa)
    sizes = [chunk_tokens] * (tokens // chunk_tokens)
    chunks = [torch.empty(layout.chunk_shape(n), dtype=torch.bfloat16) for n in sizes]
    layout.gather_chunks(caches, slots, chunks)
    flat = torch.cat([c.flatten() for c in chunks])
    copy_dst = torch.empty_like(flat)
    bounds = [(i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(len(sizes))]

    def each(gather: bool) -> Callable[[], None]:
        def run() -> None:
            for chunk, (a, b) in zip(chunks, bounds):
                if gather:
                    layout.gather(caches, slots[a:b], chunk)
                else:
                    layout.scatter(chunk, caches, slots[a:b])
        return run

    contenders = {"copy": lambda: copy_dst.copy_(flat),
                  "op_gather": with_mode("auto", lambda: layout.gather_chunks(caches, slots, chunks)),
                  "op_scatter": with_mode("auto", lambda: layout.scatter_chunks(chunks, caches, slots)),
                  "op_gather_each": with_mode("auto", each(True)),
                  "op_scatter_each": with_mode("auto", each(False))}
    samples: dict[str, list[float]] = {}
    t = interleaved(contenders, rounds, calls, samples)
    tag = f"cpu_{isa}_head64_chunk{chunk_tokens}" + (f"_start{start}" if start else "")
    gib = flat.numel() * flat.element_size() / 2**30
    print(f"\n{tag}: {layers} layers x {heads} heads x {head_size} x {tokens} tokens bf16 in {len(sizes)} chunks "
          f"({gib * 1024:.0f} MiB)")
    for name, seconds in t.items():
        print(f"  {name:<17}{seconds * 1e3:>9.3f} ms {gib / seconds:>8.2f} GiB/s")
        results[f"{tag}_{name}_ms"] = round(seconds * 1e3, 4)
    ratios = {"op_vs_copy_store_retrieve_ratio": 2 * t["copy"] / (t["op_gather"] + t["op_scatter"]),
              "op_vs_copy_store_retrieve_median_ratio": statistics.median(
                  2 * c / (g + s) for c, g, s in zip(samples["copy"], samples["op_gather"], samples["op_scatter"])),
              "one_call_vs_per_chunk_ratio": (t["op_gather_each"] + t["op_scatter_each"]) /
                                             (t["op_gather"] + t["op_scatter"])}
    for name, value in ratios.items():
        print(f"  {name:<40}{value:>7.2f}")
        results[f"{tag}_{name}"] = round(value, 3)


def bench_cuda(rounds: int, calls: int, results: dict) -> None:
    if not torch.cuda.is_available() or ops.cuda_ext() is None:
        print("\ncuda: skipped (no GPU or lmcache_vllm._cuda_ops not built)")
        results["cuda_skipped"] = True
        return
    tokens = 256
    case = KVViewCase(layout="LBNHC", num_layers=32, num_blocks=1024, block_size=16, num_kv_heads=8,
                      head_size=128)
    dev = torch.device("cuda")
    caches = kv_views(case, dev)
    raw = torch.empty(0, dtype=torch.uint8, device=dev).set_(caches[0].untyped_storage())
    raw.copy_(torch.randint(0, 100, raw.shape, dtype=torch.uint8, device=dev))
    slots = torch.randperm(case.num_blocks * case.block_size)[:tokens]  # host slots, as the connector has them
    layout = detect_layout(caches, **case.describe())
    dev_chunk = torch.empty(layout.chunk_shape(tokens), dtype=torch.bfloat16, device=dev)
    host_chunk = torch.empty(layout.chunk_shape(tokens), dtype=torch.bfloat16, pin_memory=True)
    dev_src, dev_dst = dev_chunk.clone(), torch.empty_like(dev_chunk)

    def on_device(fn):  # `calls` operations back to back, timed by CUDA events, per operation
        def run():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            run.seconds = start.elapsed_time(end) / 1e3 / calls
        return run

    contenders = {"d2d_copy": on_device(lambda: dev_dst.copy_(dev_src)),
                  "pinned_d2h_copy": on_device(lambda: host_chunk.copy_(dev_src, non_blocking=True)),
                  "pinned_h2d_copy": on_device(lambda: dev_dst.copy_(host_chunk, non_blocking=True)),
                  "op_gather_device": on_device(lambda: layout.gather(caches, slots, dev_chunk)),
                  "op_gather_pinned": on_device(lambda: layout.gather(caches, slots, host_chunk)),
                  "op_scatter_device": on_device(lambda: layout.scatter(dev_chunk, caches, slots)),
                  "op_scatter_pinned": on_device(lambda: layout.scatter(host_chunk, caches, slots))}
    for fn in contenders.values():
        fn()  # warm up: layer pointer array, slot upload
    best = {name: float("inf") for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            fn()
            best[name] = min(best[name], fn.seconds)
    nbytes = dev_chunk.numel() * dev_chunk.element_size()
    print(f"\ncuda {torch.cuda.get_device_name()}: strided kernel on LBNHC views, {tokens} random slots, "
          f"{nbytes >> 20} MiB")
    for name, seconds in best.items():
        print(f"  {name:<20}{seconds * 1e3:>9.4f} ms {nbytes / seconds / 1e9:>8.1f} GB/s")
        results[f"cuda_{name}_ms"] = round(seconds * 1e3, 5)
    for op, kind, base in (("gather", "device", "d2d_copy"), ("scatter", "device", "d2d_copy"),
                           ("gather", "pinned", "pinned_d2h_copy"), ("scatter", "pinned", "pinned_h2d_copy")):
        ratio = best[base] / best[f"op_{op}_{kind}"]
        results[f"cuda_{op}_{kind}_vs_copy_ratio"] = round(ratio, 3)
        print(f"  cuda_{op}_{kind}_vs_copy_ratio {ratio:.2f}")
    results["cuda_device"] = torch.cuda.get_device_name()


def bench_cpu_strided(rounds: int, calls: int, results: dict) -> None:
    """The compiled op on a CUDA-style LBNHC view held on the CPU (vLLM's CPU_MLA and tests use this path)."""
    case = KVViewCase(layout="LBNHC", num_layers=32, num_blocks=64, block_size=128, num_kv_heads=8, head_size=128)
    caches = fill_known(kv_views(case), case)
    slots = torch.arange(10 * 128, 10 * 128 + 256)
    layout = detect_layout(caches, **case.describe())
    chunk = torch.empty(layout.chunk_shape(256), dtype=torch.bfloat16)
    copy_src, copy_dst = chunk.clone(), torch.empty_like(chunk)
    contenders = {"copy": lambda: copy_dst.copy_(copy_src),
                  "op_gather": with_mode("auto", lambda: layout.gather(caches, slots, chunk)),
                  "op_scatter": with_mode("auto", lambda: layout.scatter(chunk, caches, slots))}
    t = interleaved(contenders, rounds, calls)
    ratio = 2 * t["copy"] / (t["op_gather"] + t["op_scatter"])
    results["cpu_strided_lbnhc_op_vs_copy_store_retrieve_ratio"] = round(ratio, 3)
    print(f"\ncpu strided LBNHC views: gather {t['op_gather'] * 1e3:.3f} ms, scatter {t['op_scatter'] * 1e3:.3f} ms, "
          f"copy {t['copy'] * 1e3:.3f} ms, store+retrieve vs copy {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    parser.add_argument("--json", metavar="FILE", help="write one flat JSON object of results")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--isa", default="auto", help="compiled CPU kernels: auto, avx512, avx2, sse2 or scalar")
    add_clock_argument(parser)
    args = parser.parse_args(argv)
    set_clock(args.clock)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, calls = (7, 3) if args.quick else (21, 5)
    results: dict[str, object] = {"threads": torch.get_num_threads(), "cpu_ext": ops.cpu_ext() is not None,
                                  "clock": args.clock}
    if ops.cpu_ext() is not None:
        error = ops.cpu_ext().set_isa(args.isa)
        if error:
            parser.error(error)
        results["cpu_isa"] = ops.cpu_ext().isa()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compiled CPU op: {results['cpu_ext']} "
          f"(kernels: {results.get('cpu_isa')}), {args.clock} clock")
    for isa in ("vec", "amx"):
        bench_cpu(isa, "blocks", rounds, calls, results)
    bench_cpu("vec", "midblock", max(3, rounds // 2), calls, results)
    bench_cpu("amx", "midblock", max(3, rounds // 2), calls, results)
    for isa in ("vec", "amx"):
        for chunk_tokens, start in ((128, 0), (256, 0), (256, 5)):
            bench_cpu_load(isa, chunk_tokens, start, max(3, rounds // 2), calls, results)
    bench_cpu("vec", "scattered", max(3, rounds // 2), 1, results)
    if ops.cpu_ext() is not None:
        bench_cpu_strided(max(3, rounds // 2), calls, results)
    bench_cuda(rounds, calls, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
