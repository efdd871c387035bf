"""Builds the configured tiers: the L1 arena and the lower tiers (L2 local disk, L3 Redis) in config order.

Everything comes typed and defaulted from an `LMCacheConfig`: the LMCache keys (`max_local_cpu_size`,
`local_disk`, `max_local_disk_size`, `remote_url`) and our own knobs in `config.extra_config`
(`config_extra.ExtraConfig`). `chunk_mac` resolves the optional MAC secret of the lower tiers' chunks:
`extra_config.chunk_mac_key`, else the `LMCACHE_VLLM_CHUNK_MAC_KEY` environment variable (preferred:
vLLM logs its kv_connector_extra_config at start-up).

Tiers others can write (`unprotected_tiers`: Redis, which every instance and anyone who reaches it can
write; a disk directory configured as shared) without a MAC key let anyone plant KV the model reads:
building them then logs one warning saying so and how to fix it, or, with
`extra_config.require_chunk_mac`, refuses to start (`ConfigError`). See docs/SECURITY.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Mapping, Optional

from lmcache_vllm import logs
from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.config_schema import ConfigError, Problem
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.redis_backend import RedisBackend

logger = logging.getLogger(__name__)

GB = 1 << 30
MAC_KEY_ENV = "LMCACHE_VLLM_CHUNK_MAC_KEY"


def chunk_mac(config: LMCacheConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[ChunkMac]:
    """The keyed MAC for chunks on disk and in Redis, or None when no secret is configured."""
    environ = os.environ if environ is None else environ
    secret = config.extra_config.chunk_mac_key or environ.get(MAC_KEY_ENV) or None
    return ChunkMac(secret) if secret else None


def unprotected_tiers(config: LMCacheConfig, mac: Optional[ChunkMac]) -> dict[str, str]:
    """The configured tiers others can write that would store chunks without a MAC: tier -> who can."""
    if mac is not None:
        return {}
    found = {}
    if config.local_disk and config.extra_config.local_disk_shared:
        found["local_disk"] = f"{config.local_disk} is configured as shared with other users"
    if config.remote_url:
        found["redis"] = "every instance and anyone who can reach the Redis server writes it"
    return found


def check_chunk_mac(config: LMCacheConfig, mac: Optional[ChunkMac]) -> None:
    """One warning when a tier others can write stores chunks without a MAC; `ConfigError` instead with
    `extra_config.require_chunk_mac`."""
    exposed = unprotected_tiers(config, mac)
    if not exposed:
        return
    what = "; ".join(f"{tier}: {why}" for tier, why in exposed.items())
    fix = (f"set a secret in {MAC_KEY_ENV} (e.g. `export {MAC_KEY_ENV}=$(lmcache-vllm keygen)`), the same on "
           f"every instance sharing the tier; see docs/SECURITY.md")
    if config.extra_config.require_chunk_mac:
        raise ConfigError([Problem("extra_config.require_chunk_mac", True, f"no chunk MAC key, and others can "
                                   f"write these tiers ({what}): {fix}")])
    logs.warn(logger, "chunk_mac_missing", "lmcache-vllm: chunks carry no keyed MAC, and others can write "
              "these tiers (%s): whoever can write them can plant KV that the model then reads. To fix: %s. "
              "extra_config.require_chunk_mac: true refuses to start without a MAC key.", what, fix)


def build_allocator(config: LMCacheConfig) -> HostAllocator:
    size_bytes = config.max_local_cpu_bytes
    if not config.local_cpu and size_bytes <= 0:
        # No L1 cache, but transfers still need an arena to stage chunks in.
        size_bytes = int(config.extra_config.staging_buffer_size * GB)
    return HostAllocator(size_bytes, prefault=config.extra_config.prefault_local_cpu)


def build_lower_tiers(config: LMCacheConfig,
                      key_filter: Optional[Callable[[str], bool]] = None) -> list[StorageBackend]:
    """The disk and Redis backends the config enables, slowest last. A backend that fails to start closes
    the ones already built before the error propagates (nothing is left open)."""
    extra = config.extra_config
    mac = chunk_mac(config)
    check_chunk_mac(config, mac)
    tiers: list[StorageBackend] = []
    try:
        if config.local_disk:
            tiers.append(LocalDiskBackend(
                config.local_disk, config.max_local_disk_bytes, io_threads=extra.disk_io_threads,
                fsync=extra.disk_fsync, key_filter=key_filter, direct_io=extra.disk_direct_io, mac=mac,
                shared=extra.local_disk_shared))
        if config.remote_url:
            tiers.append(RedisBackend(
                config.remote_url, prefix=extra.remote_key_prefix, ttl_secs=extra.remote_ttl_secs,
                timeout_secs=extra.remote_timeout_secs, max_connections=extra.remote_max_connections,
                read_groups=extra.remote_read_groups, read_batch_keys=extra.remote_read_batch_keys,
                breaker_max_secs=extra.remote_breaker_max_secs, mac=mac))
    except BaseException:
        for tier in tiers:
            asyncio.run(tier.close())
        raise
    return tiers
