"""Our KV cache events (`lmcache_vllm.observability.kv_events`) through vLLM's KV event publisher, for cache-aware
routers.

Each worker's connector hands vLLM the events of its process every step as its connector worker metadata
(`take_worker_events` -> `LMCacheWorkerEvents`); vLLM joins the workers' metadata (`aggregate`) and gives it to
the scheduler's `update_connector_output`, and its `take_events` publishes what `SchedulerEvents` releases: with
tensor parallelism a chunk counts as stored (or removed) only once every rank reported it, which may happen in
different steps (background saves), so reports wait across steps (at most `MAX_WAITING` distinct events; older
ones are dropped). Worker metadata, not vLLM's `get_kv_connector_kv_cache_events`: vLLM's MultiConnector
(0.32 and 0.33) passes each child its own worker metadata and publishes its children's `take_events`, but
never asks children for `get_kv_connector_kv_cache_events`, so events sent that way vanish under it.

Events are vLLM's `BlockStored` / `BlockRemoved` with one block per chunk: its prefix digest as the hash, the
parent chunk's digest, its token ids (empty when this process never saw them), the chunk's token count as block
size, vLLM's medium (`CPU` for L1, `STORAGE` for disk and Redis) and locality (`LOCAL`; `REMOTE` for Redis),
and our tier's name in `ownership`, vLLM's field for the secondary tier that produced an event (`local_cpu`,
`local_disk`, `redis`). Publishing needs vLLM's `--kv-events-config`.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from lmcache_vllm.observability import kv_events
from lmcache_vllm.storage.tier import Tier

MAX_WAITING = 100_000


@dataclass
class LMCacheWorkerEvents(KVConnectorWorkerMetadata):
    """One step's events of one worker (or, aggregated, of every worker: each rank's reports kept)."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LMCacheWorkerEvents":
        if isinstance(other, LMCacheWorkerEvents):
            self.events.extend(other.events)
        return self


def to_vllm(event: kv_events.ChunkEvent, chunk_size: int) -> KVCacheEvent:
    tier = Tier(event.tier)
    if not event.stored:
        return BlockRemoved(block_hashes=[event.digest], medium=tier.medium, locality=tier.locality,
                            ownership=tier.value)
    return BlockStored(block_hashes=[event.digest], parent_block_hash=event.parent,
                       token_ids=list(event.token_ids), block_size=len(event.token_ids) or chunk_size,
                       lora_id=None, medium=tier.medium, lora_name=None, locality=tier.locality,
                       ownership=tier.value)


def take_worker_events(chunk_size: int) -> LMCacheWorkerEvents | None:
    """This process's events since the last call (None when there are none)."""
    events = kv_events.RECORDER.take()
    if not events:
        return None
    return LMCacheWorkerEvents([to_vllm(e, chunk_size) for e in events])


class SchedulerEvents:
    """Releases an event once all `world_size` ranks reported it (counted across steps)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, int(world_size))
        self._waiting: OrderedDict[KVCacheEvent, int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, reports: KVConnectorWorkerMetadata | None) -> None:
        if not isinstance(reports, LMCacheWorkerEvents):
            return
        for event, count in Counter(reports.events).items():
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
