"""L3: chunks in a Mooncake Store (`remote_url: mooncakestore://master:port`; docs/MOONCAKE.md), shared by
processes and hosts as Redis' chunks are, through `client.MooncakeClient` (every call on our threads, bounded).

- One Mooncake object per chunk, `<remote_key_prefix><key string>`, in our chunk format (codec.py: the header
  with its checksums and, with a secret, the MAC; then the payload). An object is written whole by one put and
  never overwritten; a key already there is not written again (one batched existence check first).
- Zero copy: a put sends the header from the tier's small header arena and the payload straight from the chunk
  in the L1 arena. A read of chunks whose shape and dtype the engine knows (`codec.ExpectedAlloc`) allocates
  each at that shape in L1, never at what a stored header claims, and Mooncake writes each object's header
  into the header arena and its payload into the chunk: one call for a batch of chunks. Key, shape, size,
  checksum and MAC are checked before a chunk counts. Reads without known shapes (tools, tests) ask each
  object's size and decode a copy.
- Puts that come while one is being sent go out together as the next batch.
- Faults are misses, counted (tier `mooncake`): a master that is down, dies or restarts empty (`failed_reads`,
  `failed_writes`, `breaker_skipped_calls`); an object listed but not read back, because it was evicted or
  its storage host died (`lost_chunks`; one whose replica did not read back is removed, or the master would
  list it to every lookup until the host's lease ends); bytes that are not the chunk asked for, or an object
  of another size (`corrupt_chunks`, removed).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.config.remote_url import is_mooncake_url, parse_mooncake_url
from lmcache_vllm.memory import AllocationError, AllocFn, HostAllocator, MemoryObj
from lmcache_vllm.observability import kv_events, logs, metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.base import StorageBackend, release_objs
from lmcache_vllm.storage.mooncake.client import (
    INVALID_PARAMS,
    MASTER_UNREACHABLE,
    OBJECT_ALREADY_EXISTS,
    TRANSFER_FAIL,
    CallFailed,
    MooncakeClient,
    MooncakeSettings,
    settled,
)
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

HEADER_ARENA_BYTES = 8 << 20  # headers of the calls in flight (a few hundred bytes per chunk)
MAX_KEYS_PER_CALL = 256  # a larger batch goes out as several calls at once


class _Read:
    """One chunk of a zero-copy batch read: where its header and payload go, and how the read ended."""

    __slots__ = ("index", "key", "rkey", "spec", "header_len", "nbytes", "obj", "outcome")

    def __init__(self, index: int, key: str, rkey: str, spec: codec.ChunkSpec, obj: MemoryObj):
        self.index, self.key, self.rkey, self.spec, self.obj = index, key, rkey, spec, obj
        self.header_len = codec.header_size(key, len(spec[0]))
        self.nbytes = obj.nbytes
        self.outcome = "failed"

    @property
    def size(self) -> int:
        return self.header_len + self.nbytes


class MooncakeBackend(StorageBackend):
    name = Tier.MOONCAKE

    @classmethod
    def from_config(cls, config: LMCacheConfig, *, key_filter: Callable[[str], bool] | None = None,
                    mac: codec.ChunkMac | None = None) -> MooncakeBackend | None:
        return cls(config, mac=mac) if config.remote_url and is_mooncake_url(config.remote_url) else None

    @classmethod
    def writable_by_others(cls, config: LMCacheConfig) -> str | None:
        if config.remote_url and is_mooncake_url(config.remote_url):
            return "every instance, and anyone who reaches the Mooncake master or a storage host, writes it"
        return None

    def __init__(self, config: LMCacheConfig, *, mac: codec.ChunkMac | None = None, breaker_base_secs: float = 0.5,
                 start_wait_secs: float | None = None):
        """The Mooncake Store `config.remote_url` names, with LMCache's Mooncake keys of `extra_config` and our
        `remote_key_prefix`, `remote_timeout_secs` (per chunk a call moves), `remote_breaker_max_secs` and
        `mooncake_threads`; `mac`: the keyed MAC of every chunk written and required of every chunk read.
        Waits at most `start_wait_secs` (default: remote_timeout_secs) for the store to be set up; until it
        is, every call is a miss."""
        extra = config.extra_config
        if not config.remote_url or not is_mooncake_url(config.remote_url):
            raise ValueError("MooncakeBackend needs a mooncakestore:// remote_url")
        self.location = parse_mooncake_url(config.remote_url).display()
        self.mac = mac
        self.prefix = extra.remote_key_prefix
        self.timeout = extra.remote_timeout_secs
        self._headers = HostAllocator(HEADER_ARENA_BYTES)
        self.client = MooncakeClient(MooncakeSettings.from_config(config), threads=extra.mooncake_threads,
                                     breaker_base_secs=breaker_base_secs,
                                     breaker_max_secs=extra.remote_breaker_max_secs, connect_timeout=self.timeout)
        self.start_problem = self.client.start(self.timeout if start_wait_secs is None else start_wait_secs)
        if self.start_problem is not None:
            logger.warning("lmcache-vllm: the Mooncake tier %s is not ready at start-up: %s; its calls are misses "
                           "until it is", self.location, self.start_problem)
        self._puts: list[tuple[str, MemoryObj, asyncio.Future[bool]]] = []
        self._flusher: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.location!r}, prefix={self.prefix!r})"

    def gauges(self) -> dict[str, float]:
        return {"breaker_open": int(self.client.breaker.is_open or not self.client.ready),
                "unprotected_shared_tier": int(self.mac is None)}

    def _rkey(self, key: str) -> str:
        return self.prefix + key

    # ---- reads ------------------------------------------------------------------------------------
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        rkeys = [self._rkey(k) for k in keys]
        try:
            found: list[int] = await self.client.call(lambda store: store.batch_is_exist(rkeys), timeout=self.timeout,
                                                      unreachable=_unreachable)
        except CallFailed:
            metrics.inc("failed_reads", tier=self.name)
            return [False] * len(keys)
        if any(code < 0 for code in found):
            metrics.inc("failed_reads", tier=self.name)
        return [code == 1 for code in found]

    async def get(self, key: str, alloc: AllocFn) -> MemoryObj | None:
        return (await self.get_many([key], alloc))[0]

    async def get_many(self, keys: Sequence[str], alloc: AllocFn) -> list[MemoryObj | None]:
        out: list[MemoryObj | None] = [None] * len(keys)
        if not keys:
            return out
        if not isinstance(alloc, codec.ExpectedAlloc):
            for i, obj in enumerate(await self._read_copies(keys, alloc)):
                out[i] = obj
            return out
        reads: list[_Read] = []
        for i, key in enumerate(keys):
            spec = alloc.expected.get(key)
            if spec is None:  # nobody asked for this chunk's shape: nothing to read it into
                continue
            obj = alloc(tuple(spec[0]), spec[1])
            if obj is None:
                metrics.inc("read_alloc_failures", tier=self.name)
                continue
            reads.append(_Read(i, key, self._rkey(key), spec, obj))
        batches = [reads[i:i + MAX_KEYS_PER_CALL] for i in range(0, len(reads), MAX_KEYS_PER_CALL)]
        try:
            await asyncio.gather(*(self._read_batch(batch) for batch in batches))
        except BaseException:
            release_objs(r.obj for r in reads)
            raise
        dead = []  # objects no reader can use: removed, so that lookups stop finding them
        for read in reads:
            if read.outcome == "hits":
                out[read.index] = read.obj
                continue
            read.obj.ref_down()
            if read.outcome == "corrupt":
                metrics.inc("corrupt_chunks", tier=self.name)
            elif read.outcome in ("lost", "unreadable"):
                metrics.inc("lost_chunks", tier=self.name)
            if read.outcome in ("corrupt", "unreadable"):
                dead.append(read.key)
        for key in dead:
            await self.remove(key)
        return out

    async def _read_batch(self, reads: list[_Read]) -> None:
        """One zero-copy call for `reads`: sets each one's outcome (hits, corrupt, lost, unreadable or failed)."""
        try:
            headers = self._headers.allocate((sum(r.header_len for r in reads),), torch.uint8, timeout=0.0)
        except AllocationError:
            metrics.inc("failed_reads", tier=self.name)
            return
        base = headers.tensor.data_ptr()
        starts = np.cumsum([0] + [r.header_len for r in reads[:-1]]).tolist()
        names = [r.rkey for r in reads]
        buffers = [[base + start, r.obj.tensor.data_ptr()] for start, r in zip(starts, reads)]
        sizes = [[r.header_len, r.nbytes] for r in reads]
        view = codec.payload_view(headers.tensor)

        def fn(store: Any) -> tuple[list[int], list[str]]:
            codes: list[int] = store.batch_get_into_multi_buffers(names, buffers, sizes)
            return codes, [self._check(store, read, code, view[start:start + read.header_len])
                           for read, start, code in zip(reads, starts, codes)]

        try:
            _, outcomes = await self.client.call(fn, timeout=self.timeout * len(reads),
                                                 hold=[headers, *(r.obj for r in reads)],
                                                 done=_reads_settled,
                                                 unreachable=lambda result: _unreachable(result[0]))
        except CallFailed:
            metrics.inc("failed_reads", tier=self.name)
            return
        finally:
            headers.ref_down()
        for read, outcome in zip(reads, outcomes):
            read.outcome = outcome

    def _check(self, store: Any, read: _Read, code: int, header: memoryview) -> str:
        """On the call's thread: what the answer `code` for `read` means, the chunk checked when it came."""
        if code == read.size:
            try:
                parsed = codec.parse_header(header, read.key)
                if parsed.header_len != read.header_len or parsed.shape != tuple(read.spec[0]) \
                        or parsed.dtype != read.spec[1]:
                    raise codec.CorruptEntry(f"holds {parsed.shape} {parsed.dtype} in a header of "
                                             f"{parsed.header_len} bytes, not the chunk asked for")
                codec.check_size(parsed, code)
                codec.verify_payload(parsed, codec.payload_view(read.obj.tensor), self.mac)
                return "hits"
            except codec.CorruptEntry as exc:
                logs.warn(logger, "mooncake_corrupt", "corrupt Mooncake object %r: %s; removing it", read.rkey, exc)
                return "corrupt"
        if code in MASTER_UNREACHABLE:
            return "failed"
        if code == INVALID_PARAMS or code >= 0:  # larger than the chunk: no chunk of this key
            return "corrupt"
        if code == TRANSFER_FAIL:  # shorter than the chunk, or its replica is gone with its storage host
            size = store.get_size(read.rkey)
            # The master lists an object whose replica did not read back until the host's lease ends: unremoved,
            # every lookup would find it, and every load of it fail, until then.
            return "corrupt" if size >= 0 and size != read.size else "unreadable"
        return "lost"

    async def _read_copies(self, keys: Sequence[str], alloc: AllocFn) -> list[MemoryObj | None]:
        """Reads without expected shapes: each object's size, a read into scratch memory from `alloc`, a
        decoded copy (codec.decode)."""
        rkeys = [self._rkey(k) for k in keys]
        try:
            found: list[int] = await self.client.call(lambda store: [store.get_size(k) for k in rkeys],
                                                      timeout=self.timeout, unreachable=_unreachable)
        except CallFailed:
            metrics.inc("failed_reads", tier=self.name)
            return [None] * len(keys)
        out: list[MemoryObj | None] = [None] * len(keys)
        for i, size in enumerate(found):
            if size < 0 or size > codec.MAX_HEADER_SIZE + codec.MAX_PAYLOAD_BYTES:
                continue
            scratch = alloc((size,), torch.uint8)
            if scratch is None:
                metrics.inc("read_alloc_failures", tier=self.name)
                continue
            try:
                out[i] = await self._read_copy(keys[i], rkeys[i], scratch, alloc)
            finally:
                scratch.ref_down()
        return out

    async def _read_copy(self, key: str, rkey: str, scratch: MemoryObj, alloc: AllocFn) -> MemoryObj | None:
        def fn(store: Any) -> int:
            code: int = store.get_into(rkey, scratch.tensor.data_ptr(), scratch.nbytes)
            return code

        try:
            code = await self.client.call(fn, timeout=self.timeout, hold=[scratch], done=lambda c: settled([c]),
                                          unreachable=lambda c: c in MASTER_UNREACHABLE)
        except CallFailed:
            metrics.inc("failed_reads", tier=self.name)
            return None
        if code != scratch.nbytes:
            metrics.inc("lost_chunks", tier=self.name)
            return None
        try:
            return codec.decode(codec.payload_view(scratch.tensor), key, alloc, self.mac)
        except codec.CorruptEntry as exc:
            logs.warn(logger, "mooncake_corrupt", "corrupt Mooncake object %r: %s; removing it", rkey, exc)
            metrics.inc("corrupt_chunks", tier=self.name)
            await self.remove(key)
            return None

    # ---- writes -----------------------------------------------------------------------------------
    async def put(self, key: str, obj: MemoryObj) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        obj.ref_up()  # ours until the batch it goes out in is sent (the caller may stop waiting)
        self._puts.append((key, obj, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        """Sends the puts waiting, as batches, until none is left."""
        while self._puts:
            batch, self._puts = self._puts[:MAX_KEYS_PER_CALL], self._puts[MAX_KEYS_PER_CALL:]
            results = [False] * len(batch)
            try:
                results = await self._put_batch([key for key, _, _ in batch], [obj for _, obj, _ in batch])
            except Exception as exc:  # a bug of ours must not end the flushing for every later put
                logs.warn(logger, "mooncake_put_failed", "Mooncake put of %d chunks failed: %r", len(batch), exc)
                metrics.inc("failed_writes", len(batch), tier=self.name)
            finally:
                for (_, obj, future), ok in zip(batch, results):
                    obj.ref_down()
                    if not future.done():
                        future.set_result(ok)

    async def _put_batch(self, keys: list[str], objs: list[MemoryObj]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]
        try:
            present: list[int] = await self.client.call(lambda store: store.batch_is_exist(rkeys),
                                                        timeout=self.timeout, unreachable=_unreachable)
        except CallFailed:
            metrics.inc("failed_writes", len(keys), tier=self.name)
            return [False] * len(keys)
        results = [code == 1 for code in present]  # already in the store (another instance put it)
        todo = [i for i, code in enumerate(present) if code != 1]
        if not todo:
            return results
        header_lens = [codec.header_size(keys[i], objs[i].tensor.dim()) for i in todo]
        try:
            headers = self._headers.allocate((sum(header_lens),), torch.uint8, timeout=0.0)
        except AllocationError:
            metrics.inc("failed_writes", len(todo), tier=self.name)
            return results
        base, view = headers.tensor.data_ptr(), codec.payload_view(headers.tensor)
        starts = np.cumsum([0] + header_lens[:-1]).tolist()
        names = [rkeys[i] for i in todo]
        buffers = [[base + start, objs[i].tensor.data_ptr()] for start, i in zip(starts, todo)]
        sizes = [[length, objs[i].nbytes] for length, i in zip(header_lens, todo)]

        def fn(store: Any) -> list[int]:
            for start, length, i in zip(starts, header_lens, todo):  # checksum and MAC: off the event loop
                view[start:start + length] = codec.encode_header(keys[i], objs[i].tensor, mac=self.mac)
            codes: list[int] = store.batch_put_from_multi_buffers(names, buffers, sizes, self.client.replicate)
            return codes

        try:
            codes = await self.client.call(fn, timeout=self.timeout * len(todo), done=settled, unreachable=_unreachable,
                                           hold=[headers, *(objs[i] for i in todo)])
        except CallFailed:
            metrics.inc("failed_writes", len(todo), tier=self.name)
            return results
        finally:
            headers.ref_down()
        for i, code in zip(todo, codes):
            results[i] = code in (0, OBJECT_ALREADY_EXISTS)
            if code == 0:
                kv_events.stored(keys[i], self.name)
                metrics.inc("stored_chunks", tier=self.name)
                metrics.inc("stored_bytes", objs[i].nbytes, tier=self.name)
            elif code != OBJECT_ALREADY_EXISTS:
                metrics.inc("failed_writes", tier=self.name)
        return results

    async def remove(self, key: str) -> None:
        """Removes the object even under a lease (a reader of it gets a miss: what it would read is not a
        chunk, or was asked to go)."""
        rkey = self._rkey(key)
        try:
            code = await self.client.call(lambda store: store.remove(rkey, True), timeout=self.timeout)
        except CallFailed:
            return
        if code == 0:
            kv_events.removed(key, self.name)

    async def clear(self) -> bool:
        """Removes every object under the prefix, leases or not (`remove_by_regex`); False if that failed.
        Reports no removal events: Mooncake does not say which keys it removed."""
        pattern = "^" + re.escape(self.prefix)
        try:
            removed = await self.client.call(lambda store: store.remove_by_regex(pattern, True),
                                             timeout=self.timeout * 10)
        except CallFailed as exc:
            logger.warning("clearing Mooncake %s failed: %s", self.location, exc)
            return False
        return bool(removed >= 0)

    async def close(self) -> None:
        puts, self._puts = self._puts, []
        for _, obj, future in puts:
            obj.ref_down()
            if not future.done():
                future.set_result(False)
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if await self.client.close():
            self._headers.close()


def _reads_settled(result: tuple[list[int], list[str]]) -> bool:
    """Whether no transfer of a batch read can still be running: every key's answer says so (`settled`), or
    it was a transfer failure that Mooncake reports, before submitting anything, for an object of another
    size than the buffers (its size told: corrupt)."""
    codes, outcomes = result
    return all(settled([code]) or (code == TRANSFER_FAIL and outcome == "corrupt")
               for code, outcome in zip(codes, outcomes))


def _unreachable(codes: Sequence[int]) -> bool:
    """Whether a batch call's answers say the master is gone (every key failed with an RPC error)."""
    return bool(codes) and all(code in MASTER_UNREACHABLE for code in codes)
