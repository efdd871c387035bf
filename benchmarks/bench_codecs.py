"""Chunk codecs on KV that vLLM computed: bytes ratio, encode and decode GB/s per core, and a hit's read from the
disk tier, Redis and a peer, each codec against raw (naive) in the same run.

    python benchmarks/bench_codecs.py [--quick] [--json FILE]

1. KV: the `medium` local Llama (--quick: `tiny`) serves `--prompts` random-token prompts of `--tokens` tokens
   once with our connector and a naive disk tier (an in-process vLLM, one compute thread); its chunk files are
   read back: the chunks vLLM really computed, not random tensors.
2. Codecs, one thread (torch and blosc2 pinned to one): per codec the bytes ratio (raw / stored payload) and
   encode / decode GB/s of raw bytes, best of the repeats; `lossless_lz4` (blosc2 with lz4 instead of zstd) is
   the candidate we did not pick, for comparison; fp8's error (max |error| / group max, relative L2).
3. Host memory (`local_cpu_cold_fraction`): the chunks L1 of a third of their size still serves after all were
   stored, plain against 70 % of it kept lossless-coded (`host_chunks_ratio`: the distinct prompts' KV the same
   memory holds).
4. Tiers: the chunks written through each tier with each codec, then one batched read of all of them (a
   request's hit), best of the repeats: the disk tier (page cache dropped before each read: a cold file), Redis
   (a redis-server of its own on loopback) and a peer (a prefill instance's holds and transfer server pulled
   over loopback: `transfer_serde`). GB/s of raw bytes, `*_vs_naive_ratio` = naive's read time / the codec's
   (> 1: the codec's hit is faster). Loopback and a page-cache-backed disk are fast links: a codec pays where
   the tier's bandwidth is the limit (a remote Redis, a 10 GbE peer, a busy disk), which these reads are not.

The conversation workload (vLLM's multi-turn client, bounded L1 + disk, raw vs lossless vs fp8 chunk files) is
`benchmarks/bench_conversations.py --only ours ours_lossless ours_fp8` (ours: naive chunk files, the default).
"""
from __future__ import annotations

import asyncio
import glob
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
import blosc2  # noqa: E402
import torch  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.memory import HostAllocator  # noqa: E402
from lmcache_vllm.storage import chunk_file, codec, coders  # noqa: E402

CODECS = ("naive", "lossless", "fp8")


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=None, help="prompts whose KV is captured (default 8, quick 2)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per prompt (default 2048, quick 1024)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5, quick 2)")
    parser.add_argument("--kv-dir", help="read the KV from this naive disk tier's chunk files (one a capture "
                                         "wrote) instead of running vLLM")


def capture_kv(work: Path, size: str, prompts: int, tokens: int, kv_dir: str | None) -> list[torch.Tensor]:
    """The chunks vLLM computed for `prompts` random prompts, read back from a naive disk tier."""
    from lmcache_vllm.integration.vllm.testing.local_model import build_model
    from lmcache_vllm.integration.vllm.testing.vllm_jobs import connector_config, random_tokens, run_job

    disk = work / "capture"
    if kv_dir:
        return read_chunks(Path(kv_dir))
    job = {"model": str(build_model(size)),
           "llm_kwargs": {"dtype": "bfloat16", "max_model_len": tokens + 16, "enforce_eager": True, "seed": 0},
           "kv_transfer_config": connector_config({"local_disk": str(disk), "max_local_disk_size": 8,
                                                   "max_local_cpu_size": 2,
                                                   "extra_config": {"local_disk_serde": "naive"}}),
           "phases": [{"name": "capture", "prompts": [random_tokens(s, tokens) for s in range(prompts)],
                       "max_tokens": 1}]}
    run_job(work / "job", "capture", job, kv_cache_gib=2)
    return read_chunks(disk)


def read_chunks(disk: Path) -> list[torch.Tensor]:
    out = []
    for path in sorted(glob.glob(str(disk / f"*{chunk_file.SUFFIX}"))):
        with open(path, "rb") as f:
            header = codec.parse_header(f.read(codec.MAX_HEADER_SIZE))
        obj = chunk_file.read_chunk(path, header.key, lambda shape, dtype: _Plain(torch.empty(shape, dtype=dtype)))
        out.append(obj.tensor)
    if not out:
        raise SystemExit("no chunk was captured")
    return out


