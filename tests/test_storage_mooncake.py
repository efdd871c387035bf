"""Tests for lmcache_vllm.storage.mooncake against a real Mooncake Store (a `mooncake_master` and
`mooncake_client` storage hosts on free loopback ports, tests/mooncake_servers.py): zero-copy batches in our
chunk format, planted and short values, the MAC, and the faults: a master down at start, killed, frozen or
restarted empty, a storage host killed, an object gone between the lookup and the read. Every fault is a
counted miss within a bounded time, never wrong bytes, an exception or leaked memory."""

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from mooncake_servers import MooncakeStore, raw_client
from test_storage_redis import obj_of

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import kv_events, metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.mooncake import MooncakeBackend
from lmcache_vllm.storage.registry import unprotected_tiers
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.tokens import CacheKey

CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16
SPEC = (CHUNK, torch.bfloat16)
MOONCAKE = "mooncake"


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"  # a CacheKey string (KV events name its digest)


def mooncake_config(url: str, prefix: str, **extra) -> LMCacheConfig:
    return LMCacheConfig(remote_url=url, extra_config={"remote_key_prefix": prefix, "global_segment_size": 0,
                                                       **extra})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One master and one storage host, shared by the tests that leave them running."""
    deployment = MooncakeStore(tmp_path_factory.mktemp("mooncake"))
    try:
        yield deployment.start()
    finally:
        deployment.stop()


@pytest.fixture
def fresh_store(tmp_path):
    """A master and a storage host of this test alone (it kills or freezes them)."""
    made = []

    def make(**kwargs) -> MooncakeStore:
        made.append(MooncakeStore(tmp_path / f"store{len(made)}", **kwargs))
        return made[-1]
    yield make
    for deployment in made:
        deployment.stop()


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


def expected(keys, spec=SPEC) -> dict:
    return {k: spec for k in keys}


def reader(allocator, keys, spec=SPEC) -> codec.ExpectedAlloc:
    return codec.ExpectedAlloc(lambda shape, dtype: allocator.allocate(shape, dtype), expected(keys, spec))


async def put_all(backend, allocator, chunks, first: int = 0) -> list[bool]:
    objs = [obj_of(allocator, t) for t in chunks]
    try:
        return list(await asyncio.gather(*(backend.put(key(first + i), o) for i, o in enumerate(objs))))
    finally:
        for obj in objs:
            obj.ref_down()


def release(objs) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_down()


async def test_round_trip_zero_copy_batches_in_our_chunk_format(store, prefix, allocator, make_chunk):
    kv_events.RECORDER.enabled = True
    backend = MooncakeBackend(mooncake_config(store.url, prefix))
    assert backend.start_problem is None
    chunks = [make_chunk(i, CHUNK) for i in range(6)]
    assert await put_all(backend, allocator, chunks) == [True] * 6  # concurrent puts: sent in batches
    assert await backend.contains([key(0), key(9), key(5)]) == [True, False, True]
    keys = [key(i) for i in range(7)]
    got = await backend.get_many(keys, reader(allocator, keys))
    assert got[6] is None
    for tensor, obj in zip(chunks, got):
        assert torch.equal(obj.tensor, tensor)
    release(got)
    # Mooncake wrote into the L1 arena and the header arena, both registered (RDMA needs it)
    assert allocator.arena.data_ptr() in backend.client._registered
    # the object is our chunk: header (checksums) + payload, as on disk and in Redis
    raw = raw_client(store.port)
    size = raw.get_size(prefix + key(1))
    header = codec.header_size(key(1), len(CHUNK))
    assert size == header + chunks[1].numel() * 2
    value = raw.get(prefix + key(1))
    assert value[:4] == codec.MAGIC and codec.parse_header(value, key(1)).shape == CHUNK
    raw.close()
    # a put of a key the store has is not sent again, and reports no second event
    assert await put_all(backend, allocator, chunks[:1]) == [True]
    events = kv_events.RECORDER.take()
    assert sorted(e.digest for e in events if e.stored and e.tier == MOONCAKE) == \
        sorted(CacheKey.from_str(key(i)).digest for i in range(6))
    assert metrics.value("stored_chunks", tier=MOONCAKE) == 6
    assert await backend.clear()
    assert await backend.contains(keys[:6]) == [False] * 6
    await backend.close()


async def test_a_read_without_known_shapes_decodes_a_copy(store, prefix, allocator, make_chunk):
    backend = MooncakeBackend(mooncake_config(store.url, prefix))
    chunk = make_chunk(3, CHUNK)
    assert await put_all(backend, allocator, [chunk]) == [True]
    (obj, missing) = await backend.get_many([key(0), key(1)], lambda s, d: allocator.allocate(s, d))
    assert missing is None and torch.equal(obj.tensor, chunk)
    obj.ref_down()
    await backend.close()


def planted_values(make_chunk) -> dict[str, bytes]:
    """Values someone else could write under our keys, none of them the chunk our reader asks for."""
    good = bytes(codec.encode(key(1), make_chunk(1, CHUNK)))
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    bigger = bytes(codec.encode(key(3), make_chunk(3, (2, 2, 64, 64))))  # a header claiming 4x the chunk
    reshaped = bytes(codec.encode(key(4), make_chunk(4, CHUNK).reshape(2, 2, 32, 32)))  # same bytes, other shape
    return {key(1): bytes(flipped), key(2): b"\x80\x04 not a chunk at all" * 100, key(3): bigger,
            key(4): reshaped, key(5): good[:-1000],  # cut short
            key(6): bytes(codec.encode(key(7), make_chunk(6, CHUNK)))}  # another key's chunk


async def test_planted_and_short_values_are_counted_misses_and_removed(store, prefix, allocator, make_chunk):
    backend = MooncakeBackend(mooncake_config(store.url, prefix))
    planted = planted_values(make_chunk)
    raw = raw_client(store.port)
    for k, value in planted.items():
        assert raw.put(prefix + k, value) == 0
    raw.close()
    keys = list(planted)
    peak = []
    alloc = codec.ExpectedAlloc(lambda s, d: peak.append(d.itemsize * torch.Size(s).numel()) or
                                allocator.allocate(s, d), expected(keys))
    assert await backend.get_many(keys, alloc) == [None] * len(keys)
    assert max(peak) == 2 * 2 * 16 * 64 * 2  # never what a planted header claims
    assert metrics.value("corrupt_chunks", tier=MOONCAKE) == len(keys)
    assert await backend.contains(keys) == [False] * len(keys)  # removed, under their leases too
    await backend.close()


async def test_chunks_need_our_mac(store, prefix, allocator, make_chunk):
    plain = MooncakeBackend(mooncake_config(store.url, prefix))
    signed = MooncakeBackend(mooncake_config(store.url, prefix + "mac:"), mac=codec.ChunkMac("s3cret"))
    chunk = make_chunk(1, CHUNK)
    assert await put_all(plain, allocator, [chunk]) == [True]
    assert await put_all(signed, allocator, [chunk]) == [True]
    got = await signed.get_many([key(0)], reader(allocator, [key(0)]))
    assert torch.equal(got[0].tensor, chunk)
    release(got)
    # a well-formed chunk written without the secret where the signed tier reads: refused
    forger = MooncakeBackend(mooncake_config(store.url, prefix + "mac:"))
    assert await put_all(forger, allocator, [chunk], first=9) == [True]
    assert await signed.get_many([key(9)], reader(allocator, [key(9)])) == [None]
    assert metrics.value("unauthenticated_chunks") == 1 and metrics.value("corrupt_chunks", tier=MOONCAKE) == 1
    for backend in (plain, signed, forger):
        await backend.close()


async def test_an_object_gone_between_lookup_and_read_is_a_lost_chunk(store, prefix, allocator, make_chunk):
    backend = MooncakeBackend(mooncake_config(store.url, prefix))
    assert await put_all(backend, allocator, [make_chunk(i, CHUNK) for i in range(2)]) == [True, True]
    keys = [key(0), key(1)]
    assert await backend.contains(keys) == [True, True]
    raw = raw_client(store.port)
    assert raw.remove(prefix + key(1), True) == 0  # evicted, or removed by another instance
    raw.close()
    got = await backend.get_many(keys, reader(allocator, keys))
    assert got[0] is not None and got[1] is None
    assert metrics.value("lost_chunks", tier=MOONCAKE) == 1
    release(got)
    await backend.close()


async def test_a_full_pool_evicts_silently_and_every_read_is_right_or_a_miss(fresh_store, prefix, allocator,
                                                                          make_chunk):
    deployment = fresh_store(segment="16MB").start()  # Mooncake's smallest: room for ~120 of these chunks
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix))
    big, n, step = (2, 2, 256, 64), 300, 30  # 128 KiB chunks
    for first in range(0, n, step):
        await put_all(backend, allocator, [make_chunk(i, big) for i in range(first, first + step)], first)
    keys = [key(i) for i in range(n)]
    listed = await backend.contains(keys)
    assert 0 < sum(listed) < n  # Mooncake evicted some (or refused them when full), without a word
    hits = 0
    for first in range(0, n, step):
        got = await backend.get_many(keys[first:first + step], reader(allocator, keys[first:first + step],
                                                                      (big, torch.bfloat16)))
        for i, obj in enumerate(got, first):
            if obj is not None:
                assert torch.equal(obj.tensor, make_chunk(i, big)), i
                hits += 1
        release(got)
    assert hits + metrics.value("lost_chunks", tier=MOONCAKE) >= sum(listed)
    assert metrics.value("corrupt_chunks", tier=MOONCAKE) == 0
    await backend.close()


async def test_master_down_at_start_then_up(fresh_store, prefix, allocator, make_chunk):
    deployment = fresh_store()  # not started: nothing listens on its port
    start = time.monotonic()
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix, remote_timeout_secs=0.5,
                                              remote_breaker_max_secs=0.5), breaker_base_secs=0.2)
    assert time.monotonic() - start < 5  # bounded: it does not wait for Mooncake's own ~90 s of retries
    assert "no master listens" in backend.start_problem
    assert backend.gauges()["breaker_open"] == 1
    assert await backend.contains([key(0)]) == [False]
    assert await put_all(backend, allocator, [make_chunk(0, CHUNK)]) == [False]
    assert await backend.get_many([key(0)], reader(allocator, [key(0)])) == [None]
    assert metrics.value("failed_reads", tier=MOONCAKE) == 2 and metrics.value("failed_writes", tier=MOONCAKE) == 1
    deployment.start()
    deadline = time.monotonic() + 30
    while not backend.client.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await put_all(backend, allocator, [make_chunk(0, CHUNK)]) == [True]
    got = await backend.get_many([key(0)], reader(allocator, [key(0)]))
    assert torch.equal(got[0].tensor, make_chunk(0, CHUNK)) and backend.gauges()["breaker_open"] == 0
    release(got)
    await backend.close()


async def until(what, check, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


async def test_master_killed_mid_run_then_restarted_empty(fresh_store, prefix, allocator, make_chunk):
    deployment = fresh_store().start()
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix, remote_timeout_secs=0.5,
                                              remote_breaker_max_secs=1.0, mooncake_threads=2),
                              breaker_base_secs=0.5)
    chunks = [make_chunk(i, CHUNK) for i in range(4)]
    keys = [key(i) for i in range(4)]
    assert await put_all(backend, allocator, chunks) == [True] * 4
    deployment.master.kill()
    start = time.monotonic()
    for _ in range(10):  # the first calls fail (Mooncake: ~4 s each); then the breaker answers at once
        assert await backend.get_many(keys, reader(allocator, keys)) == [None] * 4
        assert await backend.contains(keys) == [False] * 4
        assert await put_all(backend, allocator, chunks[:1]) == [False]
    assert time.monotonic() - start < 15  # without deadlines: 30 calls x ~4 s
    assert backend.client.busy_threads <= 2  # calls past their deadline never pile up threads
    assert metrics.value("breaker_skipped_calls", tier=MOONCAKE) > 0
    assert metrics.value("failed_reads", tier=MOONCAKE) >= 20
    deployment.restart_master()  # empty: what was stored is gone
    async def stored_again() -> bool:
        return all(await put_all(backend, allocator, chunks[:2]))
    await until("the tier to store again after the restart", stored_again)
    assert await backend.contains(keys) == [True, True, False, False]  # the rest: misses, not errors
    got = await backend.get_many(keys, reader(allocator, keys))
    assert [g is not None for g in got] == [True, True, False, False]
    assert torch.equal(got[1].tensor, chunks[1])
    release(got)
    await backend.close()


def freeze(pid: int) -> None:
    """SIGSTOP, then wait until every thread of `pid` has stopped: the signal takes effect asynchronously, and a
    master still running for a moment answers the first call (once seen on a loaded machine)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


