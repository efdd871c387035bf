"""KV cache events of this process for cache-aware routers: which chunks each tier gained or lost.

Off unless `enable_kv_events` (then `RECORDER.enabled` is set by the connector); every call below returns at
once while off. The tiers report by key string and their own name: `stored(key, tier)` when a chunk lands in a
tier (L1 store or promotion — a chunk pulled from a prefill instance included —, a disk file written, adopted
or re-indexed at start-up, a Redis SET) and `removed(key, tier)` when it leaves (eviction, a delete, a corrupt
entry dropped, a reset). `cleared()` says that everything this instance held locally is gone (a full clear).

The engine tells `note_chunk` the parent digest and token ids of each chunk it stores or loads for a request
without extra keys, so an event carries them: routers compute their own block hashes from the token ids (the
ids we publish only chain blocks together). A chunk this process never saw (found on disk at start-up, or
stored for a request with a LoRA adapter, multimodal items or a cache salt, which a router could not tell
apart from plain text) has none, and integration/vllm/events.py publishes no store for it. A chunk of one KV
cache group of a hybrid model (`CacheKey.group`) is not recorded: routers index the model's blocks as vLLM
names them, not our per-group chunks.

An event names a chunk by its prefix digest, which is the same on every TP rank, so vLLM can keep the events
all ranks agree on. The tier is a `storage.tier.Tier` name; integration/vllm/events.py turns a chunk into
vLLM's blocks and the tier into vLLM's medium. Redis' own expiry and eviction are not seen. `take()` hands out
the events since the last call (the worker connector asks every step); at most `MAX_PENDING` wait, older ones
are dropped and counted.
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

MAX_PENDING = 100_000
MAX_NOTED_CHUNKS = 8192  # parent and token ids of recently stored or loaded chunks (8 bytes a token: 16 MiB at 256)


@dataclass(frozen=True)
class ChunkEvent:
    """A tier gained (`stored`) or lost a chunk. `tokens`: its token ids (little-endian int64), b"" when this
    process never saw them; `parent`: the previous chunk's digest (None for a prompt's first chunk)."""

    stored: bool  # False: removed
    digest: bytes
    tier: str  # storage.tier.Tier value
    parent: bytes | None = None
    tokens: bytes = b""

    @property
    def token_ids(self) -> list[int]:
        return array("q", self.tokens).tolist()


@dataclass(frozen=True)
class Cleared:
    """Every chunk this instance held in its own tiers is gone."""


class EventRecorder:
    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._pending: list[ChunkEvent | Cleared] = []
        self._noted: OrderedDict[bytes, tuple[bytes | None, bytes]] = OrderedDict()
        self.dropped = 0

    def note_chunk(self, digest: bytes, parent: bytes | None, tokens: bytes) -> None:
        """`tokens`: the chunk's token ids as little-endian int64 bytes (`tokens.token_bytes`)."""
        if not self.enabled:
            return
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

    def cleared(self) -> None:
        if self.enabled:
            self._append(Cleared())

    def _add(self, key: str, tier: str, stored: bool) -> None:
        from lmcache_vllm.tokens import CacheKey

        try:
            parsed = CacheKey.from_str(key)
        except ValueError:
            return  # not a chunk key (tests, tools)
        if parsed.group:
            return  # one KV cache group's chunk of a hybrid model (see the module's docstring)
        with self._lock:
            parent, tokens = self._noted.get(parsed.digest, (None, b""))
        self._append(ChunkEvent(stored, parsed.digest, str(tier), parent, tokens))

    def _append(self, event: ChunkEvent | Cleared) -> None:
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > MAX_PENDING:
                drop = len(self._pending) - MAX_PENDING
                del self._pending[:drop]
                self.dropped += drop

    def take(self) -> list[ChunkEvent | Cleared]:
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self._noted.clear()
            self.dropped = 0


RECORDER = EventRecorder()


def note_chunk(digest: bytes, parent: bytes | None, tokens: bytes) -> None:
    RECORDER.note_chunk(digest, parent, tokens)


def stored(key: str, tier: str) -> None:
    RECORDER.stored(key, tier)


def removed(key: str, tier: str) -> None:
    RECORDER.removed(key, tier)


def cleared() -> None:
    RECORDER.cleared()
