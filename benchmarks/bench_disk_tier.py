"""Benchmark of the L2 disk tier (`LocalDiskBackend`): write and cold-read GB/s of KV chunks.

Baselines measured in the same run on the same bytes and directory filesystem:
- plain file I/O: one thread, `open().write()` per chunk file / `readinto()` of each file into a
  preallocated buffer;
- with `--vs-lmcache PYTHON` (an interpreter with LMCache 0.5.6, see scripts/make_lmcache_venv.sh):
  LMCache's own `LocalDiskBackend` (benchmarks/peers/lmcache_disk_peer.py) on the same geometry.
- how fast this disk gives up our own chunk files, read sequentially: `dd`-style (one stream, 32 MiB reads
  into one page-aligned buffer, file after file) and `fio`-style (`--io-threads` such streams at once), each
  with O_DIRECT (`iflag=direct`; refused on tmpfs: buffered) and through the page cache (read-ahead):
  `cold_read_vs_best_sequential_ratio` compares our cold read with the fastest of the four (1.0 = as fast
  as any plain sequential reader of the same files on the same disk).
"Cold" = the files' pages are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before each read.
Ratios > 1 mean lmcache-vllm is faster. Targets: cold read >= 1.5x LMCache, write >= 0.8x plain write.

Our backend writes with O_DIRECT by default (no page cache: far less CPU per byte, bounded by the
device); it is measured a second time with `disk_direct_io: false`, like the plain baseline, which
writes into the page cache (reads go through the page cache either way). Write CPU seconds per GiB are
reported for all three.
With `--mac` the O_DIRECT configuration runs a third time with a keyed chunk MAC (`extra_config.
chunk_mac_key`: keyed BLAKE3 over header and payload on every write and read) and its write / cold read
GB/s are reported as ratios to the same backend without MAC (1.0 = free).
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.storage.codec import ChunkMac  # noqa: E402
from lmcache_vllm.storage.local_disk import LocalDiskBackend  # noqa: E402


def _cpu_timed(fn, best: dict):
    """`fn`, recording in best["cpu"] the least CPU time of this process any call took (setup excluded)."""
    def timed():
        cpu0 = time.process_time()
        fn()
        best["cpu"] = min(best.get("cpu", float("inf")), time.process_time() - cpu0)
    return timed


SEQUENTIAL_BLOCK = 32 << 20  # dd bs=32M


def read_files(paths: list[str], streams: int, direct: bool) -> bool:
    """Reads every file of `paths` front to back in SEQUENTIAL_BLOCK pieces, `streams` files at a time, with
    O_DIRECT when `direct` and the file system takes it; returns whether O_DIRECT was used."""
    direct = [direct and hasattr(os, "O_DIRECT")]

    def read_one(path: str, buf: mmap.mmap) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct[0] else 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct[0] = False
            fd = os.open(path, os.O_RDONLY)
        view = memoryview(buf)
        try:
            offset = 0
            while n := os.preadv(fd, [view], offset):
                offset += n
        finally:
            view.release()
            os.close(fd)

    buffers = [mmap.mmap(-1, SEQUENTIAL_BLOCK) for _ in range(streams)]  # page-aligned, as O_DIRECT needs
    try:
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda i: [read_one(p, buffers[i]) for p in paths[i::streams]], range(streams)))
    finally:
        for buf in buffers:
            buf.close()
    return direct[0]


def add_arguments(parser) -> None:
    parser.add_argument("--dir", default=None, help="directory to benchmark in (default: a temp dir)")
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024, help="num_kv_heads * head_size")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--vs-lmcache", metavar="PYTHON", default=None)
    parser.add_argument("--mac", action="store_true", help="also measure with a keyed chunk MAC")


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    num_chunks = args.chunks or (8 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 4)
    shape = (args.layers, 2, args.chunk_tokens, args.hidden)
    base = tempfile.mkdtemp(prefix="lmcache-bench-disk-", dir=args.dir)
    chunks, keys, src_objs, dst_alloc = _common.staged_chunks(num_chunks, shape)
    chunk_bytes = chunks[0].numel() * 2
    total = chunk_bytes * num_chunks
    plain_dir = os.path.join(base, "plain")
    ours_dir = os.path.join(base, "ours")
    results: dict = {"chunk_bytes": chunk_bytes, "chunks": num_chunks, "repeats": repeats}

    # ---- plain file I/O ----
    def plain_reset():
        shutil.rmtree(plain_dir, ignore_errors=True)
        os.makedirs(plain_dir)
        os.sync()

    def plain_write():
        for i, t in enumerate(chunks):
            with open(os.path.join(plain_dir, f"{i}.bin"), "wb") as f:
                f.write(t.view(torch.uint8).numpy())

    bufs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(num_chunks)]

    def plain_read():
        for i in range(num_chunks):
            with open(os.path.join(plain_dir, f"{i}.bin"), "rb", buffering=0) as f:
                f.readinto(bufs[i].numpy())

    plain_cpu: dict = {}
    plain_write_s = _common.best_of(_cpu_timed(plain_write, plain_cpu), repeats, warmup=0, setup=plain_reset)
    plain_write_cpu = plain_cpu["cpu"]
    plain_reset()
    plain_write()
    plain_read_s = _common.best_of(plain_read, repeats, warmup=0, setup=lambda: _common.drop_page_cache(plain_dir))
    shutil.rmtree(plain_dir, ignore_errors=True)

    # ---- our backend: O_DIRECT writes (the default), then through the page cache ----
    def measure_ours(direct_io: bool, mac: ChunkMac | None = None):
        loop = asyncio.new_event_loop()
        state = {}

        def reset():
            if "disk" in state:
                loop.run_until_complete(state["disk"].close())
            shutil.rmtree(ours_dir, ignore_errors=True)
            os.sync()
            config = LMCacheConfig(local_disk=ours_dir, max_local_disk_size=4 * total / (1 << 30),
                                   extra_config={"disk_io_threads": args.io_threads, "disk_direct_io": direct_io})
            state["disk"] = LocalDiskBackend(config, mac=mac)

        def write():
            async def run():
                ok = await asyncio.gather(*(state["disk"].put(k, o) for k, o in zip(keys, src_objs)))
                assert all(ok)
            loop.run_until_complete(run())

        def read():
            async def run():
                got = await state["disk"].get_many(keys, lambda s, d: dst_alloc.allocate(s, d))
                assert all(o is not None for o in got)
                return got
            state["got"] = loop.run_until_complete(run())

        def read_setup():
            for obj in state.pop("got", []):
                obj.ref_down()
            _common.drop_page_cache(ours_dir)

        write_s = _common.best_of(_cpu_timed(write, state), repeats, warmup=0, setup=reset)
        used_direct = state["disk"].direct_io
        read_s = _common.best_of(read, repeats, warmup=0, setup=read_setup)
        got = state.pop("got")
        if not all(torch.equal(o.tensor, t) for o, t in zip(got, chunks)):
            raise SystemExit("read-back mismatch")
        for obj in got:
            obj.ref_down()
        loop.run_until_complete(state["disk"].close())
        loop.close()
        return write_s, read_s, state["cpu"], used_direct

    ours_write_s, ours_read_s, ours_write_cpu, used_direct = measure_ours(True)
    # Plain sequential readers of the files our backend just wrote (headers included: the same bytes).
    files = sorted(os.path.join(ours_dir, n) for n in os.listdir(ours_dir) if not n.startswith("."))
    file_bytes = sum(os.path.getsize(f) for f in files)
    sequential_rows = []
    for streams, style in ((1, "dd"), (args.io_threads, "fio")):
        for direct in (True, False):
            seconds = _common.best_of(lambda s=streams, d=direct: read_files(files, s, d), repeats, warmup=0,
                                      setup=lambda: _common.drop_page_cache(ours_dir))
            used = read_files(files[:1], 1, direct)
            name = f"{style}_{'direct' if direct else 'page_cache'}_read_gbps"
            results[name] = _common.gbps(file_bytes, seconds)
            sequential_rows.append((f"{style}-style: {streams} stream{'s' * (streams > 1)}, 32 MiB reads, "
                                    f"{'O_DIRECT' if used else 'page cache'}", float("nan"), results[name]))
    results["best_sequential_read_gbps"] = max(row[2] for row in sequential_rows)
    buffered_write_s, buffered_read_s, buffered_write_cpu, _ = measure_ours(False)
    if args.mac:
        mac_write_s, mac_read_s, _, _ = measure_ours(True, ChunkMac("benchmark secret"))
        results.update(mac_write_gbps=_common.gbps(total, mac_write_s),
                       mac_cold_read_gbps=_common.gbps(total, mac_read_s),
                       mac_write_vs_no_mac_ratio=ours_write_s / mac_write_s,
                       mac_cold_read_vs_no_mac_ratio=ours_read_s / mac_read_s)

    results.update({
        "plain_write_gbps": _common.gbps(total, plain_write_s),
        "plain_cold_read_gbps": _common.gbps(total, plain_read_s),
        "ours_write_gbps": _common.gbps(total, ours_write_s),
        "ours_cold_read_gbps": _common.gbps(total, ours_read_s),
        "ours_write_direct_io": used_direct,
        "ours_page_cache_write_gbps": _common.gbps(total, buffered_write_s),
        "ours_page_cache_cold_read_gbps": _common.gbps(total, buffered_read_s),
        # CPU seconds of this process per GiB written (best repeat): what a write costs the serving host.
        "plain_write_cpu_s_per_gib": plain_write_cpu * 2**30 / total,
        "ours_write_cpu_s_per_gib": ours_write_cpu * 2**30 / total,
        "ours_page_cache_write_cpu_s_per_gib": buffered_write_cpu * 2**30 / total,
    })
    results["page_cache_write_vs_plain_ratio"] = results["ours_page_cache_write_gbps"] / results["plain_write_gbps"]
    results["write_vs_plain_ratio"] = results["ours_write_gbps"] / results["plain_write_gbps"]
    results["cold_read_vs_plain_ratio"] = results["ours_cold_read_gbps"] / results["plain_cold_read_gbps"]
    results["cold_read_vs_best_sequential_ratio"] = (results["ours_cold_read_gbps"]
                                                     / results["best_sequential_read_gbps"])
    rows = [("plain file I/O", results["plain_write_gbps"], results["plain_cold_read_gbps"]),
            ("lmcache-vllm LocalDiskBackend" + (" (O_DIRECT)" if used_direct else ""), results["ours_write_gbps"],
             results["ours_cold_read_gbps"]),
            ("lmcache-vllm, disk_direct_io: false", results["ours_page_cache_write_gbps"],
             results["ours_page_cache_cold_read_gbps"]), *sequential_rows]
    if args.mac:
        rows.append(("lmcache-vllm with chunk MAC", results["mac_write_gbps"], results["mac_cold_read_gbps"]))

    if args.vs_lmcache:
        peer = _common.run_peer(os.path.abspath(args.vs_lmcache), "lmcache_disk_peer.py", [
            "--dir", base, "--chunks", str(num_chunks), "--repeats", str(repeats),
            "--layers", str(args.layers), "--chunk-tokens", str(args.chunk_tokens),
            "--hidden", str(args.hidden)])
        results["lmcache_write_gbps"] = peer["write_gbps"]
        results["lmcache_cold_read_gbps"] = peer["cold_read_gbps"]
        results["lmcache_version"] = peer.get("lmcache_version", "")
        results["write_vs_lmcache_ratio"] = results["ours_write_gbps"] / peer["write_gbps"]
        results["cold_read_vs_lmcache_ratio"] = results["ours_cold_read_gbps"] / peer["cold_read_gbps"]
        rows.append((f"LMCache {results['lmcache_version']} LocalDiskBackend", peer["write_gbps"],
                     peer["cold_read_gbps"]))
    shutil.rmtree(base, ignore_errors=True)

    _common.print_table(f"disk tier: {num_chunks} chunks x {chunk_bytes / 2**20:.0f} MiB, best of "
                        f"{repeats} (GB/s)", rows, ("path", "write", "cold read"))
    print(f"write CPU per GiB: plain {results['plain_write_cpu_s_per_gib']:.3f} s, ours "
          f"{results['ours_write_cpu_s_per_gib']:.3f} s, ours through the page cache "
          f"{results['ours_page_cache_write_cpu_s_per_gib']:.3f} s")
    for name, value in results.items():
        if name.endswith("_ratio"):
            print(f"{name}: {value:.2f}")
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