async def test_frozen_master_is_bounded_by_the_timeout(fresh_store, prefix, allocator, make_chunk):
    deployment = fresh_store().start()
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix, remote_timeout_secs=0.5))
    assert await put_all(backend, allocator, [make_chunk(0, CHUNK)]) == [True]
    freeze(deployment.master.proc.pid)
    try:
        start = time.monotonic()
        # key(1): never read, so its replica is not in the client's cache (key(0)'s may be: a read of it can
        # go straight to the storage host)
        assert await backend.get_many([key(1)], reader(allocator, [key(1)])) == [None]
        assert await backend.contains([key(0)]) == [False]
        assert await backend.contains([key(0)]) == [False]  # by now the breaker is open: at once
        assert time.monotonic() - start < 3
        assert metrics.value("breaker_skipped_calls", tier=MOONCAKE) >= 1
    finally:
        os.kill(deployment.master.proc.pid, signal.SIGCONT)
    async def answers() -> bool:
        return (await backend.contains([key(0)])) == [True]
    await until("the master to answer again", answers, timeout=30)
    await backend.close()


async def test_killed_storage_host_makes_its_listed_chunks_lost(fresh_store, prefix, allocator, make_chunk):
    deployment = fresh_store().start()
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix, remote_timeout_secs=1.0))
    keys = [key(i) for i in range(3)]
    assert await put_all(backend, allocator, [make_chunk(i, CHUNK) for i in range(3)]) == [True] * 3
    deployment.hosts[0].kill()
    assert await backend.contains(keys) == [True] * 3  # the master lists them until the host's lease ends
    start = time.monotonic()
    assert await backend.get_many(keys, reader(allocator, keys)) == [None] * 3
    assert time.monotonic() - start < 5
    assert metrics.value("lost_chunks", tier=MOONCAKE) == 3
    # removed: the master would list them until the host's lease ends, and every lookup find them in vain
    assert await backend.contains(keys) == [False] * 3
    assert await put_all(backend, allocator, [make_chunk(9, CHUNK)], first=9) == [False]  # no segment left
    await backend.close()  # returns the quarantined memory of the failed transfers (the allocator checks)


