"""Tests for lmcache_vllm.storage.manager.StorageManager with real tiers (arena, files, redis-server):
write-through, promotion, prefixes across tiers, dropped stores, faults, prefetch and clean shutdown."""

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import redis
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.local_disk import filename_for
from lmcache_vllm.storage.manager import StorageManager

CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16
MiB = 1 << 20


def key(i: int) -> str:
    return f"m@1@0@bfloat16@v1@{i:064x}"


def config(**kw) -> LMCacheConfig:
    extra = kw.pop("extra", {})
    kw.setdefault("max_local_cpu_size", 16 * MiB / (1 << 30))
    return LMCacheConfig(blocking_timeout_secs=kw.pop("blocking_timeout_secs", 5.0),
                         extra_config={"close_drain_secs": 2.0, **extra}, **kw)


def store(mgr: StorageManager, i: int, tensor: torch.Tensor) -> None:
    obj = mgr.allocate(tensor.shape, tensor.dtype)
    obj.tensor.copy_(tensor)
    mgr.put(key(i), obj)
    obj.ref_down()


def check_and_release(objs, expected) -> None:
    assert len(objs) == len(expected)
    for obj, t in zip(objs, expected):
        assert torch.equal(obj.tensor, t)
        obj.ref_down()


def test_l1_round_trip_and_prefix(make_chunk):
    with StorageManager(config()) as mgr:
        chunks = [make_chunk(i, CHUNK) for i in range(3)]
        for i in (0, 1, 2):
            store(mgr, i, chunks[i])
        assert mgr.contains([key(0), key(5), key(2)]) == [True, False, True]
        assert mgr.contains_prefix([key(0), key(1), key(5), key(2)]) == 2
        check_and_release(mgr.get([key(0), key(1), key(5), key(2)]), chunks[:2])
        assert metrics.value("chunk_hits", tier="local_cpu") == 2


def test_write_through_promotion_and_restart(tmp_path, redis_server, redis_prefix, make_chunk):
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01, remote_url=redis_server.url,
                 extra={"remote_key_prefix": redis_prefix})
    chunks = [make_chunk(i, CHUNK) for i in range(4)]
    with StorageManager(cfg) as mgr:
        for i, t in enumerate(chunks):
            store(mgr, i, t)
        assert mgr.flush()
        assert os.path.exists(tmp_path / filename_for(key(3)))
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.exists(*(redis_prefix + key(i) for i in range(4))) == 4
        mgr.l1.clear_sync()
        os.unlink(tmp_path / filename_for(key(2)))  # chunk 2 only in redis now
        mgr.lower[0]._index.forget(key(2))
        raw.delete(redis_prefix + key(1))  # chunk 1 only on disk
        assert mgr.contains_prefix([key(i) for i in range(5)]) == 4
        # where a load would read each chunk from: the first tier holding it
        assert mgr.prefix_tiers([key(i) for i in range(5)]) == ["local_disk", "local_disk", "redis",
                                                                "local_disk"]
        check_and_release(mgr.get([key(i) for i in range(5)]), chunks)
        assert mgr.prefix_tiers([key(i) for i in range(5)]) == ["local_cpu"] * 4  # promoted
        assert metrics.value("chunk_hits", tier="local_disk") == 3
        assert metrics.value("chunk_hits", tier="redis") == 1
        assert all(mgr.l1.contains_sync(key(i)) for i in range(4))  # promoted
        check_and_release(mgr.get([key(2)]), chunks[2:3])
        assert metrics.value("chunk_hits", tier="redis") == 1  # served by L1 this time
        raw.close()
    # a restarted process (new manager) finds the disk chunks again
    with StorageManager(config(local_disk=str(tmp_path), max_local_disk_size=0.01)) as mgr2:
        assert mgr2.contains_prefix([key(0), key(1)]) == 2
        check_and_release(mgr2.get([key(0), key(1)]), chunks[:2])


def test_full_write_queue_drops_stores(redis_server, redis_prefix, make_chunk):
    cfg = config(remote_url=redis_server.url, extra={
        "remote_key_prefix": redis_prefix, "write_queue_depth": 2, "write_workers": 1,
        "remote_timeout_secs": 1.0})
    with StorageManager(cfg) as mgr:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the writer hangs on its first SET
        try:
            start = time.monotonic()
            for i in range(6):
                store(mgr, i, make_chunk(i, CHUNK))
            assert time.monotonic() - start < 0.5  # put never waits for the slow tier
            assert metrics.value("dropped_stores", reason="queue_full") == 4
            assert all(mgr.l1.contains_sync(key(i)) for i in range(6))  # L1 has them all
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert mgr.flush()