class _Plain:
    """A MemoryObj stand-in for reading chunk files outside an arena."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def ref_down(self) -> None:
        return None


def lz4_encode(tensor: torch.Tensor) -> bytes:
    raw = codec.payload_view(tensor)
    return blosc2.compress2(raw, codec=blosc2.Codec.LZ4, clevel=5, typesize=tensor.element_size(),
                            filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
                            blocksize=1 << 20, nthreads=1)


def _encoders(name: str):
    """(encode(tensor) -> (stored, argument), decode(stored, argument, out)) of one codec, one thread each."""
    if name == "lossless_lz4":
        return (lambda t: (lz4_encode(t), 0),
                lambda stored, arg, out: blosc2.decompress2(stored, dst=codec.payload_view(out), nthreads=1))
    coder = coders.CODERS[name]
    return (lambda t: coder.encode(t) or (codec.payload_view(t), 0), coder.decode_into)


def _measure(name: str, chunks: list[torch.Tensor], outs: list[torch.Tensor], repeats: int) -> tuple:
    encode, decode = _encoders(name)
    total = sum(t.numel() * t.element_size() for t in chunks)
    enc_s = _common.best_of(lambda: [encode(t) for t in chunks], repeats)
    stored = [encode(t) for t in chunks]
    dec_s = _common.best_of(lambda: [decode(s, a, o) for (s, a), o in zip(stored, outs)], repeats)
    nbytes = sum(memoryview(s).nbytes for s, _ in stored)
    errors = [(o.float() - t.float()) for o, t in zip(outs, chunks)]
    worst = max((e.abs().max() / t.float().abs().max()).item() for e, t in zip(errors, chunks))
    rel = sum((e.norm() / t.float().norm()).item() for e, t in zip(errors, chunks)) / len(chunks)
    return name, total / nbytes, _common.gbps(total, enc_s), _common.gbps(total, dec_s), worst, rel


def codec_rows(chunks: list[torch.Tensor], repeats: int, res: dict) -> list[tuple]:
    torch.set_num_threads(1)
    outs = [torch.empty_like(t) for t in chunks]
    rows = [_measure(name, chunks, outs, repeats) for name in (*CODECS, "lossless_lz4")]
    for name, ratio, enc, dec, worst, _ in rows:
        res.update({f"{name}_bytes_ratio": ratio, f"{name}_encode_gbps": enc, f"{name}_decode_gbps": dec,
                    f"{name}_max_rel_error": worst})
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


def keys_of(n: int) -> list[str]:
    return [f"bench@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}" for i in range(n)]


async def _through(tier, chunks: list[torch.Tensor], repeats: int, before_read=None) -> float:
    """Writes the chunks through `tier`, then the best time of one batched read of all of them."""
    keys = keys_of(len(chunks))
    total = sum(t.numel() * t.element_size() for t in chunks)
    src = HostAllocator(total + 4096 * len(chunks))
    dst = HostAllocator(total + 4096 * len(chunks))
    dst.arena.fill_(0)
    for key, t in zip(keys, chunks):
        obj = src.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        assert await tier.put(key, obj), "a write was refused"
        obj.ref_down()
    best = float("inf")
    for _ in range(repeats):
        if before_read is not None:
            before_read()
        start = time.perf_counter()
        got = await tier.get_many(keys, lambda shape, dtype: dst.allocate(shape, dtype))
        best = min(best, time.perf_counter() - start)
        assert all(o is not None for o in got), "a read missed"
        for o in got:
            o.ref_down()
    src.close()
    dst.close()
    return best


def disk_read(work: Path, name: str, chunks: list[torch.Tensor], repeats: int) -> float:
    from lmcache_vllm.storage.local_disk import LocalDiskBackend

    path = work / f"disk-{name}"
    total = sum(t.numel() * t.element_size() for t in chunks)
    tier = LocalDiskBackend(LMCacheConfig(local_disk=str(path), max_local_disk_size=2 * total / (1 << 30) + 0.01,
                                          extra_config={"local_disk_serde": name}))

    async def run() -> float:
        try:
            return await _through(tier, chunks, repeats, lambda: _common.drop_page_cache(str(path)))
        finally:
            await tier.close()
    return asyncio.run(run())


def redis_read(url: str, name: str, chunks: list[torch.Tensor], repeats: int) -> float:
    from lmcache_vllm.storage.redis import RedisBackend

    tier = RedisBackend(LMCacheConfig(remote_url=url, remote_serde=name,
                                      extra_config={"remote_key_prefix": f"bench-{name}:"}))

    async def run() -> float:
        try:
            return await _through(tier, chunks, repeats)
        finally:
            await tier.close()
    return asyncio.run(run())


def peer_read(name: str, chunks: list[torch.Tensor], repeats: int) -> float:
    """A prefill instance's holds and transfer server on loopback, pulled `repeats` times (one hold each)."""
    from lmcache_vllm.storage.manager import StorageManager
    from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier
    from lmcache_vllm.storage.transfer.holds import PeerHolds
    from lmcache_vllm.storage.transfer.server import TransferServer

    keys = keys_of(len(chunks))
    total = sum(t.numel() * t.element_size() for t in chunks)
    arena = HostAllocator(total + 4096 * len(chunks))
    held = []
    for t in chunks:
        obj = arena.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        held.append(obj)
    holds = PeerHolds(60.0, serde=name)
    server = TransferServer(holds, host="127.0.0.1", port=0)
    cfg = LMCacheConfig(max_local_cpu_size=2 * total / (1 << 30) + 0.01)
    best = float("inf")
    try:
        with StorageManager(cfg) as mgr:
            for i in range(repeats + 1):
                for obj in held:
                    obj.ref_up()  # the hold takes one reference per chunk
                holds.expect(f"r{i}")
                holds.fill(f"r{i}", keys, held)
                start = time.perf_counter()
                handle = mgr.prefetch(keys, peer=PeerTier(PeerSource("127.0.0.1", server.port, f"r{i}"),
                                                          timeout_s=30.0))
                handle.wait(60)
                elapsed = time.perf_counter() - start
                got = mgr.get(keys, owner=handle.owner, lower_tiers=False)
                assert len(got) == len(keys), f"the pull brought {len(got)} of {len(keys)} chunks"
                for o in got:
                    o.ref_down()
                mgr.clear(lower_tiers=False)
                if i:  # the first pull measures the link for `auto` and warms the sockets
                    best = min(best, elapsed)
    finally:
        server.close()
        holds.close()
        for obj in held:
            obj.ref_down()
        arena.close()
    return best


