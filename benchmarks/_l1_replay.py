"""Which L1 eviction policy a recorded conversation trace favours: its chunk accesses replayed through LRU (what
L1 does by default), LIP (`cache_policy: LIP`), ARC (recency and frequency, adaptive, as LMCache's server and
vLLM's OffloadingConnector offer) and Belady's optimum (the upper bound no policy passes), each holding
`capacity` chunks.

The replay models our tiers behind vLLM's own cache, taken as an LRU of its size (the requests in flight are not
modelled): each request looks up its prompt's whole chunks from the first one vLLM's cache lacks while some tier
has them (an L1 hit touches the chunk; a chunk only on disk is read and promoted into L1, then touched by the
load that takes it), then stores the whole chunks of its prompt and answer (a chunk L1 holds already is left as
it is, as `LocalCPUBackend.put_sync` does; a new one goes into L1 and to disk, which keeps everything). Counts,
not times: valid on a busy machine.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from _chat_trace import Exchange, prefix_digests

Request = tuple[list[bytes], list[bytes]]  # (keys its lookup walks, keys it stores)


def requests_of(exchanges: Iterable[Exchange], unit: int) -> list[Request]:
    return [(list(prefix_digests(e.prompt_ids, unit)), list(prefix_digests(e.prompt_ids + e.output_ids[:-1], unit)))
            for e in exchanges]


class LRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.items

    def hit(self, key: bytes, now: int) -> None:
        self.items.move_to_end(key)

    def insert(self, key: bytes, now: int) -> None:
        self.items[key] = None
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)


class LIP(LRU):
    """LRU insertion (`cache_policy: LIP`): a new chunk enters at the least recently used end, a use moves it."""

    def insert(self, key: bytes, now: int) -> None:
        while len(self.items) >= self.capacity:
            self.items.popitem(last=False)
        self.items[key] = None
        self.items.move_to_end(key, last=False)


class ARC:
    """Adaptive replacement: T1 (seen once lately), T2 (seen again), ghost lists B1/B2 of what each evicted
    steer the target size `p` of T1."""

    def __init__(self, capacity: int):
        self.c, self.p = capacity, 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.t1 or key in self.t2

    def hit(self, key: bytes, now: int) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)
        self.t2[key] = None

    def _replace(self, key: bytes) -> None:
        if self.t1 and (len(self.t1) > self.p or (key in self.b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        elif self.t2:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None
        elif self.t1:
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None

    def insert(self, key: bytes, now: int) -> None:
        if key in self.b1:  # evicted from T1 too early: T1 grows
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1))
            del self.b1[key]
            self._replace(key)
            self.t2[key] = None
            return
        if key in self.b2:  # evicted from T2 too early: T2 grows
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            del self.b2[key]
            self._replace(key)
            self.t2[key] = None
            return
        if len(self.t1) + len(self.b1) >= self.c:
            if len(self.t1) < self.c:
                self.b1.popitem(last=False)
                self._replace(key)
            else:
                self.t1.popitem(last=False)
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= self.c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * self.c and self.b2:
                self.b2.popitem(last=False)
            if len(self.t1) + len(self.t2) >= self.c:
                self._replace(key)
        self.t1[key] = None


class Belady:
    """Evicts the chunk whose next lookup is farthest away (or never comes); needs the whole trace."""

    def __init__(self, capacity: int, requests: Sequence[Request]):
        self.capacity = capacity
        self.uses: dict[bytes, list[int]] = {}
        for i, (walk, _) in enumerate(requests):
            for key in walk:
                self.uses.setdefault(key, []).append(i)
        self.items: set[bytes] = set()

    def __contains__(self, key: bytes) -> bool:
        return key in self.items

    def _next_use(self, key: bytes, now: int) -> int:
        return next((i for i in self.uses.get(key, ()) if i > now), 1 << 62)

    def hit(self, key: bytes, now: int) -> None:
        pass

    def insert(self, key: bytes, now: int) -> None:
        self.items.add(key)
        if len(self.items) > self.capacity:
            self.items.remove(max(self.items, key=lambda k: self._next_use(k, now)))


def replay(requests: Sequence[Request], policy, device_chunks: int = 0) -> tuple[int, int]:
    """(chunks the lookups found in L1, chunks they read from disk) under `policy`, behind vLLM's own cache
    taken as an LRU of `device_chunks` chunks (every chunk of a request's prompt and answer passes through
    it; a lookup asks our tiers only from its first miss on)."""
    on_disk: set[bytes] = set()
    device = LRU(device_chunks)
    from_l1 = from_disk = 0
    for now, (walk, stores) in enumerate(requests):
        skip = next((i for i, key in enumerate(walk) if key not in device), len(walk))
        for key in walk[skip:]:
            if key in policy:
                from_l1 += 1
                policy.hit(key, now)
            elif key in on_disk:
                from_disk += 1
                policy.insert(key, now)  # read and promoted,
                policy.hit(key, now)  # then taken by the load
            else:
                break
        for key in stores:
            if key not in policy:
                policy.insert(key, now)
            on_disk.add(key)
            if key in device:
                device.hit(key, now)
            elif device_chunks:
                device.insert(key, now)
    return from_l1, from_disk


def compare(exchanges: Iterable[Exchange], unit: int, capacity: int, device_chunks: int = 0
            ) -> dict[str, tuple[int, int]]:
    """{policy: (chunks from L1, chunks from disk)} of the trace with an L1 of `capacity` chunks behind a device
    cache of `device_chunks`."""
    requests = requests_of(exchanges, unit)
    return {name: replay(requests, policy, device_chunks) for name, policy in (
        ("lru", LRU(capacity)), ("lip", LIP(capacity)), ("arc", ARC(capacity)),
        ("belady", Belady(capacity, requests)))}
