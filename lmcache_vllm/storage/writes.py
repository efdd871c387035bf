"""Which write-throughs to the lower tiers are in flight, and how the recent ones ended, by key: what a
PD producer waits on before it answers (`StorageManager.wait_written`), so that a consumer looking the
prompt up in the shared tier right after finds it."""

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

    def wait(self, keys: Iterable[str], timeout: float) -> bool:
        """True when every key's last write ended well within `timeout` seconds (a key not written
        through lately was written before: L1 held it, so it came from or went to the lower tiers)."""
        deadline = time.monotonic() + timeout
        for key in keys:
            with self._lock:
                write: Optional[_Write] = self._writes.get(key)
            if write is None:
                continue
            if not write.done.wait(max(0.0, deadline - time.monotonic())) or not write.ok:
                return False
        return True
