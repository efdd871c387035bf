"""GroupedEngine: the KV cache groups of one hybrid model over one storage, and the hit every group can serve.

Each attention group (`kv_groups.GroupKind.FULL`, `SLIDING`) has its own `CacheEngine` (a layout over its
layers, keys tagged with the group) and each state group a `StateEngine`; all share one `StorageManager`.

A lookup (`lookup_and_hold` -> `GroupedHold`) finds the longest hit `n` every group can serve: the
full-attention groups' prefix run gives the first candidate; for it each other group must hold the chunks
`KVGroup.chunks_needed` names (a sliding group the window before `n`, a state group the state at `n`), held
by one prefetch per group. A group that lacks a chunk moves the candidate down to that chunk's start (a
state group: to the previous chunk boundary), and the groups are asked again, until every group agrees or
nothing is left. A prefetch that waits on a lower tier makes the answer pending (asked again later); each
ask continues where the last stopped. A hit of the whole prompt is checked for the prompt minus its last
token (vLLM computes that one); a state group never allows it (no state is stored there).

Loads and saves take per group a slot mapping (`GroupSlots`: tokens of null blocks have slot -1 and are
neither wanted nor stored) or, for a state group, (boundary, block) pairs.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.engine.cache_engine import CacheEngine
from lmcache_vllm.engine.holds import HeldPrefix, PrefixHit
from lmcache_vllm.engine.kv_groups import GroupKind, GroupSlots, KVGroup
from lmcache_vllm.engine.state import StateEngine
from lmcache_vllm.extra_keys import ExtraKeys
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.tier import TIER_NAMES
from lmcache_vllm.tokens import KeyBuilder, TokenIds

GroupEngine = CacheEngine | StateEngine


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _slowest(a: str, b: str) -> str:
    rank = {name: i for i, name in enumerate(TIER_NAMES)}
    return a if rank.get(a, len(rank)) >= rank.get(b, len(rank)) else b


class GroupedHold:
    """What a lookup promised, over every group (the interface of `engine.HeldPrefix`: `located`,
    `ready`, `wait`, `add_done_callback`, `release`; `hold_of(group)` for the load)."""

    def __init__(self, engine: "GroupedEngine", tokens: TokenIds, start: int, extra: ExtraKeys | None):
        self._engine = engine
        self._tokens = tokens
        self._extra = extra
        cs = engine.keys.chunk_size
        self.start = start
        self._anchors = {g.index: engine.engines[g.index].lookup_and_hold(tokens, start, extra)
                         for g in engine.groups if g.kind == GroupKind.FULL}
        self._others: dict[int, HeldPrefix] = {}  # the prefetch of each other group for `_candidate`
        self._candidate: int | None = None  # the hit end the other groups are being asked about
        self._result: PrefixHit | None = None
        self._limited: set[int] = set()
        self._chunk_size = cs
        self._released = False  # the request went away: no prefetch may start for it any more

    def hold_of(self, group: int) -> HeldPrefix | None:
        return self._anchors.get(group) or self._others.get(group)

    def _holds(self) -> list[HeldPrefix]:
        return list(self._anchors.values()) + list(self._others.values())

    # ------------------------------------------------------------------ the hit
    def located(self, timeout: float | None = 0.0) -> PrefixHit | None:
        """The hit every group can serve, once every tier answered (waiting at most `timeout` s in all);
        None while some prefetch has not."""
        if self._result is not None:
            return self._result
        if self._released:  # asking the other groups would start prefetches nobody releases
            return PrefixHit(self.start, 0, ())
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._candidate is None:
            ends = []
            for hold in self._anchors.values():
                hit = hold.located(_remaining(deadline))
                if hit is None:
                    return None
                ends.append(hit.end if hit.end else self.start)
            self._candidate = min(ends) if ends else self._longest()
        while True:
            n = self._candidate
            if n <= self.start:
                return self._finish(self.start)
            lower = None
            for group in self._engine.groups:
                if group.kind == GroupKind.FULL:
                    continue
                answer = self._ask(group, n, _remaining(deadline))
                if answer is None:
                    return None
                if answer < n:
                    self._limited.add(group.index)
                    lower = answer if lower is None else min(lower, answer)
            if lower is None:
                return self._finish(n)
            self._candidate = lower

    def _longest(self) -> int:
        """The candidate without a full-attention group: every token that could be stored."""
        num = len(self._tokens)
        cs = self._chunk_size
        return num if self._engine.config.save_unfull_chunk else num - num % cs

    def _ask(self, group: KVGroup, n: int, timeout: float | None) -> int | None:
        """n if `group` holds what a hit of n needs, else the longest end it may still serve (< n); None
        while a prefetch has not answered."""
        cs = self._chunk_size
        num = len(self._tokens)
        engine = self._engine.engines[group.index]
        if group.kind == GroupKind.STATE:
            # States are stored at chunk boundaries, and none at the prompt's end (vLLM computes its last token).
            end = min(n, num - 1) // cs * cs
            if end < n:
                return end
            hold = self._others.get(group.index)
            if hold is None or hold.start != n - cs or hold.ends != [n]:
                hold = self._replace(group.index, engine.lookup_and_hold(self._tokens, n, self._extra))
            hit = hold.located(timeout)
            if hit is None:
                return None
            return n if hit.end == n else n - cs
        usable = n - 1 if n == num else n
        needed = group.chunks_needed(usable, self.start, cs)
        if not len(needed):
            return n
        first = needed[0] * cs
        hold = self._others.get(group.index)
        if hold is None or hold.start != first or (hold.ends and hold.ends[-1] != n):
            hold = self._replace(group.index, engine.lookup_and_hold(self._tokens[:n], first, self._extra))
        hit = hold.located(timeout)
        if hit is None:
            return None
        if hit.end == n:
            return n
        missing = (hit.end if hit.end else first) // cs  # the first chunk of the window not found
        return missing * cs

    def _replace(self, group: int, hold: HeldPrefix) -> HeldPrefix:
        old = self._others.get(group)
        if old is not None:
            old.release()
        self._others[group] = hold
        if self._released:  # released while this group was asked (another thread): let it go at once
            hold.release()
        return hold

    def _finish(self, end: int) -> PrefixHit:
        cs = self._chunk_size
        first = self.start // cs
        count = max(0, -(-end // cs) - first)
        tiers = [TIER_NAMES[0]] * count
        for hold in self._holds():
            found = hold.located(0.0)
            if found is None:
                continue
            offset = hold.start // cs - first
            for i, tier in enumerate(found.chunk_tiers):
                if 0 <= offset + i < count:
                    tiers[offset + i] = _slowest(tiers[offset + i], tier)
        for group in self._limited:
            metrics.inc("group_limited_hits", group=self._engine.groups_by_index[group].tag)
        self._result = PrefixHit(self.start, end if end > self.start else 0, tuple(tiers) if end > self.start else ())
        return self._result

    # ------------------------------------------------------------------ HeldPrefix's interface
    def ready(self) -> bool:
        return all(hold.ready() for hold in self._holds())

    def read_in_full(self) -> bool:
        return all(hold.read_in_full() for hold in self._holds())

    def wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for hold in self._holds():
            hold.wait(_remaining(deadline))

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        for hold in self._holds():
            hold.add_done_callback(callback)

    def release(self) -> None:
        self._released = True
        for hold in self._holds():
            hold.release()


class GroupedEngine:
    """The engines of every KV cache group of one model over one storage (see the module docstring)."""

    def __init__(self, config: LMCacheConfig, groups: Sequence[KVGroup], engines: Sequence[GroupEngine],
                 caches: Sequence[list[torch.Tensor]], storage: StorageManager):
        """`engines[i]` and `caches[i]` (the paged views of its layers, in the group's layer order) belong to
        `groups[i]`; every engine uses `storage`."""
        if not groups or not len(groups) == len(engines) == len(caches):
            raise ValueError(f"{len(groups)} groups for {len(engines)} engines and {len(caches)} cache lists")
        self.config = config
        self.groups = list(groups)
        self.groups_by_index = {g.index: g for g in groups}
        self.engines: dict[int, GroupEngine] = {g.index: e for g, e in zip(groups, engines)}
        self.caches: dict[int, list[torch.Tensor]] = {g.index: list(c) for g, c in zip(groups, caches)}
        self.storage = storage
        anchor = next((e for e in engines if isinstance(e, CacheEngine)), engines[0])
        self.keys: KeyBuilder = anchor.keys
        self.layout = getattr(anchor, "layout", None)

    def __repr__(self) -> str:
        return "GroupedEngine(" + ", ".join(f"{g.index}:{g.tag}" for g in self.groups) + ")"

    @property
    def frees_blocks_while_running(self) -> bool:
        """Whether vLLM frees blocks of running requests (sliding window, states): a save reading them must
        end before the next step's forward."""
        return any(g.kind != GroupKind.FULL for g in self.groups)

    def lookup_and_hold(self, tokens: TokenIds, start: int = 0, extra: ExtraKeys | None = None) -> GroupedHold:
        return GroupedHold(self, tokens, max(0, start) // self.keys.chunk_size * self.keys.chunk_size, extra)

    def retrieve(self, tokens: TokenIds, parts: dict[int, GroupSlots], extra: ExtraKeys | None = None,
                 hold: GroupedHold | None = None, lower_tiers: bool = False) -> dict[int, bool]:
        """Loads each group's part; per group whether everything it wanted was loaded."""
        done: dict[int, bool] = {}
        loaded_tokens = 0
        for group in self.groups:
            part = parts.get(group.index)
            if part is None:
                continue
            engine = self.engines[group.index]
            held = hold.hold_of(group.index) if hold is not None else None
            owner = held.owner if held is not None else None
            if isinstance(engine, StateEngine):
                ok = part.complete and all([engine.retrieve(tokens, boundary, block, extra, owner, lower_tiers)
                                            for boundary, block in part.states])
                if ok and part.states:
                    metrics.inc("group_loaded_tokens", self.keys.chunk_size * len(part.states), group=group.tag)
                done[group.index] = ok
                continue
            assert part.slots is not None and part.mask is not None
            if not bool(part.mask.any()):
                done[group.index] = part.complete
                continue
            loaded = engine.retrieve(tokens, self.caches[group.index], part.slots, part.mask, extra=extra,
                                     owner=owner, lower_tiers=lower_tiers)
            done[group.index] = part.complete and bool((loaded | ~part.mask).all())
            loaded_tokens = max(loaded_tokens, int(loaded.sum()))
        metrics.inc("loaded_tokens", loaded_tokens)
        return done

    def store(self, tokens: TokenIds, parts: dict[int, GroupSlots], extra: ExtraKeys | None = None) -> None:
        """Stores each group's part (chunks of attention groups wholly in the mask, states of state groups)."""
        stored = 0
        for group in self.groups:
            part = parts.get(group.index)
            if part is None:
                continue
            engine = self.engines[group.index]
            if isinstance(engine, StateEngine):
                count = engine.store(tokens, part.states, extra)
                metrics.inc("group_stored_tokens", count * self.keys.chunk_size, group=group.tag)
                continue
            assert part.slots is not None and part.mask is not None
            if bool(part.mask.any()):
                stored = max(stored, engine.store(tokens, self.caches[group.index], part.slots, part.mask,
                                                  extra=extra))
        metrics.inc("stored_tokens", stored)

    def wait_written(self, tokens: TokenIds, timeout: float, extra: ExtraKeys | None = None) -> bool:
        deadline = time.monotonic() + timeout
        return all(engine.wait_written(tokens, max(0.0, deadline - time.monotonic()), extra)
                   for engine in self.engines.values() if isinstance(engine, CacheEngine))

    def clear(self, lower_tiers: bool = True) -> bool:
        return self.storage.clear(lower_tiers=lower_tiers)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.storage.close()

