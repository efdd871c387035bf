"""Benchmark: a page round trip through SGLang's own cache controller into our disk or Redis tier, against SGLang's
own `HiCacheFile` backend on the same pages (lmcache_vllm/integration/sglang, docs/SGLANG.md).

Everything but the backend is the same in every configuration: SGLang 0.5.23's real `HiCacheController` with its
backup and prefetch threads, one real `MHATokenToKVPoolHost` (`page_first`, SGLang's default layout) with random
bytes, the same pages under the same page hashes (SGLang's native hash), in one process:
- `file`: SGLang's `HiCacheFile` (`--hicache-storage-backend file`): one file per page, buffered writes, no
  checksum; SGLang drives it through its generic flat-page calls (it has no v1 calls);
- `ours_disk`: `LMCacheHiCacheStorage`, v1 calls, `local_disk` (O_DIRECT writes of checksummed chunk files, the
  default);
- `ours_disk_buffered`: the same with `disk_direct_io: false` (buffered writes, like HiCacheFile's);
- `ours_redis`: the same with `remote_url` (a redis-server started here on loopback).
One round: a new prompt of `--pages` pages is backed up (`write_storage` to its ack), then prefetched into other
host slots (the hit query, the read, the acks); the pages read are checked bit for bit. "cold": before the
prefetch the page cache drops both directories' files (fsync + POSIX_FADV_DONTNEED), as after their host copy
was evicted long ago; "warm": not (buffered writes leave the pages in the page cache, O_DIRECT writes do not:
`ours_disk_buffered` is the like-with-like of HiCacheFile there). Times are medians over `--rounds` rounds after
one untimed.

Ratios (`*_ratio`) are HiCacheFile's time over ours: > 1 means ours is faster. The goal: a round trip into our disk
or Redis tier within 1.2x of HiCacheFile's time, i.e. a ratio >= 0.83.

    python benchmarks/bench_sglang.py --quick            # 1 MiB pages, 32 per round (a few minutes)
    python benchmarks/bench_sglang.py --json bench_out/sglang.json   # 8 MiB pages, 64 per round
"""
from __future__ import annotations

import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests"))
import sglang_support as S  # noqa: E402  (SGLang's classes on a CPU, its torchvision stand-in)
import torch  # noqa: E402


def add_arguments(parser) -> None:
    parser.add_argument("--pages", type=int, default=None, help="pages per round (default 64; --quick 32)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --quick 3)")
    parser.add_argument("--dir", default=None, help="directory of both disk tiers (default: a temp dir under /tmp)")


def drop_cache(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, "**", "*"), recursive=True):
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(ctl: S.Controller, pages: int, rounds: int, seed: int, cold_dir: str | None) -> dict[str, float]:
    """Median backup and prefetch seconds of `rounds` rounds (after one untimed)."""
    pool = ctl.pool
    backups, prefetches = [], []
    for r in range(rounds + 1):
        tokens = [(seed * 1_000_003 + r * 7919 + i) % 30000 + 1 for i in range(pages * pool.page_size)]
        hashes = S.page_hashes(tokens, page=pool.page_size)
        src = pool.alloc(len(tokens))
        want = S.pages_of(pool, src)
        t0 = time.perf_counter()
        done = ctl.backup(src, hashes)
        t1 = time.perf_counter()
        if done != len(tokens):
            raise SystemExit(f"backup stored {done} of {len(tokens)} tokens")
        pool.free(src)
        if cold_dir is not None:
            drop_cache(cold_dir)
        t2 = time.perf_counter()
        read, dst = ctl.prefetch(tokens, rid=f"r{seed}-{r}")
        t3 = time.perf_counter()
        if read != len(tokens) or not all(torch.equal(a, b) for a, b in zip(want, S.pages_of(pool, dst))):
            raise SystemExit(f"prefetch read {read} of {len(tokens)} tokens, or other bytes")
        pool.free(dst)
        if r:
            backups.append(t1 - t0)
            prefetches.append(t3 - t2)
    backup, prefetch = statistics.median(backups), statistics.median(prefetches)
    return {"backup_s": backup, "prefetch_s": prefetch, "round_trip_s": backup + prefetch}


def main() -> None:
    args = _common.parse_args(__doc__.split("\n")[0], add_arguments)
    pages = args.pages or (32 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 5)
    layers, page = (8, 32) if args.quick else (32, 64)
    S.import_sglang()
    pool = S.mha_pool("page_first", layers=layers, heads=8, head_dim=128, page=page,
                      device_tokens=pages * page * 2, ratio=1.5)
    page_bytes = pool.get_data_page(0, flat=False).numel() * pool.dtype.itemsize
    root = tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir)
    redis_proc, redis_url = _common.start_redis(root)
    print(f"SGLang page round trips: {pages} pages of {page_bytes / 2**20:.1f} MiB per round, {rounds} rounds; "
          f"CPU: {_common.cpu_model()}; directory {root}")
    ours = {"local_cpu": False, "max_local_disk_size": 64, "blocking_timeout_secs": 120,
            "extra_config": {"staging_buffer_size": 2 * pages * page_bytes / 2**30}}
    configs = {
        "file": ("file", {"file_storage_path": os.path.join(root, "file")}),
        "ours_disk": ("dynamic", S.dynamic({**ours, "local_disk": os.path.join(root, "disk")})),
        "ours_disk_buffered": ("dynamic", S.dynamic({**ours, "local_disk": os.path.join(root, "buffered"),
                                                     "extra_config": {**ours["extra_config"],
                                                                      "disk_direct_io": False}})),
        "ours_redis": ("dynamic", S.dynamic({**ours, "remote_url": redis_url})),
    }
    results: dict[str, float] = {"pages": pages, "page_bytes": page_bytes}
    try:
        for mode in ("cold", "warm"):
            for seed, (name, (backend, extra)) in enumerate(configs.items()):
                ctl = S.Controller(pool, extra, backend=backend, layers=layers)
                try:
                    cold_dir = root if mode == "cold" and name != "ours_redis" else None
                    got = measure(ctl, pages, rounds, seed + (10 if mode == "warm" else 0), cold_dir)
                finally:
                    ctl.close()
                for key, value in got.items():
                    results[f"{mode}_{name}_{key}"] = value
                results[f"{mode}_{name}_round_trip_gbps"] = 2 * pages * page_bytes / got["round_trip_s"] / 1e9
        rows = []
        for mode in ("cold", "warm"):
            for name in configs:
                rows.append((mode, name, *(results[f"{mode}_{name}_{k}"] * 1000 for k in
                                          ("backup_s", "prefetch_s", "round_trip_s")),
                             results[f"{mode}_{name}_round_trip_gbps"]))
                if name != "file":
                    for part in ("backup", "prefetch", "round_trip"):
                        results[f"{mode}_{name}_{part}_vs_file_ratio"] = \
                            results[f"{mode}_file_{part}_s"] / results[f"{mode}_{name}_{part}_s"]
        _common.print_table("median per round (ms); GB/s = bytes moved both ways / round trip", rows,
                            ("pages", "backend", "backup ms", "prefetch ms", "round trip ms", "GB/s"))
        for key, value in results.items():
            if key.endswith("_ratio"):
                print(f"{key}: {value:.2f}")
        print("goal: round_trip ratios >= 0.83 (within 1.2x of HiCacheFile's time)")
        _common.write_json(args.json, results)
    finally:
        redis_proc.kill()
        redis_proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