def test_two_processes_share_chunks_through_redis(redis_server, redis_prefix, make_chunk):
    script = textwrap.dedent(f"""
        import torch
        from lmcache_vllm.config import LMCacheConfig
        from lmcache_vllm.storage.manager import StorageManager
        cfg = LMCacheConfig(max_local_cpu_size=0.01, remote_url={redis_server.url!r},
                            extra_config={{"remote_key_prefix": {redis_prefix!r}}})
        mgr = StorageManager(cfg)
        for i in range(3):
            t = torch.randn({CHUNK!r}, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            obj = mgr.allocate(t.shape, t.dtype)
            obj.tensor.copy_(t)
            mgr.put("m@1@0@bfloat16@v1@" + format(i, "064x"), obj)
            obj.ref_down()
        assert mgr.flush()
        mgr.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with StorageManager(config(remote_url=redis_server.url,
                               extra={"remote_key_prefix": redis_prefix})) as mgr:
        assert mgr.contains_prefix([key(i) for i in range(4)]) == 3
        check_and_release(mgr.get([key(i) for i in range(3)]), [make_chunk(i, CHUNK) for i in range(3)])


def test_redis_killed_mid_run_then_restarted(redis_server, redis_prefix, make_chunk):
    cfg = config(remote_url=redis_server.url, blocking_timeout_secs=2.0,
                 extra={"remote_key_prefix": redis_prefix, "remote_timeout_secs": 0.5,
                        "remote_breaker_max_secs": 0.3})
    with StorageManager(cfg) as mgr:
        store(mgr, 0, make_chunk(0, CHUNK))
        assert mgr.flush()
        mgr.l1.clear_sync()
        redis_server.kill()
        try:
            start = time.monotonic()
            assert mgr.contains_prefix([key(0)]) == 0
            assert mgr.get([key(0)]) == []
            store(mgr, 1, make_chunk(1, CHUNK))  # no exception; the write-through is dropped
            assert mgr.flush()
            assert time.monotonic() - start < 2.0
            assert metrics.value("failed_reads", tier="redis") >= 1
            assert metrics.value("failed_writes", tier="redis") >= 1
            assert metrics.value("breaker_open", tier="redis") == 1
        finally:
            redis_server.restart()
        mgr.l1.clear_sync()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the breaker closes after its short backoff
            store(mgr, 2, make_chunk(2, CHUNK))
            assert mgr.flush()
            mgr.l1.clear_sync()
            if mgr.contains_prefix([key(2)]) == 1:
                break
            time.sleep(0.1)
        check_and_release(mgr.get([key(2)]), [make_chunk(2, CHUNK)])


def test_frozen_redis_get_returns_within_timeout(redis_server, redis_prefix, make_chunk):
    cfg = config(remote_url=redis_server.url, blocking_timeout_secs=0.3,
                 extra={"remote_key_prefix": redis_prefix, "remote_timeout_secs": 5.0})
    with StorageManager(cfg) as mgr:
        store(mgr, 0, make_chunk(0, CHUNK))
        assert mgr.flush()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert len(mgr.get([key(0), key(1)])) == 1  # L1 answers, the frozen tier times out
            assert time.monotonic() - start < 1.0
            assert metrics.value("storage_timeouts", op="get") == 1
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_corrupt_redis_entry_is_counted_and_removed(redis_server, redis_prefix, make_chunk):
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(redis_prefix + key(0), b"garbage" * 100)
    with StorageManager(config(remote_url=redis_server.url,
                               extra={"remote_key_prefix": redis_prefix})) as mgr:
        assert mgr.contains_prefix([key(0)]) == 1  # it exists ...
        assert mgr.get([key(0)]) == []  # ... but is not a chunk
        assert metrics.value("corrupt_chunks", tier="redis") == 1
        assert raw.exists(redis_prefix + key(0)) == 0
    raw.close()


def test_prefetch_and_cancel_leak_nothing(tmp_path, make_chunk):
    big = (4, 2, 256, 512)  # 2 MiB chunks
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.1, max_local_cpu_size=64 * MiB / (1 << 30))
    chunks = [make_chunk(i, big) for i in range(8)]
    with StorageManager(cfg) as mgr:
        for i, t in enumerate(chunks):
            store(mgr, i, t)
        assert mgr.flush()
        mgr.l1.clear_sync()
        assert mgr.allocator.used_bytes == 0
        handle = mgr.prefetch([key(i) for i in range(8)])
        assert handle.wait(10) == 8 and all(mgr.l1.contains_sync(key(i)) for i in range(8))
        assert mgr.allocator.used_bytes == 8 * chunks[0].numel() * 2  # L1's entries, also held
        handle.cancel()  # drops the holds; the entries stay in L1
        assert mgr.allocator.used_bytes == 8 * chunks[0].numel() * 2 and len(mgr.l1) == 8
        for _ in range(10):
            mgr.l1.clear_sync()
            handle = mgr.prefetch([key(i) for i in range(8)])
            handle.cancel()
            # Whatever the cancelled prefetch read ends up in L1 (owned by it) or freed; disk reads already
            # in flight finish on their threads and are freed then, so allow them a bounded time. The
            # handle says done once nothing of it runs any more (a cancel can come before its reads even
            # start: waiting for no read in flight alone let it read on into the next round).
            disk = mgr.lower[0]
            deadline = time.monotonic() + 10
            while (not handle.done() or disk.reads_in_flight) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert handle.done(), "the cancelled prefetch did not end within 10 s"
            assert disk.reads_in_flight == 0, "cancelled disk reads did not finish within 10 s"
            # No read can allocate any more; the releases of the ones that just finished follow at once.
            while True:
                in_l1 = sum(mgr.l1.contains_sync(key(i)) for i in range(8))
                if mgr.allocator.num_live == in_l1 or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert handle.done()
            assert mgr.allocator.used_bytes == in_l1 * chunks[0].numel() * 2
            assert mgr.allocator.num_live == in_l1
        got = mgr.get([key(0)])
        assert len(got) == 1, {f"{name}.{tier}": metrics.value(name, tier=tier)
                               for name in ("chunk_hits", "chunk_misses", "read_alloc_failures", "failed_reads",
                                            "corrupt_chunks")
                               for tier in ("local_cpu", "local_disk")} | {"in_l1": in_l1}
        check_and_release(got, chunks[:1])


def settle(mgr: StorageManager, timeout: float = 10.0) -> None:
    """Waits until nothing runs on the manager's loop but its writers (whatever a cancel left going)."""
    async def others_done():
        me = asyncio.current_task()
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not me and t not in mgr._writers),
                             return_exceptions=True)

    asyncio.run_coroutine_threadsafe(others_done(), mgr._loop).result(timeout)


