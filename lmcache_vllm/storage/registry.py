"""Builds the configured tiers from an `LMCacheConfig`: the L1 arena, and the lower tiers in
`LOWER_TIERS` order (L2 local disk, then L3 Redis). A new tier is one module with a `StorageBackend`
subclass whose `from_config` says whether the configuration enables it, plus one line in `LOWER_TIERS`.

`chunk_mac` resolves the optional MAC secret of the lower tiers' chunks: `extra_config.chunk_mac_key`,
else the `LMCACHE_VLLM_CHUNK_MAC_KEY` environment variable (preferred: vLLM logs its
kv_connector_extra_config at start-up).
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable, Mapping, Optional

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.redis import RedisBackend

GB = 1 << 30
MAC_KEY_ENV = "LMCACHE_VLLM_CHUNK_MAC_KEY"

# The lower tiers, fastest first: a read asks them in this order, a write goes to every one enabled.
LOWER_TIERS: tuple[type[StorageBackend], ...] = (LocalDiskBackend, RedisBackend)


def chunk_mac(config: LMCacheConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[ChunkMac]:
    """The keyed MAC for chunks on disk and in Redis, or None when no secret is configured."""
    environ = os.environ if environ is None else environ
    secret = config.extra_config.chunk_mac_key or environ.get(MAC_KEY_ENV) or None
    return ChunkMac(secret) if secret else None


def build_allocator(config: LMCacheConfig) -> HostAllocator:
    size_bytes = config.max_local_cpu_bytes
    if not config.local_cpu and size_bytes <= 0:
        # No L1 cache, but transfers still need an arena to stage chunks in.
        size_bytes = int(config.extra_config.staging_buffer_size * GB)
    return HostAllocator(size_bytes, prefault=config.extra_config.prefault_local_cpu)


def build_lower_tiers(config: LMCacheConfig,
                      key_filter: Optional[Callable[[str], bool]] = None) -> list[StorageBackend]:
    """The lower tiers the config enables, slowest last. A backend that fails to start closes the ones
    already built before the error propagates (nothing is left open)."""
    mac = chunk_mac(config)
    tiers: list[StorageBackend] = []
    try:
        for backend_type in LOWER_TIERS:
            tier = backend_type.from_config(config, key_filter=key_filter, mac=mac)
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            asyncio.run(tier.close())
        raise
    return tiers
