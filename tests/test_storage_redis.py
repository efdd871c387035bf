"""Tests for lmcache_vllm.storage.redis (one server) against a real redis-server: round trips, TTL, garbage
values, a killed or frozen server (bounded misses, circuit breaker) and recovery after a restart."""

import asyncio
import os
import shutil
import signal
import subprocess
import time

import pytest
import redis
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.redis import RedisBackend

pytestmark = pytest.mark.redis
CHUNK = (2, 2, 16, 64)


def redis_config(url: str, **extra) -> LMCacheConfig:
    return LMCacheConfig(remote_url=url, extra_config=extra)


def key(i: int) -> str:
    return f"m@1@0@bfloat16@v1@{i:064x}"


def alloc_fn(allocator):
    return lambda shape, dtype: allocator.allocate(shape, dtype)


def obj_of(allocator, tensor):
    obj = allocator.allocate(tensor.shape, tensor.dtype)
    obj.tensor.copy_(tensor)
    return obj


async def test_round_trip_batch_and_ttl(redis_server, redis_prefix, allocator, make_chunk):
    # more concurrent calls than pooled connections: they wait for a connection, none fails
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_ttl_secs=60,
                                        remote_read_groups=2, remote_max_connections=2))
    chunks = [make_chunk(i, CHUNK) for i in range(5)]
    srcs = [obj_of(allocator, t) for t in chunks]
    assert all(await asyncio.gather(*(backend.put(key(i), o) for i, o in enumerate(srcs))))
    for src in srcs:
        src.ref_down()
    assert await backend.contains([key(0), key(9), key(4)]) == [True, False, True]
    got = await backend.get_many([key(i) for i in range(6)], alloc_fn(allocator))
    for t, obj in zip(chunks, got[:5]):
        assert torch.equal(obj.tensor, t)
        obj.ref_down()
    assert got[5] is None
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl(redis_prefix + key(0)) <= 60_000
    assert raw.get(redis_prefix + key(1)).startswith(codec.MAGIC)
    await backend.clear()
    assert raw.keys(redis_prefix + "*") == []
    raw.close()
    await backend.close()


async def test_garbage_value_is_a_miss_and_deleted(redis_server, redis_prefix, allocator, make_chunk):
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix))
    good = bytearray(codec.encode(key(1), make_chunk(1, CHUNK)))
    good[-3] ^= 0xFF  # a flipped payload bit
    assert await backend.put_bytes(key(1), bytes(good))
    assert await backend.put_bytes(key(2), b"\x80\x04 not a chunk at all")
    assert await backend.get_many([key(1), key(2)], alloc_fn(allocator)) == [None, None]
    assert metrics.value("corrupt_chunks", tier="redis") == 2
    assert await backend.contains([key(1), key(2)]) == [False, False]
    await backend.close()


async def test_killed_server_gives_fast_misses_then_recovers(redis_server, redis_prefix, allocator,
                                                            make_chunk):
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_timeout_secs=1.0,
                                        remote_breaker_max_secs=0.4), breaker_base_secs=0.2)
    src = obj_of(allocator, make_chunk(1, CHUNK))
    assert await backend.put(key(1), src)
    redis_server.kill()
    try:
        start = time.monotonic()
        assert await backend.contains([key(1)]) == [False]
        assert await backend.get(key(1), alloc_fn(allocator)) is None
        assert not await backend.put(key(2), src)
        assert backend.breaker_open
        for _ in range(20):  # while open: no network calls at all
            assert await backend.get(key(1), alloc_fn(allocator)) is None
        assert time.monotonic() - start < 2.0
        assert metrics.value("breaker_skipped_calls", tier="redis") >= 1
        assert metrics.value("failed_reads", tier="redis") >= 20  # every read while down or open
        assert metrics.value("failed_writes", tier="redis") == 1
    finally:
        redis_server.restart()  # a fresh, empty server on the same port
    # the breaker lets a probe through after its backoff; until then puts are dropped
    deadline = time.monotonic() + 5
    while not await backend.put(key(1), src) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    got = await backend.get(key(1), alloc_fn(allocator))
    assert got is not None and torch.equal(got.tensor, src.tensor) and not backend.breaker_open
    got.ref_down()
    src.ref_down()
    await backend.close()


async def test_cancelled_probe_does_not_leave_the_breaker_open(redis_server, redis_prefix):
    """A probe (the first call after the breaker's retry time) cancelled mid-flight, e.g. its request
    was aborted, says nothing about Redis: the next call after the retry time probes again."""
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_timeout_secs=5.0,
                                        remote_breaker_max_secs=0.05), breaker_base_secs=0.05)
    redis_server.kill()
    try:
        assert not await backend.ping()  # connection refused: the breaker opens
        assert backend.breaker_open
    finally:
        redis_server.restart()
    await asyncio.sleep(0.1)  # past the retry time: the next call is the probe
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # it connects, then waits for an answer
    try:
        probe = asyncio.ensure_future(backend.contains([key(1)]))
        await asyncio.sleep(0.2)
        assert not probe.done()
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await asyncio.sleep(0.1)
    assert await backend.ping(), "the breaker never lets a call through again"
    assert not backend.breaker_open
    await backend.close()


async def test_frozen_server_is_bounded_by_the_timeout(redis_server, redis_prefix, allocator):
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_timeout_secs=0.5))
    assert await backend.ping()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert await backend.get(key(1), alloc_fn(allocator)) is None
        assert await backend.contains([key(1)]) == [False]  # breaker open: immediate
        assert time.monotonic() - start < 1.5
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await backend.close()


