"""Disk tiers for the tests, built as the registry builds them: from a configuration
(`LocalDiskBackend(config)`), with the cap in bytes and any `extra_config` keys given by name."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.local_disk import LocalDiskBackend

GiB = 1 << 30


def disk_config(path: str | os.PathLike, max_bytes: int, **extra_config: Any) -> LMCacheConfig:
    """A configuration of the disk tier in `path` capped at `max_bytes` (exactly: a byte count divided by a
    power of two is an exact float)."""
    return LMCacheConfig(local_disk=str(path), max_local_disk_size=max_bytes / GiB, extra_config=extra_config)


def open_disk(path: str | os.PathLike, max_bytes: int, *, key_filter: Optional[Callable[[str], bool]] = None,
              mac: Optional[ChunkMac] = None, **extra_config: Any) -> LocalDiskBackend:
    return LocalDiskBackend(disk_config(path, max_bytes, **extra_config), key_filter=key_filter, mac=mac)
