"""The CUDA kernel against the layouts' torch path (`lmcache_vllm.integration.vllm.testing.cuda_cases`), and the device
self-check on every layout.

    python scripts/check_cuda_kernels.py                       # the kernel source built for the host (CI)
    python scripts/check_cuda_kernels.py --build wrong         # a deliberately wrong build: must fail
    python scripts/check_cuda_kernels.py --device cuda         # the real kernel (lmcache_vllm._cuda_ops)
    python scripts/check_cuda_kernels.py --self-check [--device cuda]

The comparison prints one line, `cuda kernels on host: P/T cases match the torch path` (on a GPU: `on
<device name>`), after the cases that differed, and exits 1 unless P = T. `--self-check` runs
`PagedKVLayout.bind_kernel` (what the connector runs at registration) on vLLM's views of every
`KVCacheLayout`, KV and MLA, bf16 and fp8, prints each verdict and exits 1 unless the kernel was chosen
for every one. `--json FILE` writes the results; `--cases TEXT...` keeps the cases whose name contains one.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lmcache_vllm import ops  # noqa: E402
from lmcache_vllm.integration.vllm.testing.cuda_cases import build_views, kernel_cases, run_case, unit_bytes  # noqa: E402
from lmcache_vllm.integration.vllm.testing.kv_views import LAYOUTS, KVViewCase, fill_known  # noqa: E402
from lmcache_vllm.layouts import detect_layout  # noqa: E402


def the_kernel(device: str, build: str):
    if device == "cpu":
        from lmcache_vllm.integration.vllm.testing.cuda_host import host_kernel
        return lambda variant: host_kernel(build if build != "as_built" else variant)
    ext = ops.cuda_ext()
    if ext is None:
        raise SystemExit("no CUDA device or lmcache_vllm._cuda_ops not built (python setup.py build_ext --inplace)")
    return lambda variant: ext  # the device build is the only one; small_grid cases run it as built


def compare(args) -> int:
    kernel_for = the_kernel(args.device, args.build)
    cases = [case for case in kernel_cases() if not args.cases or any(part in str(case) for part in args.cases)]
    results, failed = [], 0
    units: collections.Counter[int] = collections.Counter()
    start = time.perf_counter()
    for i, case in enumerate(cases):
        kernel = kernel_for(case.variant)
        try:
            problem = run_case(case, kernel, args.device, seed=i)
        except Exception as exc:  # a crash of one case is that case's failure, reported like a mismatch
            problem = f"raised {type(exc).__name__}: {exc}"
        if args.device == "cpu":
            units[unit_bytes(case, kernel)] += 1
        if problem is not None:
            failed += 1
            print(f"MISMATCH {case}: {problem}")
        results.append({"case": str(case), "what": list(case.what), "ok": problem is None, "problem": problem})
    where = "host" if args.device == "cpu" else torch.cuda.get_device_name()
    passed = len(cases) - failed
    if units:
        print(f"[check-cuda] unit widths exercised (bytes: cases): {dict(sorted(units.items()))}")
    print(f"[check-cuda] {len(cases)} cases in {time.perf_counter() - start:.1f} s "
          f"(kernel build: {args.build if args.device == 'cpu' else 'nvcc'})")
    print(f"cuda kernels on {where}: {passed}/{len(cases)} cases match the torch path")
    _write(args.json, {"where": where, "build": args.build, "passed": passed, "total": len(cases), "cases": results})
    return 0 if passed == len(cases) else 1


def self_check(args) -> int:
    """`bind_kernel` on every layout, as the connector runs it at registration."""
    device = torch.device(args.device)
    ext = None
    if device.type == "cpu":
        from lmcache_vllm.integration.vllm.testing.cuda_host import host_kernel
        ext = host_kernel(args.build)
    verdicts, chosen = [], 0
    for name in LAYOUTS:
        for mla in (False, True):
            for dtype in (torch.bfloat16, torch.uint8):
                view = KVViewCase(layout=name, mla=mla, dtype=dtype, head_size=576 if mla else 128,
                                  num_kv_heads=8, num_layers=4, num_blocks=32, block_size=16)
                caches = fill_known(build_views(view, device), view)
                layout = detect_layout(caches, **view.describe())
                verdict = layout.bind_kernel(caches, "auto", ext)
                chosen += verdict.use_kernel
                print(f"{'kernel' if verdict.use_kernel else 'TORCH '} {view}: {verdict.reason}")
                verdicts.append({"case": str(view), "use_kernel": verdict.use_kernel, "reason": verdict.reason})
    where = "host" if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"cuda kernel self-check on {where}: kernel chosen for {chosen}/{len(verdicts)} layouts")
    _write(args.json, {"where": where, "chosen": chosen, "total": len(verdicts), "verdicts": verdicts})
    return 0 if chosen == len(verdicts) else 1


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its config warns about CPU block sizes per case
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: the kernel source built for the host; cuda: the real kernel on a GPU")
    parser.add_argument("--build", default="as_built", choices=("as_built", "small_grid", "wrong"),
                        help="host build for every case (default: as nvcc builds it, small_grid where a case asks)")
    parser.add_argument("--self-check", action="store_true", help="the device self-check on every layout")
    parser.add_argument("--cases", nargs="*", metavar="TEXT", help="only the cases whose name contains one of these")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    return self_check(args) if args.self_check else compare(args)


if __name__ == "__main__":
    sys.exit(main())
