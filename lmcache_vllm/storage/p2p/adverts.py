"""`Adverts`: which chunks this rank lists in the P2P directory, and the changes not written there yet.

`add(key)` when a chunk is stored into L1 (the P2P tier's write-through), `discard(key)` when it leaves L1
(L1's removal listener, on any thread). `take()` hands the pending additions and withdrawals to the tier's
flusher, which writes them in batches; a key added and gone again before a flush never reaches the directory.
`ids()` is everything listed, for a full rewrite after the directory lost this rank's entries; `clear()` lists
nothing (every tier was emptied). Only the 8-byte
ids are kept (a key's id is computed again when it leaves): two keys with one id would share an entry, a hint
the pull's key check corrects. Thread-safe.
"""
from __future__ import annotations

import threading

from lmcache_vllm.storage.p2p.directory import chunk_id


class Adverts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[bytes] = set()  # directory ids of the chunks listed (or about to be)
        self._add: set[bytes] = set()
        self._remove: set[bytes] = set()

    def add(self, key: str) -> None:
        cid = chunk_id(key)
        with self._lock:
            if cid in self._held:
                return
            self._held.add(cid)
            self._remove.discard(cid)
            self._add.add(cid)

    def discard(self, key: str) -> None:
        cid = chunk_id(key)
        with self._lock:
            if cid not in self._held:
                return
            self._held.discard(cid)
            if cid in self._add:
                self._add.discard(cid)  # never written: nothing to withdraw
            else:
                self._remove.add(cid)

    def discard_many(self, keys: list[str]) -> None:
        for key in keys:
            self.discard(key)

    def clear(self) -> None:
        """Nothing is listed any more: the flusher's next full rewrite (`ids()`) empties the directory's set."""
        with self._lock:
            self._held, self._add, self._remove = set(), set(), set()

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """(ids to add, ids to withdraw) since the last take."""
        with self._lock:
            add, remove = list(self._add), list(self._remove)
            self._add, self._remove = set(), set()
        return add, remove

    def ids(self) -> list[bytes]:
        """Every id listed (what was pending is part of it, and no longer pending)."""
        with self._lock:
            self._add, self._remove = set(), set()
            return list(self._held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        cid = chunk_id(key)
        with self._lock:
            return cid in self._held
