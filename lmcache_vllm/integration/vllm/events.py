"""Our KV cache events (`lmcache_vllm.observability.kv_events`) through vLLM's KV event publisher, for cache-aware
routers.

Each worker's connector hands vLLM the events of its process every step (`take_worker_events`); vLLM
gathers the workers' containers into the scheduler's `update_connector_output`, and its `take_events`
publishes what `SchedulerEvents` releases: with tensor parallelism a chunk counts as stored (or removed)
only once every rank reported it, which may happen in different steps (background saves), so reports
wait across steps (at most `MAX_WAITING` distinct events; older ones are dropped). Events are vLLM's
`BlockStored` / `BlockRemoved` with one block per chunk: its prefix digest as the hash, the parent
chunk's digest, its token ids (empty when this process never saw them), the chunk's token count as
block size, and medium `cpu` / `disk` / `redis`. Publishing needs vLLM's `--kv-events-config`.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)

from lmcache_vllm.observability import kv_events

MAX_WAITING = 100_000


class LMCacheVllmKVEvents(KVConnectorKVEvents):
    """The container vLLM carries from workers to the scheduler (vLLM's aggregator underneath)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> "LMCacheVllmKVEvents":
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


def to_vllm(event: kv_events.ChunkEvent, chunk_size: int) -> KVCacheEvent:
    if not event.stored:
        return BlockRemoved(block_hashes=[event.digest], medium=event.medium)
    return BlockStored(block_hashes=[event.digest], parent_block_hash=event.parent,
                       token_ids=list(event.token_ids), block_size=len(event.token_ids) or chunk_size,
                       lora_id=None, medium=event.medium, lora_name=None)


def take_worker_events(chunk_size: int) -> LMCacheVllmKVEvents | None:
    """This process's events since the last call (None when there are none)."""
    events = kv_events.RECORDER.take()
    if not events:
        return None
    container = LMCacheVllmKVEvents(num_workers=1)
    container.add_events([to_vllm(e, chunk_size) for e in events])
    return container


class SchedulerEvents:
    """Releases an event once all `world_size` ranks reported it (counted across steps)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, int(world_size))
        self._waiting: OrderedDict[KVCacheEvent, int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, container: KVConnectorKVEvents | None) -> None:
        if not isinstance(container, LMCacheVllmKVEvents):
            return
        for event, count in Counter(container.get_all_events()).items():
            seen = self._waiting.pop(event, 0) + count
            if seen >= self.world_size:
                self._ready.append(event)
            else:
                self._waiting[event] = seen
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready
