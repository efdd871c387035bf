"""Host memory for cached KV chunks: the arena and its allocator (`allocator`: `HostAllocator`,
ref- and pin-counted `MemoryObj` regions, LRU eviction through owners' callbacks), the exact-size pinned
arena on CUDA hosts (`pinned`), populating the arena's pages before serving (`prefault`), and several objects'
reference and LRU updates under one lock (`batch`)."""
from lmcache_vllm.memory.allocator import (
    ALIGNMENT,
    AllocationError,
    AllocFn,
    HostAllocator,
    MemoryObj,
)
from lmcache_vllm.memory.batch import release_all, touch_all

__all__ = ["ALIGNMENT", "AllocationError", "AllocFn", "HostAllocator", "MemoryObj", "release_all", "touch_all"]
