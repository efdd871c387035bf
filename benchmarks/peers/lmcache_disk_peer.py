"""Peer of benchmarks/bench_disk_tier.py, run under an interpreter with LMCache 0.5.6 installed.

Measures LMCache's own `LocalDiskBackend` (default settings: 4 disk I/O threads, buffered I/O) on the same
chunk geometry: write = `submit_put_task` of chunks already in its CPU memory until every key is on
disk; cold read = `batched_get_blocking` of all keys after their pages were dropped from the page cache.
Prints one JSON object as its last stdout line. Does not import lmcache_vllm.
"""

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import torch

# benchmarks/_common.py is plain stdlib at import time, so this interpreter can share it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import drop_page_cache  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

    import lmcache
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

    shape = (args.layers, 2, args.chunk_tokens, args.hidden)
    chunk_bytes = int(np.prod(shape)) * 2
    total = chunk_bytes * args.chunks
    disk_dir = tempfile.mkdtemp(prefix="lmcache-peer-disk-", dir=args.dir)
    metadata = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(args.layers, 2, args.chunk_tokens, args.hidden // 128, 128))
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_tokens, local_cpu=False,
        max_local_cpu_size=(2 * args.chunks + 2) * chunk_bytes / (1 << 30),
        local_disk=disk_dir, max_local_disk_size=64.0)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config, metadata)
    disk = LocalDiskBackend(config, loop, cpu)
    db = ChunkedTokenDatabase(config, metadata)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 128_000, args.chunks * args.chunk_tokens))
    keys = [k for _, _, k in db.process_tokens(tokens=tokens)]
    src = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
           for i in range(args.chunks)]
    objs = []
    for t in src:
        obj = cpu.allocate(torch.Size(shape), torch.bfloat16)
        obj.tensor.copy_(t)
        objs.append(obj)

    def reset():
        for key in keys:
            disk.remove(key)
        os.sync()

    def write_all():
        for key, obj in zip(keys, objs):
            disk.submit_put_task(key, obj)
        while not all(disk.contains(k) for k in keys):
            time.sleep(0.0005)

    best_write = float("inf")
    for _ in range(args.repeats):
        reset()
        start = time.perf_counter()
        write_all()
        best_write = min(best_write, time.perf_counter() - start)

    best_read = float("inf")
    for _ in range(args.repeats):
        drop_page_cache(disk_dir)
        start = time.perf_counter()
        got = disk.batched_get_blocking(keys)
        best_read = min(best_read, time.perf_counter() - start)
        if any(o is None for o in got) or not all(torch.equal(o.tensor.view(shape), t)
                                                  for o, t in zip(got, src)):
            raise SystemExit("LMCache LocalDiskBackend returned different bytes")
        for o in got:
            o.ref_count_down()

    shutil.rmtree(disk_dir, ignore_errors=True)
    print(json.dumps({"lmcache_version": getattr(lmcache, "__version__", "0.5.6"),
                      "write_gbps": total / best_write / 1e9, "cold_read_gbps": total / best_read / 1e9,
                      "bytes": total}))
    sys.stdout.flush()
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