async def test_unix_socket_url(tmp_path, allocator, make_chunk):
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        backend = RedisBackend(redis_config(f"unix://{sock}?db=1", remote_key_prefix="u:"))
        src = obj_of(allocator, make_chunk(3, CHUNK))
        assert await backend.put(key(3), src)
        got = await backend.get(key(3), alloc_fn(allocator))
        assert torch.equal(got.tensor, src.tensor)
        got.ref_down()
        src.ref_down()
        await backend.close()
    finally:
        proc.kill()
        proc.wait()


async def test_pipelined_batches_cancel_and_reuse(redis_server, redis_prefix, allocator, make_chunk):
    # 9 keys in MGETs of 2 on one connection: a miss and a corrupt value in later batches; a get
    # cancelled at any point leaks no memory and leaves no half-read connection in the pool
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_read_batch_keys=2,
                                        remote_max_connections=1))
    chunks = {i: make_chunk(i, (2, 2, 64, 128)) for i in range(9) if i != 5}  # 64 KiB each
    for i, t in chunks.items():
        src = obj_of(allocator, t)
        assert await backend.put(key(i), src)
        src.ref_down()
    assert await backend.put_bytes(key(7), b"LMCV" + bytes(100))  # corrupt
    got = await backend.get_many([key(i) for i in range(9)], alloc_fn(allocator))
    assert [o is not None for o in got] == [i not in (5, 7) for i in range(9)]
    for i, obj in enumerate(got):
        if obj is not None:
            assert torch.equal(obj.tensor, chunks[i])
            obj.ref_down()
    assert metrics.value("corrupt_chunks", tier="redis") == 1
    keys = [key(i) for i in range(7)]
    for delay in (0, 0.0005, 0.001, 0.002, 0.005):
        task = asyncio.ensure_future(backend.get_many(keys, alloc_fn(allocator)))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            for obj in await task:
                obj is not None and obj.ref_down()
        except asyncio.CancelledError:
            pass
        deadline = time.monotonic() + 5
        while allocator.used_bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert allocator.used_bytes == 0
        again = await backend.get_many(keys, alloc_fn(allocator))
        assert [o is not None for o in again] == [i != 5 for i in range(7)]
        for i, obj in enumerate(again):
            if obj is not None:
                assert torch.equal(obj.tensor, chunks[i])
                obj.ref_down()
    await backend.close()


async def test_keyed_mac_values_of_another_writer_are_misses_and_deleted(redis_server, redis_prefix,
                                                                         allocator, make_chunk):
    mac = codec.ChunkMac("fleet secret")
    signed = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix), mac=mac)
    other = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix),
                         mac=codec.ChunkMac("someone else's"))
    src = make_chunk(4, CHUNK)
    for backend, i in ((signed, 1), (other, 2)):
        obj = obj_of(allocator, src)
        assert await backend.put(key(i), obj)
        obj.ref_down()
    got = await signed.get_many([key(1), key(2)], alloc_fn(allocator))
    assert torch.equal(got[0].tensor, src) and got[1] is None
    got[0].ref_down()
    assert await signed.contains([key(2)]) == [False]  # deleted
    assert metrics.value("unauthenticated_chunks") == 1
    for backend in (signed, other):
        await backend.close()


async def test_large_read_slower_than_the_timeout_is_not_a_dead_server(redis_server, redis_prefix, make_chunk):
    """The timeout is per chunk: a legitimate read of many large chunks may take longer than one chunk's
    timeout without tripping the breaker (it used to cover the whole batch: a big hit became misses and
    marked Redis down)."""
    allocator = HostAllocator(270 << 20)
    big = (4, 2, 256, 1024)  # 4 MiB of bf16 per chunk: 256 MiB in all, ~0.4-1 s over loopback
    chunks = [make_chunk(i, big) for i in range(64)]
    writer = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix))
    for i, t in enumerate(chunks):
        src = obj_of(allocator, t)
        assert await writer.put(key(i), src)
        src.ref_down()
    await writer.close()
    # One MGET of all 64 chunks: 64 x 0.1 s = 6.4 s for a reply that takes ~0.4-1 s (room for a loaded
    # 2-core machine), while one chunk's 0.1 s is always exceeded.
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix, remote_timeout_secs=0.1,
                                        remote_read_batch_keys=64))
    start = time.monotonic()
    got = await backend.get_many([key(i) for i in range(64)], alloc_fn(allocator))
    took = time.monotonic() - start
    assert all(obj is not None for obj in got), f"{sum(o is None for o in got)} misses in {took:.2f}s"
    assert took > 0.1, "the read was quicker than one chunk's timeout: the test proves nothing"
    assert not backend.breaker_open and metrics.value("failed_reads", tier="redis") == 0
    for obj, t in zip(got, chunks):
        assert torch.equal(obj.tensor, t)
        obj.ref_down()
    await backend.close()
    assert allocator.used_bytes == 0


async def test_put_of_a_key_already_in_redis_sends_no_value(redis_server, redis_prefix, allocator, make_chunk):
    raw = redis.Redis.from_url(redis_server.url)
    backend = RedisBackend(redis_config(redis_server.url, remote_key_prefix=redis_prefix))
    src = obj_of(allocator, make_chunk(1, CHUNK))
    raw.config_resetstat()
    assert await backend.put(key(1), src)
    assert await backend.put(key(1), src)  # e.g. another instance stored it, or L1 evicted it
    sets = raw.info("commandstats").get("cmdstat_set", {}).get("calls", 0)
    assert sets == 1 and metrics.value("stored_chunks", tier="redis") == 1
    src.ref_down()
    raw.close()
    await backend.close()
