"""Where each key of a batch goes: `Standalone` (one server, or the master a set of Sentinels names) and
`Cluster` (the node redis-py's slot map names for each key), each handing out `Route`s (a node's guard and
its share of the batch) and pipelined connections to a route's node.

The tier sends one pipeline per node: a cluster batch is split by redis-py's slot map (no hash tags: the
chunks of one prompt spread over the shards), each node's share goes down one connection of that node
(GETs or EXISTS, one per key: keys in different slots cannot share a command); a standalone batch is MGETs
of `read_batch_keys` keys. A reply that is a redirect (MOVED/ASK during a resharding, TRYAGAIN) is kept as
its exception for the tier to re-send through redis-py's own command path, which follows it and patches
the slot map. A node that fails has its dead sockets dropped and, in a cluster, makes the tier ask the
cluster for its slot map again (a replica may have taken over), at most once per `refresh_secs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AskError, ClusterDownError, MovedError, RedisError, TryAgainError

from lmcache_vllm.config.redact import redact_text
from lmcache_vllm.storage.redis.guard import CallFailed, NodeGuard

logger = logging.getLogger(__name__)

SCAN_BATCH = 1000  # keys per SCAN step and per UNLINK
REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
GuardFactory = Callable[..., NodeGuard]  # (name, on_failure=...) -> a new NodeGuard


@dataclass
class Route:
    """A node's share of a batch: the indices (into the batch) of its keys, its guard, and (cluster) the
    redis-py node."""

    guard: NodeGuard
    indices: list[int]
    node: Any = None  # redis.asyncio.cluster.ClusterNode


async def batched(items: AsyncIterator[Any], size: int = SCAN_BATCH) -> AsyncIterator[list[Any]]:
    """`items` in lists of at most `size`."""
    batch: list[Any] = []
    async for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


async def read_reply(conn: Any) -> Any:
    """The next reply on `conn`; a redirect reply is returned as its exception (the connection stays in
    step: its reply was read whole)."""
    try:
        return await conn.read_response()
    except REDIRECTS as exc:
        return exc


class Standalone:
    """One server (or the Sentinel master): every key goes to it; reads are MGETs."""

    per_key_commands = False  # one MGET per batch of keys

    def __init__(self, client: Any, name: str, make_guard: GuardFactory):
        """`client`: a `redis.asyncio.Redis` (typed Any: the installed types-redis stubs predate redis-py 8)."""
        self.client = client
        self.guard = make_guard(name, on_failure=self._drop_connections)

    def guards(self) -> list[NodeGuard]:
        return [self.guard]

    async def routes(self, rkeys: Sequence[str]) -> list[Route]:
        return [Route(self.guard, list(range(len(rkeys))))]

    async def guard_of(self, rkey: str) -> NodeGuard:
        return self.guard

    @contextlib.asynccontextmanager
    async def connection(self, route: Route, timeout: float) -> AsyncIterator[Any]:
        """A connection of the pool (connected within `timeout`), disconnected if the caller fails."""
        pool = self.client.connection_pool
        async with asyncio.timeout(timeout):
            conn = await pool.get_connection()
        try:
            yield conn
        except BaseException:
            await conn.disconnect()  # replies may be left unread: never reuse it
            raise
        finally:
            await pool.release(conn)

    async def _drop_connections(self, guard: NodeGuard, exc: BaseException) -> None:
        try:
            await self.client.connection_pool.disconnect()
        except Exception:  # dropping dead sockets is best effort
            pass

    async def scan(self, match: str) -> AsyncIterator[list[Any]]:
        async for batch in batched(self.client.scan_iter(match=match, count=SCAN_BATCH)):
            yield batch

    async def close(self) -> None:
        await self.client.aclose()
        await self.client.connection_pool.disconnect()


class Cluster:
    """A Redis Cluster through redis-py's `RedisCluster`: its slot map routes each key to a node."""

    per_key_commands = True  # GET / EXISTS per key

    def __init__(self, client: Any, name: str, make_guard: GuardFactory, refresh_secs: float, timeout: float):
        """`client`: a `redis.asyncio.cluster.RedisCluster` (typed Any, as in `Standalone`)."""
        self.client = client
        self._make_guard = make_guard
        self._guards: dict[str, NodeGuard] = {}
        # Discovery (the first CLUSTER SLOTS) has its own breaker: while no node answers, every key is a
        # miss at once instead of a connection attempt per call.
        self.discovery = make_guard(name)
        self._ready = False
        self._refresh_secs = refresh_secs
        self._timeout = timeout
        self._refresh: asyncio.Task[None] | None = None
        self._refreshed_at = 0.0

    def guards(self) -> list[NodeGuard]:
        return [self.discovery, *self._guards.values()]

    def _guard(self, name: str) -> NodeGuard:
        guard = self._guards.get(name)
        if guard is None:
            guard = self._guards[name] = self._make_guard(name, on_failure=self._node_failed)
        return guard

    async def guard_of_node(self, name: str) -> NodeGuard:
        return self._guard(name)

    async def ready(self) -> None:
        """Makes sure the slot map is known (the first CLUSTER SLOTS); CallFailed when no node answers."""
        await self._ensure_ready()

    async def _ensure_ready(self) -> None:
        if not self._ready:
            nodes = len(self.client.nodes_manager.startup_nodes)
            await self.discovery.call(self.client.initialize, self._timeout * (1 + nodes))
            self._ready = True

    async def routes(self, rkeys: Sequence[str]) -> list[Route]:
        """One route per node holding some of `rkeys`; keys of slots no node serves get none (misses)."""
        try:
            await self._ensure_ready()
        except CallFailed:
            return []
        by_node: dict[str, Route] = {}
        slots = self.client.nodes_manager.slots_cache
        for i, rkey in enumerate(rkeys):
            nodes = slots.get(self.client.keyslot(rkey))
            if not nodes:
                self._schedule_refresh()
                continue
            node = nodes[0]
            route = by_node.get(node.name)
            if route is None:
                route = by_node[node.name] = Route(self._guard(node.name), [], node)
            route.indices.append(i)
        return list(by_node.values())

    async def guard_of(self, rkey: str) -> NodeGuard:
        await self._ensure_ready()
        nodes = self.client.nodes_manager.slots_cache.get(self.client.keyslot(rkey))
        if not nodes:
            self._schedule_refresh()
            raise CallFailed("-", "error", RedisError("slot not covered"))
        return self._guard(nodes[0].name)

    @contextlib.asynccontextmanager
    async def connection(self, route: Route, timeout: float) -> AsyncIterator[Any]:
        """A connection of the route's node (it connects on first use, bounded by the socket timeouts),
        disconnected if the caller fails."""
        node = route.node
        if node is None:
            raise RedisError("a cluster route without its node")
        conn = node.acquire_connection()
        try:
            await node.disconnect_if_needed(conn)  # marked stale by a topology refresh
            yield conn
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            node.release(conn)

    async def _node_failed(self, guard: NodeGuard, exc: BaseException) -> None:
        node = self.client.get_node(node_name=guard.name)
        if node is not None:
            try:
                await node.disconnect_free_connections()
            except Exception:  # best effort
                pass
        self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        """Asks the cluster for its slot map again in the background (a replica may have taken over a dead
        node's slots), at most once per `refresh_secs` and one at a time."""
        if not self._ready or (self._refresh is not None and not self._refresh.done()):
            return
        if time.monotonic() - self._refreshed_at < self._refresh_secs:
            return
        self._refreshed_at = time.monotonic()
        self._refresh = asyncio.ensure_future(self._refresh_slot_map())

    async def _refresh_slot_map(self) -> None:
        try:
            nodes = len(self.client.nodes_manager.startup_nodes) + 1
            await asyncio.wait_for(self.client.nodes_manager.initialize(), self._timeout * nodes)
        except Exception as exc:  # the next failure tries again
            logger.debug("redis cluster slot map refresh failed: %s", redact_text(repr(exc)))

    async def scan(self, match: str) -> AsyncIterator[list[Any]]:
        """Keys matching `match`, node by node over every primary (SCAN runs per node in a cluster)."""
        await self._ensure_ready()
        for node in self.client.get_primaries():
            async for batch in batched(self.client.scan_iter(match=match, count=SCAN_BATCH, target_nodes=node)):
                yield batch

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
        await self.client.aclose()
