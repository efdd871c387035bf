"""One byte budget per disk directory, shared by every process that writes chunk files into it (the TP
ranks of one vLLM, several vLLM instances or models on one host).

The budget is a small file in the directory, `.lmcache-usage`: the bytes of the chunk files there, an
8-byte little-endian count, read and changed only inside a `transaction()`, which holds an exclusive
`fcntl.flock` on it. A writer writes its temp file first, then in one transaction evicts what the cap
needs and renames the file into place, adding its bytes; whoever unlinks a chunk file (only one `unlink`
of a file succeeds) takes its bytes off. So the chunk files of the directory stay under one cap, not one
cap per process, and a start-up `recount` (in a transaction, so between two commits) is exact. Only a
process dying between its rename and the end of the transaction's write-back can leave the count off,
until the next process start re-counts.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from lmcache_vllm.config.fields import ConfigError, Problem
from lmcache_vllm.storage.disk_dir import NotRegularFile, open_regular

USAGE_FILE = ".lmcache-usage"
_COUNT = struct.Struct("<Q")


def chunk_files_oldest_first(path: str, suffix: str, skip: Iterable[str] = ()) -> list[tuple[str, int]]:
    """(name, size) of the regular files of one name named `*suffix` in `path` but those in `skip`, oldest
    first."""
    skip = set(skip)
    found = []
    with os.scandir(path) as it:
        for entry in it:
            if entry.name.endswith(suffix) and entry.name not in skip:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # (a hard link is no file of the directory's)
                    found.append((st.st_mtime, entry.name, st.st_size))
    return [(name, size) for _, name, size in sorted(found)]


@dataclass
class Usage:
    """The directory's count inside a transaction: change `used`; it is written back at the end."""

    used: int


class SharedDiskBudget:
    """The used-bytes count of a directory, shared through a locked file (see the module docstring)."""

    def __init__(self, path: str, max_bytes: int):
        self.path = os.path.join(path, USAGE_FILE)
        self.max_bytes = int(max_bytes)
        try:  # never through a symbolic link: the count would be written into the link's target
            self._fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except NotRegularFile as exc:
            raise ConfigError([Problem("local_disk", path, f"{exc}; {USAGE_FILE} must be a regular file "
                                       "(remove what stands there)")]) from None
        self._thread_lock = threading.Lock()  # flock excludes other open files, not our own threads

    @contextmanager
    def transaction(self) -> Iterator[Usage]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _COUNT.size, 0)
                usage = Usage(_COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else 0)
                yield usage
                os.pwrite(self._fd, _COUNT.pack(max(0, usage.used)), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @classmethod
    def of_directory(cls, path: str) -> "SharedDiskBudget | None":
        """The budget of a directory a disk tier has used (None when none has: nothing to keep count of)."""
        if not os.path.exists(os.path.join(path, USAGE_FILE)):
            return None
        return cls(path, 0)

    def used(self) -> int:
        with self.transaction() as usage:
            return usage.used

    def release(self, nbytes: int) -> None:
        """A chunk file of `nbytes` was unlinked (by us)."""
        with self.transaction() as usage:
            usage.used -= nbytes

    def recount(self, sizes: Iterable[int]) -> int:
        """Sets the count to the sum of `sizes` (of the chunk files actually there); returns it."""
        with self.transaction() as usage:
            usage.used = sum(sizes)
            return usage.used

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
