"""`LMCacheConfig`: one validated dataclass with LMCache's key names, and `load_config` to build it.

Sources, later wins: field defaults < the YAML file named by `LMCACHE_CONFIG_FILE` < `LMCACHE_<KEY>`
environment variables < the `overrides` mapping given in code. Strings from any source are parsed to
the field's type (bool: true/false/1/0/yes/no/on/off; dict: a JSON object; None: "" / "none" / "null"
for optional fields). Every problem is a `ConfigError` naming the key, the value and what is accepted:
- a key nobody knows -> the closest valid key is suggested (unknown `LMCACHE_*` environment variables
  are left alone: LMCache itself and other tools use that prefix too);
- a key LMCache has but lmcache-vllm does not implement is accepted only at LMCache's default value
  (the feature off, so LMCache YAML files keep working); any other value -> "not supported by
  lmcache-vllm".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

import yaml

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
ENV_PREFIX = "LMCACHE_"
SUPPORTED_HASH_ALGORITHMS = ("xxh3_128", "blake3", "sha256")  # tokens.py implements these
SUPPORTED_CACHE_POLICIES = ("LRU",)
SUPPORTED_REMOTE_SERDE = ("naive",)
SUPPORTED_REMOTE_SCHEMES = ("redis", "rediss", "unix")
GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration key or value that lmcache-vllm cannot accept."""


@dataclass
class LMCacheConfig:
    """Configuration of lmcache-vllm; key names and units (sizes in GiB) are LMCache's."""

    chunk_size: int = 256                      # tokens per stored chunk, any value > 0
    local_cpu: bool = True                     # L1 host-memory tier
    max_local_cpu_size: float = 5.0            # GiB of host memory for L1
    local_disk: Optional[str] = None           # L2 directory ("/path" or "file:///path"); None = off
    max_local_disk_size: float = 0.0           # GiB on disk for L2
    remote_url: Optional[str] = None           # L3: redis://host:port[/db], rediss://..., unix:///sock
    remote_serde: str = "naive"                # raw payload behind our codec header
    save_unfull_chunk: bool = False            # also store the last, shorter chunk of a prompt
    save_decode_cache: bool = False            # also store KV produced while decoding
    use_layerwise: bool = False                # store/load one layer at a time, overlapping compute
    cache_policy: str = "LRU"
    blocking_timeout_secs: float = 10.0        # longest any synchronous wait on the cache may take
    lookup_timeout_ms: int = 3000              # scheduler -> worker lookup; a timeout counts as a miss
    pre_caching_hash_algorithm: str = "xxh3_128"  # chunk digest; see tokens.py
    extra_config: dict = field(default_factory=dict)  # lmcache-vllm's own, less common settings

    def __post_init__(self):
        _validate(self)

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GiB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GiB)

    def get_extra(self, key: str, default: Any = None) -> Any:
        return self.extra_config.get(key, default)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(LMCacheConfig)}

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

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("", "none", "null")


def _describe(name: str, value: Any, source: str) -> str:
    where = f"{ENV_PREFIX}{name.upper()}" if source == "environment" else name
    return f"{where}={value!r} ({source})"


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _parse_str(name: str, text: str, kind: str, source: str) -> Any:
    """Parses a string into `kind` ("bool", "int", "float", "dict", "str", "optional")."""
    text = _unquote(text)
    low = text.lower()
    try:
        if kind == "bool":
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise ValueError("expected one of " + "/".join(_TRUE + _FALSE))
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "dict":
            value = json.loads(text) if text else {}
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object")
            return value
        if kind == "optional":
            return None if low in _NONE else text
        return text
    except ValueError as exc:
        raise ConfigError(f"{_describe(name, text, source)}: cannot parse as {kind}: {exc}") from None


def _kind_of_field(name: str) -> str:
    ftype = FIELD_TYPES[name]
    return {"int": "int", "bool": "bool", "float": "float", "dict": "dict", "str": "str"}.get(
        ftype, "optional")


