"""Benchmark of the Mooncake Store tier (`MooncakeBackend`) against the Redis tier and a raw copy, in one run:
hit throughput of the tiers, then time to first token of a prompt loaded from each by a fresh vLLM process.

    python benchmarks/bench_mooncake_tier.py [--quick] [--json FILE]

Starts its own `mooncake_master` + one `mooncake_client` storage host (TCP over loopback, tests/mooncake_servers.py)
and a redis-server, on free loopback ports; the tiers use them as an instance would (our tier's process gives
the Mooncake pool no memory: global_segment_size 0).

1. Hit throughput, GB/s (best of N): `get_many` of 64 chunks (4 MiB each; --quick: 2 MiB) into L1 memory, as
   the engine reads (`codec.ExpectedAlloc`), from Mooncake (zero-copy batch into the arena) and from Redis
   (pipelined MGETs, decoded on a thread), against
   - raw copy: `memmove` of the same bytes from one arena into another, one thread (what a hit from host memory
     moves), and
   - raw Mooncake: the library's own `batch_get_into` of the same objects into a registered buffer, without our
     header, checks or allocation (what Mooncake gives on this box).
   Puts (GB/s) of both tiers too. Every read is checked against the chunks written.
2. TTFT (s, best of the repeats): a writer vLLM process stores prompts into Mooncake, another into Redis; a fresh
   process per tier (after one short warm-up request) asks each prompt: the hit loads from that tier; then asks
   it again: the hit comes from host memory (L1, the raw-copy case end to end). Every run has the same thread
   binding; cold requests of the writers give the cold TTFT. `outputs_identical` is true when every hit gave the
   same tokens whichever tier served it (the same split, the same KV).

Ratios (> 1: the first is better): `mooncake_vs_redis_get_ratio`, `mooncake_get_vs_raw_copy_ratio`,
`mooncake_get_vs_raw_mooncake_ratio`, `mooncake_vs_redis_put_ratio`, `ttft_mooncake_vs_redis_ratio` (Redis TTFT
/ Mooncake TTFT), `ttft_mooncake_vs_l1_ratio` (L1 / Mooncake), `ttft_cold_vs_mooncake_ratio`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)

sys.path.insert(0, os.path.join(_common.REPO_ROOT, "tests"))
import mooncake_servers  # noqa: E402
import torch  # noqa: E402

from lmcache_vllm.config import LMCacheConfig  # noqa: E402
from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, random_tokens, run_job  # noqa: E402
from lmcache_vllm.storage import codec  # noqa: E402
from lmcache_vllm.storage.mooncake import MooncakeBackend  # noqa: E402
from lmcache_vllm.storage.redis import RedisBackend  # noqa: E402


def add_arguments(parser) -> None:
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=None, help="MiB per chunk (default 4, quick 2)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--skip-ttft", action="store_true", help="only the tiers' throughput (no vLLM)")


def tier_configs(mooncake_url: str, redis_url: str) -> dict[str, dict]:
    """`kv_connector_extra_config` / LMCacheConfig keys of each tier (long timeouts: a slow machine is no fault)."""
    return {"mooncake": {"remote_url": mooncake_url, "extra_config": {
                "remote_key_prefix": "bench:", "remote_timeout_secs": 30.0, "global_segment_size": 0,
                "local_hostname": "127.0.0.1"}},
            "redis": {"remote_url": redis_url, "extra_config": {"remote_key_prefix": "bench:",
                                                                "remote_timeout_secs": 30.0}}}


async def throughput(args, configs: dict[str, dict], mooncake_port: int) -> dict:
    num, shape, repeats = _common.tier_chunks(args)
    chunks, keys, objs, dst = _common.staged_chunks(num, shape)
    chunk_bytes = chunks[0].numel() * 2
    total = chunk_bytes * num
    res: dict = {"chunks": num, "chunk_bytes": chunk_bytes, "repeats": repeats}
    held: list = []

    async def best(fn, after=None) -> float:
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            await fn()
            if i:
                times.append(time.perf_counter() - start)
            if after is not None:
                await after()
        return min(times)

    async def release() -> None:
        for obj in held:
            obj.ref_down()
        held.clear()

    def expect() -> codec.ExpectedAlloc:
        return codec.ExpectedAlloc(lambda s, d: dst.allocate(s, d), {k: (shape, torch.bfloat16) for k in keys})

    async def raw_copy() -> None:
        for obj in objs:
            out = dst.allocate(obj.shape, obj.dtype)
            ctypes.memmove(out.tensor.data_ptr(), obj.tensor.data_ptr(), obj.nbytes)
            held.append(out)
    res["raw_copy_gbps"] = _common.gbps(total, await best(raw_copy, release))

    for name, backend_type in (("mooncake", MooncakeBackend), ("redis", RedisBackend)):
        backend = backend_type(LMCacheConfig(**configs[name]))
        start = time.perf_counter()
        assert all(await asyncio.gather(*(backend.put(k, o) for k, o in zip(keys, objs))))
        res[f"{name}_put_gbps"] = _common.gbps(total, time.perf_counter() - start)  # one put: a key is written once

        async def get(backend=backend) -> None:
            got = await backend.get_many(keys, expect())
            if any(o is None for o in got):
                raise SystemExit(f"{backend!r}: a chunk did not read back")
            held.extend(got)

        await get()
        if not all(torch.equal(o.tensor, t) for o, t in zip(held, chunks)):
            raise SystemExit(f"{name}: read-back mismatch")
        await release()
        res[f"{name}_get_gbps"] = _common.gbps(total, await best(get, release))
        await backend.clear()
        await backend.close()

    # the library alone: the same objects (header + payload) into a registered buffer, one call
    store = mooncake_servers.raw_client(mooncake_port)
    names = [f"raw:{k}" for k in keys]
    size = codec.header_size(keys[0], len(shape)) + chunk_bytes
    buffer = torch.empty(size * num, dtype=torch.uint8)
    store.register_buffer(buffer.data_ptr(), buffer.numel())
    for i, tensor in enumerate(chunks):
        buffer[i * size:(i + 1) * size] = torch.frombuffer(bytearray(codec.encode(keys[i], tensor)), dtype=torch.uint8)
    assert store.batch_put_from(names, [buffer.data_ptr() + i * size for i in range(num)], [size] * num) == [0] * num

    async def raw_mooncake() -> None:
        got = store.batch_get_into(names, [buffer.data_ptr() + i * size for i in range(num)], [size] * num)
        assert got == [size] * num
    res["raw_mooncake_get_gbps"] = _common.gbps(total, await best(raw_mooncake))
    store.remove_all(True)
    store.close()

    res["mooncake_vs_redis_get_ratio"] = res["mooncake_get_gbps"] / res["redis_get_gbps"]
    res["mooncake_get_vs_raw_copy_ratio"] = res["mooncake_get_gbps"] / res["raw_copy_gbps"]
    res["mooncake_get_vs_raw_mooncake_ratio"] = res["mooncake_get_gbps"] / res["raw_mooncake_get_gbps"]
    res["mooncake_vs_redis_put_ratio"] = res["mooncake_put_gbps"] / res["redis_put_gbps"]
    return res


def ttft(args, configs: dict[str, dict], tmp: Path) -> dict:
    size, prompt_len, repeats = ("tiny", 1400, 1) if args.quick else ("medium", 3900, 3)
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    model = str(build_model(size))
    kwargs = {"dtype": "bfloat16", "max_model_len": prompt_len + 256, "enforce_eager": True, "seed": 0,
              "max_num_batched_tokens": 8192, "enable_prefix_caching": False}
    one = {"max_tokens": 1}
    prompts = [random_tokens(500 + i, prompt_len) for i in range(repeats)]
    res: dict = {"model": size, "prompt_tokens": prompt_len, "prompts": repeats}
    outputs: dict[str, list] = {}
    for name, extra in configs.items():
        extra = dict(extra, max_local_cpu_size=2.0)
        kv = dict(CONNECTOR, kv_connector_extra_config=extra)
        writer = run_job(tmp, f"writer_{name}", {"model": model, "llm_kwargs": kwargs, "kv_transfer_config": kv,
                                                 "phases": [{"name": f"cold{i}", "prompts": [p], **one}
                                                            for i, p in enumerate(prompts)]}, hash_seed=1)
        reader = run_job(tmp, f"reader_{name}", {
            "model": model, "llm_kwargs": kwargs, "kv_transfer_config": kv,
            "phases": [{"name": "warmup", "prompts": [random_tokens(7, 100)], **one}]
            + [{"name": f"hit{i}", "prompts": [p], **one} for i, p in enumerate(prompts)]
            + [{"name": f"l1_{i}", "prompts": [p], **one} for i, p in enumerate(prompts)]}, hash_seed=2)
        walls = {p["name"]: p["wall_s"] for p in reader["phases"]}
        cached = {p["name"]: p["results"][0]["num_cached_tokens"] for p in reader["phases"]}
        res[f"cold_{name}_ttft_s"] = min(p["wall_s"] for p in writer["phases"])
        res[f"{name}_ttft_s"] = min(walls[f"hit{i}"] for i in range(repeats))
        res[f"l1_after_{name}_ttft_s"] = min(walls[f"l1_{i}"] for i in range(repeats))
        res[f"{name}_cached_tokens"] = min(cached[f"hit{i}"] for i in range(repeats))
        outputs[name] = [p["results"][0]["tokens"] for p in reader["phases"] if p["name"] != "warmup"]
    res["outputs_identical"] = len({str(o) for o in outputs.values()}) == 1 and \
        all(o[:repeats] == o[repeats:] for o in outputs.values())
    cold = min(res[f"cold_{name}_ttft_s"] for name in configs)
    l1 = min(res[f"l1_after_{name}_ttft_s"] for name in configs)
    res["ttft_mooncake_vs_redis_ratio"] = res["redis_ttft_s"] / res["mooncake_ttft_s"]
    res["ttft_mooncake_vs_l1_ratio"] = l1 / res["mooncake_ttft_s"]
    res["ttft_cold_vs_mooncake_ratio"] = cold / res["mooncake_ttft_s"]
    return res


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-mooncake-"))
    redis_proc, redis_url = _common.start_redis(str(workdir))
    store = mooncake_servers.MooncakeStore(workdir / "mooncake", segment="2GB" if args.quick else "4GB")
    try:
        store.start()
        configs = tier_configs(store.url, redis_url)
        res = asyncio.run(throughput(args, configs, store.port))
        if not args.skip_ttft:
            res.update(ttft(args, configs, workdir / "ttft"))
        res["cpu"] = _common.cpu_model()
    finally:
        store.stop()
        redis_proc.kill()
        redis_proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.skip_ttft:
        _common.print_table(f"TTFT, {res['model']} model, {res['prompt_tokens']}-token prompts, best of "
                            f"{res['prompts']} (s)", [(k[:-len("_ttft_s")], v) for k, v in res.items()
                                                     if k.endswith("_ttft_s")], ("request", "TTFT s"))
        print(f"outputs_identical: {res['outputs_identical']}; tokens from the tier: mooncake "
              f"{res['mooncake_cached_tokens']}, redis {res['redis_cached_tokens']}")
    print(f"cpu: {res['cpu']}")
    _common.report_gbps(f"Mooncake tier vs Redis tier vs raw copy: {res['chunks']} chunks x "
                        f"{res['chunk_bytes'] / 2**20:.1f} MiB, best of {res['repeats']}", res, args.json)


if __name__ == "__main__":
    main()