def test_a_cancel_as_the_tiers_answer_stops_the_prefetch(tmp_path, make_chunk, monkeypatch):
    """The cause of test_prefetch_and_cancel_leak_nothing's rare failure, made deterministic: a cancel
    that reaches the prefetch just as the lower tiers answered was swallowed (asyncio.wait_for before
    Python 3.12 returns the finished inner result instead of raising), so the prefetch of a request that
    went away read every chunk into the arena anyway, while its handle already said done. Several such
    prefetches filled the arena, and a later get found no memory to read into (read_alloc_failures, a miss
    that looked like none). The ordering is set here with an event on the storage loop."""
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.1)
    with StorageManager(cfg) as mgr:
        for i in range(4):
            store(mgr, i, make_chunk(i, CHUNK))
        assert mgr.flush()
        mgr.l1.clear_sync()
        real_locate = type(mgr)._locate
        gate: dict = {}
        reached = threading.Event()

        async def gated_locate(self, keys, tiers=None):
            gate["answer"] = asyncio.Event()
            reached.set()
            await gate["answer"].wait()  # the tiers answer when the test says so
            return await real_locate(self, keys, tiers)

        monkeypatch.setattr(type(mgr), "_locate", gated_locate)
        handle = mgr.prefetch([key(i) for i in range(4)])
        assert reached.wait(10)
        # In one step of the loop: the tiers answer, then the request goes away.
        mgr._loop.call_soon_threadsafe(lambda: (gate["answer"].set(), handle.cancel()))
        settle(mgr)
        assert handle.done(), "the cancelled prefetch never ended"
        assert metrics.value("chunk_hits", tier="local_disk") == 0, "a cancelled prefetch went on reading"
        assert mgr.allocator.num_live == 0 and len(mgr.l1) == 0 and mgr._holds.num_held() == 0