def _kind_of_value(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "optional"


def _coerce(name: str, value: Any, source: str) -> Any:
    """Turns a raw value of a known key into the field's type (strings are parsed)."""
    if name in UNSUPPORTED_LMCACHE_KEYS:
        default = UNSUPPORTED_LMCACHE_KEYS[name]
        if isinstance(value, str):
            value = _parse_str(name, value, _kind_of_value(default), source)
        if value != default and not (default is None and value in ("", [], {})):
            raise ConfigError(f"{_describe(name, value, source)}: LMCache's '{name}' is not supported "
                              f"by lmcache-vllm (only its default {default!r} is accepted)")
        return value
    kind = _kind_of_field(name)
    if isinstance(value, str) and kind != "str":
        return _parse_str(name, value, kind, source)
    if kind == "str" and isinstance(value, str):
        return _unquote(value)
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _check_key(name: str, source: str) -> None:
    if name in FIELD_TYPES or name in UNSUPPORTED_LMCACHE_KEYS:
        return
    close = difflib.get_close_matches(name, list(FIELD_TYPES), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(FIELD_TYPES)}"
    raise ConfigError(f"unknown configuration key '{name}' ({source}){hint}")


def _fail(name: str, value: Any, accepted: str) -> None:
    raise ConfigError(f"invalid {name}={value!r}: expected {accepted}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def normalize_local_disk(value: Optional[str]) -> Optional[str]:
    """'file:///path' or '/path' -> '/path' (None and '' -> None)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        _fail("local_disk", value, "a directory path or file:// URL")
    if value.startswith("file://"):
        parsed = urlparse(value)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            _fail("local_disk", value, "file:///absolute/path (no host part)")
        value = parsed.path
    if "," in value:
        _fail("local_disk", value, "a single directory (several local_disk paths are not supported)")
    return os.path.normpath(value)


def _validate(cfg: LMCacheConfig) -> None:
    """Checks types and ranges; normalises local_disk, cache_policy and a None remote_serde in place."""
    for name in ("local_cpu", "save_unfull_chunk", "save_decode_cache", "use_layerwise"):
        if not isinstance(getattr(cfg, name), bool):
            _fail(name, getattr(cfg, name), "a bool")
    if not isinstance(cfg.chunk_size, int) or isinstance(cfg.chunk_size, bool) or cfg.chunk_size <= 0:
        _fail("chunk_size", cfg.chunk_size, "an int > 0")
    for name in ("max_local_cpu_size", "max_local_disk_size"):
        value = getattr(cfg, name)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            _fail(name, value, "a size in GiB >= 0")
        setattr(cfg, name, float(value))
    if cfg.local_cpu and cfg.max_local_cpu_bytes <= 0:
        _fail("max_local_cpu_size", cfg.max_local_cpu_size, "a size > 0 while local_cpu is true")
    cfg.local_disk = normalize_local_disk(cfg.local_disk)
    if cfg.local_disk is not None and cfg.max_local_disk_bytes <= 0:
        _fail("max_local_disk_size", cfg.max_local_disk_size, "a size > 0 when local_disk is set")
    if cfg.remote_url is not None:
        url = cfg.remote_url
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in SUPPORTED_REMOTE_SCHEMES:
            _fail("remote_url", url, "a URL with scheme " + "/".join(SUPPORTED_REMOTE_SCHEMES)
                  + " (e.g. redis://127.0.0.1:6379/0 or unix:///run/redis.sock), or None")
        if parsed.scheme in ("redis", "rediss") and not parsed.hostname:
            _fail("remote_url", url, "redis://HOST[:PORT][/DB]")
        if parsed.scheme == "unix" and not parsed.path:
            _fail("remote_url", url, "unix:///path/to/redis.sock")
    if cfg.remote_serde is None:
        cfg.remote_serde = "naive"
    if cfg.remote_serde not in SUPPORTED_REMOTE_SERDE:
        _fail("remote_serde", cfg.remote_serde, "one of " + ", ".join(SUPPORTED_REMOTE_SERDE))
    if isinstance(cfg.cache_policy, str) and cfg.cache_policy.upper() in SUPPORTED_CACHE_POLICIES:
        cfg.cache_policy = cfg.cache_policy.upper()
    else:
        _fail("cache_policy", cfg.cache_policy, "one of " + ", ".join(SUPPORTED_CACHE_POLICIES))
    if not _is_number(cfg.blocking_timeout_secs) or not 0 < cfg.blocking_timeout_secs < math.inf:
        _fail("blocking_timeout_secs", cfg.blocking_timeout_secs, "a finite number of seconds > 0")
    cfg.blocking_timeout_secs = float(cfg.blocking_timeout_secs)
    if (not isinstance(cfg.lookup_timeout_ms, int) or isinstance(cfg.lookup_timeout_ms, bool)
            or cfg.lookup_timeout_ms <= 0):
        _fail("lookup_timeout_ms", cfg.lookup_timeout_ms, "an int number of milliseconds > 0")
    if cfg.pre_caching_hash_algorithm not in SUPPORTED_HASH_ALGORITHMS:
        _fail("pre_caching_hash_algorithm", cfg.pre_caching_hash_algorithm,
              "one of " + ", ".join(SUPPORTED_HASH_ALGORITHMS)
              + " (LMCache's 'builtin' depends on PYTHONHASHSEED and is not supported)")
    if cfg.extra_config is None:
        cfg.extra_config = {}
    if not isinstance(cfg.extra_config, dict):
        _fail("extra_config", cfg.extra_config, "a mapping (a JSON object in the environment)")


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {CONFIG_FILE_ENV}={path!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r} must hold a mapping of keys to values, "
                          f"got {type(data).__name__}")
    return data


def load_config(overrides: Optional[Mapping[str, Any]] = None, *,
                environ: Optional[Mapping[str, str]] = None) -> LMCacheConfig:
    """Builds the configuration: defaults < YAML file < LMCACHE_* environment < `overrides`."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = environ.get(CONFIG_FILE_ENV)
    sources = []
    if path:
        sources.append((f"file {path}", _read_yaml(path)))
    env_values = {}
    for name in list(FIELD_TYPES) + list(UNSUPPORTED_LMCACHE_KEYS):
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            env_values[name] = environ[env_name]
    sources.append(("environment", env_values))
    sources.append(("overrides", dict(overrides or {})))
    for source, values in sources:
        for name, value in values.items():
            if not isinstance(name, str):
                raise ConfigError(f"configuration keys must be strings, got {name!r} ({source})")
            _check_key(name, source)
            value = _coerce(name, value, source)
            if name in FIELD_TYPES:
                merged[name] = value
    return LMCacheConfig(**merged)
