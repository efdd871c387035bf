"""The backend's `LMCacheConfig`, from the same sources as the vLLM side: defaults < the YAML file
`LMCACHE_CONFIG_FILE` names < `LMCACHE_*` environment variables < SGLang's
`--hicache-storage-backend-extra-config` (its JSON, or the `@file` SGLang read), whose keys are those of the YAML
file (LMCache's names; `extra_config` nested).

SGLang's own keys in that mapping (`SGLANG_KEYS`: the dynamic loader's `backend_name` / `module_path` /
`class_name`, `interface_v1`, the host allocator, the controller's prefetch knobs) are not ours and are left
out; every other key must be one of ours, and everything wrong is one `ConfigError` naming each key and
"hicache-storage-backend-extra-config" as its source (a configuration that builds no tier at all is refused by
the backend the same way, `no_tier`). Keys that shape vLLM's requests (`chunk_size`, `save_unfull_chunk`,
`use_layerwise`, `enable_async_loading`, `pd`, ...) mean nothing here: SGLang's page size is the chunk size.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from lmcache_vllm.config import ConfigError, LMCacheConfig, load_config
from lmcache_vllm.config.fields import MISSING, Problem

SOURCE = "hicache-storage-backend-extra-config"
# Keys SGLang itself reads from the extra config (0.5.23: storage/backend_factory.py, managers/cache_controller.py,
# hybrid_cache_controller.py, pool_host/common.py) or its built-in file backend documents.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
})


def our_keys(extra: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    return {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}


def backend_config(extra: Optional[Mapping[str, Any]], *,
                   environ: Optional[Mapping[str, str]] = None) -> LMCacheConfig:
    """The configuration of the backend (see the module docstring); ConfigError lists every problem."""
    return load_config(our_keys(extra), environ=environ, source=SOURCE)


def no_tier() -> ConfigError:
    return ConfigError([Problem("local_disk", MISSING, "SGLang's HiCache storage backend needs a tier to store pages "
                                "in: local_disk (with max_local_disk_size), remote_url (Redis, Mooncake) or "
                                "enable_p2p")])
