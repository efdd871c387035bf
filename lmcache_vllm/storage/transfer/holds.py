"""`PeerHolds`: the chunks a prefill instance keeps in L1 for the decode instance that will pull them.

A hold is registered (`expect`) in the step that completes a request's prompt, before vLLM can answer the
request, and filled (`fill`) once the request's saves are over: a reference on each L1 chunk of the prompt,
so the allocator cannot evict them. It ends on the decode instance's RELEASE (`release`), when the request
was aborted (`release` too), or `lease_s` after it was registered (`expire`): memory is never held for a
decode instance that never comes.

The transfer server (`server.py`) sends held chunks straight from the arena. It takes its own reference
on the chunks it sends (`checkout`) and hands them back once its sends returned (`sent`: every byte is in
the kernel's buffers by then, or the send failed), so a hold can end at any time, also while its chunks are
being sent; a peer that stops reading is dropped after the server's I/O timeout.

Thread-safe: holds are registered on vLLM's worker thread, filled on the save thread, served and expired on
the transfer server's thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator, Optional, Sequence

from lmcache_vllm.memory import MemoryObj
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.base import release_objs

logger = logging.getLogger(__name__)

_REMEMBER_ENDED = 4096  # ended holds remembered (so a late pull hears "expired", not "unknown")


@dataclass(eq=False)
class Hold:
    """One request's held chunks: pending (`keys` None) until its saves are over."""

    req_id: str
    deadline: float
    keys: Optional[list[str]] = None
    objs: list[MemoryObj] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)  # each chunk's wire header, when made in advance

    @property
    def ready(self) -> bool:
        return self.keys is not None

    def prefix(self, keys: Sequence[str]) -> list[int]:
        """Indexes of the held chunks of the longest prefix of `keys` (in order) this hold has."""
        mine = {key: i for i, key in enumerate(self.keys or ())}
        out = []
        for key in keys:
            index = mine.get(key)
            if index is None:
                break
            out.append(index)
        return out

    @property
    def nbytes(self) -> int:
        return sum(obj.nbytes for obj in self.objs)


class HoldState(str, Enum):
    READY = "ready"
    PENDING = "pending"  # registered, its saves not over yet
    UNKNOWN = "unknown"  # never registered here (or forgotten long ago)
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Checkout:
    state: HoldState
    objs: list[MemoryObj]  # READY: the prefix asked for, one reference each for the caller
    held_keys: tuple[str, ...] = ()  # READY: every key the hold has (to explain a key mismatch)
    headers: tuple[bytes, ...] = ()  # READY: their wire headers when made in advance (else empty)


class PeerHolds:
    """See the module docstring. `clock` is for tests."""

    def __init__(self, lease_s: float, *, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = float(lease_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._ended: "OrderedDict[str, HoldState]" = OrderedDict()
        self._unregister = metrics.register_gauges(self._gauges)

    def expect(self, req_id: str) -> None:
        """Registers a pending hold for `req_id` (its chunks are being saved); an older one is replaced."""
        hold = Hold(req_id, self._clock() + self.lease_s)
        with self._lock:
            old = self._holds.pop(req_id, None)
            self._holds[req_id] = hold
        if old is not None:
            release_objs(old.objs)

    def fill(self, req_id: str, keys: Sequence[str], objs: Sequence[MemoryObj],
             headers: Sequence[bytes] = ()) -> bool:
        """The request's saves are over: `objs` (one reference each, taken over) are the held chunks of
        `keys` (`headers`: their wire headers, made now so that a pull only sends). False (and the
        references dropped) when the hold was released or expired meanwhile."""
        if len(keys) != len(objs) or (headers and len(headers) != len(keys)):
            release_objs(objs)
            raise ValueError(f"{len(keys)} keys but {len(objs)} chunks")
        filled = False
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is not None and not hold.ready:
                hold.keys, hold.objs, hold.headers = list(keys), list(objs), list(headers)
                filled = True
        if not filled:
            release_objs(objs)
        return filled

    def checkout(self, req_id: str, keys: Sequence[str]) -> Checkout:
        """The held chunks of the longest prefix of `keys`, each with a reference for the caller (who
        hands them back with `sent`); or the state that keeps them from being sent."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None:
                return Checkout(self._ended.get(req_id, HoldState.UNKNOWN), [])
            if not hold.ready:
                return Checkout(HoldState.PENDING, [])
            indexes = hold.prefix(keys)
            objs = [hold.objs[i] for i in indexes]
            for obj in objs:
                obj.ref_up()
            headers = tuple(hold.headers[i] for i in indexes) if hold.headers else ()
            return Checkout(HoldState.READY, objs, tuple(hold.keys or ()), headers)

    def sent(self, objs: Sequence[MemoryObj]) -> None:
        """Hands back checked-out chunks (their sends are over)."""
        release_objs(objs)

    def release(self, req_id: str) -> bool:
        """Ends the hold of `req_id` (the decode instance has its chunks, or the request was aborted)."""
        with self._lock:
            hold = self._holds.pop(req_id, None)
            if hold is not None:
                self._remember(req_id, HoldState.RELEASED)
        if hold is None:
            return False
        metrics.inc("pd_holds_released")
        release_objs(hold.objs)
        return True

    def _remember(self, req_id: str, state: HoldState) -> None:
        self._ended[req_id] = state
        while len(self._ended) > _REMEMBER_ENDED:
            self._ended.popitem(last=False)

    def expire(self) -> list[str]:
        """Ends the holds whose lease is over; returns their request ids."""
        now = self._clock()
        with self._lock:
            gone = [h for h in self._holds.values() if now >= h.deadline]
            for hold in gone:
                del self._holds[hold.req_id]
                self._remember(hold.req_id, HoldState.EXPIRED)
        for hold in gone:
            metrics.inc("pd_holds_expired")
            logger.info("hold of request %s expired after %.0fs without a pull or release (%d chunks)",
                        hold.req_id, self.lease_s, len(hold.objs))
            release_objs(hold.objs)
        return [h.req_id for h in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        with self._lock:
            holds = list(self._holds.values())
        yield "pd_holds", {}, len(holds)
        yield "pd_held_bytes", {}, sum(h.nbytes for h in holds)

    def close(self) -> None:
        """Ends every hold (a send in flight keeps its own references until it returns)."""
        self._unregister()
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
        for hold in holds:
            release_objs(hold.objs)
