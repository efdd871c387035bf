"""The disk tier's index of its chunk files (`DiskIndex`): which key is in which file of what size, least
recently used first; which of them are the tier's own (written by it or found at start-up: evicted
before those adopted from other live processes sharing the directory); which keys it is writing now.

No I/O here: the files, the directory's shared byte budget and the metrics are `local_disk.py`'s. The
index is used from the event loop, the tier's read and write threads and `contains` callers at once,
so every method takes its lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

Entry = tuple[str, int]  # (file name, size in bytes)


class DiskIndex:
    """Key -> `Entry` of the chunk files a disk tier knows, least recently used first (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._mine: set[str] = set()  # keys of files we wrote or found at start-up (evicted first)
        self._writing: set[str] = set()
        self.used = 0  # bytes of the indexed files (the directory's total is the shared budget's)

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def lookup(self, key: str) -> Optional[Entry]:
        """The key's entry, now the most recently used; None when it is not indexed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def add(self, key: str, entry: Entry, *, mine: bool) -> None:
        """Indexes (or re-indexes) `key` as the most recently used; `mine`: a file we wrote or found."""
        with self._lock:
            self._drop(key)
            self._entries[key] = entry
            self.used += entry[1]
            if mine:
                self._mine.add(key)

    def adopt(self, key: str, entry: Entry, *, writing: bool) -> tuple[Optional[Entry], bool]:
        """Indexes a file another live process wrote, unless a write of ours of the key is under way (one
        that is not the caller, `writing`): (the key's entry, or None; whether it was added now)."""
        with self._lock:
            if key in self._writing and not writing:
                return None, False  # our own write of it is about to index it
            if key in self._entries:
                return self._entries[key], False
            self._entries[key] = entry
            self.used += entry[1]
            return entry, True

    def forget(self, key: str) -> Optional[Entry]:
        with self._lock:
            return self._drop(key)

    def pop_lru(self, mine: bool) -> Optional[tuple[str, Entry]]:
        """Removes and returns the least recently used (key, entry) of our own files (`mine`) or of the
        others; None when there is none."""
        with self._lock:
            key = next((k for k in self._entries if (k in self._mine) == mine), None)
            if key is None:
                return None
            self._mine.discard(key)
            entry = self._entries.pop(key)
            self.used -= entry[1]
            return key, entry

    def names(self) -> set[str]:
        """The file names of every indexed key."""
        with self._lock:
            return {name for name, _ in self._entries.values()}

    def drain(self) -> list[Entry]:
        """Empties the index; returns what it held."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._mine.clear()
            self.used -= sum(size for _, size in entries)
            return entries

    def begin_write(self, key: str) -> bool:
        """Marks `key` as being written; False (nothing marked) when it is indexed or written already."""
        with self._lock:
            if key in self._entries or key in self._writing:
                return False
            self._writing.add(key)
            return True

    def end_write(self, key: str) -> None:
        with self._lock:
            self._writing.discard(key)

    def _drop(self, key: str) -> Optional[Entry]:
        entry = self._entries.pop(key, None)
        self._mine.discard(key)
        if entry is not None:
            self.used -= entry[1]
        return entry
