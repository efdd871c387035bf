"""Host memory for cached KV chunks: one arena, an allocator over it, and ref/pin-counted objects.

`HostAllocator` allocates a single flat uint8 tensor once, starting on a page (when CUDA is present: an
mmap of exactly that size registered with cudaHostRegister, see `pinned.py`, so that host<->device copies
are asynchronous and nothing is rounded to a power of two; otherwise, when asked, populated at once or
in the background, see `prefault.py`) and hands out `MemoryObj` regions of it of exactly the size
asked for (offsets aligned to 64 bytes, objects of 64 KiB or more reserved in whole pages; no
power-of-two rounding). Free space is kept as sorted free blocks, coalesced on free; a best-fit search
by size is a bisect.

Lifetime and eviction:
- An object is born with `ref_count == 1` (the caller's reference). `ref_up()`/`ref_down()` count
  references; the region is freed when the count reaches 0. A `ref_down()` on a freed object raises.
- `pin()`/`unpin()` protect an object from eviction (a lookup pins what it promised to load).
- An owner that can give an object up (the L1 index) registers an eviction callback with
  `obj.set_evictor(callback)`; the object is then kept in LRU order (`obj.touch()` marks a use). It enters
  at the most recently used end, or with `insert_cold` at the least recently used one (LIP, "LRU insertion"):
  then only a use makes it recent, and a stream of new objects evicts itself instead of what is in use.
  When an allocation does not fit, the allocator picks least-recently-used evictable objects that are
  neither pinned nor referenced by anyone but their owner (ref_count == 1) and calls `callback(obj)`;
  the callback must forget the object and drop the owner's reference (`obj.ref_down()`). Callbacks
  run outside the allocator's lock, each at most once, after the object was taken off the LRU list.
- If nothing can be evicted the allocation waits at most `timeout` seconds for frees/unpins, then
  raises `AllocationError` naming the requested size, capacity, bytes used and bytes pinned.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional, Sequence, Union

import torch

from lmcache_vllm.memory.pinned import pinned_arena
from lmcache_vllm.memory.prefault import MODES as PREFAULT_MODES
from lmcache_vllm.memory.prefault import ArenaPrefaulter

logger = logging.getLogger(__name__)

ALIGNMENT = 64
# Objects of at least LARGE_OBJECT bytes are reserved in whole pages, so that (in an arena of such
# objects, the KV chunk case) every object starts on a page: the disk tier can then write it with
# O_DIRECT, straight from the arena, without copying it through the page cache.
PAGE = 4096
LARGE_OBJECT = 64 << 10

EvictCallback = Callable[["MemoryObj"], None]


class AllocationError(RuntimeError):
    """An allocation could not be satisfied (too large, or memory stayed full past the timeout)."""


def _align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class MemoryObj:
    """A region of a `HostAllocator`'s arena viewed as a tensor of a given shape and dtype."""

    __slots__ = ("_allocator", "offset", "nbytes", "reserved", "shape", "dtype", "_tensor",
                 "ref_count", "pin_count", "_evictor", "_freed", "__weakref__")

    def __init__(self, allocator: "HostAllocator", offset: int, nbytes: int, reserved: int,
                 shape: torch.Size, dtype: torch.dtype, tensor: torch.Tensor):
        self._allocator = allocator
        self.offset = offset
        self.nbytes = nbytes
        self.reserved = reserved  # bytes taken from the arena (nbytes rounded up to the alignment)
        self.shape = shape
        self.dtype = dtype
        self._tensor: Optional[torch.Tensor] = tensor
        self.ref_count = 1
        self.pin_count = 0
        self._evictor: Optional[EvictCallback] = None
        self._freed = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise AllocationError(f"use after free of a {self.nbytes}-byte MemoryObj at offset {self.offset}")
        return self._tensor

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def arena(self) -> torch.Tensor:
        """The whole arena this region lies in (a transfer engine registers it once: Mooncake's tier)."""
        return self._allocator.arena

    @property
    def evictable(self) -> bool:
        return self._evictor is not None

    def ref_up(self) -> None:
        self._allocator._ref_up(self)

    def ref_down(self) -> None:
        self._allocator._ref_down(self)

    def pin(self) -> None:
        self._allocator._pin(self)

    def unpin(self) -> None:
        self._allocator._unpin(self)

    def set_evictor(self, callback: EvictCallback) -> None:
        """Makes this object evictable: under memory pressure the allocator calls `callback(self)`."""
        self._allocator._set_evictor(self, callback)

    def clear_evictor(self) -> None:
        """Makes this object non-evictable again (its owner is giving it up by itself)."""
        self._allocator._clear_evictor(self)

    def touch(self) -> None:
        """Marks a use: the object moves to the most-recently-used end of the eviction order."""
        self._allocator._touch(self)

    def __repr__(self) -> str:
        return (f"MemoryObj(offset={self.offset}, nbytes={self.nbytes}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, ref_count={self.ref_count}, pin_count={self.pin_count})")


