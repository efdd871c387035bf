"""`NodeGuard`: what stands between the Redis tier and one Redis server (a single server, the Sentinel master,
or one node of a cluster): a circuit breaker, an in-flight limit and the per-node metrics.

- Circuit breaker (`storage/breaker.py`): a connection error or timeout opens it; calls then fail at once (no
  network) until a retry time that doubles after each failed retry, from `base_secs` up to `max_secs`; the
  first call after it is the probe.
- In-flight limit: at most `max_inflight` calls at once; more wait for a slot within the call's timeout
  (a node that answers slowly gets no pile of calls behind it). A wait that times out is a failed call but
  says nothing about the node, so it does not open the breaker.
- Metrics (`redis_node_*`, label `node`), and the tier-level `breaker_skipped_calls` of the Redis tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisClusterException, RedisError

from lmcache_vllm.config.redact import redact_text
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.breaker import Breaker
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A failure of the node, of our link to it, or (cluster) of finding which node serves a key.
CALL_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class CallFailed(Exception):
    """A guarded call did not run or did not finish: `reason` is "breaker_open", "busy" or "error" (the
    node failed: `cause` says how)."""

    def __init__(self, node: str, reason: str, cause: BaseException | None = None):
        super().__init__(f"redis node {node}: {reason}" + (f" ({type(cause).__name__})" if cause else ""))
        self.node = node
        self.reason = reason
        self.cause = cause


class NodeGuard(Breaker):
    """Breaker and in-flight limit of one Redis server, named `name` (host:port; never credentials)."""

    def __init__(self, name: str, *, base_secs: float, max_secs: float, max_inflight: int, slot_wait_secs: float,
                 on_failure: Callable[[NodeGuard, BaseException], Awaitable[None]] | None = None):
        """`slot_wait_secs`: the longest wait for an in-flight slot; `on_failure(guard, exc)` runs after a
        failed call (e.g. to drop the node's dead sockets)."""
        super().__init__(f"redis node {name}", base_secs=base_secs, max_secs=max_secs)
        self.name = name
        self.slot_wait_secs = slot_wait_secs
        self._slots = asyncio.Semaphore(max_inflight)
        self._on_failure = on_failure
        self.inflight = 0

    def call_failed(self, exc: BaseException) -> None:
        self.failed(f"{type(exc).__name__}: {redact_text(str(exc))}")
        metrics.inc("redis_node_failed_calls", node=self.name)

    # ---- a guarded call ---------------------------------------------------------------------------
    async def call(self, make_coro: Callable[[], Awaitable[T]], timeout: float | None) -> T:
        """The result of `make_coro()` run under the breaker, the in-flight limit and `timeout` seconds
        (None: the coroutine bounds its own waits); waiting for a slot takes at most `slot_wait_secs`.
        Raises `CallFailed` when the call was refused or failed; the breaker has been told."""
        probe = self.admit()
        if probe is None:
            metrics.inc("breaker_skipped_calls", tier=Tier.REDIS)
            metrics.inc("redis_node_skipped_calls", node=self.name)
            raise CallFailed(self.name, "breaker_open")
        settled = False
        try:
            if self._slots.locked():  # the common case takes a free slot without a timer
                try:
                    await asyncio.wait_for(self._slots.acquire(), self.slot_wait_secs)
                except asyncio.TimeoutError:
                    raise CallFailed(self.name, "busy") from None
            else:
                await self._slots.acquire()
            self.inflight += 1
            try:
                if timeout is None:
                    result = await make_coro()
                else:
                    async with asyncio.timeout(timeout):
                        result = await make_coro()
            except CALL_ERRORS as exc:
                settled = True
                self.call_failed(exc)
                if self._on_failure is not None:
                    await self._on_failure(self, exc)
                raise CallFailed(self.name, "error", exc) from exc
            finally:
                self.inflight -= 1
                self._slots.release()
            settled = True
            self.succeeded()
            return result
        finally:
            if probe and not settled:
                self.abandon_probe()  # a probe that said nothing (busy, cancelled) gives its turn back
