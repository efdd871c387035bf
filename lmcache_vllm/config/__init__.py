"""lmcache-vllm's configuration: one schema (`LMCacheConfig` with LMCache's key names, our own keys in
`ExtraConfig`), read from defaults < a YAML file < `LMCACHE_*` environment < vLLM's
`kv_connector_extra_config`, every problem of every source reported in one `ConfigError`.

Modules: `fields` (how a key is declared, parsed and checked), `schema` (the top-level keys), `extra`
(the `extra_config` keys), `sources` (YAML, environment, code), `values` (checks and translations of
single values), `lmcache` (LMCache's keys we take, map or lack), `loader` (`load_config`,
`inspect_config`), `doc` (the generated key tables).
"""
from lmcache_vllm.config.extra import ExtraConfig
from lmcache_vllm.config.fields import ConfigError
from lmcache_vllm.config.loader import ConfigReport, inspect_config, load_config
from lmcache_vllm.config.schema import HASH_ALGORITHMS, LMCacheConfig
from lmcache_vllm.config.sources import CONFIG_FILE_ENV, ENV_PREFIX

__all__ = ["CONFIG_FILE_ENV", "ENV_PREFIX", "HASH_ALGORITHMS", "ConfigError", "ConfigReport", "ExtraConfig",
           "LMCacheConfig", "inspect_config", "load_config"]
