"""Tiered chunk storage: L1 host memory (`LocalCPUBackend`), L2 local disk (`LocalDiskBackend`), L3 Redis
(`RedisBackend`) behind the synchronous `StorageManager`; `codec` is the byte format outside memory."""

from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.codec import CorruptEntry
from lmcache_vllm.storage.local_cpu import LocalCPUBackend
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.manager import PrefetchHandle, StorageManager
from lmcache_vllm.storage.redis_backend import RedisBackend

__all__ = ["CorruptEntry", "LocalCPUBackend", "LocalDiskBackend", "PrefetchHandle", "RedisBackend",
           "StorageBackend", "StorageManager"]
