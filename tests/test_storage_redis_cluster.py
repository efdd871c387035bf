"""The Redis tier on a real 3-node Redis Cluster (redis-server --cluster-enabled, made with redis-cli
--cluster create): chunks spread over the nodes, per-node pipelines and metrics, a SIGKILLed node making only
its own keys misses while the others serve, and a slot resharding (redis-cli --cluster reshard) under reads
and writes losing nothing."""

import asyncio
import threading
import time

import pytest
import torch
from redis.crc import key_slot

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.redis import RedisBackend

pytestmark = pytest.mark.redis
CHUNK = (2, 2, 16, 64)


def key(i: int) -> str:
    return f"m@1@0@bfloat16@v1@{i:064x}"


def cluster_backend(cluster, prefix: str, **extra) -> RedisBackend:
    return RedisBackend(LMCacheConfig(remote_url=cluster.url, extra_config={"remote_key_prefix": prefix, **extra}),
                        breaker_base_secs=0.2)


@pytest.fixture
def allocator():
    alloc = HostAllocator(32 << 20)
    yield alloc
    assert alloc.used_bytes == 0, "a test leaked MemoryObjs"


def alloc_fn(allocator):
    return lambda shape, dtype: allocator.allocate(shape, dtype)


def chunk(i: int) -> torch.Tensor:
    return torch.full(CHUNK, float(i % 251), dtype=torch.bfloat16)


async def put_all(backend, allocator, ids) -> list[bool]:
    out = []
    for i in ids:
        obj = allocator.allocate(CHUNK, torch.bfloat16)
        obj.tensor.copy_(chunk(i))
        out.append(await backend.put(key(i), obj))
        obj.ref_down()
    return out


async def read_all(backend, allocator, ids) -> list[bool]:
    """Which of `ids` read back with their own bytes (objects released)."""
    got = await backend.get_many([key(i) for i in ids], alloc_fn(allocator))
    ok = []
    for i, obj in zip(ids, got):
        ok.append(obj is not None and torch.equal(obj.tensor, chunk(i)))
        if obj is not None:
            obj.ref_down()
    return ok


def port_of(slot_map, prefix: str, i: int) -> int:
    slot = key_slot((prefix + key(i)).encode())
    return next(port for first, last, port in slot_map if first <= slot <= last)


async def test_chunks_spread_over_the_nodes_and_read_back(redis_cluster, redis_prefix, allocator):
    backend = cluster_backend(redis_cluster, redis_prefix, remote_read_batch_keys=4, remote_read_groups=2)
    assert backend.start_problem is None
    ids = list(range(40))
    assert all(await put_all(backend, allocator, ids))
    per_node = redis_cluster.keys_per_node(redis_prefix + "*")
    assert sum(per_node.values()) == 40 and sum(1 for n in per_node.values() if n) == 3, per_node
    assert await read_all(backend, allocator, ids) == [True] * 40
    assert await backend.contains([key(0), key(99), key(39)]) == [True, False, True]
    assert await read_all(backend, allocator, [7, 1000]) == [True, False]
    snap = metrics.flat(metrics.snapshot())
    served = {name: v for name, v in snap.items() if name.startswith("redis_node_read_chunks.")}
    assert len(served) == 3 and sum(served.values()) == 41, served  # each node served its own keys
    assert sum(v for n, v in snap.items() if n.startswith("redis_node_stored_chunks.")) == 40
    assert metrics.value("failed_reads", tier="redis") == 0 and not backend.breaker_open
    assert await backend.ping()
    assert await backend.clear()
    assert sum(redis_cluster.keys_per_node(redis_prefix + "*").values()) == 0
    await backend.close()


async def test_in_flight_limit_per_node_queues_calls(redis_cluster, redis_prefix, allocator):
    # one connection slot per node: 12 concurrent batched reads wait for it in turn, none fails
    backend = cluster_backend(redis_cluster, redis_prefix, remote_max_connections=1)
    assert all(await put_all(backend, allocator, range(12)))
    results = await asyncio.gather(*(read_all(backend, allocator, range(12)) for _ in range(12)))
    assert results == [[True] * 12] * 12
    assert metrics.value("failed_reads", tier="redis") == 0
    await backend.close()


