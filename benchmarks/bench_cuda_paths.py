"""The two ways a GPU's KV reaches the L1 chunk, timed in one run: the CUDA kernel path and the torch path
with its device staging chunk (gather into staging, one copy into host memory; scatter from a staging copy).

On the CPU (what CI and this machine have) both run on CPU tensors: the torch path exactly as on a GPU
(`layout.stage_on_cpu`), the kernel as its source compiled for the host (`testing.cuda_host`: one host
thread walks the grid, so its time says nothing about a GPU; it is the same-run baseline the issue asks
for), next to the torch path without staging, the compiled CPU op on the same views and a plain copy of
the chunk's bytes. On a GPU with `lmcache_vllm._cuda_ops` it times the real kernel into device and pinned
memory against the staged torch path into pinned memory and a raw pinned copy, per call between CUDA events.

Shape: vLLM's FLASH_ATTN default (LBNHC views, block 16), 32 layers x 8 KV heads x head 128, bf16, 256
random slots (whole blocks in random order).

    python benchmarks/bench_cuda_paths.py [--quick] [--json FILE]

Ratios (> 1: the first named is faster): staged_vs_kernel = kernel time / staged torch time;
staging_cost = direct torch time / staged torch time (<= 1); op_vs_staged = staged time / CPU op time.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from _common import cpu_model, parse_args, write_json  # (importing it puts the repo on sys.path)
from bench_ops import interleaved, with_mode

from lmcache_vllm import ops
from lmcache_vllm.integration.vllm.testing.kv_views import KVViewCase, fill_known, kv_views
from lmcache_vllm.layouts import detect_layout

CASE = KVViewCase(layout="LBNHC", num_layers=32, num_blocks=256, block_size=16, num_kv_heads=8, head_size=128)
TOKENS = 256


def _slots() -> torch.Tensor:
    blocks = torch.randperm(CASE.num_blocks, generator=torch.Generator().manual_seed(0))[:TOKENS // CASE.block_size]
    return torch.cat([torch.arange(b * CASE.block_size, (b + 1) * CASE.block_size) for b in blocks.tolist()])


def _staged(layout, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        layout.stage_on_cpu = True
        try:
            fn()
        finally:
            layout.stage_on_cpu = False
    return run


def bench_cpu(rounds: int, calls: int, results: dict) -> None:
    views = fill_known(kv_views(CASE), CASE)
    layout = detect_layout(views, **CASE.describe())
    slots = _slots()
    chunk = torch.empty(layout.chunk_shape(TOKENS), dtype=CASE.dtype)
    copy_src, copy_dst = chunk.clone(), torch.empty_like(chunk)
    torch_path = {
        "torch_direct_gather": lambda: layout.torch_transfer(True, views, slots, chunk),
        "torch_direct_scatter": lambda: layout.torch_transfer(False, views, slots, chunk),
        "torch_staged_gather": _staged(layout, lambda: layout.torch_transfer(True, views, slots, chunk)),
        "torch_staged_scatter": _staged(layout, lambda: layout.torch_transfer(False, views, slots, chunk)),
    }
    contenders: dict[str, Callable[[], None]] = {"copy": lambda: copy_dst.copy_(copy_src), **torch_path}
    try:
        from lmcache_vllm.integration.vllm.testing.cuda_host import HostKernelUnavailable, host_kernel
        kernel = host_kernel("as_built").with_chunk_path(True)  # the pinned-chunk path
        contenders["cuda_kernel_host_gather"] = lambda: layout.kernel_transfer(kernel, True, views, slots, chunk)
        contenders["cuda_kernel_host_scatter"] = lambda: layout.kernel_transfer(kernel, False, views, slots, chunk)
    except HostKernelUnavailable as exc:
        print(f"cuda kernel on the host: skipped ({exc})")
    if ops.cpu_ext() is not None:
        contenders["cpu_op_gather"] = with_mode("auto", lambda: layout.gather(views, slots, chunk))
        contenders["cpu_op_scatter"] = with_mode("auto", lambda: layout.scatter(chunk, views, slots))
    t = interleaved(contenders, rounds, calls)
    nbytes = chunk.numel() * chunk.element_size()
    print(f"\ncpu, {torch.get_num_threads()} threads: {CASE}, {TOKENS} slots, {nbytes >> 20} MiB per chunk")
    for name, seconds in t.items():
        print(f"  {name:<26}{seconds * 1e3:>10.3f} ms{nbytes / seconds / 1e9:>8.2f} GB/s")
        results[f"cpu_{name}_ms"] = round(seconds * 1e3, 4)
    ratios = {}
    for op in ("gather", "scatter"):
        ratios[f"cpu_{op}_staging_cost_ratio"] = t[f"torch_direct_{op}"] / t[f"torch_staged_{op}"]
        if f"cuda_kernel_host_{op}" in t:
            ratios[f"cpu_{op}_staged_vs_kernel_ratio"] = t[f"cuda_kernel_host_{op}"] / t[f"torch_staged_{op}"]
        if f"cpu_op_{op}" in t:
            ratios[f"cpu_{op}_op_vs_staged_ratio"] = t[f"torch_staged_{op}"] / t[f"cpu_op_{op}"]
    for name, value in ratios.items():
        print(f"  {name:<40}{value:>7.2f}")
        results[name] = round(value, 3)


def bench_cuda(rounds: int, calls: int, results: dict) -> None:
    ext = ops.cuda_ext()
    if ext is None:
        print("\ncuda: skipped (no GPU or lmcache_vllm._cuda_ops not built)")
        results["cuda_skipped"] = True
        return
    dev = torch.device("cuda")
    views = fill_known(kv_views(CASE, dev), CASE)
    layout = detect_layout(views, **CASE.describe())
    slots = _slots()
    dev_chunk = torch.empty(layout.chunk_shape(TOKENS), dtype=CASE.dtype, device=dev)
    pinned = torch.empty(layout.chunk_shape(TOKENS), dtype=CASE.dtype).pin_memory()

    def per_call(fn: Callable[[], None]):
        def run() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()  # the staged path's copy runs on the copy stream
            return start.elapsed_time(end) / 1e3 / calls
        return run

    contenders = {
        "pinned_d2h_copy": per_call(lambda: pinned.copy_(dev_chunk, non_blocking=True)),
        "kernel_gather_device": per_call(lambda: layout.kernel_transfer(ext, True, views, slots, dev_chunk)),
        "kernel_gather_pinned": per_call(lambda: layout.kernel_transfer(ext, True, views, slots, pinned)),
        "torch_staged_gather_pinned": per_call(lambda: layout.torch_transfer(True, views, slots, pinned)),
        "kernel_scatter_pinned": per_call(lambda: layout.kernel_transfer(ext, False, views, slots, pinned)),
        "torch_staged_scatter_pinned": per_call(lambda: layout.torch_transfer(False, views, slots, pinned)),
    }
    best = {name: min(fn() for _ in range(rounds)) for name, fn in contenders.items()}
    nbytes = dev_chunk.numel() * dev_chunk.element_size()
    print(f"\ncuda {torch.cuda.get_device_name()}: {CASE}, {TOKENS} slots, {nbytes >> 20} MiB per chunk")
    for name, seconds in best.items():
        print(f"  {name:<30}{seconds * 1e3:>10.4f} ms{nbytes / seconds / 1e9:>8.1f} GB/s")
        results[f"cuda_{name}_ms"] = round(seconds * 1e3, 5)
    ratios = {f"cuda_{op}_staged_vs_kernel_ratio": best[f"kernel_{op}_pinned"] / best[f"torch_staged_{op}_pinned"]
              for op in ("gather", "scatter")}
    ratios["cuda_gather_kernel_pinned_vs_copy_ratio"] = best["pinned_d2h_copy"] / best["kernel_gather_pinned"]
    ratios["cuda_gather_staged_vs_copy_ratio"] = best["pinned_d2h_copy"] / best["torch_staged_gather_pinned"]
    for name, value in ratios.items():
        print(f"  {name:<44}{value:>7.2f}")
        results[name] = round(value, 3)
    results["cuda_device"] = torch.cuda.get_device_name()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    rounds, calls = (5, 2) if args.quick else (11, 3)
    results: dict[str, object] = {"threads": torch.get_num_threads(), "cpu_ext": ops.cpu_ext() is not None,
                                  "cpu": cpu_model()}
    print(f"{results['cpu']}, torch {torch.__version__}")
    with torch.no_grad():
        bench_cpu(rounds, calls, results)
        bench_cuda(rounds, calls, results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