def host_memory_chunks(chunks: list[torch.Tensor], fraction: float) -> int:
    """Chunks L1 (with `fraction` of it kept lossless-coded: `local_cpu_cold_fraction`) still serves after all
    of `chunks` were stored into host memory of a third of their size."""
    from lmcache_vllm.storage.local_cpu_cold import ColdCPUBackend
    from lmcache_vllm.storage.manager import StorageManager

    total = sum(t.numel() * t.element_size() for t in chunks)
    cfg = LMCacheConfig(max_local_cpu_size=total / 3 / (1 << 30),
                        extra_config={"local_cpu_cold_fraction": fraction})
    keys = keys_of(len(chunks))
    with StorageManager(cfg) as mgr:
        for key, t in zip(keys, chunks):
            obj = mgr.allocate(t.shape, t.dtype, timeout=5.0)
            obj.tensor.copy_(t)
            mgr.put(key, obj)
            obj.ref_down()
        cold = next((t for t in mgr.lower if isinstance(t, ColdCPUBackend)), None)
        deadline = time.monotonic() + 60
        while cold is not None and cold.gauges()["resident_chunks"] + len(mgr.l1) < len(chunks) \
                and cold._pending and time.monotonic() < deadline:
            time.sleep(0.05)  # its coding thread catching up with the evictions
        in_l1 = mgr.contains(keys)
        in_cold = [False] * len(keys) if cold is None else \
            asyncio.run_coroutine_threadsafe(cold.contains(keys), mgr._loop).result()
        return sum(a or b for a, b in zip(in_l1, in_cold))


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    size = "tiny" if args.quick else "medium"
    prompts = args.prompts or (2 if args.quick else 8)
    tokens = args.tokens or (1024 if args.quick else 2048)
    repeats = args.repeats or (2 if args.quick else 5)
    res: dict = {"model": size, "prompts": prompts, "tokens": tokens, "cpu": _common.cpu_model()}
    with tempfile.TemporaryDirectory(prefix="bench_codecs_") as tmp:
        work = Path(tmp)
        chunks = capture_kv(work, size, prompts, tokens, args.kv_dir)
        total = sum(t.numel() * t.element_size() for t in chunks)
        res.update(chunks=len(chunks), chunk_shape="x".join(map(str, chunks[0].shape)), kv_bytes=total)
        print(f"KV of the {size} model: {len(chunks)} chunks {tuple(chunks[0].shape)} {chunks[0].dtype}, "
              f"{total / 1e6:.1f} MB; CPU {res['cpu']}", flush=True)
        _common.print_table("codecs, one thread (GB/s of raw bytes)", codec_rows(chunks, repeats, res),
                            ("codec", "bytes ratio", "encode GB/s", "decode GB/s", "max |err|/max", "rel L2 err"))
        plain, cold = host_memory_chunks(chunks, 0.0), host_memory_chunks(chunks, 0.7)
        res.update(host_chunks_plain=plain, host_chunks_cold_compressed=cold, host_chunks_ratio=cold / plain)
        print(f"\nhost memory of a third of the KV: {plain} chunks served plain, {cold} with 70 % of it "
              f"compressed (local_cpu_cold_fraction 0.7): {cold / plain:.2f}x", flush=True)
        redis_proc, url = _common.start_redis(tmp)
        try:
            rows = []
            for tier, read in (("disk", lambda n: disk_read(work, n, chunks, repeats)),
                               ("redis", lambda n: redis_read(url, n, chunks, repeats)),
                               ("peer", lambda n: peer_read(n, chunks, repeats))):
                seconds = {name: read(name) for name in CODECS}
                for name in CODECS:
                    res[f"{tier}_{name}_read_gbps"] = _common.gbps(total, seconds[name])
                    if name != "naive":
                        res[f"{tier}_{name}_vs_naive_ratio"] = seconds["naive"] / seconds[name]
                    rows.append((tier, name, seconds[name] * 1000, _common.gbps(total, seconds[name]),
                                 seconds["naive"] / seconds[name]))
        finally:
            redis_proc.kill()
            redis_proc.wait()
        _common.print_table("a hit's read of every chunk, per tier and codec", rows,
                            ("tier", "codec", "ms", "GB/s (raw)", "vs naive"))
    for name, value in res.items():
        if name.endswith("_ratio"):
            print(f"{name}: {value:.3f}")
    _common.write_json(args.json, res)


if __name__ == "__main__":
    main()
