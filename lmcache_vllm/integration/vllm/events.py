"""What each worker tells the scheduler half every step, as vLLM's connector worker metadata
(`LMCacheWorkerReport`): our KV cache events (`lmcache_vllm.observability.kv_events`), published through vLLM's
KV event publisher for cache-aware routers, and on a prefill instance its `HoldReport` (the holds for decode
instances that ended, and how many tokens' KV a rank may hold: the scheduler half's ledger in pd/scheduler.py).

Each worker's connector hands vLLM the events of its process every step (`take_worker_events`); vLLM joins the
workers' metadata (`aggregate`) and gives it to the scheduler's `update_connector_output`, and its `take_events`
publishes what `SchedulerEvents` releases: with tensor parallelism a chunk counts as stored (or removed) only once
every rank reported it, which may happen in different steps (background saves), so reports wait across steps (at
most `MAX_WAITING` distinct events; older ones are dropped). Worker metadata, not vLLM's
`get_kv_connector_kv_cache_events`: vLLM's MultiConnector (0.32 and 0.33) passes each child its own worker metadata
and publishes its children's `take_events`, but never asks children for `get_kv_connector_kv_cache_events`, so
events sent that way vanish under it.

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
class HoldReport:
    """A prefill rank's holds since its last report: the request ids whose holds ended, and the most tokens'
    KV it may hold at once (`extra_config.pd_max_held_bytes` over one token's bytes on the rank; 0: no cap)."""

    ended: list[str] = field(default_factory=list)
    cap_tokens: int = 0


@dataclass
class LMCacheWorkerReport(KVConnectorWorkerMetadata):
    """One step's report of one worker (or, aggregated, of every worker: each rank's events kept, the holds'
    reports joined with the smallest cap)."""

    events: list[KVCacheEvent] = field(default_factory=list)
    holds: HoldReport | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "LMCacheWorkerReport":
        if isinstance(other, LMCacheWorkerReport):
            self.events.extend(other.events)
            if self.holds is None or other.holds is None:
                self.holds = self.holds or other.holds
            else:
                caps = [c for c in (self.holds.cap_tokens, other.holds.cap_tokens) if c > 0]
                self.holds = HoldReport(self.holds.ended + other.holds.ended, min(caps) if caps else 0)
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


def take_worker_events(chunk_size: int) -> list[KVCacheEvent]:
    """This process's events since the last call."""
    return [to_vllm(e, chunk_size) for e in kv_events.RECORDER.take()]


def worker_report(events: list[KVCacheEvent], holds: HoldReport | None) -> LMCacheWorkerReport | None:
    """This step's report (None when it has nothing to say)."""
    return LMCacheWorkerReport(events, holds) if events or holds is not None else None


class SchedulerEvents:
    """Releases an event once all `world_size` ranks reported it (counted across steps)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, int(world_size))
        self._waiting: OrderedDict[KVCacheEvent, int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, reports: KVConnectorWorkerMetadata | None) -> None:
        if not isinstance(reports, LMCacheWorkerReport):
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
