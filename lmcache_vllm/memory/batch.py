"""Reference and LRU updates of several `MemoryObj`s at once, one allocator lock for all of them: a lookup's or
a load's chunks (these run in vLLM's step, where a lock per chunk showed in the profile)."""
from __future__ import annotations

from typing import Iterable, Optional

from lmcache_vllm.memory.allocator import HostAllocator, MemoryObj


def _by_allocator(objs: Iterable[Optional[MemoryObj]]) -> list[tuple[HostAllocator, list[MemoryObj]]]:
    groups: dict[int, tuple[HostAllocator, list[MemoryObj]]] = {}
    for obj in objs:
        if obj is not None:
            groups.setdefault(id(obj._allocator), (obj._allocator, []))[1].append(obj)
    return list(groups.values())


def release_all(objs: Iterable[Optional[MemoryObj]]) -> None:
    """`ref_down` of each object (None skipped), one lock per allocator."""
    for allocator, group in _by_allocator(objs):
        allocator.ref_down_all(group)


def touch_all(objs: Iterable[Optional[MemoryObj]]) -> None:
    """`touch` of each object (None skipped), in order, one lock per allocator."""
    for allocator, group in _by_allocator(objs):
        allocator.touch_all(group)
