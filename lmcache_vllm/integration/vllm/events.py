"""What each worker tells the scheduler half every step, as vLLM's connector worker metadata
(`LMCacheWorkerReport`): our KV cache events (`lmcache_vllm.observability.kv_events`), published through vLLM's
KV event publisher for cache-aware routers, and on a prefill instance its `HoldReport` (the holds for decode
instances that ended, and how many tokens' KV a rank may hold: the scheduler half's ledger in pd/scheduler.py).

Each worker's connector hands vLLM the events of its process every step (`take_worker_events`); vLLM joins the
workers' metadata (`aggregate`) and gives it to the scheduler's `update_connector_output`, and its `take_events`
publishes what `SchedulerEvents` releases: with tensor parallelism a chunk counts as stored (or removed) only once
every rank reported it, which may happen in different steps (background saves), so reports wait across steps (at
most `MAX_WAITING` distinct events; older ones are dropped), and at most `MAX_EVENTS_PER_BATCH` go out a step.
vLLM's scheduler publishes them in the same batch as its own device events. Worker metadata, not vLLM's
`get_kv_connector_kv_cache_events`: vLLM's MultiConnector (0.32 and 0.33) passes each child its own worker metadata
and publishes its children's `take_events`, but never asks children for `get_kv_connector_kv_cache_events`, so
events sent that way vanish under it.

`VllmBlocks` makes the events exactly what vLLM publishes of its own blocks (v1/core/block_pool.py), so that
routers index them (vllm-router's `kv_aware`, llm-d, Dynamo: docs/ROUTING.md): a chunk of ours is `chunk_size /
block_size` blocks of vLLM's `--block-size`; a stored chunk is one `BlockStored` with one hash per block, the block
before it as parent (the last block of the previous chunk), its token ids, vLLM's block size, no extra keys (one
None per block, as vLLM says it), group 0, and the tier's medium, locality and owner (`Tier.event_names`); a
removed chunk is one `BlockRemoved` of its blocks in that tier; a clear of every local tier is `AllBlocksCleared`.
Block hashes are derived from the chunk's prefix digest and the block's index (`block_id`, the same on every TP
rank and after a restart) and go through vLLM's own `maybe_convert_block_hash`: 64-bit integers unless
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`. A chunk whose token ids this process never saw gets no `BlockStored` (a
router recomputes its hashes from the token ids; without them it cannot use the block, and vLLM never publishes a
store without them); its removal is still published (a superset of the blocks a partial chunk held: unknown hashes
are ignored by consumers). A partial chunk publishes its whole blocks only. Publishing needs vLLM's
`--kv-events-config`.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

from lmcache_vllm.observability import kv_events, logs
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

MAX_WAITING = 100_000
# Ours in one of vLLM's event batches at most (the rest wait for the next steps): vllm-router refuses a batch of
# more than 4096 events and then forgets everything the instance published, vLLM's own device blocks included.
MAX_EVENTS_PER_BATCH = 2048


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


def block_id(digest: bytes, index: int) -> bytes:
    """The 32-byte id of block `index` of the chunk with prefix digest `digest` (what vLLM's sha256 hashes are
    long): it names the block's whole prefix, as vLLM's chained block hashes do."""
    return hashlib.sha256(b"lmcache-vllm block v1" + digest + index.to_bytes(4, "little")).digest()


class VllmBlocks:
    """Our chunk events as vLLM's block events (see the module's docstring)."""

    def __init__(self, block_size: int, chunk_size: int) -> None:
        if block_size <= 0 or chunk_size % block_size:
            raise ValueError(f"enable_kv_events needs chunk_size ({chunk_size}) to be a multiple of vLLM's block size "
                             f"({block_size}): routers count whole blocks of vLLM's --block-size")
        self.block_size = block_size
        self.per_chunk = chunk_size // block_size

    def _hashes(self, digest: bytes, count: int) -> list[ExternalBlockHash]:
        return [maybe_convert_block_hash(BlockHash(block_id(digest, i))) for i in range(count)]

    def to_vllm(self, event: kv_events.ChunkEvent | kv_events.Cleared) -> KVCacheEvent | None:
        """The event vLLM would publish, or None when there is nothing to publish."""
        if isinstance(event, kv_events.Cleared):
            return AllBlocksCleared()
        names = Tier(event.tier).event_names
        if names is None:
            return None
        tokens = event.token_ids
        if not event.stored:
            count = len(tokens) // self.block_size if tokens else self.per_chunk
            return BlockRemoved(block_hashes=self._hashes(event.digest, count), medium=names.medium, group_idx=0,
                                locality=names.locality, ownership=names.ownership) if count else None
        count = len(tokens) // self.block_size
        if not count:
            return None
        parent = (maybe_convert_block_hash(BlockHash(block_id(event.parent, self.per_chunk - 1)))
                  if event.parent is not None else None)
        return BlockStored(block_hashes=self._hashes(event.digest, count), parent_block_hash=parent,
                           token_ids=tokens[:count * self.block_size], block_size=self.block_size, lora_id=None,
                           medium=names.medium, lora_name=None, extra_keys=[None] * count, group_idx=0,
                           locality=names.locality, ownership=names.ownership)


def take_worker_events(blocks: VllmBlocks) -> list[KVCacheEvent]:
    """This process's events since the last call, as vLLM's (on vLLM's step: an event that cannot be converted,
    of a tier this version does not know, is logged and left out, never raised)."""
    out = []
    for event in kv_events.RECORDER.take():
        try:
            converted = blocks.to_vllm(event)
        except Exception:
            logs.warn(logger, "kv_event_conversion", "a KV event could not be converted: %r", event, exc_info=True)
            continue
        if converted is not None:
            out.append(converted)
    return out


def worker_report(events: list[KVCacheEvent], holds: HoldReport | None) -> LMCacheWorkerReport | None:
    """This step's report (None when it has nothing to say)."""
    return LMCacheWorkerReport(events, holds) if events or holds is not None else None


def _event_key(event: KVCacheEvent) -> Hashable:
    # vLLM's AllBlocksCleared has no fields and no hash (msgspec: not frozen, no __hash__ of its own)
    return AllBlocksCleared if isinstance(event, AllBlocksCleared) else event


class SchedulerEvents:
    """Releases an event once all `world_size` ranks reported it (counted across steps)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = max(1, int(world_size))
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()
        self._ready: list[KVCacheEvent] = []

    def add(self, reports: KVConnectorWorkerMetadata | None) -> None:
        if not isinstance(reports, LMCacheWorkerReport):
            return
        for event in reports.events:
            key = _event_key(event)
            seen = self._waiting.pop(key, 0) + 1
            if seen >= self.world_size:
                self._ready.append(event)
            else:
                self._waiting[key] = seen
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready[:MAX_EVENTS_PER_BATCH], self._ready[MAX_EVENTS_PER_BATCH:]
        return ready
