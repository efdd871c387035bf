"""Every LMCache configuration key that lmcache-vllm does not take as it is, with what it does with each
and why: LMCache 0.5.6's keys and aliases, older keys still found in real files, LMCache's `extra_config`
keys, LMCache's values of keys we do implement, and LMCache's own `LMCACHE_*` environment variables.

- `NOOP`: accepted whatever its value, with a one-line warning saying why it changes nothing here.
- `MAPPED`: accepted and translated to our equivalent (the warning says into what).
- `UNSUPPORTED`: a feature lmcache-vllm lacks. Accepted at LMCache's default (`off`: the feature off);
  any other value is an error giving the reason. `part_of` names the switches of the feature a key
  configures: while they are all off, LMCache ignores the key and so do we (a warning); while one is
  on, the switch's error lists the key.

The LMCache keys lmcache-vllm implements are the fields of `LMCacheConfig` (config.py). To support one of
the keys below, move it there as a field (`tests/test_config_lmcache.py` fails while a key is in both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

NOOP, MAPPED, UNSUPPORTED = "no-op", "mapped", "unsupported"


@dataclass(frozen=True)
class KeyRule:
    status: str
    reason: str
    lmcache_type: Any = Any  # to parse environment strings the way LMCache does
    off: Any = None  # UNSUPPORTED: the one accepted value (LMCache's default: the feature off)
    part_of: tuple[str, ...] = ()  # UNSUPPORTED: the switches of the feature this key configures
    target: str = ""  # MAPPED: our key ("extra_config.x" for extra keys)
    since: str = "0.5.6"  # where the key comes from: LMCache 0.5.6, an alias, v0, older v1 releases


def noop(reason: str, since: str = "0.5.6") -> KeyRule:
    return KeyRule(NOOP, reason, since=since)


def mapped(target: str, reason: str, since: str = "0.5.6") -> KeyRule:
    return KeyRule(MAPPED, reason, target=target, since=since)


def lacks(tp: Any, off: Any, reason: str, part_of: tuple[str, ...] = (), since: str = "0.5.6") -> KeyRule:
    return KeyRule(UNSUPPORTED, reason, tp, off, part_of, since=since)


# The keys of Mooncake's store setup that LMCache takes unprefixed in extra_config; they are ours under the same
# names (config/extra.py), and LMCache's mooncake_<key> spelling maps onto them.
MOONCAKE_SETUP_KEYS = ("local_hostname", "metadata_server", "master_server_address", "global_segment_size",
                       "local_buffer_size", "protocol", "device_name")
OptStr, OptInt, OptFloat = Optional[str], Optional[int], Optional[float]
Ints, Strs, Floats = Optional[list[int]], Optional[list[str]], Optional[list[float]]
PD = ("enable_pd", "enable_xpyd", "enable_nixl")  # disaggregated prefill: 0.5.6's switch, older ones
CONTROLLER = ("enable_controller",)
API_SERVER = ("internal_api_server_enabled",)
BLEND = ("enable_blending",)
_PD = "LMCache's disaggregated prefill (P pushes KV GPU to GPU over NIXL to D's listener, LMCache's proxy " \
      "protocol); lmcache-vllm speaks vLLM's protocol instead (kv_transfer_params, D pulls from P; no switch, " \
      "settings extra_config.pd_*: docs/DISAGGREGATED.md) or goes through Redis (kv_producer / kv_consumer)"
_P2P_OURS = "lmcache-vllm's P2P finds peers in a directory on Redis (enable_p2p with extra_config.p2p_directory_url " \
            "or remote_url; docs/P2P.md)"
_CONTROLLER = f"the cache controller (a central service tracking every instance's cache); {_P2P_OURS}, no " \
              f"controller"
_API = "LMCache's internal HTTP API server"
_BLEND = "CacheBlend (reusing KV of non-prefix text); lmcache-vllm reuses prefixes only"
_GDS = "the GPU Direct Storage backend (cuFile); lmcache-vllm's disk tier is local_disk"
_V0_DEVICE = "LMCache v0's local device; ignored since LMCache v1: L1 is local_cpu/max_local_cpu_size, " \
             "L2 local_disk"

LMCACHE_KEYS: dict[str, KeyRule] = {
    # ---- storage tiers
    "local_cpu_use_hugepages": lacks(bool, False, "explicit huge pages (hugetlbfs) for L1; "
                                     "extra_config.prefault_local_cpu asks for transparent ones"),
    "reserve_local_cpu_size": lacks(float, 0.0, "shrinking L1 to leave host memory free (LMCache: only for "
                                                "MLA's rank-0 saves); size L1 with max_local_cpu_size"),
    "local_disk_path_sharding": noop("spreads several local_disk directories over GPUs; lmcache-vllm "
                                     "takes one directory"),
    "gds_path": lacks(OptStr, None, _GDS),
    "gds_path_sharding": lacks(str, "by_gpu", _GDS, ("gds_path",)),
    "gds_buffer_size": lacks(OptInt, None, _GDS, ("gds_path",)),
    "use_gds": lacks(bool, True, _GDS, ("gds_path",)),
    "gds_backend": lacks(str, "cufile", _GDS, ("gds_path",)),
    "maru_path": lacks(OptStr, None, "the Maru CXL shared-memory backend"),
    "maru_pool_size": lacks(float, 4.0, "the Maru CXL shared-memory backend", ("maru_path",)),
    "retrieve_locations": lacks(Strs, None, "choosing LMCache backends per retrieve; lmcache-vllm reads "
                                            "L1, then local_disk, then remote_url"),
    "store_location": lacks(OptStr, None, "choosing one LMCache backend to store to; lmcache-vllm stores "
                                          "to every configured tier"),
    "enable_lazy_memory_allocator": noop("the L1 arena is already backed lazily by the OS, page by page on "
                                         "first write (extra_config.prefault_local_cpu: up front)"),
    "lazy_memory_initial_ratio": noop("see enable_lazy_memory_allocator"),
    "lazy_memory_expand_trigger_ratio": noop("see enable_lazy_memory_allocator"),
    "lazy_memory_step_ratio": noop("see enable_lazy_memory_allocator"),
    "lazy_memory_safe_size": noop("see enable_lazy_memory_allocator"),
    "numa_mode": noop("L1 pages land on the NUMA node of the worker thread that first writes them"),
    "pin_timeout_sec": mapped("extra_config.prefetch_hold_secs", "longest time a prefetched chunk stays "
                                                                 "pinned for its request"),
    "pin_check_interval_sec": noop("each pin in lmcache-vllm expires on its own timer"),
    "runtime_plugin_locations": lacks(Strs, None, "LMCache's runtime plugins"),
    "storage_plugins": lacks(Strs, None, "LMCache's storage backend plugins"),
    "remote_storage_plugins": lacks(Strs, None, "LMCache's remote storage plugins"),
    "audit_actual_remote_url": lacks(OptStr, None, "LMCache's audit connector (audit:// remote_url)"),
    # ---- blending
    "enable_blending": lacks(bool, False, _BLEND),
    "blend_recompute_ratios": lacks(Floats, None, _BLEND, BLEND),
    "blend_thresholds": lacks(Floats, None, _BLEND, BLEND),
    "blend_check_layers": lacks(Ints, None, _BLEND, BLEND),
    "blend_min_tokens": lacks(int, 256, _BLEND, BLEND),
    "blend_special_str": lacks(str, " # # ", _BLEND, BLEND),
    # ---- P2P, controller, multi-process server, API server
    "p2p_lookup_ports": lacks(Ints, None, f"LMCache's P2P lookups through its controller; {_P2P_OURS}",
                              CONTROLLER),
    "transfer_channel": noop("the transfer channel of LMCache's PD and P2P (nixl, ...); lmcache-vllm moves chunks "
                             "between instances over its own TCP transport"),
    "mp_host": lacks(OptStr, None, "LMCache's multi-process server mode (a separate cache process)"),
    "mp_port": lacks(int, 5555, "LMCache's multi-process server mode (a separate cache process)"),
    "enable_controller": lacks(bool, False, _CONTROLLER),
    "lmcache_instance_id": noop("names the instance for LMCache's controller and telemetry; lmcache-vllm "
                                "has neither (vLLM's engine_id names the instance)"),
    "controller_pull_url": lacks(OptStr, None, _CONTROLLER, CONTROLLER),
    "controller_reply_url": lacks(OptStr, None, _CONTROLLER, CONTROLLER),
    "lmcache_worker_ports": lacks(Ints, None, _CONTROLLER, CONTROLLER),
    "lmcache_worker_ids": lacks(Ints, None, _CONTROLLER, CONTROLLER),
    "lmcache_worker_heartbeat_delay_time": lacks(int, 10, _CONTROLLER, CONTROLLER),
    "lmcache_worker_heartbeat_time": lacks(OptInt, None, _CONTROLLER, CONTROLLER),
    "internal_api_server_enabled": lacks(bool, False, _API),
    "internal_api_server_host": lacks(str, "127.0.0.1", _API, API_SERVER),
    "internal_api_server_port_start": lacks(int, 6999, _API, API_SERVER),
    "internal_api_server_include_index_list": lacks(Ints, None, _API, API_SERVER),
    "internal_api_server_socket_path_prefix": lacks(OptStr, None, _API, API_SERVER),
    "script_allowed_imports": lacks(Strs, None, _API, API_SERVER),
    "run_script_api_enabled": lacks(bool, False, _API, API_SERVER),
    "remote_config_url": lacks(OptStr, None, "fetching configuration from a remote service at start-up"),
    "app_id": lacks(OptStr, None, "fetching configuration from a remote service", ("remote_config_url",)),
    # ---- disaggregated prefill (0.5.6 keys; their aliases and the older NIXL keys below)
    "enable_pd": lacks(bool, False, _PD),
    "pd_role": lacks(OptStr, None, _PD, PD),
    "pd_buffer_size": lacks(OptInt, None, _PD, PD),
    "pd_buffer_device": lacks(OptStr, None, _PD, PD),
    "pd_peer_host": lacks(OptStr, None, _PD, PD),
    "pd_peer_init_port": lacks(Ints, None, _PD, PD),
    "pd_peer_alloc_port": lacks(Ints, None, _PD, PD),
    "pd_peer_query_port": lacks(Ints, None, _PD, PD),
    "pd_proxy_host": lacks(OptStr, None, _PD, PD),
    "pd_proxy_port": lacks(OptInt, None, _PD, PD),
    "pd_allocation_timeout_sec": lacks(float, math.inf, _PD, PD),
    "pd_shutdown_timeout_sec": lacks(float, 5.0, _PD, PD),
    "pd_condition_poll_interval_sec": lacks(float, 0.005, _PD, PD),
    "pd_max_prefill_len": lacks(int, 0, _PD, PD),
    "pd_backend_mode": lacks(OptStr, "async", _PD, PD),
    "pd_skip_proxy_notification": lacks(bool, False, _PD, PD),
    "pd_bidirectional": lacks(bool, False, _PD, PD),
    "nixl_backends": lacks(Strs, None, "NIXL transfers (PD, P2P)", PD),
    "nixl_buffer_size": lacks(OptInt, None, "NIXL transfers (PD, P2P)", PD),
    "nixl_buffer_device": lacks(OptStr, None, "NIXL transfers (PD, P2P)", PD),
    # ---- scheduling and lookups
    "priority_limit": lacks(OptInt, None, "skipping saves of requests above a priority"),
    "external_lookup_client": lacks(OptStr, None, "an external lookup service"),
    "hit_miss_ratio": lacks(OptFloat, None, "LMCache's test knob capping the hit ratio"),
    "lookup_server_worker_ids": noop("every TP rank of lmcache-vllm answers lookups for its own shard"),
    "enable_scheduler_bypass_lookup": noop("lmcache-vllm's scheduler already calls the worker's lookup "
                                           "directly when both live in one process"),
    "use_gpu_connector_v3": noop("selects among LMCache's GPU copy kernels; lmcache-vllm has its own"),
    "py_enable_gc": noop("lmcache-vllm leaves Python's garbage collector in vLLM's processes alone"),
    # ---- observability
    "enable_chunk_statistics": lacks(bool, False, "LMCache's chunk reuse statistics"),
    "chunk_statistics_auto_start_statistics": lacks(bool, False, "chunk statistics",
                                                    ("enable_chunk_statistics",)),
    "chunk_statistics_auto_exit_timeout_hours": lacks(float, 0.0, "chunk statistics",
                                                      ("enable_chunk_statistics",)),
    "chunk_statistics_auto_exit_target_unique_chunks": lacks(int, 0, "chunk statistics",
                                                             ("enable_chunk_statistics",)),
    "chunk_statistics_strategy": lacks(str, "memory_bloom_filter", "chunk statistics",
                                       ("enable_chunk_statistics",)),
    # ---- vLLM-Omni hidden states
    "enable_hidden_state_cache": lacks(bool, False, "caching hidden states for vLLM-Omni pipelines"),
    "max_hidden_state_cpu_size": lacks(float, 2.0, "the hidden state cache", ("enable_hidden_state_cache",)),
    "hidden_state_layers": lacks(Ints, None, "the hidden state cache", ("enable_hidden_state_cache",)),
    "hidden_states_retrieve_mode": lacks(str, "prefix_strict", "the hidden state cache",
                                         ("enable_hidden_state_cache",)),
    # ---- LMCache 0.5.6's deprecated aliases
    "enable_xpyd": lacks(bool, False, _PD, since="alias of enable_pd"),
    "nixl_peer_host": lacks(OptStr, None, _PD, PD, "alias of pd_peer_host"),
    "nixl_peer_init_port": lacks(Ints, None, _PD, PD, "alias of pd_peer_init_port"),
    "nixl_peer_alloc_port": lacks(Ints, None, _PD, PD, "alias of pd_peer_alloc_port"),
    "nixl_proxy_host": lacks(OptStr, None, _PD, PD, "alias of pd_proxy_host"),
    "nixl_proxy_port": lacks(OptInt, None, _PD, PD, "alias of pd_proxy_port"),
    "nixl_role": lacks(OptStr, None, _PD, PD, "alias of pd_role"),
    "nixl_peer_port": lacks(OptInt, None, _PD, PD, "deprecated"),
    "controller_url": lacks(OptStr, None, _CONTROLLER, CONTROLLER, "alias of controller_pull_url"),
    "lmcache_worker_port": lacks(Ints, None, _CONTROLLER, CONTROLLER, "alias of lmcache_worker_ports"),
    "plugin_locations": lacks(Strs, None, "LMCache's runtime plugins",
                              since="alias of runtime_plugin_locations"),
    "external_backends": lacks(Strs, None, "LMCache's storage backend plugins",
                               since="alias of storage_plugins"),
    # ---- older LMCache releases (v0 and early v1), still in real files
    "local_device": noop(_V0_DEVICE, "v0"),
    "max_local_cache_size": noop(_V0_DEVICE + " (its size: use max_local_cpu_size)", "v0"),
    "pipelined_backend": noop("LMCache v0's pipelined retrieve; ignored since LMCache v1", "v0"),
    "use_experimental": noop("chose LMCache's v1 engine in 0.1-0.2; lmcache-vllm has one engine", "0.1"),
    "blend_recompute_ratio": lacks(OptFloat, None, _BLEND, BLEND, "v0"),
    "blend_separator": lacks(OptStr, None, _BLEND, BLEND, "v0"),
    "blend_add_special_in_precomp": lacks(bool, False, _BLEND, BLEND, "v0"),
    "disk_path": noop("LMCache v0's disk server (local_device: disk_url://...); for a disk tier set "
                      "local_disk and max_local_disk_size", "v0"),
    "disk_url": noop("LMCache v0's disk server; ignored since LMCache v1", "v0"),
    "fmt": noop("LMCache v0's engine metadata; lmcache-vllm reads the KV layout from vLLM", "v0"),
    "dtype": noop("LMCache v0's engine metadata; lmcache-vllm reads the KV dtype from vLLM", "v0"),
    "serde": noop("LMCache v0's disk server serializer; the disk tier's codec is extra_config.local_disk_serde",
                  "v0"),
    "enable_nixl": lacks(bool, False, _PD, since="0.2"),
    "nixl_receiver_host": lacks(OptStr, None, _PD, PD, "0.2"),
    "nixl_receiver_port": lacks(OptInt, None, _PD, PD, "0.2"),
    "nixl_enable_gc": lacks(bool, False, _PD, PD, "0.2"),
    "lookup_url": lacks(OptStr, None, f"LMCache 0.2's P2P lookup server; {_P2P_OURS}", CONTROLLER, "0.2"),
    "distributed_url": lacks(OptStr, None, f"LMCache 0.2's P2P transfer server; {_P2P_OURS}", CONTROLLER, "0.2"),
    "async_loading": noop("not an LMCache key (LMCache ignores it too); the key is enable_async_loading",
                          "an LMCache example"),
    "local_disk_path": mapped("local_disk", "the L2 directory, as guides write it (with local_disk: true)",
                              "guides"),
    # ---- kv_connector_extra_config keys of vLLM's LMCacheConnectorV1 and of LMCache's lookup client
    "use_native": noop("selects vLLM's bundled copy of LMCache's connector", "vLLM"),
    "lmcache_rpc_port": noop("the port of LMCache's lookup RPC; lmcache-vllm's lookups use local sockets",
                             "kv_connector_extra_config"),
}

# LMCache reads backend- and feature-specific settings from extra_config; these are the ones in real files
# or with an equivalent here. Keys of LMCache backends we lack are no-ops: the remote_url (or switch)
# that would select the backend is refused on its own.
LMCACHE_EXTRA_KEYS: dict[str, KeyRule] = {
    "use_odirect": mapped("extra_config.disk_direct_io", "O_DIRECT chunk files (LMCache's default: off, "
                                                         "ours: on)"),
    "save_chunk_meta": noop("a header choice of LMCache's remote connectors; our chunks always carry ours"),
    "username": mapped("remote_url", "the Redis user of LMCache's resp:// remote_url"),
    "password": mapped("remote_url", "the Redis password of LMCache's resp:// remote_url"),
    "resp_num_threads": mapped("extra_config.remote_max_connections", "Redis connections of resp://"),
    "save_only_first_rank": lacks(bool, False, "saving MLA's KV (equal on every rank) from rank 0 only"),
    "tag_keys": lacks(Strs, None, "cache keys scoped by request tags (LMCache's cache-by-tags)"),
    "lookup_backoff_time": noop("LMCache's pause between P2P lookups through its controller; lmcache-vllm bounds "
                                "each directory lookup (extra_config.p2p_lookup_timeout_secs) and skips a failing "
                                "peer for extra_config.p2p_peer_backoff_secs"),
    "enable_nixl_storage": lacks(bool, False, "LMCache's NIXL storage backend"),
    "audit_verify_checksum": noop("LMCache's audit connector (not supported)"),
    "enable_sparse": lacks(bool, False, _BLEND),
    "use_exists_sync": noop("LMCache's synchronous existence checks of its remote connectors; lmcache-vllm asks a "
                            "remote tier in one batch per lookup, bounded by lookup_timeout_ms"),
    # LMCache's Mooncake store (remote_url: mooncakestore://); its other keys are ours under the same names
    "transfer_timeout": mapped("extra_config.remote_timeout_secs", "a Mooncake call's timeout (ours: per chunk a "
                                                                   "call moves)"),
    "prefer_local_alloc": mapped("extra_config.mooncake_prefer_local_alloc", "LMCache's older name"),
    "storage_root_dir": lacks(OptStr, None, "Mooncake's SSD offload directory (MOONCAKE_STORAGE_ROOT_DIR); "
                                            "lmcache-vllm's disk tier is local_disk"),
    **{f"mooncake_{name}": mapped(f"extra_config.{target}", "LMCache's mooncake_-prefixed spelling")
       for name, target in {**{k: k for k in MOONCAKE_SETUP_KEYS}, "master_server_addr": "master_server_address",
                            "rdma_devices": "device_name", "transfer_timeout": "remote_timeout_secs"}.items()},
    "mooncake_storage_root_dir": lacks(OptStr, None, "Mooncake's SSD offload directory (MOONCAKE_STORAGE_ROOT_DIR); "
                                                     "lmcache-vllm's disk tier is local_disk"),
}
# Prefixes of LMCache backends' extra_config keys.
LMCACHE_EXTRA_PREFIXES = {
    "s3_": "LMCache's S3 connector", "aws_": "LMCache's S3 connector", "azure_": "LMCache's Azure connector",
    "valkey_": "LMCache's Valkey connector", "nixl_": "LMCache's NIXL backends",
    "mooncake_": "Mooncake's setup (lmcache-vllm passes Mooncake the keys docs/CONFIG.md lists)",
    "hf3fs_": "LMCache's 3FS connector",
    "fs_connector_": "LMCache's fs:// connector", "sagemaker_hyperpod_": "LMCache's SageMaker connector",
    "remote_storage_plugin.": "LMCache's remote storage plugins", "lmcache.": "LMCache's own settings",
}

# remote_url schemes of LMCache (the part before "://") that are not ours (config/remote_url.py lists ours,
# which include LMCache's redis://, rediss://, unix://, valkey://, redis-cluster:// and redis-sentinel://):
# resp is Redis under another name.
REMOTE_SCHEMES: dict[str, str] = {
    "resp": MAPPED,
    "lm": "LMCache's own cache server (lmcache server); run redis-server and use redis://host:port",
    "plugin": "LMCache's remote storage plugins",
}
REMOTE_SCHEME_DEFAULT = "LMCache's {scheme}:// connector; lmcache-vllm's remote tier is Redis " \
                        "(redis://, rediss://, unix://, redis-cluster://, redis-sentinel://, valkey://) or a " \
                        "Mooncake Store (mooncakestore://)"
# Environment variables (without the LMCACHE_ prefix) that LMCache's Redis Sentinel connector reads.
SENTINEL_ENV_VARS = {
    "REDIS_SERVICE_NAME": "taken: the Sentinel master name of a redis-sentinel:// remote_url without "
                          "/master_name (default 'redismaster', with a warning, as in LMCache)",
    "REDIS_TIMEOUT": "ignored, with a warning when remote_url is a Sentinel one: LMCache's Sentinel "
                     "timeout; ours is extra_config.remote_timeout_secs",
}
# remote_serde values of LMCache that are not ours ("naive" and "fp8" are: config/schema.py): "torch" (v0)
# stored the raw tensors, as "naive" does; the others are GPU quantizers.
_OURS = "use remote_serde: lossless (exact, 1.47x fewer bytes on bf16 KV) or fp8 (scaled e4m3, 1.97x, lossy)"
REMOTE_SERDE: dict[str, str] = {
    "torch": MAPPED,
    "cachegen": f"CacheGen (LMCache's GPU-only KV quantizer and arithmetic coder); {_OURS}",
    "kivi": f"KIVI quantization of stored KV (GPU-only in LMCache); {_OURS}",
    "asym_k16_v8": f"LMCache's K in 16 bits and V in fp8 (1.33x); {_OURS}: lossless beats it without a loss",
}
# pre_caching_hash_algorithm: LMCache names vLLM's hash functions; ours hash int64 token bytes.
HASH_NAMES = {"builtin": "xxh3_128", "xxhash": "xxh3_128", "xxhash_cbor": "xxh3_128",
              "sha256_cbor": "sha256", "sha256_cbor_64bit": "sha256"}
CACHE_POLICIES = {"LFU": "LFU", "FIFO": "FIFO", "MRU": "MRU"}  # LMCache's others; ours: LRU

# LMCache's own LMCACHE_* environment variables that are not configuration keys.
LMCACHE_ENV_VARS = {
    "LMCACHE_LOG_LEVEL": "LMCache's log level; lmcache-vllm logs through vLLM's logging",
    "LMCACHE_TRACK_USAGE": "LMCache's usage telemetry; lmcache-vllm sends none",
    "LMCACHE_USAGE_TRACK_URL": "LMCache's usage telemetry; lmcache-vllm sends none",
    "LMCACHE_USAGE_TRACK_INTERVAL": "LMCache's usage telemetry; lmcache-vllm sends none",
    "LMCACHE_DISABLE_BANNER": "LMCache's start-up banner",
    "LMCACHE_CONTROLLER_CONFIG_FILE": "LMCache's cache controller (not supported)",
    "LMCACHE_RESP_USERNAME": "LMCache's resp:// credentials; put them into remote_url",
    "LMCACHE_RESP_PASSWORD": "LMCache's resp:// credentials; put them into remote_url",
    "LMCACHE_RESP_HOST": "LMCache's resp:// host; put it into remote_url",
    "LMCACHE_RESP_PORT": "LMCache's resp:// port; put it into remote_url",
    "LMCACHE_PLUGIN_CONFIG": "LMCache's plugins (not supported)",
    "LMCACHE_RUNTIME_PLUGIN_CONFIG": "LMCache's runtime plugins (not supported)",
}
LMCACHE_ENV_PREFIXES = {"LMCACHE_EC_": "LMCache's encoder-cache overrides",
                        "LMCACHE_COORDINATOR_": "LMCache's multi-process coordinator",
                        "LMCACHE_AEROSPIKE_": "LMCache's Aerospike connector"}