def test_close_leaves_no_threads_or_fds(tmp_path, redis_server, redis_prefix, make_chunk):
    threads_before = set(threading.enumerate())
    fds_before = set(os.listdir("/proc/self/fd"))
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01, remote_url=redis_server.url,
                 extra={"remote_key_prefix": redis_prefix})
    mgr = StorageManager(cfg)
    for i in range(4):
        store(mgr, i, make_chunk(i, CHUNK))
    assert mgr.flush()
    mgr.l1.clear_sync()
    check_and_release(mgr.get([key(i) for i in range(4)]), [make_chunk(i, CHUNK) for i in range(4)])
    assert len(set(threading.enumerate()) - threads_before) >= 2  # loop thread + disk pool
    mgr.close()
    mgr.close()  # idempotent
    assert set(threading.enumerate()) - threads_before == set()
    assert set(os.listdir("/proc/self/fd")) - fds_before == set()
    assert mgr.allocator.used_bytes == 0
    assert mgr.get([key(0)]) == [] and mgr.contains_prefix([key(0)]) == 0


def test_staging_only_l1(tmp_path, make_chunk):
    cfg = LMCacheConfig(local_cpu=False, max_local_cpu_size=0.0, local_disk=str(tmp_path),
                        max_local_disk_size=0.01)
    with StorageManager(cfg) as mgr:
        store(mgr, 0, make_chunk(0, CHUNK))
        assert mgr.flush()
        assert len(mgr.l1) == 0
        check_and_release(mgr.get([key(0)]), [make_chunk(0, CHUNK)])
        assert mgr.allocator.used_bytes == 0 and metrics.value("chunk_hits", tier="local_disk") == 1


def test_prefetch_holds_until_get_cancel_or_timeout(tmp_path, make_chunk):
    big = (4, 2, 256, 512)  # 2 MiB chunks; L1 has room for 4.5 of them
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.1, max_local_cpu_size=9 * MiB / (1 << 30),
                 extra={"prefetch_hold_secs": 60.0})
    chunks = [make_chunk(i, big) for i in range(8)]
    with StorageManager(cfg) as mgr:
        for i, t in enumerate(chunks):
            store(mgr, i, t)
            assert mgr.flush()
        mgr.l1.clear_sync()
        handle = mgr.prefetch([key(i) for i in range(4)])
        assert handle.wait(10) == 4 and metrics.value("prefetch_held_chunks") == 4
        disk_hits = metrics.value("chunk_hits", tier="local_disk")
        # Another request's get would evict chunks 0-3 under plain LRU; held, they stay.
        assert mgr.get([key(i) for i in range(4, 8)]) == []
        check_and_release(mgr.get([key(i) for i in range(4)]), chunks[:4])
        assert metrics.value("chunk_hits", tier="local_disk") == disk_hits  # served from memory, not re-read
        assert metrics.value("prefetch_held_chunks") == 0  # the get took the holds over
        # cancel: every hold released, nothing but L1's own entries left in the arena
        mgr.l1.clear_sync()
        handle = mgr.prefetch([key(i) for i in range(4, 8)])
        assert handle.wait(10) == 4 and metrics.value("prefetch_held_chunks") == 4
        handle.cancel()
        assert metrics.value("prefetch_held_chunks") == 0
        assert mgr.allocator.num_live == len(mgr.l1)
        # close releases holds too
        mgr.l1.clear_sync()
        assert mgr.prefetch([key(0)]).wait(10) == 1 and metrics.value("prefetch_held_chunks") == 1
    assert mgr.allocator.used_bytes == 0
    # timeout: a prefetch nobody gets or cancels lets go after prefetch_hold_secs
    cfg = dataclasses.replace(cfg, extra_config=dataclasses.replace(cfg.extra_config, prefetch_hold_secs=0.2))
    with StorageManager(cfg) as mgr:
        assert mgr.prefetch([key(i) for i in range(2)]).wait(10) == 2
        deadline = time.monotonic() + 5
        while metrics.value("prefetch_held_chunks") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics.value("prefetch_held_chunks") == 0
        assert mgr.allocator.num_live == len(mgr.l1) == 2