async def test_close_with_the_master_gone_is_bounded(fresh_store, prefix):
    deployment = fresh_store().start()
    backend = MooncakeBackend(mooncake_config(deployment.url, prefix))
    assert await backend.contains([key(0)]) == [False]
    deployment.master.kill()
    start = time.monotonic()
    await backend.close()
    assert time.monotonic() - start < 10


def test_configured_as_the_shared_tier_with_a_manager(store, prefix, make_chunk):
    config = LMCacheConfig(remote_url=store.url, max_local_cpu_size=16 / 1024, blocking_timeout_secs=10.0,
                           extra_config={"remote_key_prefix": prefix, "global_segment_size": 0})
    assert unprotected_tiers(config, None) == {
        "mooncake": "every instance, and anyone who reaches the Mooncake master or a storage host, writes it"}
    chunks = [make_chunk(i, CHUNK) for i in range(3)]
    keys = [key(i) for i in range(3)]
    with StorageManager(config) as writer:
        assert [t.name for t in writer.lower] == [Tier.MOONCAKE]
        for k, tensor in zip(keys, chunks):
            obj = writer.allocate(tensor.shape, tensor.dtype)
            obj.tensor.copy_(tensor)
            writer.put(k, obj)
            obj.ref_down()
        assert writer.wait_written(keys, 10.0)
    with StorageManager(config) as reader_mgr:  # another process's view: nothing in its L1
        assert reader_mgr.prefix_tiers(keys) == [Tier.MOONCAKE] * 3
        got = reader_mgr.get(keys, expected=[SPEC] * 3)
        assert [torch.equal(o.tensor, t) for o, t in zip(got, chunks)] == [True] * 3
        release(got)
        assert metrics.value("chunk_hits", tier=MOONCAKE) == 3
