"""Prefetch bookkeeping for StorageManager: `PrefetchHolds` (the references prefetches keep on the
chunks they found, by key and owner, so that L1 cannot evict them before the request's `get`) and
`PrefetchHandle` (what `StorageManager.prefetch` returns: where the chunks are, wait / done / cancel).

A prefetch is the two-phase protocol of a lookup that promised chunks to a request (vLLM's
`kv_offload` prepare/complete is the model): phase one holds every chunk found in L1 at once and asks
the lower tiers where the rest is (`located`); phase two reads those into L1 memory and holds them too.
A `get` with the prefetch's `owner` takes the holds over; `cancel()` or the hold timeout drop them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from lmcache_vllm.memory import MemoryObj, touch_all
from lmcache_vllm.storage.base import release_objs
from lmcache_vllm.storage.tier import Tier


class PrefetchHolds:
    """References that prefetches keep on the chunks they found, by key, until a `get` takes them.

    Each prefetch is an owner id; `release_owner` (cancel, timeout, close) drops what is left of its
    holds and refuses later ones, so a read finishing after its cancel cannot leave a hold behind. An owner
    made with a hold time is released by `expire` once that time passed (the storage loop sweeps every so
    often: no wake-up of another thread per prefetch, which vLLM's step, where lookups run, paid for in waits for
    the GIL)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, list[tuple[int, MemoryObj]]] = {}
        self._owners: dict[int, list[str]] = {}  # live owners -> keys they hold
        self._next_owner = 0
        self._deadlines: collections.deque[tuple[float, int]] = collections.deque()  # in order: one hold time

    def new_owner(self, hold_s: Optional[float] = None) -> int:
        """A new owner; with `hold_s`, `expire` releases it that many seconds from now."""
        with self._lock:
            self._next_owner += 1
            self._owners[self._next_owner] = []
            if hold_s is not None:
                self._deadlines.append((time.monotonic() + hold_s, self._next_owner))
            return self._next_owner

    def expire(self, now: float) -> int:
        """Releases the owners whose hold time passed by `now` (those already released are skipped); returns
        how many were still live."""
        due = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                due.append(self._deadlines.popleft()[1])
        live = [owner for owner in due if owner in self._owners]
        for owner in live:
            self.release_owner(owner)
        return len(live)

    def hold(self, owner: int, key: str, obj: MemoryObj) -> None:
        """Takes over the caller's reference on `obj`; released at once if `owner` is gone."""
        with self._lock:
            keys = self._owners.get(owner)
            if keys is not None:
                keys.append(key)
                self._by_key.setdefault(key, []).append((owner, obj))
                return
        obj.ref_down()

    def hold_many(self, owner: int, keys: list[str], objs: list[MemoryObj]) -> None:
        """`hold` of each (key, object) pair, under one lock."""
        with self._lock:
            held = self._owners.get(owner)
            if held is not None:
                held.extend(keys)
                for key, obj in zip(keys, objs):
                    self._by_key.setdefault(key, []).append((owner, obj))
                return
        release_objs(objs)

    def take_many(self, keys: list[str], owner: int) -> list[Optional[MemoryObj]]:
        """`take(key, owner)` of each key, under one lock (a load taking its lookup's holds over)."""
        out: list[Optional[MemoryObj]] = []
        with self._lock:
            held = self._owners.get(owner)
            for key in keys:
                entries = self._by_key.get(key, [])
                index = next((i for i, (o, _) in enumerate(entries) if o == owner), -1)
                if held is None or index < 0:
                    out.append(None)
                    continue
                out.append(entries.pop(index)[1])
                if not entries:
                    del self._by_key[key]
                held.remove(key)
        touch_all(out)
        return out

    def take(self, key: str, owner: Optional[int] = None) -> Optional[MemoryObj]:
        """One held object for `key` (held by `owner` when given), its reference passed to the caller;
        None if nothing (or not that owner) holds it. Taking another request's hold would leave that
        request unprotected, hence the owner."""
        with self._lock:
            entries = self._by_key.get(key)
            if not entries:
                return None
            index = len(entries) - 1
            if owner is not None:
                index = next((i for i, (o, _) in enumerate(entries) if o == owner), -1)
                if index < 0:
                    return None
            taker, obj = entries.pop(index)
            if not entries:
                del self._by_key[key]
            self._owners[taker].remove(key)
        obj.touch()
        return obj

    def share(self, key: str) -> Optional[MemoryObj]:
        """A held object for `key` with a new reference for the caller (the holds stay)."""
        with self._lock:
            entries = self._by_key.get(key)
            if not entries:
                return None
            obj = entries[-1][1]
            obj.ref_up()
            return obj

    def release_owner(self, owner: int) -> None:
        with self._lock:
            keys = self._owners.pop(owner, None) or []
            released = []
            for key in keys:
                entries = self._by_key.get(key, [])
                for j, (o, _obj) in enumerate(entries):
                    if o == owner:
                        released.append(entries.pop(j)[1])
                        break
                if not entries:
                    self._by_key.pop(key, None)
        release_objs(released)

    def release_all(self) -> None:
        with self._lock:
            owners = list(self._owners)
        for owner in owners:
            self.release_owner(owner)

    def num_held(self, owner: Optional[int] = None) -> int:
        with self._lock:
            if owner is not None:
                return len(self._owners.get(owner, ()))
            return sum(len(entries) for entries in self._by_key.values())