async def test_killed_node_makes_only_its_keys_misses(make_cluster, allocator):
    cluster = make_cluster()
    slot_map = cluster.wait_agreed()
    prefix = "kill:"
    backend = cluster_backend(cluster, prefix, remote_timeout_secs=1.0, remote_breaker_max_secs=0.4)
    ids = list(range(60))
    assert all(await put_all(backend, allocator, ids))
    victim = cluster.nodes[1]
    on_victim = {i for i in ids if port_of(slot_map, prefix, i) == victim.port}
    assert 0 < len(on_victim) < len(ids)
    victim.kill()
    started = time.monotonic()
    assert await read_all(backend, allocator, ids) == [i not in on_victim for i in ids]
    assert await backend.contains([key(i) for i in ids]) == [i not in on_victim for i in ids]
    assert time.monotonic() - started < 3.0
    victim_name = f"127.0.0.1:{victim.port}"
    assert metrics.value("redis_node_failed_calls", node=victim_name) >= 1
    assert metrics.value("failed_reads", tier="redis") >= 1
    # Past the cluster's node timeout the others mark it failed; they keep serving their own slots
    # (cluster-require-full-coverage no), and writes of keys on live nodes go on.
    time.sleep(3.0)
    again = await read_all(backend, allocator, ids)
    assert again == [i not in on_victim for i in ids]
    new_ids = list(range(100, 160))
    stored = await put_all(backend, allocator, new_ids)
    assert stored == [port_of(slot_map, prefix, i) != victim.port for i in new_ids]
    assert metrics.value("failed_writes", tier="redis") == stored.count(False) > 0
    gauges = metrics.flat(metrics.snapshot())
    assert gauges[f"redis_node_breaker_open.{victim_name}"] == 1
    assert sum(v for n, v in gauges.items() if n.startswith("redis_node_breaker_open.")) == 1
    await backend.close()


async def test_resharding_under_load_loses_nothing(make_cluster, allocator):
    cluster = make_cluster()
    prefix = "reshard:"
    backend = cluster_backend(cluster, prefix)
    ids = list(range(300))
    assert all(await put_all(backend, allocator, ids))
    source, target = cluster.nodes[0], cluster.nodes[2]
    before = cluster.wait_agreed()
    done = threading.Event()
    failure: list[BaseException] = []

    def reshard():
        try:
            cluster.reshard(source, target, 2000)  # keys move one by one (MIGRATE) while we read and write
        except BaseException as exc:  # reported by the test below
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=reshard)
    thread.start()
    rounds, during, next_id = 0, 0, 1000
    try:
        while not done.is_set() or rounds < 3:
            assert await read_all(backend, allocator, ids) == [True] * len(ids), f"round {rounds}"
            batch = list(range(next_id, next_id + 10))
            assert all(await put_all(backend, allocator, batch)), f"round {rounds}"
            ids += batch
            next_id += 10
            rounds += 1
            during += not done.is_set()
    finally:
        thread.join(300)
    assert not failure, failure
    after = cluster.wait_agreed()
    moved = [i for i in ids if port_of(before, prefix, i) != port_of(after, prefix, i)]
    assert moved and all(port_of(after, prefix, i) == target.port for i in moved)
    assert during >= 1  # reads and writes ran while slots moved
    assert sum(cluster.keys_per_node(prefix + "*").values()) == len(ids)
    assert await read_all(backend, allocator, ids) == [True] * len(ids)
    snap = metrics.flat(metrics.snapshot())
    assert sum(v for n, v in snap.items() if n.startswith("redis_node_redirects.")) >= 1  # slots did move
    assert metrics.value("failed_reads", tier="redis") == 0 and metrics.value("failed_writes", tier="redis") == 0
    await backend.close()
