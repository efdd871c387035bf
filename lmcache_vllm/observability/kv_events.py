"""KV cache events of this process for cache-aware routers: which chunks each tier gained or lost.

Off unless `enable_kv_events` (then `RECORDER.enabled` is set by the connector); every call below returns at
once while off. The tiers report by key string and their own name: `stored(key, tier)` when a chunk lands in a
tier (L1 store or promotion — a chunk pulled from a prefill instance included —, a disk file written, adopted
or re-indexed at start-up, a Redis SET) and `removed(key, tier)` when it leaves (eviction, a corrupt entry
deleted, a reset). The engine tells `note_chunk` the parent digest and token ids of each chunk it stores or
loads, so an event carries them (a router computes its own block hashes from token ids); a chunk it never saw
in this process (found on disk at start-up) has none.

An event names a chunk by its prefix digest, which is the same on every TP rank, so vLLM can keep the events
all ranks agree on. The tier is a `storage.tier.Tier` name (`local_cpu`, `local_disk`, `redis`);
integration/vllm/events.py turns it into vLLM's medium and locality. Redis' own expiry and eviction are not
seen. `take()` hands out the events since the last call (the worker connector asks every step); at most
`MAX_PENDING` wait, older ones are dropped and counted.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, SupportsInt

MAX_PENDING = 100_000
MAX_NOTED_CHUNKS = 8192  # parent/token ids of recently stored or loaded chunks (~16 MiB at 256 tokens)


@dataclass(frozen=True)
class ChunkEvent:
    stored: bool  # False: removed
    digest: bytes
    tier: str  # storage.tier.Tier value
    parent: bytes | None = None
    token_ids: tuple[int, ...] = ()


class EventRecorder:
    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._pending: list[ChunkEvent] = []
        self._noted: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        self.dropped = 0

    def note_chunk(self, digest: bytes, parent: bytes | None, token_ids: Iterable[SupportsInt]) -> None:
        if not self.enabled:
            return
        tokens = tuple(int(t) for t in token_ids)
        with self._lock:
            self._noted[digest] = (parent, tokens)
            self._noted.move_to_end(digest)
            while len(self._noted) > MAX_NOTED_CHUNKS:
                self._noted.popitem(last=False)

    def stored(self, key: str, tier: str) -> None:
        if self.enabled:
            self._add(key, tier, True)

    def removed(self, key: str, tier: str) -> None:
        if self.enabled:
            self._add(key, tier, False)

    def _add(self, key: str, tier: str, stored: bool) -> None:
        from lmcache_vllm.tokens import CacheKey

        try:
            digest = CacheKey.from_str(key).digest
        except ValueError:
            return  # not a chunk key (tests, tools)
        with self._lock:
            parent, tokens = self._noted.get(digest, (None, ())) if stored else (None, ())
            self._pending.append(ChunkEvent(stored, digest, str(tier), parent, tokens))
            if len(self._pending) > MAX_PENDING:
                drop = len(self._pending) - MAX_PENDING
                del self._pending[:drop]
                self.dropped += drop

    def take(self) -> list[ChunkEvent]:
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self._noted.clear()
            self.dropped = 0


RECORDER = EventRecorder()


def note_chunk(digest: bytes, parent: bytes | None, token_ids: Iterable[SupportsInt]) -> None:
    RECORDER.note_chunk(digest, parent, token_ids)


def stored(key: str, tier: str) -> None:
    RECORDER.stored(key, tier)


def removed(key: str, tier: str) -> None:
    RECORDER.removed(key, tier)
