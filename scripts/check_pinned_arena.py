"""Checks on a CUDA host that the L1 arena pins exactly the asked size (issue #11: `max_local_cpu_size: 5`
must lock 5 GiB, not the 8 GiB PyTorch's power-of-two host allocator took).

    python scripts/check_pinned_arena.py [--gib 5]

Prints VmRSS / VmLck / VmPin growth (from /proc/self/status) and PyTorch's host allocator use; exits 1 if
the arena is not registered pinned memory or more than the asked size (+ a page, the process's noise and the
driver's bookkeeping for the registered pages, at most 64 MiB + 1/32 of the size) became resident.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lmcache_vllm.config import load_config  # noqa: E402
from lmcache_vllm.memory import HostAllocator  # noqa: E402
from lmcache_vllm.memory.pinned import PAGE  # noqa: E402


def status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                if line.split(":")[0] in ("VmRSS", "VmLck", "VmPin")}


def host_allocator_bytes() -> int:
    stats = getattr(torch.cuda.memory, "host_memory_stats", lambda: {})()
    return int(stats.get("reserved_bytes.all.current", stats.get("allocated_bytes.all.current", 0)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=5.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the arena is not pinned on this host (nothing to check)")
        return 0
    torch.cuda.init()
    size = load_config({"max_local_cpu_size": args.gib}, environ={}).max_local_cpu_bytes
    before, host_before = status(), host_allocator_bytes()
    alloc = HostAllocator(size, pin_memory=True)
    after, host_after = status(), host_allocator_bytes()
    grown = {key: after[key] - before.get(key, 0) for key in after}
    result = {"asked_bytes": size, "arena_bytes": alloc.arena.numel(), "registered": alloc.pinned_arena,
              "is_pinned": alloc.arena.is_pinned(), "torch_host_allocator_growth": host_after - host_before,
              **{f"{key}_growth": value for key, value in grown.items()}}
    print(json.dumps(result, indent=1))
    # Beyond the arena the process grows by its own noise and by what registering the pages costs the driver:
    # 95 MiB in all for 5 GiB on the H200 host of 2026-11-30 (not broken down further). That stays far below
    # what the bug took (the next power of two: 8 GiB for 5).
    overhead = (64 << 20) + size // 32
    ok = alloc.pinned_arena and alloc.arena.is_pinned() and host_after == host_before \
        and size - PAGE <= grown["VmRSS"] <= size + PAGE + overhead
    print("OK: exactly the asked size is pinned" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