@dataclass(frozen=True)
class Located:
    """Where the chunks a prefetch asked for are: one tier name per chunk of the run found from the
    first key (`Tier.LOCAL_CPU` for L1, then the lower tiers' names)."""

    tiers: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.tiers)


def _in_l1(n: int) -> Located:
    return Located((Tier.LOCAL_CPU,) * n)


class PrefetchHandle:
    """A background read of lower-tier chunks into L1; what it found stays held until a `get` with its
    `owner` takes it, `cancel()` or the hold timeout."""

    def __init__(self, future: Optional[concurrent.futures.Future[int]], ready: int = 0,
                 release: Optional[Callable[[], None]] = None, owner: Optional[int] = None,
                 lower_pending: bool = False) -> None:
        self._future = future
        self._ready = ready  # chunks held from L1 when the prefetch started
        self._release = release
        self.owner = owner
        self._located: Optional[Located] = None
        self._located_event = threading.Event()
        if not lower_pending:  # everything it will hold is known now
            self.set_located(_in_l1(ready))
        self.cancelled = False
        # Set by the lower-tier phase when it is over, however it ended. Not the future's state: a
        # cancelled future says done at once, while the task on the loop may still be reading.
        self._finished = threading.Event()
        self._read = 0  # chunks the lower-tier phase read and holds (set when it is over)
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def attach(self, future: concurrent.futures.Future[int]) -> None:
        """The lower-tier phase, started after the handle exists (it reports back to the handle)."""
        self._future = future
        future.add_done_callback(self._located_if_never_answered)

    def _located_if_never_answered(self, _future: concurrent.futures.Future[int]) -> None:
        # Failed or cancelled before the lower tiers answered: what L1 held is all there is.
        if not self._located_event.is_set():
            self.set_located(_in_l1(self._ready))

    def set_located(self, located: Located) -> None:
        """Called from the storage loop once the lower tiers answered (or could not answer in time)."""
        self._located = located
        self._located_event.set()

    def located(self, timeout: Optional[float] = 0.0) -> Optional[Located]:
        """Where the chunks are, waiting at most `timeout` seconds (None: forever) for the lower tiers'
        answer; None while they have not answered."""
        if not self._located_event.is_set() and timeout != 0.0:
            self._located_event.wait(timeout)
        return self._located

    def finished(self, read: int = 0) -> None:
        """Called on the storage loop when the lower-tier phase is over (read, failed or cancelled), with
        how many chunks (after those L1 held) it read and holds."""
        with self._callbacks_lock:
            self._read = read
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def done(self) -> bool:
        """Whether the reads are over: nothing of this prefetch runs any more (also after a cancel)."""
        return self._future is None or self._finished.is_set()

    def held(self) -> int:
        """Chunks (from the first) held once `done()`: those L1 had and those read. Fewer than located when a
        read failed (a lower tier listed a chunk it could not give) or the prefetch was cancelled."""
        return self._ready + (self._read if self._finished.is_set() else 0)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` once the reads are over (at once if they are); runs on the storage loop."""
        with self._callbacks_lock:
            if self._future is not None and not self._finished.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Number of keys (from the first) in L1 once the prefetch is done; 0 on timeout or cancel."""
        if self._future is None:
            return self._ready
        try:
            return self._ready + self._future.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            return 0
        except Exception:  # a failed prefetch is just a smaller cache hit later
            return self._ready

    def cancel(self) -> bool:
        """Stops the reads and releases every hold of this prefetch (the request went away); `done()`
        says when the reads have actually stopped."""
        self.cancelled = True
        cancelled = self._future.cancel() if self._future is not None else False
        if self._release is not None:
            self._release()
        self._located_event.set()
        return cancelled
