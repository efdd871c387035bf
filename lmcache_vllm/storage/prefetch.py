"""Prefetch bookkeeping for StorageManager: `PrefetchHolds` (the references prefetches keep on the
chunks they found, by key, so that L1 cannot evict them before the request's `get`) and
`PrefetchHandle` (what `StorageManager.prefetch` returns: wait / done / cancel)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, Optional

from lmcache_vllm.memory import MemoryObj
from lmcache_vllm.storage.base import release_objs


class PrefetchHolds:
    """References that prefetches keep on the chunks they found, by key, until a `get` takes them.

    Each prefetch is an owner id; `release_owner` (cancel, timeout, close) drops what is left of its
    holds and refuses later ones, so a read finishing after its cancel cannot leave a hold behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, list[tuple[int, MemoryObj]]] = {}
        self._owners: dict[int, list[str]] = {}  # live owners -> keys they hold
        self._next_owner = 0

    def new_owner(self) -> int:
        with self._lock:
            self._next_owner += 1
            self._owners[self._next_owner] = []
            return self._next_owner

    def hold(self, owner: int, key: str, obj: MemoryObj) -> None:
        """Takes over the caller's reference on `obj`; released at once if `owner` is gone."""
        with self._lock:
            keys = self._owners.get(owner)
            if keys is not None:
                keys.append(key)
                self._by_key.setdefault(key, []).append((owner, obj))
                return
        obj.ref_down()

    def take(self, key: str) -> Optional[MemoryObj]:
        """One held object for `key`, its reference passed to the caller; None if nothing holds it."""
        with self._lock:
            entries = self._by_key.get(key)
            if not entries:
                return None
            owner, obj = entries.pop()
            if not entries:
                del self._by_key[key]
            self._owners[owner].remove(key)
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
                for j, (o, obj) in enumerate(entries):
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

    def num_held(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._by_key.values())


class PrefetchHandle:
    """A background read of lower-tier chunks into L1; what it found stays held until a `get` takes
    it, `cancel()` or the hold timeout."""

    def __init__(self, future: Optional[concurrent.futures.Future], ready: int = 0,
                 release: Optional[Callable[[], None]] = None):
        self._future = future
        self._ready = ready
        self._release = release

    def done(self) -> bool:
        return self._future is None or self._future.done()

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
        """Stops the reads and releases every hold of this prefetch (the request went away)."""
        cancelled = self._future.cancel() if self._future is not None else False
        if self._release is not None:
            self._release()
        return cancelled
