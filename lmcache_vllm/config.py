"""`LMCacheConfig`: lmcache-vllm's configuration, one validated dataclass with LMCache's key names, and
`load_config` to build it from every source.

Sources, later wins: the defaults declared here < the YAML file named by `LMCACHE_CONFIG_FILE` <
`LMCACHE_<KEY>` environment variables < `overrides` (vLLM's `kv_connector_extra_config`). `extra_config`
merges key by key across sources; its keys are declared in `config_extra.ExtraConfig`. Strings from any
source are parsed to the key's type the same way (`config_schema.parse_value`: booleans true/false,
1/0, yes/no, on/off; null/none/"" for optional keys; JSON for mappings); string values are never stripped.

Everything wrong with the configuration, from every source, is collected and raised as ONE `ConfigError`
that names each key, its value, where it came from (file and line, environment variable, or
kv_connector_extra_config) and what is accepted. An unknown key gets a "did you mean" only for a likely
typo of a known key of the same type. An LMCache key that lmcache-vllm does not implement is accepted
at LMCache's default value (the feature off), so LMCache YAML files keep working; any other value is an
error saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from lmcache_vllm.config_extra import ExtraConfig
from lmcache_vllm.config_schema import (MISSING, ConfigError, Origin, Problem, at_least, check_setting,
                                        did_you_mean, field_types, greater_than, normalize_fields,
                                        parse_setting, parse_value, raise_if_any, setting, size_gib)
from lmcache_vllm.config_sources import (CONFIG_FILE_ENV, ENV_PREFIX, Entry, code_entries, env_entries,
                                         read_yaml)

__all__ = ["ConfigError", "ExtraConfig", "LMCacheConfig", "load_config", "CONFIG_FILE_ENV", "ENV_PREFIX"]

logger = logging.getLogger(__name__)

SUPPORTED_HASH_ALGORITHMS = ("xxh3_128", "blake3", "sha256")  # tokens.py implements these
SUPPORTED_REMOTE_SCHEMES = ("redis", "rediss", "unix")
GiB = 1 << 30


@dataclass
class LMCacheConfig:
    """Configuration of lmcache-vllm; key names and units (sizes in GiB) are LMCache's."""

    chunk_size: int = setting(256, "tokens per stored chunk (any value; independent of vLLM's block size)",
                              check=at_least(1, "an integer"))
    local_cpu: bool = setting(True, "keep chunks in the L1 host-memory tier")
    max_local_cpu_size: float = setting(5.0, "GiB of host memory for L1", check=size_gib)
    local_disk: Optional[str] = setting(None, "L2 directory: /path, file:///path or a path relative to the "
                                              "working directory; null or false: no disk tier",
                                        value_aliases={False: None})
    max_local_disk_size: float = setting(0.0, "GiB cap of L2 (> 0 when local_disk is set)", check=size_gib)
    remote_url: Optional[str] = setting(None, "L3 Redis: redis://[user:pw@]host:port[/db], rediss://..., "
                                              "unix:///path/to/redis.sock; null: no L3")
    remote_serde: str = setting("naive", "encoding of stored chunks: raw bytes behind our header",
                                choices=("naive",), value_aliases={None: "naive"})
    save_unfull_chunk: bool = setting(False, "also store the last, shorter chunk of a prompt")
    save_decode_cache: bool = setting(False, "also store KV produced while decoding")
    use_layerwise: bool = setting(False, "load and store one layer at a time, overlapping compute")
    cache_policy: str = setting("LRU", "L1 eviction order", choices=("LRU",))
    blocking_timeout_secs: float = setting(10.0, "longest any synchronous wait on the cache may take",
                                           check=greater_than(0, "seconds"))
    lookup_timeout_ms: int = setting(3000, "longest wait of a scheduler lookup; past it: a miss",
                                     check=at_least(1, "milliseconds"))
    pre_caching_hash_algorithm: str = setting("xxh3_128", "chunk digest (see tokens.py)",
                                              choices=SUPPORTED_HASH_ALGORITHMS)
    extra_config: ExtraConfig = setting(meaning="lmcache-vllm's own settings (config_extra.py)",
                                        default_factory=ExtraConfig)

    def __post_init__(self):
        problems = normalize_fields(self, skip=("extra_config",))
        if not isinstance(self.extra_config, ExtraConfig):
            self.extra_config = build_extra(self.extra_config, Origin("code"), problems)
        problems += _check_together(self)
        raise_if_any(problems)

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GiB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GiB)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line with every top-level key and the extra_config keys that differ from their default
        (for the start-up log; a password in remote_url is masked)."""
        parts = [f"{f.name}={_masked(getattr(self, f.name))!r}" for f in dataclasses.fields(self)
                 if f.name != "extra_config"]
        defaults = ExtraConfig()
        changed = {f.name: getattr(self.extra_config, f.name) for f in dataclasses.fields(ExtraConfig)
                   if getattr(self.extra_config, f.name) != getattr(defaults, f.name)}
        return ", ".join(parts + [f"extra_config={changed!r}"])


TOP_FIELDS = {f.name: f for f in dataclasses.fields(LMCacheConfig)}
TOP_TYPES = field_types(LMCacheConfig)
EXTRA_FIELDS = {f.name: f for f in dataclasses.fields(ExtraConfig)}
EXTRA_TYPES = field_types(ExtraConfig)
FIELD_TYPES = {name: tp for name, tp in TOP_TYPES.items()}  # kept for callers of the old module
# Keys of LMCache 0.5.6 that lmcache-vllm does not implement, with LMCache's default for each.
# Setting one to its default is accepted (and ignored); any other value is a ConfigError.
UNSUPPORTED_LMCACHE_KEYS: dict[str, Any] = {
    "local_cpu_use_hugepages": False, "reserve_local_cpu_size": 0.0,
    "local_disk_path_sharding": "by_gpu", "enable_blending": False, "blend_recompute_ratios": None,
    "blend_thresholds": None, "blend_check_layers": None, "blend_min_tokens": 256,
    "blend_special_str": " # # ", "retrieve_locations": None, "store_location": None,
    "enable_p2p": False, "p2p_host": None, "p2p_init_ports": None, "p2p_lookup_ports": None,
    "mp_host": None, "mp_port": 5555, "enable_controller": False, "lmcache_instance_id": None,
    "controller_pull_url": None, "controller_reply_url": None, "lmcache_worker_ports": None,
    "lmcache_worker_ids": None, "lmcache_worker_heartbeat_delay_time": 10,
    "lmcache_worker_heartbeat_time": None, "enable_pd": False, "pd_role": None,
    "pd_buffer_size": None, "pd_buffer_device": None, "pd_peer_host": None,
    "pd_peer_init_port": None, "pd_peer_alloc_port": None, "pd_peer_query_port": None,
    "pd_proxy_host": None, "pd_proxy_port": None, "pd_allocation_timeout_sec": math.inf,
    "pd_shutdown_timeout_sec": 5.0, "pd_condition_poll_interval_sec": 0.005, "pd_max_prefill_len": 0,
    "pd_backend_mode": "async", "pd_skip_proxy_notification": False, "pd_bidirectional": False,
    "transfer_channel": None, "nixl_backends": None, "nixl_buffer_size": None,
    "nixl_buffer_device": None, "gds_path": None, "gds_path_sharding": "by_gpu",
    "gds_buffer_size": None, "maru_path": None, "maru_pool_size": 4.0, "use_gds": True,
    "gds_backend": "cufile", "audit_actual_remote_url": None, "internal_api_server_host": "127.0.0.1",
    "external_lookup_client": None, "py_enable_gc": True, "numa_mode": None,
    "enable_async_loading": False, "internal_api_server_enabled": False,
    "internal_api_server_port_start": 6999, "priority_limit": None,
    "internal_api_server_include_index_list": None, "internal_api_server_socket_path_prefix": None,
    "runtime_plugin_locations": None, "storage_plugins": None, "remote_storage_plugins": None,
    "min_retrieve_tokens": 0, "hit_miss_ratio": None, "lookup_server_worker_ids": None,
    "enable_scheduler_bypass_lookup": False, "script_allowed_imports": None,
    "run_script_api_enabled": False, "enable_lazy_memory_allocator": False,
    "lazy_memory_initial_ratio": 0.2, "lazy_memory_expand_trigger_ratio": 0.5,
    "lazy_memory_step_ratio": 0.1, "lazy_memory_safe_size": 0.0, "enable_chunk_statistics": False,
    "chunk_statistics_auto_start_statistics": False, "chunk_statistics_auto_exit_timeout_hours": 0.0,
    "chunk_statistics_auto_exit_target_unique_chunks": 0,
    "chunk_statistics_strategy": "memory_bloom_filter", "enable_kv_events": False,
    "use_gpu_connector_v3": False, "pin_timeout_sec": 300, "pin_check_interval_sec": 30,
    "remote_config_url": None, "app_id": None, "enable_hidden_state_cache": False,
    "max_hidden_state_cpu_size": 2.0, "hidden_state_layers": None,
    "hidden_states_retrieve_mode": "prefix_strict",
    # LMCache's deprecated aliases
    "enable_xpyd": False, "nixl_peer_host": None, "nixl_peer_init_port": None,
    "nixl_peer_alloc_port": None, "nixl_proxy_host": None, "nixl_proxy_port": None,
    "nixl_role": None, "controller_url": None, "lmcache_worker_port": None, "plugin_locations": None,
    "external_backends": None,
}


def _masked(value: Any) -> Any:
    if isinstance(value, str) and "@" in value and "://" in value:
        scheme, rest = value.split("://", 1)
        userinfo, host = rest.rsplit("@", 1)
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}" if ":" in userinfo else value
    return value


# ---------------------------------------------------------------------------------- checks across keys
def _check_together(cfg: LMCacheConfig) -> list[Problem]:
    problems: list[Problem] = []
    if cfg.local_cpu and cfg.max_local_cpu_bytes <= 0:
        problems.append(Problem("max_local_cpu_size", cfg.max_local_cpu_size,
                                "expected a size > 0 while local_cpu is true"))
    if cfg.local_disk is not None:
        cfg.local_disk, message = _normalize_local_disk(cfg.local_disk)
        if message:
            problems.append(Problem("local_disk", cfg.local_disk, message))
        elif cfg.max_local_disk_bytes <= 0:
            problems.append(Problem("max_local_disk_size", cfg.max_local_disk_size,
                                    "expected a size > 0 when local_disk is set"))
    if cfg.remote_url is not None:
        message = _remote_url_problem(cfg.remote_url)
        if message:
            problems.append(Problem("remote_url", cfg.remote_url, message))
    return problems


def _normalize_local_disk(value: str) -> tuple[str, Optional[str]]:
    """As LMCache: 'file://' is dropped, so 'file:///abs' is /abs and 'file://rel/' the relative rel/."""
    path = value[len("file://"):] if value.startswith("file://") else value
    if "," in path:
        return value, ("a single directory (LMCache's several comma-separated local_disk paths "
                       "are not supported)")
    if not path.strip():
        return value, "a directory path"
    return os.path.normpath(path), None


def _remote_url_problem(url: str) -> Optional[str]:
    """What is wrong with a Redis URL (checked here so that redis-py never sees a bad one)."""
    expected = ("a URL with scheme " + "/".join(SUPPORTED_REMOTE_SCHEMES)
                + " (e.g. redis://127.0.0.1:6379/0 or unix:///run/redis.sock), or null")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a valid URL ({exc}); expected {expected}"
    if parts.scheme not in SUPPORTED_REMOTE_SCHEMES:
        return f"expected {expected}"
    if parts.scheme == "unix":
        return None if parts.path else "expected unix:///path/to/redis.sock"
    if not parts.hostname:
        return "expected redis://HOST[:PORT][/DB] (no host given)"
    if port is not None and not 0 < port < 65536:
        return "the port must be 1 to 65535"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"the database ({db!r}) must be a number: redis://HOST:PORT/DB"
    return None


# ---------------------------------------------------------------------------------- loading
class _Loader:
    """Collects every source's entries into field values, with the origin of each, and every problem."""

    def __init__(self):
        self.problems: list[Problem] = []
        self.values: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.origins: dict[str, Origin] = {}

    def top(self, entry: Entry) -> None:
        key = entry.key
        if not isinstance(key, str):
            self.problems.append(Problem(repr(key), entry.value, "keys must be strings", entry.origin))
        elif key == "extra_config":
            self.extra_mapping(entry)
        elif key in TOP_FIELDS:
            self._take(TOP_FIELDS[key], TOP_TYPES[key], key, entry, self.values)
        elif key in UNSUPPORTED_LMCACHE_KEYS:
            self._unsupported(key, entry)
        else:
            self._unknown(key, entry, TOP_TYPES, "")

    def extra_mapping(self, entry: Entry) -> None:
        try:
            mapping = parse_value(entry.value, Optional[dict])
        except ValueError as exc:
            self.problems.append(Problem("extra_config", entry.value, str(exc), entry.origin))
            return
        children = entry.children or tuple(Entry(k, v, entry.origin) for k, v in (mapping or {}).items())
        for child in children:
            self.extra_key(child)

    def extra_key(self, entry: Entry) -> None:
        key = entry.key
        if isinstance(key, str) and key in EXTRA_FIELDS:
            self._take(EXTRA_FIELDS[key], EXTRA_TYPES[key], f"extra_config.{key}", entry, self.extra)
        else:
            self._unknown(key, entry, EXTRA_TYPES, "extra_config.")

    def _take(self, f: dataclasses.Field, tp: Any, name: str, entry: Entry, into: dict) -> None:
        try:
            value = parse_setting(f, tp, entry.value)
        except ValueError as exc:
            self.problems.append(Problem(name, entry.value, str(exc), entry.origin))
            return
        message = check_setting(f, value)
        if message:
            self.problems.append(Problem(name, value, message, entry.origin))
            return
        into[f.name] = value
        self.origins[name] = entry.origin

    def _unsupported(self, key: str, entry: Entry) -> None:
        default = UNSUPPORTED_LMCACHE_KEYS[key]
        value = entry.value
        tp = type(default) if default is not None else Optional[str]
        try:
            value = parse_value(value, tp) if isinstance(value, str) else value
        except ValueError:
            pass
        if value != default and not (default is None and value in ("", [], {})):
            self.problems.append(Problem(key, entry.value, f"LMCache's '{key}' is not supported by "
                                         f"lmcache-vllm (only its default {default!r} is accepted)",
                                         entry.origin))

    def _unknown(self, key: Any, entry: Entry, candidates: Mapping[str, Any], prefix: str) -> None:
        name = f"{prefix}{key}"
        if not isinstance(key, str):
            self.problems.append(Problem(name, entry.value, "keys must be strings", entry.origin))
            return
        hint = did_you_mean(key, entry.value, candidates)
        message = (f"unknown key; did you mean '{prefix}{hint}'?" if hint else
                   f"unknown key; lmcache-vllm's {prefix or ''}keys: {', '.join(candidates)}")
        self.problems.append(Problem(name, entry.value, message, entry.origin))

    def build(self) -> LMCacheConfig:
        extra = ExtraConfig(**self.extra)
        try:
            config = LMCacheConfig(**self.values, extra_config=extra)
        except ConfigError as exc:
            self.problems += [dataclasses.replace(p, origin=p.origin or self.origins.get(p.key))
                              for p in exc.problems]
            config = None
        raise_if_any(self.problems)
        return config


def build_extra(mapping: Any, origin: Origin, problems: list[Problem]) -> ExtraConfig:
    """An ExtraConfig from a plain mapping (e.g. `LMCacheConfig(extra_config={...})` in code)."""
    loader = _Loader()
    loader.extra_mapping(Entry("extra_config", mapping, origin))
    problems += loader.problems
    return ExtraConfig(**loader.extra)


def load_config(overrides: Optional[Mapping[str, Any]] = None, *,
                environ: Optional[Mapping[str, str]] = None) -> LMCacheConfig:
    """Builds the configuration: defaults < YAML file < LMCACHE_* environment < `overrides`. Raises one
    ConfigError listing every problem of every source."""
    environ = os.environ if environ is None else environ
    loader = _Loader()
    path = environ.get(CONFIG_FILE_ENV)
    entries = read_yaml(path, loader.problems) if path else []
    entries += env_entries(environ, set(TOP_FIELDS) | set(UNSUPPORTED_LMCACHE_KEYS))
    entries += code_entries(overrides)
    for entry in entries:
        loader.top(entry)
    return loader.build()
