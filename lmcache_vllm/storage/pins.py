"""Prefixes a client asked to keep in L1 (`lmcache.pin_tokens`, docs/CONFIG.md "Per-request hints"), within a
byte budget.

`PinnedPrefixes.add(name, objs)` keeps one reference on each of a prefix's L1 chunks (the allocator evicts only
chunks nobody else references, so they stay in L1 while pinned). Pins are bounded: when the pinned bytes would
exceed `budget_bytes`, the oldest pins are let go first (their chunks become ordinary L1 entries again, evicted
in LRU order); a prefix larger than the whole budget is not pinned at all. Pinning the same prefix again (the
same `name`: its last chunk's key) renews it as the newest. A chunk shared by two pinned prefixes counts for
both, so the bytes actually kept never exceed the budget. Thread-safe (the save thread adds, the worker's step
and shutdown clear).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator, Sequence

from lmcache_vllm.observability import metrics

if TYPE_CHECKING:  # vLLM's API server imports the connector (and this) without the cache's memory
    from lmcache_vllm.memory import MemoryObj


class PinnedPrefixes:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes ({budget_bytes}) must not be negative")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._pins: OrderedDict[str, list[MemoryObj]] = OrderedDict()  # oldest first
        self._bytes = 0
        self._unregister = metrics.register_gauges(self._gauges)

    @property
    def pinned_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, name: str, objs: Sequence[MemoryObj]) -> bool:
        """Takes over one reference on each of `objs` (the caller's) as the pin `name`; False when there is
        nothing to pin or the prefix does not fit the budget at all (the references are dropped)."""
        size = sum(obj.reserved for obj in objs)
        if not objs or size > self.budget_bytes:
            for obj in objs:
                obj.ref_down()
            if objs:
                metrics.inc("pins_released", reason="too_large")
            return False
        released: list[MemoryObj] = []
        with self._lock:
            old = self._pins.pop(name, None)
            if old is not None:  # renewed: the newest now, with the references just taken
                self._bytes -= sum(obj.reserved for obj in old)
                released += old
            while self._pins and self._bytes + size > self.budget_bytes:
                _, oldest = self._pins.popitem(last=False)
                self._bytes -= sum(obj.reserved for obj in oldest)
                released += oldest
                metrics.inc("pins_released", reason="budget")
            self._pins[name] = list(objs)
            self._bytes += size
        for obj in released:
            obj.ref_down()
        return True

    def clear(self) -> None:
        """Lets every pin go (a cache reset, shutdown)."""
        with self._lock:
            pins, self._pins, self._bytes = list(self._pins.values()), OrderedDict(), 0
        for objs in pins:
            for obj in objs:
                obj.ref_down()

    def close(self) -> None:
        self.clear()
        self._unregister()

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        yield "pinned_prefixes", {}, len(self._pins)
        yield "pinned_bytes", {}, self._bytes