# alloc(shape, dtype) -> a MemoryObj holding one reference for the caller, or None when memory is full.
AllocFn = Callable[[tuple[int, ...], torch.dtype], Optional[MemoryObj]]


class HostAllocator:
    """Free-list allocator over one host arena; thread-safe. See the module docstring for the rules."""

    def __init__(self, capacity_bytes: int, pin_memory: Optional[bool] = None,
                 default_timeout: float = 0.0, prefault: str = "off", insert_cold: bool = False):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._capacity = _align_up(capacity_bytes)
        if pin_memory:
            # Exactly the capacity (to a page), registered with CUDA; pageable if registration fails.
            self.arena, self.pinned_arena = pinned_arena(self._capacity)
        else:
            self.pinned_arena = False
            # One page more than needed, so that the arena itself can start on a page boundary.
            raw = torch.empty(self._capacity + PAGE, dtype=torch.uint8)
            skip = -raw.data_ptr() % PAGE
            self.arena = raw[skip:skip + self._capacity]
        # Pinned memory is resident already; pageable memory is populated as `prefault` says.
        if prefault not in PREFAULT_MODES:
            raise ValueError(f"prefault={prefault!r}: expected one of {PREFAULT_MODES}")
        self.prefaulter = None
        if prefault != "off" and not self.pinned_arena:
            self.prefaulter = ArenaPrefaulter(self.arena, background=prefault == "background")
        self.default_timeout = default_timeout
        self.insert_cold = insert_cold
        self._cond = threading.Condition(threading.Lock())
        # Free blocks, two sorted views of the same set: by start (for coalescing) and by
        # (size, start) (for best-fit search).
        self._free_starts: list[int] = [0]
        self._free_size_of: dict[int, int] = {0: self._capacity}
        self._free_by_size: list[tuple[int, int]] = [(self._capacity, 0)]
        self._used = 0
        self._pinned_bytes = 0
        self._num_live = 0
        self._lru: "OrderedDict[int, MemoryObj]" = OrderedDict()  # id(obj) -> obj, LRU first
        self.num_evictions = 0

    # ---- public API -------------------------------------------------------------------------
    def close(self) -> None:
        """Stops background work on the arena (the arena itself lives as long as its objects)."""
        if self.prefaulter is not None:
            self.prefaulter.stop()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes taken from the arena by live objects (each rounded up to the 64-byte alignment)."""
        return self._used

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    @property
    def num_live(self) -> int:
        return self._num_live

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"capacity_bytes": self._capacity, "used_bytes": self._used,
                    "pinned_bytes": self._pinned_bytes, "live_objects": self._num_live,
                    "evictable_objects": len(self._lru), "free_blocks": len(self._free_starts),
                    "largest_free_block": self._free_by_size[-1][0] if self._free_by_size else 0,
                    "evictions": self.num_evictions}

    def allocate(self, shape: Union[int, Sequence[int], torch.Size], dtype: torch.dtype,
                 timeout: Optional[float] = None) -> MemoryObj:
        """Allocates a region viewed as `shape`/`dtype`, evicting LRU evictable objects if needed.

        Waits at most `timeout` seconds (None: the allocator's `default_timeout`) for memory held by
        pinned or referenced objects to be released, then raises `AllocationError`.
        """
        shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {tuple(shape)}")
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        reserved = max(_align_up(nbytes, PAGE if nbytes >= LARGE_OBJECT else ALIGNMENT), ALIGNMENT)
        if reserved > self._capacity:
            raise AllocationError(
                f"cannot allocate {nbytes} bytes: larger than the whole arena ({self._capacity} bytes)")
        timeout = self.default_timeout if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._cond:
                offset = self._take_free(reserved)
                if offset is not None:
                    return self._make_obj(offset, nbytes, reserved, shape, dtype)
                victims = self._pick_victims(reserved)
                if not victims:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise AllocationError(
                            f"cannot allocate {nbytes} bytes within {timeout:.3g}s: capacity "
                            f"{self._capacity} bytes, used {self._used}, pinned {self._pinned_bytes}, "
                            f"largest free block "
                            f"{self._free_by_size[-1][0] if self._free_by_size else 0}, "
                            f"{self._num_live} live objects ({len(self._lru)} evictable)")
                    self._cond.wait(remaining)
                    continue
            # Callbacks run without our lock: they take their owner's locks and call ref_down().
            for victim in victims:
                try:
                    victim_callback = victim[1]
                    victim_callback(victim[0])
                except Exception:  # an owner's bug must not wedge the allocator
                    logger.exception("eviction callback failed for %r", victim[0])

    # ---- free list --------------------------------------------------------------------------
    def _take_free(self, reserved: int) -> Optional[int]:
        i = bisect.bisect_left(self._free_by_size, (reserved, -1))
        if i == len(self._free_by_size):
            return None
        size, start = self._free_by_size.pop(i)
        j = bisect.bisect_left(self._free_starts, start)
        if size == reserved:
            del self._free_starts[j]
            del self._free_size_of[start]
        else:
            # Keep the tail free; the start list stays sorted because the tail starts inside the block.
            new_start, new_size = start + reserved, size - reserved
            self._free_starts[j] = new_start
            del self._free_size_of[start]
            self._free_size_of[new_start] = new_size
            bisect.insort(self._free_by_size, (new_size, new_start))
        self._used += reserved
        return start

    def _remove_free(self, j: int) -> tuple[int, int]:
        start = self._free_starts.pop(j)
        size = self._free_size_of.pop(start)
        k = bisect.bisect_left(self._free_by_size, (size, start))
        del self._free_by_size[k]
        return start, size

    def _release(self, start: int, size: int) -> None:
        j = bisect.bisect_left(self._free_starts, start)
        # Coalesce with the following block, then with the preceding one.
        if j < len(self._free_starts) and self._free_starts[j] == start + size:
            _, next_size = self._remove_free(j)
            size += next_size
        if j > 0:
            prev_start = self._free_starts[j - 1]
            prev_size = self._free_size_of[prev_start]
            if prev_start + prev_size == start:
                self._remove_free(j - 1)
                start, size = prev_start, prev_size + size
                j -= 1
        self._free_starts.insert(j, start)
        self._free_size_of[start] = size
        bisect.insort(self._free_by_size, (size, start))

    def _make_obj(self, offset: int, nbytes: int, reserved: int, shape: torch.Size,
                  dtype: torch.dtype) -> MemoryObj:
        tensor = self.arena[offset:offset + nbytes].view(dtype).view(shape)
        self._num_live += 1
        return MemoryObj(self, offset, nbytes, reserved, shape, dtype, tensor)

    # ---- eviction ---------------------------------------------------------------------------
    def lru_ids(self) -> list[int]:
        """`id()` of every evictable object, least recently used first (a snapshot: a quota's eviction order)."""
        with self._cond:
            return list(self._lru)

    def _pick_victims(self, reserved: int) -> list[tuple[MemoryObj, EvictCallback]]:
        """Takes LRU objects whose eviction frees memory until enough bytes could be free. Walks the LRU from
        its cold end only as far as it must: a full L1 evicts on every store, and a walk over the whole LRU (a
        copy of it, thousands of chunks) took 0.2 ms per allocation under the lock and the GIL, on the save
        thread, while vLLM's step waited for both (profiled: 6 ms of a 30-chunk store's 9 ms)."""
        free_total = self._capacity - self._used
        victims: list[tuple[MemoryObj, EvictCallback]] = []
        for obj in self._lru.values():
            if free_total >= reserved and victims:
                break
            evictor = obj._evictor  # set for every object in the LRU (`_set_evictor`)
            if obj.pin_count > 0 or obj.ref_count != 1 or evictor is None:
                continue  # in use: evicting it would not free its bytes now
            victims.append((obj, evictor))
            free_total += obj.reserved
        for obj, _ in victims:  # off the LRU after the walk: an OrderedDict may not change while it is walked
            del self._lru[id(obj)]
            obj._evictor = None
        self.num_evictions += len(victims)
        return victims

    # ---- object operations (called through MemoryObj) ----------------------------------------
    def _check_live(self, obj: MemoryObj, what: str) -> None:
        if obj._freed:
            raise AllocationError(f"{what} on a freed MemoryObj (offset {obj.offset}, {obj.nbytes} bytes)")

    def _ref_up(self, obj: MemoryObj) -> None:
        with self._cond:
            self._check_live(obj, "ref_up")
            obj.ref_count += 1

    def _ref_down(self, obj: MemoryObj) -> None:
        with self._cond:
            self._ref_down_locked(obj)

    def _ref_down_locked(self, obj: MemoryObj) -> None:
        self._check_live(obj, "ref_down (double free?)")
        obj.ref_count -= 1
        if obj.ref_count > 0:
            if obj.ref_count == 1 and obj._evictor is not None:
                self._cond.notify_all()  # it may have just become evictable
            return
        obj._freed = True
        obj._tensor = None
        self._lru.pop(id(obj), None)
        obj._evictor = None
        if obj.pin_count:
            self._pinned_bytes -= obj.reserved
            obj.pin_count = 0
        self._used -= obj.reserved
        self._num_live -= 1
        self._release(obj.offset, obj.reserved)
        self._cond.notify_all()

    # A lookup's or a load's chunks, all at once: one lock, not one per chunk (these run in vLLM's step).
    def ref_up_all(self, objs: Sequence[MemoryObj]) -> None:
        """`ref_up` of each object (of this allocator)."""
        with self._cond:
            for obj in objs:
                self._check_live(obj, "ref_up")
            for obj in objs:
                obj.ref_count += 1

    def ref_down_all(self, objs: Sequence[MemoryObj]) -> None:
        """`ref_down` of each object (of this allocator)."""
        with self._cond:
            for obj in objs:
                self._ref_down_locked(obj)

    def touch_all(self, objs: Sequence[MemoryObj]) -> None:
        """`touch` of each object (of this allocator), in order: the last is the most recently used."""
        with self._cond:
            lru = self._lru
            for obj in objs:
                if id(obj) in lru:
                    lru.move_to_end(id(obj))

    def _pin(self, obj: MemoryObj) -> None:
        with self._cond:
            self._check_live(obj, "pin")
            if obj.pin_count == 0:
                self._pinned_bytes += obj.reserved
            obj.pin_count += 1

    def _unpin(self, obj: MemoryObj) -> None:
        with self._cond:
            self._check_live(obj, "unpin")
            if obj.pin_count <= 0:
                raise AllocationError(f"unpin of an unpinned MemoryObj (offset {obj.offset})")
            obj.pin_count -= 1
            if obj.pin_count == 0:
                self._pinned_bytes -= obj.reserved
                self._cond.notify_all()

    def _set_evictor(self, obj: MemoryObj, callback: EvictCallback) -> None:
        if not callable(callback):
            raise TypeError("eviction callback must be callable")
        with self._cond:
            self._check_live(obj, "set_evictor")
            obj._evictor = callback
            self._lru[id(obj)] = obj
            self._lru.move_to_end(id(obj), last=not self.insert_cold)
            self._cond.notify_all()

    def _clear_evictor(self, obj: MemoryObj) -> None:
        with self._cond:
            obj._evictor = None
            self._lru.pop(id(obj), None)

    def _touch(self, obj: MemoryObj) -> None:
        with self._cond:
            if id(obj) in self._lru:
                self._lru.move_to_end(id(obj))
