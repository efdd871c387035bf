"""The per-node guard of the Redis tier (`storage/redis/guard.py`) against a real redis-server: a probe
cancelled mid-flight gives the probe slot back (the breaker never stays shut), and calls waiting for an
in-flight slot that time out are failed calls that do not open the breaker."""

import asyncio
import os
import signal

import pytest

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.redis import RedisBackend
from lmcache_vllm.storage.redis.guard import CallFailed

pytestmark = pytest.mark.redis


async def test_cancelled_probe_does_not_leave_the_breaker_shut(redis_server, redis_prefix):
    backend = RedisBackend(LMCacheConfig(remote_url=redis_server.url, extra_config={
        "remote_key_prefix": redis_prefix, "remote_timeout_secs": 5.0, "remote_breaker_max_secs": 0.05}),
        breaker_base_secs=0.05)
    redis_server.kill()
    try:
        assert not await backend.ping()  # connection refused: the breaker opens
        assert backend.breaker_open
    finally:
        redis_server.restart()
    await asyncio.sleep(0.1)  # past the retry time: the next call is the probe
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # it connects, then waits for an answer
    try:
        probe = asyncio.ensure_future(backend.contains(["k"]))
        await asyncio.sleep(0.3)
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
