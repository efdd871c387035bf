"""lmcache-vllm's tiers (disk, Redis / Redis Cluster / Sentinel, P2P) as SGLang's HiCache storage backend: the
only package that imports SGLang. SGLang loads `LMCacheHiCacheStorage` by module path (docs/SGLANG.md):

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "lmcache", "module_path": "lmcache_vllm.integration.sglang",
      "class_name": "LMCacheHiCacheStorage", "interface_v1": 1, "local_disk": "/var/cache/lmcache",
      "max_local_disk_size": 50}'

Modules: `backend` (the `HiCacheStorage` subclass: v1 and generic calls), `hybrid` (the v2 calls of hybrid
models), `pages` (a host pool as pages), `keys` (page hashes -> our keys), `config` (the configuration from
YAML / env / the extra config), `stats` (SGLang's `get_stats`).
"""
from lmcache_vllm.integration.sglang.backend import LMCacheHiCacheStorage

__all__ = ["LMCacheHiCacheStorage"]
