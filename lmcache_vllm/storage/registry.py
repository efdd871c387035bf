"""Builds the configured tiers from an `LMCacheConfig`: the L1 arena, and the lower tiers in
`LOWER_TIERS` order (L1's compressed cold part, L2 local disk, P2P, then L3: Redis or a Mooncake Store). A new
tier is one module with a `StorageBackend` subclass whose `from_config` says whether the configuration enables
it, plus one line in `LOWER_TIERS`.

`chunk_mac` resolves the optional MAC secret of the lower tiers' chunks: `extra_config.chunk_mac_key`,
else the `LMCACHE_VLLM_CHUNK_MAC_KEY` environment variable (preferred: vLLM logs its
kv_connector_extra_config at start-up); either may be a list of keys (comma-separated in the environment),
the first signing, any verifying: a key rotation. Each must hold at least 128 bits (`ConfigError` otherwise;
the configuration checks the variable at load too, `config.loader`).

Tiers others can write (`unprotected_tiers`: Redis, which every instance and anyone who reaches it can
write; a disk directory configured as shared) without a MAC key let anyone plant KV the model reads:
building them then logs one warning saying so and how to fix it, or, with
`extra_config.require_chunk_mac`, refuses to start (`ConfigError`). A prefill instance's transfer port
(`transfer_host`: where it binds) counts too: without a key anyone who reaches it and names a request id
pulls that request's KV, and its requests are not authenticated. `require_chunk_mac` refuses it like a
tier; without it, the warning names the port only when it listens beyond loopback. See docs/SECURITY.md.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from typing import Callable, Mapping, Optional

from lmcache_vllm.config import ConfigError, LMCacheConfig
from lmcache_vllm.config.extra import MAC_KEY_ENV, check_mac_keys, env_mac_keys
from lmcache_vllm.config.fields import MISSING, Problem
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import logs
from lmcache_vllm.storage.base import StorageBackend
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.local_cpu_cold import ColdCPUBackend, cold_bytes
from lmcache_vllm.storage.local_disk import LocalDiskBackend
from lmcache_vllm.storage.mooncake import MooncakeBackend
from lmcache_vllm.storage.p2p import P2PTier
from lmcache_vllm.storage.redis import RedisBackend
from lmcache_vllm.storage.transfer.sockets import bind_address

logger = logging.getLogger(__name__)

GB = 1 << 30
TRANSFER_PORT = "transfer port"  # a prefill instance's KV transfer server (storage/transfer/server.py)

# The lower tiers, fastest first: a read asks them in this order, a write goes to every one enabled (P2P's
# write lists the chunk in its directory).
LOWER_TIERS: tuple[type[StorageBackend], ...] = (ColdCPUBackend, LocalDiskBackend, P2PTier, RedisBackend,
                                                  MooncakeBackend)


def chunk_mac(config: LMCacheConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[ChunkMac]:
    """The keyed MAC for chunks on disk and in Redis, or None when no secret is configured."""
    environ = os.environ if environ is None else environ
    keys = config.extra_config.chunk_mac_key or env_mac_keys(environ)
    if not keys:
        return None
    problem = check_mac_keys(keys)
    if problem is not None:
        where = "extra_config.chunk_mac_key" if config.extra_config.chunk_mac_key else MAC_KEY_ENV
        raise ConfigError([Problem(where, MISSING, problem)])
    return ChunkMac(keys)


def unprotected_tiers(config: LMCacheConfig, mac: Optional[ChunkMac]) -> dict[str, str]:
    """The configured tiers others can write that would store chunks without a MAC: tier -> who can."""
    if mac is not None:
        return {}
    found = {backend.name.value: backend.writable_by_others(config) for backend in LOWER_TIERS}
    return {tier: who for tier, who in found.items() if who}


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(bind_address(host)).is_loopback
    except ValueError:
        return False


def check_chunk_mac(config: LMCacheConfig, mac: Optional[ChunkMac], *, transfer_host: Optional[str] = None) -> None:
    """One warning when a tier others can write stores chunks without a MAC; `ConfigError` instead with
    `extra_config.require_chunk_mac`. `transfer_host`: this process serves a transfer port bound there."""
    exposed = unprotected_tiers(config, mac)
    if transfer_host is not None and mac is None:
        local = _loopback(transfer_host)
        if config.extra_config.require_chunk_mac or not local:
            exposed[TRANSFER_PORT] = (f"any process on this host ({transfer_host})" if local else
                                      f"anyone who reaches {transfer_host}") + \
                " reads a request's held KV by its id, unauthenticated"
    if not exposed:
        return
    what = "; ".join(f"{tier}: {why}" for tier, why in exposed.items())
    fix = (f"set a secret in {MAC_KEY_ENV} (e.g. `export {MAC_KEY_ENV}=$(lmcache-vllm keygen)`), the same on "
           f"every instance sharing the tier; see docs/SECURITY.md")
    if config.extra_config.require_chunk_mac:
        raise ConfigError([Problem("extra_config.require_chunk_mac", True, f"no chunk MAC key, and others can "
                                   f"write these tiers or pull from this port ({what}): {fix}")])
    logs.warn(logger, "chunk_mac_missing", "lmcache-vllm: chunks carry no keyed MAC, and others can write these "
              "tiers or pull from this port (%s): whoever can write them can plant KV that the model then reads, "
              "whoever reaches the port reads held KV. To fix: %s. extra_config.require_chunk_mac: true refuses "
              "to start without a MAC key.", what, fix)


def build_allocator(config: LMCacheConfig) -> HostAllocator:
    size_bytes = config.max_local_cpu_bytes - cold_bytes(config)  # (the cold part of L1 is coded apart)
    if not config.local_cpu and size_bytes <= 0:
        # No L1 cache, but transfers still need an arena to stage chunks in.
        size_bytes = int(config.extra_config.staging_buffer_size * GB)
    return HostAllocator(size_bytes, prefault=config.extra_config.prefault_local_cpu,
                         insert_cold=config.cache_policy == "LIP")


def build_lower_tiers(config: LMCacheConfig,
                      key_filter: Optional[Callable[[str], bool]] = None) -> list[StorageBackend]:
    """The lower tiers the config enables, slowest last. A backend that fails to start closes the ones
    already built before the error propagates (nothing is left open)."""
    mac = chunk_mac(config)
    check_chunk_mac(config, mac)
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
