"""`StorageManager.wait_written` (what a PD producer waits on before it answers) counts a chunk as durable only
when it really is in every lower tier (a real redis-server): not a chunk that was never stored, nor one
known in L1 whose write-through failed; a chunk stored again after a failed write is written again."""
from __future__ import annotations

import time

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.storage.manager import StorageManager

CHUNK = (2, 2, 16, 64)
MiB = 1 << 20


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def manager(redis_server, prefix: str) -> StorageManager:
    return StorageManager(LMCacheConfig(
        max_local_cpu_size=16 * MiB / (1 << 30), remote_url=redis_server.url, blocking_timeout_secs=2.0,
        extra_config={"close_drain_secs": 1.0, "remote_key_prefix": prefix, "remote_timeout_secs": 0.3,
                      "remote_breaker_max_secs": 0.2}))


def store(mgr: StorageManager, i: int, tensor: torch.Tensor) -> None:
    obj = mgr.allocate(tensor.shape, tensor.dtype)
    obj.tensor.copy_(tensor)
    mgr.put(key(i), obj)
    obj.ref_down()


def test_written_chunks_count_and_unstored_ones_do_not(redis_server, redis_prefix, make_chunk):
    with manager(redis_server, redis_prefix) as mgr:
        store(mgr, 0, make_chunk(0, CHUNK))
        assert mgr.wait_written([key(0)], 5.0)
        # A chunk dropped before any write (no L1 memory for it, say) has no write record: asked, Redis says no.
        assert not mgr.wait_written([key(0), key(1)], 5.0)


def test_a_chunk_written_long_ago_is_found_in_the_tiers(redis_server, redis_prefix, make_chunk):
    with manager(redis_server, redis_prefix) as mgr:
        store(mgr, 0, make_chunk(0, CHUNK))
        assert mgr.flush(5)
    with manager(redis_server, redis_prefix) as mgr:  # no record of that write in this process
        assert mgr.wait_written([key(0)], 5.0)


def test_a_failed_write_is_retried_when_the_chunk_is_stored_again(redis_server, redis_prefix, make_chunk):
    tensor = make_chunk(0, CHUNK)
    with manager(redis_server, redis_prefix) as mgr:
        redis_server.kill()
        try:
            store(mgr, 0, tensor)
            assert not mgr.wait_written([key(0)], 3.0)  # in L1 only
        finally:
            redis_server.start()
        assert not mgr.wait_written([key(0)], 1.0)  # still not in Redis: L1 having it is not enough
        time.sleep(0.5)  # past the breaker's pause (remote_breaker_max_secs 0.2) after the failed write
        store(mgr, 0, tensor)  # known in L1, but its write failed: written through again
        assert mgr.wait_written([key(0)], 10.0)
