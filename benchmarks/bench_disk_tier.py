"""Benchmark of the L2 disk tier (`LocalDiskBackend`): write and cold-read GB/s of KV chunks.

Baselines measured in the same run on the same bytes and directory filesystem:
- plain file I/O: one thread, `open().write()` per chunk file / `readinto()` of each file into a
  preallocated buffer;
- with `--vs-lmcache PYTHON` (an interpreter with LMCache 0.5.6, see scripts/make_lmcache_venv.sh):
  LMCache's own `LocalDiskBackend` (benchmarks/peers/lmcache_disk_peer.py) on the same geometry.
"Cold" = the files' pages are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before each read.
Ratios > 1 mean lmcache-vllm is faster. Targets: cold read >= 1.5x LMCache, write >= 0.8x plain write.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)

import torch  # noqa: E402

from lmcache_vllm.storage.local_disk import LocalDiskBackend  # noqa: E402


def add_arguments(parser) -> None:
    parser.add_argument("--dir", default=None, help="directory to benchmark in (default: a temp dir)")
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024, help="num_kv_heads * head_size")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--vs-lmcache", metavar="PYTHON", default=None)


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

    plain_write_s = _common.best_of(plain_write, repeats, warmup=0, setup=plain_reset)
    plain_reset()
    plain_write()
    plain_read_s = _common.best_of(plain_read, repeats, warmup=0, setup=lambda: _common.drop_page_cache(plain_dir))
    shutil.rmtree(plain_dir, ignore_errors=True)

    # ---- our backend ----
    loop = asyncio.new_event_loop()
    state = {}

    def ours_reset():
        if "disk" in state:
            loop.run_until_complete(state["disk"].close())
        shutil.rmtree(ours_dir, ignore_errors=True)
        os.sync()
        state["disk"] = LocalDiskBackend(ours_dir, 4 * total, io_threads=args.io_threads)

    def ours_write():
        async def run():
            ok = await asyncio.gather(*(state["disk"].put(k, o) for k, o in zip(keys, src_objs)))
            assert all(ok)
        loop.run_until_complete(run())

    def ours_read():
        async def run():
            got = await state["disk"].get_many(keys, lambda s, d: dst_alloc.allocate(s, d))
            assert all(o is not None for o in got)
            return got
        state["got"] = loop.run_until_complete(run())

    def ours_read_setup():
        for obj in state.pop("got", []):
            obj.ref_down()
        _common.drop_page_cache(ours_dir)

    ours_write_s = _common.best_of(ours_write, repeats, warmup=0, setup=ours_reset)
    ours_read_s = _common.best_of(ours_read, repeats, warmup=0, setup=ours_read_setup)
    got = state.pop("got")
    if not all(torch.equal(o.tensor, t) for o, t in zip(got, chunks)):
        raise SystemExit("read-back mismatch")
    for obj in got:
        obj.ref_down()
    loop.run_until_complete(state["disk"].close())
    loop.close()

    results.update({
        "plain_write_gbps": _common.gbps(total, plain_write_s),
        "plain_cold_read_gbps": _common.gbps(total, plain_read_s),
        "ours_write_gbps": _common.gbps(total, ours_write_s),
        "ours_cold_read_gbps": _common.gbps(total, ours_read_s),
    })
    results["write_vs_plain_ratio"] = results["ours_write_gbps"] / results["plain_write_gbps"]
    results["cold_read_vs_plain_ratio"] = results["ours_cold_read_gbps"] / results["plain_cold_read_gbps"]
    rows = [("plain file I/O", results["plain_write_gbps"], results["plain_cold_read_gbps"]),
            ("lmcache-vllm LocalDiskBackend", results["ours_write_gbps"], results["ours_cold_read_gbps"])]

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
    for name, value in results.items():
        if name.endswith("_ratio"):
            print(f"{name}: {value:.2f}")
    _common.write_json(args.json, results)


if __name__ == "__main__":
    main()
