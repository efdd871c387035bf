"""First-touch cost of the L1 arena, and what `prefault_local_cpu: sync` pays at start-up to avoid it.

A fresh host arena (as `HostAllocator` reserves it) gets physical pages only when first written; in a VM
that backs guest memory lazily that first write is far slower than a write into pages already backed.
Measured here, each on a fresh arena of the same size: copy a source tensor into untouched memory
(what a store of new data pays without prefaulting), populate with `ArenaPrefaulter` (what `sync` pays at
start-up, seconds per GiB), then copy into the populated arena (the baseline: touched memory). Prints
`touched_over_first_touch_ratio` (how many times faster the store is once the arena is backed).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402

from lmcache_vllm.memory import HostAllocator  # noqa: E402
from lmcache_vllm.memory.prefault import ArenaPrefaulter  # noqa: E402


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    gib = 0.25 if args.quick else 1.0
    nbytes = int(gib * (1 << 30))
    torch.set_num_threads(1)  # the save thread copies on one core
    src = torch.ones(nbytes, dtype=torch.uint8)

    fresh = HostAllocator(nbytes, pin_memory=False).arena
    first_touch_s = _common.time_once(lambda arena=fresh: arena.copy_(src))
    del fresh

    arena = HostAllocator(nbytes, pin_memory=False).arena
    prefaulter = ArenaPrefaulter(arena, background=False)
    populate_s = prefaulter.seconds
    touched_s = _common.best_of(lambda: arena.copy_(src), repeats=3)

    res = {"cpu": _common.cpu_model(), "arena_gib": gib,
           "first_touch_copy_gbps": _common.gbps(nbytes, first_touch_s),
           "touched_copy_gbps": _common.gbps(nbytes, touched_s),
           "prefault_sync_s_per_gib": populate_s / gib if prefaulter.error is None else None,
           "touched_over_first_touch_ratio": first_touch_s / touched_s}
    _common.print_table(f"L1 arena of {gib} GiB on {res['cpu']}", [
        ("copy into untouched pages", f"{res['first_touch_copy_gbps']:.2f} GB/s"),
        ("prefault (sync), per GiB", f"{populate_s / gib:.2f} s" if prefaulter.error is None
         else f"unavailable (errno {prefaulter.error})"),
        ("copy into populated pages", f"{res['touched_copy_gbps']:.2f} GB/s")], ("what", "figure"))
    print(f"touched_over_first_touch_ratio: {res['touched_over_first_touch_ratio']:.2f}")
    _common.write_json(args.json, res)


if __name__ == "__main__":
    main()
