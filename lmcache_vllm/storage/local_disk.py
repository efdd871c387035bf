"""L2: one file per chunk in a local directory, with a size cap, LRU eviction and a start-up re-index.

- A chunk file's name and contents, and what makes one valid: `chunk_file.py`. Written to a `.tmp-*`
  file (mode 0600, directory 0700) with `O_DIRECT` straight from the MemoryObj's bytes where the file
  system allows it (else one `os.writev` of header + bytes through the page cache), then renamed into
  place, so a reader never sees half a file. A failed write (ENOSPC, EIO, ...) removes the temp file and counts the
  store as dropped.
- Reads run on a thread pool (several threads: parallel cold reads are ~3x faster than one on this
  machine): `pread` of the header, allocation of a MemoryObj of the right shape, `preadv` of the payload
  straight into the MemoryObj's bytes, checksum. A corrupt or truncated file is a miss and is deleted.
  Eviction may unlink a file a reader has open; POSIX keeps the open file readable, so that is safe.
- What it holds (key -> file, LRU order, its own files, writes under way): `disk_index.DiskIndex`.
- Several live processes may share the directory: a key missing from the index is looked up as a
  file (one stat) before it counts as a miss, and a valid file is adopted into the index; a write of a
  key whose file another process wrote already is skipped. They share one cap (`disk_budget.py`): only
  a writer that would take the directory over it evicts, so another process's files are never evicted
  while the directory is under its cap. It evicts, least recently used first, the files it wrote or
  found at start-up (nobody was known to use them), then those it adopted from live processes, then
  chunk files it does not know, oldest first.
- Start-up: the directory is scanned and every header read; our files (valid by `chunk_file.check_file`,
  accepted by `key_filter`, e.g. the same model) are indexed oldest-mtime first; files of another
  format version, misnamed or rejected by the filter are left alone and not counted; corrupt files of
  our format are removed; stale temp files (a crashed writer's, `chunk_file.STALE_TMP_SECS`) are removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage import chunk_file, codec, coders, disk_dir
from lmcache_vllm.storage.base import StorageBackend, gather_owned
from lmcache_vllm.storage.chunk_file import HEADER_ALIGN, SUFFIX, TMP_PREFIX, filename_for, key_from_filename
from lmcache_vllm.storage.disk_budget import SharedDiskBudget, Usage, chunk_files_oldest_first
from lmcache_vllm.storage.disk_index import DiskIndex, Entry
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)


class LocalDiskBackend(StorageBackend):
    name = Tier.LOCAL_DISK

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                    mac: Optional[codec.ChunkMac] = None) -> Optional[LocalDiskBackend]:
        return cls(config, key_filter=key_filter, mac=mac) if config.local_disk else None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> Optional[str]:
        if config.local_disk and config.extra_config.local_disk_shared:
            return f"{config.local_disk} is configured as shared with other users"
        return None

    def __init__(self, config: LMCacheConfig, *, key_filter: Optional[Callable[[str], bool]] = None,
                 mac: Optional[codec.ChunkMac] = None):
        """The directory `config.local_disk` capped at `max_local_disk_size`, with the `extra_config.disk_*`
        settings and `local_disk_shared`; `key_filter(key)`: whether a chunk found there is ours to use
        (e.g. this model's); `mac`: the keyed MAC of every chunk written and required of every chunk read."""
        extra = config.extra_config
        if not config.local_disk:
            raise ValueError("LocalDiskBackend needs local_disk")
        # O_DIRECT writes skip the page cache: no copy, no page-cache pages to fault in (measured here:
        # 256 MiB cost 0.24-0.75 s of CPU buffered, 0.01 s direct). Turned off for good the first
        # time the file system refuses it (tmpfs does).
        self.direct_io = extra.disk_direct_io and hasattr(os, "O_DIRECT")
        self.path = os.path.abspath(config.local_disk)
        self.max_bytes = config.max_local_disk_bytes
        self.fsync = extra.disk_fsync
        self.key_filter = key_filter
        self.mac = mac  # keyed MAC of every chunk written and required of every chunk read
        self.serde = extra.local_disk_serde  # the codec of the chunks it writes (it reads every codec)
        # Created 0700; one another user owns or others can write is refused unless `shared`.
        self.shared = extra.local_disk_shared  # others may write it: without `mac`, they can plant chunks
        disk_dir.prepare_directory(self.path, self.shared)
        self._lock = threading.Lock()  # (for `_reads_in_flight`)
        self._index = DiskIndex()
        self._budget = SharedDiskBudget(self.path, self.max_bytes)
        self._read_pool = ThreadPoolExecutor(extra.disk_io_threads, thread_name_prefix="lmcache-disk-read",
                                             initializer=enter_background_cpus)
        self._reads_in_flight = 0  # file reads submitted and not finished (cancelled ones included)
        # A write thread per write-through worker of the manager: each has one put in flight at a time.
        self._write_pool = ThreadPoolExecutor(extra.write_workers, thread_name_prefix="lmcache-disk-write",
                                              initializer=enter_background_cpus)
        self._closed = False
        self._scan()

    # ---- start-up -----------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        now = time.time()
        with os.scandir(self.path) as it:
            for entry in it:
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    try:  # another live process may be renaming it right now
                        stale = chunk_file.is_stale_tmp(entry.name, entry.stat().st_mtime, now)
                    except OSError:
                        continue
                    if stale:
                        self._unlink(entry.name)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                item = self._check_file(entry.name)
                if item is not None:
                    found.append(item)
        found.sort(key=lambda item: item[0])
        for _, key, name, size in found:
            self._index.add(key, (name, size), mine=True)
            kv_events.stored(key, self.name)
        metrics.inc("reindexed_chunks", len(found), tier=self.name)
        with self._budget.transaction() as usage:
            usage.used = sum(size for _, size in chunk_files_oldest_first(self.path, SUFFIX))
            if usage.used > self.max_bytes:  # e.g. the cap was lowered since the files were written
                self._evict(usage.used - self.max_bytes, usage)

    def _check_file(self, name: str, expected_key: Optional[str] = None) -> Optional[tuple[float, str, str, int]]:
        """(mtime, key, name, size) when `name` is a valid chunk file of ours, else None (a corrupt
        one of our format is removed; anything else, a symbolic link or FIFO included, is left alone)."""
        try:
            fd = disk_dir.open_regular(os.path.join(self.path, name))
        except (OSError, disk_dir.NotRegularFile):
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, codec.MAX_HEADER_SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)

        def accept(key: str) -> bool:  # not a hashed name's other key, nor e.g. another model's chunk
            return (expected_key is None or key == expected_key) and (self.key_filter is None or self.key_filter(key))

        try:
            header = chunk_file.check_file(name, head, st.st_size, accept)
        except chunk_file.MisnamedFile:
            return None  # not where its key's file would be: leave it alone
        except codec.CorruptEntry:
            self._drop_corrupt(name, st.st_size)
            return None
        if header is None:
            return None  # another format, not ours, or not accepted: leave it alone
        return (st.st_mtime, header.key, name, st.st_size)

    def _adopt(self, key: str, writing: bool = False) -> Optional[Entry]:
        """On an index miss: the key's file written by another live process sharing the directory is
        indexed (one failed open when there is no such file; a header read when there is). `writing`: asked
        by our own write of the key, which then skips writing it."""
        name = filename_for(key)
        item = self._check_file(name, key)
        if item is None:
            return None
        entry, added = self._index.adopt(key, (name, item[3]), writing=writing)
        if added:
            metrics.inc("adopted_chunks", tier=self.name)
            kv_events.stored(key, self.name)
        return entry

    # ---- helpers ------------------------------------------------------------------------------
    def _unlink(self, name: str, size: int | None = None, usage: Usage | None = None) -> bool:
        """Removes a file; when it was a counted chunk file (`size`), its bytes come off the shared
        budget (only the one unlink that succeeds takes them off; inside the caller's transaction when
        it gives its `usage`) and a KV event says so. True if we removed it."""
        try:
            os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("cannot remove %s: %s", name, exc)
            return False
        if size is not None:
            if usage is not None:
                usage.used -= size
            else:
                self._budget.release(size)
            key = key_from_filename(name)
            if key is not None:  # (a hashed name's key is in its header: no event)
                kv_events.removed(key, self.name)
        return True

    def _drop_corrupt(self, name: str, size: int | None = None) -> None:
        metrics.inc("corrupt_chunks", tier=self.name)
        self._unlink(name, size)

    def _evict(self, nbytes: int, usage: Usage) -> bool:
        """Frees `nbytes` of the directory's shared budget inside the caller's transaction: our own least
        recently used files first, then the others we know, then unknown chunk files, oldest first.
        False if that is impossible."""
        freed = 0
        for own in (True, False):
            while freed < nbytes:
                lru = self._index.pop_lru(mine=own)
                if lru is None:
                    break
                _, (name, size) = lru
                if self._unlink(name, size, usage):
                    freed += size
                    metrics.inc("evictions", tier=self.name)
        if freed < nbytes:
            for name, size in chunk_files_oldest_first(self.path, SUFFIX, skip=self._index.names()):
                if freed >= nbytes:
                    break
                if self._unlink(name, size, usage):
                    freed += size
                    metrics.inc("evictions", tier=self.name)
        return freed >= nbytes

    # ---- StorageBackend -----------------------------------------------------------------------
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        found = self._index.contains(keys)
        return [hit or self._adopt(k) is not None for k, hit in zip(keys, found)]

    def holds(self, key: str) -> bool:
        """Whether `key` is indexed here now (no I/O; a file another process wrote is not looked for)."""
        return self._index.contains([key])[0]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._index.used

    @property
    def reads_in_flight(self) -> int:
        """File reads still running; a cancelled read frees its memory only when it finishes."""
        return self._reads_in_flight

    def _read_done(self, _fut: Future[Optional[MemoryObj]]) -> None:
        with self._lock:
            self._reads_in_flight -= 1

    async def get(self, key: str, alloc: AllocFn) -> Optional[MemoryObj]:
        item = self._index.lookup(key)
        if item is None:
            item = self._adopt(key)
        if item is None:
            return None  # the manager counts misses
        cfut: Future[Optional[MemoryObj]] = self._read_pool.submit(
            chunk_file.read_chunk, os.path.join(self.path, item[0]), key, alloc, self.mac)
        with self._lock:
            self._reads_in_flight += 1
        cfut.add_done_callback(self._read_done)
        afut = asyncio.wrap_future(cfut)
        try:
            obj = await asyncio.shield(afut)
        except asyncio.CancelledError:
            # The read thread may still be filling the object: free it only once the thread is done
            # (its error, if any, is nobody's to handle any more).
            if not cfut.cancel():
                cfut.add_done_callback(_release_result)
                afut.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        except codec.CorruptEntry as exc:
            logs.warn(logger, "disk_corrupt", "corrupt disk chunk %s: %s", item[0], exc)
            if self._index.forget(key) is not None:
                self._drop_corrupt(item[0], item[1])
            return None
        except FileNotFoundError:
            self._index.forget(key)
            return None
        except OSError as exc:
            logs.warn(logger, "disk_read_failed", "disk read of %s failed: %s", item[0], exc)
            metrics.inc("failed_reads", tier=self.name)
            return None
        if obj is None:
            metrics.inc("read_alloc_failures", tier=self.name)
        return obj

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[Optional[MemoryObj]]:
        # One read per file in parallel on the read pool.
        return await gather_owned(self.get(key, alloc) for key in keys)

    async def put(self, key: str, obj: MemoryObj) -> bool:
        if self._closed:
            return False
        size = codec.header_size(key, obj.tensor.dim(), HEADER_ALIGN, coded=True) + obj.nbytes  # at most
        if not self._index.begin_write(key):
            return True  # indexed, or being written
        if size > self.max_bytes:
            self._index.end_write(key)
            metrics.inc("failed_writes", tier=self.name)
            return False
        try:
            if self._adopt(key, writing=True) is not None:
                return True  # another process sharing the directory wrote it already
            name = filename_for(key)
            # The writer thread holds its own reference, so cancelling this coroutine (shutdown) never
            # frees the bytes while the thread is still writing them.
            obj.ref_up()
            cfut = self._write_pool.submit(self._write_file, name, key, obj)
            cfut.add_done_callback(lambda _: obj.ref_down())
            written = await asyncio.wrap_future(cfut)
            ok = written is not None
            if written is not None:
                self._index.add(key, (name, written[0]), mine=True)
                kv_events.stored(key, self.name)
                metrics.inc("stored_chunks", tier=self.name)
                metrics.inc("stored_bytes", obj.nbytes, tier=self.name)
                metrics.inc("coded_bytes", written[1], tier=self.name, codec=written[2])
            else:
                metrics.inc("failed_writes", tier=self.name)
            return ok
        finally:
            self._index.end_write(key)

    def _write_file(self, name: str, key: str, obj: MemoryObj) -> Optional[tuple[int, int, str]]:
        """(file size, payload size, the codec that applied), or None when the write failed."""
        # The payload's coding and the header (with the payload checksum) are made here, on the writer
        # thread, so that a batch of puts neither codes nor checksums serially on the event loop.
        parts = codec.encode_parts(key, obj.tensor, self.mac, coder=self.serde, align=HEADER_ALIGN)
        # O_DIRECT straight from the arena (page-aligned large objects); a coded payload is a buffer of its own
        want_direct = self.direct_io and parts.coder == coders.NAIVE and \
            obj.tensor.data_ptr() % chunk_file.DIRECT_ALIGN == 0
        size = parts.nbytes
        ok = chunk_file.write_chunk(self.path, name, f"{TMP_PREFIX}{uuid.uuid4().hex}", parts.header,
                                    parts.payload, want_direct, self.fsync, self._no_direct_io,
                                    lambda tmp, final: self._commit(tmp, final, size))
        return (size, size - len(parts.header), parts.coder) if ok else None

    def _commit(self, tmp: str, final: str, size: int) -> bool:
        """Renames a written chunk file into place, in one transaction with the evictions the shared cap
        needs for it (another process's files only when the directory would be over its cap). Another
        writer of the same key may have committed its file meanwhile (both found none when they began):
        ours replaces it, and only the difference is counted, so the key's bytes count once."""
        with self._budget.transaction() as usage:
            over = usage.used + size - _regular_file_size(final) - self.max_bytes
            if over > 0 and not self._evict(over, usage):
                return False
            replaced = _regular_file_size(final)  # (the eviction may just have removed it)
            os.rename(tmp, final)
            usage.used += size - replaced
            return True

    def _no_direct_io(self, what: str) -> None:
        if self.direct_io:
            self.direct_io = False
            logger.info("%s: O_DIRECT %s refused; chunk files are written through the page cache",
                        self.path, what)

    async def remove(self, key: str) -> None:
        item = self._index.forget(key)
        if item is not None:
            self._unlink(*item)

    async def clear(self) -> None:
        for name, size in self._index.drain():
            self._unlink(name, size)

    async def close(self) -> None:
        self._closed = True
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        self._budget.close()

    def gauges(self) -> dict[str, float]:
        return {"resident_chunks": len(self._index), "used_bytes": self._index.used,
                "capacity_bytes": self.max_bytes, "unprotected_shared_tier": int(self.shared and self.mac is None)}


def _regular_file_size(path: str) -> int:
    """The size of the regular file at `path`; 0 when there is none (or something else is there, a hard link
    included: replacing that name frees none of its bytes)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def _release_result(cfut: Future[Optional[MemoryObj]]) -> None:
    if cfut.cancelled() or cfut.exception() is not None:
        return
    obj = cfut.result()
    if obj is not None:
        obj.ref_down()
