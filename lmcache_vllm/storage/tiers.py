"""Builds the configured tiers: the L1 arena and the lower tiers (L2 local disk, L3 Redis) in config order.

Our own knobs come from `extra_config` (see `storage/manager.py` for the list); the LMCache keys
(`max_local_cpu_size`, `local_disk`, `max_local_disk_size`, `remote_url`) from the config itself.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.redis_backend import RedisBackend

GB = 1 << 30


def _extra(config) -> dict:
    return dict(getattr(config, "extra_config", None) or {})


def build_allocator(config) -> HostAllocator:
    size_gb = float(getattr(config, "max_local_cpu_size", 5.0))
    if not getattr(config, "local_cpu", True) and size_gb <= 0:
        # No L1 cache, but transfers still need an arena to stage chunks in.
        size_gb = float(_extra(config).get("staging_buffer_size", 1.0))
    return HostAllocator(int(size_gb * GB), prefault=_prefault_mode(_extra(config).get("prefault_local_cpu", False)))


def _prefault_mode(value) -> str:
    """`extra_config.prefault_local_cpu`: false / "off" (default), true / "background", "sync"."""
    if value is True or value == "background":
        return "background"
    if value is False or value == "off":
        return "off"
    if value == "sync":
        return "sync"
    raise ValueError(f"extra_config.prefault_local_cpu={value!r}: expected true, false, 'background', "
                     f"'sync' or 'off'")


def build_lower_tiers(config, key_filter: Optional[Callable[[str], bool]] = None) -> list[StorageBackend]:
    """The disk and Redis backends the config enables, slowest last. A backend that fails to start closes
    the ones already built before the error propagates (nothing is left open)."""
    extra = _extra(config)
    tiers: list[StorageBackend] = []
    try:
        local_disk = getattr(config, "local_disk", None)
        if local_disk:
            tiers.append(LocalDiskBackend(
                local_disk, int(float(getattr(config, "max_local_disk_size", 0.0)) * GB),
                io_threads=int(extra.get("disk_io_threads", 8)),
                fsync=bool(extra.get("disk_fsync", False)), key_filter=key_filter,
                direct_io=bool(extra.get("disk_direct_io", True))))
        remote_url = getattr(config, "remote_url", None)
        if remote_url:
            tiers.append(RedisBackend(
                remote_url, prefix=str(extra.get("remote_key_prefix", "lmcache_vllm:")),
                ttl_secs=extra.get("remote_ttl_secs"),
                timeout_secs=float(extra.get("remote_timeout_secs", 2.0)),
                max_connections=int(extra.get("remote_max_connections", 16)),
                read_groups=int(extra.get("remote_read_groups", 1)),
                read_batch_keys=int(extra.get("remote_read_batch_keys", 8)),
                breaker_max_secs=float(extra.get("remote_breaker_max_secs", 30.0))))
    except BaseException:
        for tier in tiers:
            asyncio.run(tier.close())
        raise
    return tiers