def test_a_prefetch_of_l1_chunks_wakes_no_other_thread(make_chunk):
    """A lookup runs on vLLM's step: a prefetch whose chunks are all in L1 hands nothing to the storage loop (its
    hold time is kept as a deadline the loop sweeps), so the step never waits for that thread to give the GIL
    back; the hold still ends on time."""
    cfg = config(extra={"prefetch_hold_secs": 0.2})
    with StorageManager(cfg) as mgr:
        for i in range(3):
            store(mgr, i, make_chunk(i, CHUNK))
        handed = []
        real = mgr._loop.call_soon_threadsafe
        mgr._loop.call_soon_threadsafe = lambda *args: (handed.append(args), real(*args))[1]
        try:
            handle = mgr.prefetch([key(i) for i in range(3)])
        finally:
            mgr._loop.call_soon_threadsafe = real
        assert handle.wait(0) == 3 and handed == []
        assert metrics.value("prefetch_held_chunks") == 3
        deadline = time.monotonic() + 5
        while metrics.value("prefetch_held_chunks") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics.value("prefetch_held_chunks") == 0


def test_a_store_of_many_chunks_wakes_the_loop_once(tmp_path, make_chunk):
    """The save thread's store hands its write-throughs to the storage loop in one call: each wake-up of that
    thread takes the GIL from whoever runs, vLLM's step among them. Every chunk still reaches the disk."""
    with StorageManager(config(local_disk=str(tmp_path), max_local_disk_size=0.01)) as mgr:
        objs = []
        for i in range(4):
            obj = mgr.allocate(CHUNK, torch.bfloat16)
            obj.tensor.copy_(make_chunk(i, CHUNK))
            objs.append(obj)
        handed = []
        real = mgr._loop.call_soon_threadsafe
        mgr._loop.call_soon_threadsafe = lambda *args: (handed.append(args), real(*args))[1]
        try:
            mgr.put_many([key(i) for i in range(4)], objs)
        finally:
            mgr._loop.call_soon_threadsafe = real
        for obj in objs:
            obj.ref_down()
        assert len(handed) == 1
        assert mgr.flush()
        mgr.l1.clear_sync()
        check_and_release(mgr.get([key(i) for i in range(4)]), [make_chunk(i, CHUNK) for i in range(4)])
        assert metrics.value("chunk_hits", tier="local_disk") == 4


def test_two_live_processes_share_a_disk_directory(tmp_path, make_chunk):
    # Two managers (as two vLLM processes would) on one directory, both started before any write:
    # each sees the other's chunks at once, without a restart.
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    with StorageManager(cfg) as writer, StorageManager(cfg) as reader:
        assert reader.contains_prefix([key(0)]) == 0
        store(writer, 0, make_chunk(0, CHUNK))
        store(writer, 1, make_chunk(1, CHUNK))
        assert writer.flush()
        assert reader.contains([key(0), key(1)]) == [False, False]  # L1 only: no I/O
        assert reader.contains_prefix([key(0), key(1), key(2)]) == 2
        check_and_release(reader.get([key(0), key(1), key(2)]), [make_chunk(0, CHUNK), make_chunk(1, CHUNK)])
        assert metrics.value("adopted_chunks", tier="local_disk") == 2
        # a file the other process removed is a miss again (never a stale hit)
        store(writer, 3, make_chunk(3, CHUNK))
        assert writer.flush()
        assert reader.contains_prefix([key(3)]) == 1
        os.unlink(tmp_path / filename_for(key(3)))
        assert reader.get([key(3)]) == []


def test_clear_empties_l1_and_on_request_the_lower_tiers(tmp_path, redis_server, redis_prefix, make_chunk):
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01, remote_url=redis_server.url,
                 extra={"remote_key_prefix": redis_prefix})
    with StorageManager(cfg) as mgr:
        for i in range(3):
            store(mgr, i, make_chunk(i, CHUNK))
        assert mgr.flush()
        assert mgr.clear(lower_tiers=False)
        assert len(mgr.l1) == 0 and mgr.prefix_tiers([key(0)]) == ["local_disk"]
        assert mgr.clear()
        assert mgr.contains_prefix([key(0)]) == 0 and not list(tmp_path.glob("*.lmc"))
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.keys(redis_prefix + "*") == []
        raw.close()
        redis_server.kill()
        try:
            assert not mgr.clear()  # an unreachable tier: not done
        finally:
            redis_server.restart()
