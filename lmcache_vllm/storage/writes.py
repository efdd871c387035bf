"""Which write-throughs to the lower tiers are in flight, and how the recent ones ended, by key: what a
PD producer waits on before it answers (`StorageManager.wait_written`), so that a consumer looking the
prompt up in the shared tier right after finds it. A key with no write seen lately is not assumed written:
`wait` returns it, and the manager asks the lower tiers whether they have it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Iterable, Optional

_KEEP_DONE = 4096  # outcomes kept after they are known (a waiter comes within a step or two)


class _Write:
    __slots__ = ("done", "ok")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False


class WriteTracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: "OrderedDict[str, _Write]" = OrderedDict()

    def started(self, key: str) -> None:
        with self._lock:
            self._writes[key] = _Write()
            self._writes.move_to_end(key)
            while len(self._writes) > _KEEP_DONE and next(iter(self._writes.values())).done.is_set():
                self._writes.popitem(last=False)

    def ended(self, key: str, ok: bool) -> None:
        """A write of `key` finished (`ok`: every lower tier has it) or was dropped (not ok)."""
        with self._lock:
            write = self._writes.get(key)
            if write is None:
                write = self._writes[key] = _Write()
        write.ok = ok
        write.done.set()

    def failed(self, key: str) -> bool:
        """Whether the last write-through seen of `key` was dropped or failed (a new store retries it)."""
        with self._lock:
            write = self._writes.get(key)
        return write is not None and write.done.is_set() and not write.ok

    def wait(self, keys: Iterable[str], timeout: float) -> tuple[bool, list[str]]:
        """(whether every write seen of these keys ended well within `timeout` seconds, the keys with no
        write seen lately: stored before, skipped, or never stored at all, which only the tiers can tell)."""
        deadline = time.monotonic() + timeout
        unseen = []
        for key in keys:
            with self._lock:
                write: Optional[_Write] = self._writes.get(key)
            if write is None:
                unseen.append(key)
                continue
            if not write.done.wait(max(0.0, deadline - time.monotonic())) or not write.ok:
                return False, unseen
        return True, unseen
