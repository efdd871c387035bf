"""The Redis tier behind real Sentinels (one master, one replica, three Sentinels, all redis-server
processes): the master is found through the Sentinels, and when it is SIGKILLed the failover is a short burst
of counted failed writes and misses, then writes go to the new master without a restart of the tier."""

import asyncio
import logging
import time

import pytest
import torch
from redis_servers import SentinelSet

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.redis import RedisBackend

pytestmark = pytest.mark.redis
CHUNK = (2, 2, 16, 64)
PASSWORD = "s3ntinel-secret"


def key(i: int) -> str:
    return f"m@1@0@bfloat16@v1@{i:064x}"


@pytest.fixture
def sentinels(tmp_path):
    deployment = SentinelSet(tmp_path / "sentinel", password=PASSWORD)
    try:
        yield deployment.start()
    finally:
        deployment.stop()


async def put(backend, allocator, i) -> bool:
    obj = allocator.allocate(CHUNK, torch.bfloat16)
    obj.tensor.fill_(i)
    try:
        return await backend.put(key(i), obj)
    finally:
        obj.ref_down()


async def test_failover_is_a_short_burst_then_writes_resume(sentinels, caplog):
    caplog.set_level(logging.INFO)
    allocator = HostAllocator(8 << 20)
    backend = RedisBackend(LMCacheConfig(remote_url=sentinels.url, extra_config={
        "remote_key_prefix": "s:", "remote_timeout_secs": 0.5, "remote_breaker_max_secs": 0.5}),
        breaker_base_secs=0.1)
    assert backend.start_problem is None
    assert all([await put(backend, allocator, i) for i in range(10)])
    old = sentinels.master
    assert sentinels.master_port() == old.port
    client = old.client()
    assert client.wait(1, 5000) == 1  # the replica has every key before the master dies
    client.close()

    old.kill()
    started = time.monotonic()
    i, failed = 100, 0
    while True:  # write on, as a server would, until the new master takes them
        if await put(backend, allocator, i):
            break
        failed += 1
        assert time.monotonic() - started < 60, "writes never resumed after the failover"
        await asyncio.sleep(0.1)
        i += 1
    new_port = sentinels.wait_failover(old.port)
    assert new_port == sentinels.replica.port
    assert failed >= 1 and metrics.value("failed_writes", tier="redis") == failed
    # the new master holds what was written before and after the failover
    got = await backend.get_many([key(j) for j in [*range(10), i]], lambda s, d: allocator.allocate(s, d))
    assert all(obj is not None for obj in got)
    assert [int(obj.tensor[0, 0, 0, 0]) for obj in got] == [*range(10), i]
    for obj in got:
        obj.ref_down()
    client = sentinels.replica.client()
    assert client.exists(f"s:{key(i)}") == 1
    client.close()
    await backend.close()
    assert allocator.used_bytes == 0
    assert PASSWORD not in caplog.text


async def test_unknown_master_name_is_reported_at_start(sentinels):
    url = sentinels.url.rsplit("/", 1)[0] + "/no-such-master"
    backend = RedisBackend(LMCacheConfig(remote_url=url, extra_config={"remote_timeout_secs": 0.5}))
    assert "no Sentinel names a master 'no-such-master'" in backend.start_problem
    assert PASSWORD not in backend.start_problem
    assert not await put(backend, HostAllocator(1 << 20), 1)  # a counted failed write, no exception
    assert metrics.value("failed_writes", tier="redis") == 1
    await backend.close()


async def test_master_name_from_lmcache_environment_variable(sentinels, monkeypatch):
    monkeypatch.setenv("REDIS_SERVICE_NAME", sentinels.master_name)
    url = sentinels.url.rsplit("/", 1)[0]  # LMCache's form: no master name in the URL
    backend = RedisBackend(LMCacheConfig(remote_url=url))
    assert backend.start_problem is None and await backend.ping()
    await backend.close()
