"""The per-node guard of the Redis tier (`storage/redis/guard.py`) against a real redis-server: calls waiting
for an in-flight slot that time out are failed calls that do not open the breaker. (A probe cancelled
mid-flight: tests/test_storage_redis.py.)"""

import asyncio

import pytest

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.redis import RedisBackend
from lmcache_vllm.storage.redis.guard import CallFailed

pytestmark = pytest.mark.redis


async def test_waiting_for_a_busy_node_fails_the_call_without_opening_the_breaker(redis_server, redis_prefix):
    backend = RedisBackend(LMCacheConfig(remote_url=redis_server.url, extra_config={
        "remote_key_prefix": redis_prefix, "remote_max_connections": 1, "remote_timeout_secs": 0.3}))
    guard = backend.topology.guard
    release = asyncio.Event()

    async def hold():  # a call that keeps the node's only slot
        await release.wait()
        return True

    holder = asyncio.ensure_future(guard.call(hold, None))
    await asyncio.sleep(0)
    with pytest.raises(CallFailed) as failed:
        await guard.call(backend._client.ping, 1.0)
    assert failed.value.reason == "busy" and not guard.is_open
    release.set()
    assert await holder and await backend.ping()
    assert metrics.value("redis_node_failed_calls", node=guard.name) == 0
    await backend.close()
