"""Benchmark of the L3 Redis tier (`RedisBackend`): batched get/put of 64 KV chunks, GB/s.

Starts its own redis-server (no persistence) on a free loopback port. Baselines in the same run, on the
same bytes, with the same client library (redis-py asyncio + hiredis):
- raw MGET of the 64 values in one call; raw pipelined GETs (64 GETs, one round trip); raw MGET split
  over 4 connections at once; raw pipelined SETs.
Our get = pipelined MGETs of 8 keys on one connection, each batch's copy into allocator memory +
header/checksum verification done on a decode thread while the next replies arrive; our put = codec encode + one
SET per chunk (concurrently). Ratios > 1 mean lmcache-vllm is faster; the get target is >= 0.9x the best
raw read path, which does none of that work. With `--mac` our backend also runs with a keyed chunk MAC
(keyed BLAKE3 over header and payload on every put and get) and reports put / get against itself
without MAC (1.0 = free).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
import redis.asyncio as aioredis  # noqa: E402
import torch  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.storage import codec  # noqa: E402
from lmcache_vllm.storage.redis import RedisBackend  # noqa: E402


def add_arguments(parser) -> None:
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=None, help="MiB per chunk (default 4, quick 2)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--read-groups", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--mac", action="store_true", help="also measure with a keyed chunk MAC")


async def run(args, url: str) -> dict:
    num, shape, repeats = _common.tier_chunks(args)
    chunks, keys, objs, dst_alloc = _common.staged_chunks(num, shape)
    chunk_bytes = chunks[0].numel() * 2
    total = chunk_bytes * num
    res: dict = {"chunks": num, "chunk_bytes": chunk_bytes, "repeats": repeats}

    async def best(fn, setup=None) -> float:
        times = []
        for i in range(repeats + 1):
            if setup is not None:
                await setup()
            start = time.perf_counter()
            await fn()
            if i:
                times.append(time.perf_counter() - start)
        return min(times)

    raw = aioredis.Redis.from_url(url, max_connections=16)
    raw_keys = [f"raw:{k}" for k in keys]
    values = [bytes(codec.encode(k, t)) for k, t in zip(keys, chunks)]  # same bytes as our values

    async def raw_put():
        async with raw.pipeline(transaction=False) as pipe:
            for k, v in zip(raw_keys, values):
                pipe.set(k, v)
            await pipe.execute()

    async def raw_mget():
        got = await raw.mget(raw_keys)
        assert len(got) == num and got[-1] is not None

    async def raw_pipe_get():
        async with raw.pipeline(transaction=False) as pipe:
            for k in raw_keys:
                pipe.get(k)
            got = await pipe.execute()
        assert got[-1] is not None

    async def raw_mget_split(n=4):
        step = -(-num // n)
        await asyncio.gather(*(raw.mget(raw_keys[i:i + step]) for i in range(0, num, step)))

    res["raw_put_gbps"] = _common.gbps(total, await best(raw_put))
    res["raw_mget_gbps"] = _common.gbps(total, await best(raw_mget))
    res["raw_pipelined_get_gbps"] = _common.gbps(total, await best(raw_pipe_get))
    res["raw_mget_4conn_gbps"] = _common.gbps(total, await best(raw_mget_split))
    await raw.flushdb()

    async def measure(groups: int, mac: codec.ChunkMac | None = None, with_put: bool = False):
        """(put GB/s or None, get GB/s) of our backend reading in `groups` groups."""
        config = LMCacheConfig(remote_url=url, extra_config={
            "remote_key_prefix": "ours:" if mac is None else "mac:", "remote_read_groups": groups,
            "remote_timeout_secs": 30.0})
        backend = RedisBackend(config, mac=mac)
        held: list = []

        async def ours_put():
            ok = await asyncio.gather(*(backend.put(k, o) for k, o in zip(keys, objs)))
            assert all(ok)

        async def release():
            for o in held:
                o.ref_down()
            held.clear()

        async def ours_get():
            got = await backend.get_many(keys, lambda s, d: dst_alloc.allocate(s, d))
            assert all(o is not None for o in got)
            held.extend(got)

        # An empty Redis before each put: a put of a key Redis already has sends no value (the store path
        # skips it), which would time a no-op.
        put_gbps = _common.gbps(total, await best(ours_put, raw.flushdb)) if with_put else None
        get_gbps = _common.gbps(total, await best(ours_get, release))
        if not all(torch.equal(o.tensor, t) for o, t in zip(held, chunks)):
            raise SystemExit("read-back mismatch")
        await release()
        await backend.close()
        return put_gbps, get_gbps

    for groups in args.read_groups:
        put_gbps, res[f"ours_get_groups{groups}_gbps"] = await measure(groups, with_put=groups == args.read_groups[0])
        if put_gbps is not None:
            res["ours_put_gbps"] = put_gbps
    if args.mac:  # the same backend with a keyed chunk MAC, against itself without
        first = args.read_groups[0]
        res["mac_put_gbps"], res["mac_get_gbps"] = await measure(first, codec.ChunkMac("benchmark secret"),
                                                                 with_put=True)
        res["mac_put_vs_no_mac_ratio"] = res["mac_put_gbps"] / res["ours_put_gbps"]
        res["mac_get_vs_no_mac_ratio"] = res["mac_get_gbps"] / res[f"ours_get_groups{first}_gbps"]
    await raw.flushdb()
    await raw.aclose()

    best_raw_get = max(res["raw_mget_gbps"], res["raw_pipelined_get_gbps"])
    best_ours_get = max(res[f"ours_get_groups{g}_gbps"] for g in args.read_groups)
    res["ours_get_gbps"] = best_ours_get
    res["get_vs_raw_mget_ratio"] = res["ours_get_groups1_gbps"] / res["raw_mget_gbps"] \
        if 1 in args.read_groups else best_ours_get / res["raw_mget_gbps"]
    res["get_best_vs_raw_best_ratio"] = best_ours_get / best_raw_get
    res["put_vs_raw_pipelined_set_ratio"] = res["ours_put_gbps"] / res["raw_put_gbps"]
    return res


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    workdir = tempfile.mkdtemp(prefix="lmcache-bench-redis-")
    proc, url = _common.start_redis(workdir)
    try:
        res = asyncio.run(run(args, url))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    _common.report_gbps(f"redis tier: {res['chunks']} chunks x {res['chunk_bytes'] / 2**20:.1f} MiB, "
                        f"best of {res['repeats']} (GB/s)", res, args.json)


if __name__ == "__main__":
    main()
