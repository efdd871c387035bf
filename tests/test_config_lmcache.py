"""LMCache users' configuration in lmcache_vllm.config: every LMCache key is classified; real LMCache YAML
files (tests/data/lmcache_configs, SOURCES.tsv says where each comes from) load, or are refused for
exactly the features we lack; no-op and mapped keys; LMCACHE_* environment variables; the generated
key tables of docs/CONFIG.md."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_vllm.config import ExtraConfig, LMCacheConfig, inspect_config, load_config
from lmcache_vllm.config import doc as config_doc
from lmcache_vllm.config.fields import did_you_mean
from lmcache_vllm.config.lmcache import (
    LMCACHE_ENV_PREFIXES,
    LMCACHE_ENV_VARS,
    LMCACHE_EXTRA_KEYS,
    LMCACHE_KEYS,
    UNSUPPORTED,
)
from lmcache_vllm.config.sources import OWN_ENV_VARS

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "lmcache_configs"

# Every key of LMCache 0.5.6's lmcache/v1/config.py (its aliases, deprecated keys and definitions)
LMCACHE_056_KEYS = """
enable_xpyd nixl_peer_host nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host nixl_proxy_port
nixl_buffer_size nixl_role controller_url lmcache_worker_port plugin_locations external_backends
nixl_peer_port chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size
local_disk local_disk_path_sharding max_local_disk_size remote_url remote_serde use_layerwise
save_decode_cache pre_caching_hash_algorithm enable_blending blend_recompute_ratios blend_thresholds
blend_check_layers blend_min_tokens blend_special_str retrieve_locations store_location enable_p2p
p2p_host p2p_init_ports p2p_lookup_ports mp_host mp_port enable_controller lmcache_instance_id
controller_pull_url controller_reply_url lmcache_worker_ports lmcache_worker_ids
lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time enable_pd pd_role pd_buffer_size
pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port pd_peer_query_port pd_proxy_host
pd_proxy_port pd_allocation_timeout_sec pd_shutdown_timeout_sec pd_condition_poll_interval_sec
pd_max_prefill_len pd_backend_mode pd_skip_proxy_notification pd_bidirectional transfer_channel
nixl_backends nixl_buffer_device gds_path gds_path_sharding gds_buffer_size maru_path maru_pool_size
use_gds gds_backend audit_actual_remote_url internal_api_server_host extra_config save_unfull_chunk
blocking_timeout_secs external_lookup_client py_enable_gc cache_policy numa_mode enable_async_loading
internal_api_server_enabled internal_api_server_port_start priority_limit
internal_api_server_include_index_list internal_api_server_socket_path_prefix runtime_plugin_locations
storage_plugins remote_storage_plugins lookup_timeout_ms min_retrieve_tokens hit_miss_ratio
lookup_server_worker_ids enable_scheduler_bypass_lookup script_allowed_imports run_script_api_enabled
enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio
lazy_memory_step_ratio lazy_memory_safe_size enable_chunk_statistics
chunk_statistics_auto_start_statistics chunk_statistics_auto_exit_timeout_hours
chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_strategy enable_kv_events
use_gpu_connector_v3 pin_timeout_sec pin_check_interval_sec remote_config_url app_id
enable_hidden_state_cache max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode
""".split()

# The keys named in the error per shared file; an empty set: the file loads. A change here is a change of
# what LMCache users can run: say why in the commit.
LMCACHE_BUILDKITE = {"LMCache__.buildkite__configs__lmcache_config": set(),
                     "LMCache__.buildkite__lmcache_configs__local_cpu": set(),
                     "LMCache__.buildkite__lmcache_configs__local_disk": set()}
REFUSED = {
    **LMCACHE_BUILDKITE,
    "LMCache__benchmarks__sglang-integration__config": set(),
    "LMCache__examples__blend_kv_v1__blending": {"enable_blending"},
    "LMCache__examples__cache_by_tags__example": {"extra_config.tag_keys"},
    "LMCache__examples__cache_controller__compress__instance1": {"enable_controller"},
    "LMCache__examples__cache_controller__example": {"enable_controller"},
    "LMCache__examples__cache_controller__pin__example": {"enable_controller"},
    "LMCache__examples__caching_switch__example": set(),
    "LMCache__examples__disagg_prefill__1p1d__configs__lmcache-decoder-config": {"enable_nixl"},
    "LMCache__examples__disagg_prefill__1p1d__configs__lmcache-prefiller-config": {"enable_pd"},
    "LMCache__examples__disagg_prefill__xpyd__configs__lmcache-decoder-1-pd-with-remote-config": {
        "enable_pd", "remote_serde", "remote_url", "retrieve_locations", "store_location"},
    "LMCache__examples__disagg_prefill__xpyd_experimental__configs__lmcache-prefiller-config": {
        "enable_nixl", "enable_xpyd"},
    "LMCache__examples__disk_backend__keymanager": set(),
    "LMCache__examples__disk_offline_inference__example": set(),
    "LMCache__examples__docker__example": {"remote_serde", "remote_url"},
    "LMCache__examples__example": {"remote_url"},
    "LMCache__examples__experimental__storage_backends__mooncakestore__backend_type": set(),  # our Mooncake tier
    "LMCache__examples__kv_cache_reuse__remote_backends__benchmark__example": {"remote_url"},
    "LMCache__examples__kv_cache_reuse__remote_backends__external__backend_type": {
        "remote_url", "extra_config.adt_kv_secret", "extra_config.adt_kv_connections",
        "extra_config.adt_kv_workers"},
    "LMCache__examples__kv_cache_reuse__remote_backends__resp__resp": set(),
    "LMCache__examples__kv_cache_reuse__remote_backends__s3__example": {"remote_url"},
    "LMCache__examples__kv_cache_reuse__remote_backends__tigris__example": {"remote_url"},
    "LMCache__examples__kv_cache_reuse__share_across_instances__centralized_sharing__example": {
        "remote_serde", "remote_url"},
    # its P2P keys load (p2p_host, p2p_init_ports); the controller is refused, and enable_p2p needs a directory
    "LMCache__examples__kv_cache_reuse__share_across_instances__p2p_sharing__example1": {
        "enable_controller", "enable_p2p"},
    "LMCache__examples__lmc_connector__example": set(),
    "LMCache__examples__lmcache_config_azure": {"backend_config", "cache_config", "logging"},
    "LMCache__examples__offline_inference__example": {"remote_serde", "remote_url"},
    # enable_p2p is ours but needs a directory (no remote_url here); LMCache 0.2's P2P servers are ignored
    "LMCache__examples__p2p__example1": {"enable_p2p"},
    "LMCache__examples__sample_integration__example_default": set(),  # cachegen, but no remote_url
    "LMCache__examples__save_decode_cache__example": {"remote_serde", "remote_url"},
    "LMCache__examples__sgl_integration__lmcache_config": set(),
    "LMCache__examples__sglang_interface__config": set(),
    "vllm__examples__others__lmcache__disagg_prefill_lmcache_v1__configs__lmcache-decoder-config": {
        "enable_pd"},
    "vllm__examples__others__lmcache__disagg_prefill_lmcache_v1__configs__lmcache-prefiller-config": {
        "enable_pd"},
    "vllm__examples__others__lmcache__hpu__configs__lmcache-config-lm": {"remote_url"},
    "vllm__examples__others__lmcache__hpu__configs__lmcache-config-redis": set(),
}


def inspect(overrides=None, environ=None, **env):
    return inspect_config(overrides, environ={**(environ or {}), **env})


def test_every_lmcache_056_key_is_ours_or_in_the_table():
    ours = {f.name for f in dataclasses.fields(LMCacheConfig)}
    assert len(LMCACHE_056_KEYS) == 120
    assert [k for k in LMCACHE_056_KEYS if k not in ours and k not in LMCACHE_KEYS] == []
    assert not ours & set(LMCACHE_KEYS)
    assert not {f.name for f in dataclasses.fields(ExtraConfig)} & set(LMCACHE_EXTRA_KEYS)


def test_every_shared_file_is_in_the_table():
    assert sorted(p.stem for p in DATA.glob("*.yaml")) == sorted(REFUSED)
    listed = {line.split("\t")[0] for line in (DATA / "SOURCES.tsv").read_text().splitlines()[1:]}
    assert listed == {f"{name}.yaml" for name in REFUSED}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_lmcache_file_loads_or_names_exactly_the_features_we_lack(name):
    report = inspect(LMCACHE_CONFIG_FILE=str(DATA / f"{name}.yaml"))
    assert {p.key for p in report.problems} == REFUSED[name]
    assert (report.config is None) == bool(REFUSED[name])
    for problem in report.problems:  # never refused for a key that is a no-op or has another name here
        rule = LMCACHE_KEYS.get(problem.key) or LMCACHE_EXTRA_KEYS.get(problem.key.split(".", 1)[-1])
        assert rule is None or rule.status == UNSUPPORTED, problem
        assert problem.origin is not None and f"{name}.yaml, line " in str(problem.origin)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_our_example_configs_load_without_warnings(path):
    report = inspect(LMCACHE_CONFIG_FILE=str(path))
    assert report.problems == [] and report.warnings == []


def test_obsolete_keys_load_with_one_warning_each(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("chunk_size: 256\nlocal_device: cpu\nuse_experimental: true\npipelined_backend: false\n"
                    "lmcache_instance_id: pod-7\npy_enable_gc: false\nnuma_mode: auto\n")
    report = inspect(LMCACHE_CONFIG_FILE=str(path))
    assert report.problems == [] and report.config == LMCacheConfig(chunk_size=256)
    assert [w.split(" ")[0] for w in report.warnings] == ["local_device", "use_experimental",
                                                          "pipelined_backend", "lmcache_instance_id",
                                                          "py_enable_gc", "numa_mode"]
    assert all(": ignored: " in w for w in report.warnings)
    assert f"local_device (file {path}, line 2): ignored: LMCache v0's local device" in report.warnings[0]


def test_did_you_mean_never_crosses_meanings():
    assert did_you_mean("local_devic", "cpu", {"local_device": str, "local_disk": str}) == "local_device"
    assert did_you_mean("local_device", "cpu", {"local_disk": str}) is None
    assert did_you_mean("use_experimental", True, {"use_layerwise": bool}) is None
    assert did_you_mean("lookup_url", "localhost:8100", {"lookup_timeout_ms": int}) is None
    assert did_you_mean("chunk_sizes", 256, {"chunk_size": int}) == "chunk_size"
    assert did_you_mean("chunk_sizes", "big", {"chunk_size": int}) is None  # a typo keeps the type
    assert did_you_mean("max_local_cpu", 5, {"max_local_cpu_size": float}) is None  # 5 edits
    # the loader's own hints: an obsolete key is known (a no-op), never "corrected" into another one
    assert "did you mean" not in "".join(inspect({"local_device": "cpu", "use_experimental": True}).warnings)


def test_mapped_keys_and_values(tmp_path):
    path = tmp_path / "guide.yaml"
    path.write_text("local_disk: true\nlocal_disk_path: /var/lib/lmcache\nmax_local_disk_size: 2\n"
                    "pin_timeout_sec: 5\nremote_serde: torch\npre_caching_hash_algorithm: sha256_cbor_64bit\n"
                    "extra_config: {use_odirect: false}\n")
    report = inspect(LMCACHE_CONFIG_FILE=str(path))
    cfg = report.config
    assert report.problems == [] and cfg.local_disk == "/var/lib/lmcache" and cfg.max_local_disk_size == 2.0
    assert cfg.extra_config.prefetch_hold_secs == 5.0 and cfg.remote_serde == "naive"
    assert cfg.pre_caching_hash_algorithm == "sha256" and cfg.extra_config.disk_direct_io is False
    assert any("extra_config.use_odirect" in w and "taken as extra_config.disk_direct_io" in w
               for w in report.warnings)
    # llm-d's extra_config in code: O_DIRECT off on NFS
    llm_d = load_config({"extra_config": {"use_odirect": False}}, environ={})
    assert llm_d.extra_config.disk_direct_io is False
    error_keys = {p.key for p in inspect({"local_disk": True}).problems}
    assert error_keys == {"local_disk"}
    assert load_config({"local_disk_path": "/x", "max_local_disk_size": 1}, environ={}).local_disk == "/x"


def test_resp_url_is_redis_with_lmcache_credentials():
    cfg = load_config({"remote_url": "resp://cache.internal:6380",
                       "extra_config": {"username": "svc", "password": "p@ss:w/rd", "resp_num_threads": 4}},
                      environ={})
    assert cfg.remote_url == "redis://svc:p%40ss%3Aw%2Frd@cache.internal:6380"
    assert cfg.extra_config.remote_max_connections == 4
    assert "p%40ss" not in cfg.summary()
    report = inspect({"remote_url": "redis://h:1", "extra_config": {"password": "x"}})
    assert report.config.remote_url == "redis://h:1"
    assert any("only LMCache's resp://" in w for w in report.warnings)


def test_kv_connector_extra_config_takes_lmcache_prefixed_keys():
    report = inspect({"lmcache.chunk_size": 64, "lmcache.local_cpu": "false", "use_native": True,
                      "lmcache.max_local_cpu_size": 0, "lmcache.extra_config": {"async_save": "no"}})
    assert report.problems == [] and report.config.chunk_size == 64 and not report.config.local_cpu
    assert report.config.extra_config.async_save is False and any("use_native" in w for w in report.warnings)


def test_feature_settings_are_named_under_their_switch_or_ignored_while_it_is_off():
    report = inspect({"pd_role": "sender", "transfer_channel": "nixl", "extra_config": {"s3_region": "x"}})
    assert report.problems == [] and len(report.warnings) == 3
    assert "pd_role (kv_connector_extra_config): ignored while enable_pd / enable_xpyd / enable_nixl is " \
           "off (by LMCache too)" in report.warnings
    assert "extra_config.s3_region (kv_connector_extra_config): ignored: a setting of LMCache's S3 " \
           "connector, which lmcache-vllm does not have" in report.warnings
    report = inspect({"pd_role": "sender", "enable_pd": "true", "transfer_channel": "nixl"})
    assert [p.key for p in report.problems] == ["enable_pd"]
    assert "its settings here: pd_role" in str(report.problems[0])  # transfer_channel: a no-op (TCP here)
    # LMCache's defaults written out are accepted silently
    assert inspect({"enable_pd": False, "pd_backend_mode": "async", "use_gds": True}).warnings == []


def test_environment_variables(tmp_path):
    env = {"LMCACHE_CHUNK_SIZE": "64", "LMCACHE_NIXL_PEER_PORT": "7000", "LMCACHE_LOG_LEVEL": "DEBUG",
           "LMCACHE_VLLM_OPS": "torch", "LMCACHE_CHUNK_SIZ": "32", "LMCACHE_ASYNC_SAVE": "false",
           "LMCACHE_LMCACHE_INSTANCE_ID": "pod-1", "LMCACHE_SOMETHING": "1"}
    report = inspect(environ=env)
    assert report.problems == [] and report.config.chunk_size == 64
    text = "\n".join(report.warnings)
    assert "LMCACHE_VLLM_OPS" not in text  # ours, declared in config.sources.OWN_ENV_VARS
    assert "nixl_peer_port (environment LMCACHE_NIXL_PEER_PORT): ignored while enable_pd" in text
    assert "LMCACHE_LOG_LEVEL (environment): ignored: LMCache's log level" in text
    assert "LMCACHE_CHUNK_SIZ (environment): ignored: not a configuration key of lmcache-vllm or LMCache; " \
           "did you mean LMCACHE_CHUNK_SIZE?" in text
    assert "LMCACHE_ASYNC_SAVE (environment): ignored: not a configuration key of lmcache-vllm or LMCache; " \
           "extra_config.async_save is set with LMCACHE_EXTRA_CONFIG" in text
    assert "lmcache_instance_id (environment LMCACHE_LMCACHE_INSTANCE_ID): ignored" in text
    assert "LMCACHE_SOMETHING (environment): ignored" in text
    strict = inspect(environ={**env, "LMCACHE_EXTRA_CONFIG": '{"strict_env": true}'})
    assert {p.key for p in strict.problems} == {"LMCACHE_CHUNK_SIZ", "LMCACHE_ASYNC_SAVE",
                                                "LMCACHE_SOMETHING"}
    assert "LMCACHE_SOMETHING='1' (environment LMCACHE_SOMETHING): not a configuration key" in \
           str(strict.problems[-1])


def test_every_lmcache_name_in_the_repository_is_declared():
    keys = {f.name for f in dataclasses.fields(LMCacheConfig)} | set(LMCACHE_KEYS)
    names = set()
    for path in ROOT.glob("**/*"):
        # Virtual environments (.venv, the LMCache peer's .venv-lmcache) and the downloaded vLLM sources (.cache)
        # hold other projects' names.
        if (path.suffix in (".py", ".sh", ".md", ".yaml") or path.name == "Makefile") \
                and not any(part.startswith(".venv") or part in ("data", ".cache") for part in path.parts) \
                and not path.name.startswith("test_config"):
            names |= set(re.findall(r"\bLMCACHE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    python_names = {"LMCACHE_KEYS", "LMCACHE_EXTRA_KEYS", "LMCACHE_EXTRA_PREFIXES", "LMCACHE_ENV_VARS",
                    "LMCACHE_ENV_PREFIXES", "LMCACHE_BUILDKITE", "LMCACHE_056_KEYS"}
    declared = set(OWN_ENV_VARS) | set(LMCACHE_ENV_VARS) | {f"LMCACHE_{k.upper()}" for k in keys}
    undeclared = {n for n in names - python_names - declared if not n.startswith(tuple(LMCACHE_ENV_PREFIXES))}
    assert undeclared == set()


def test_config_doc_carries_the_generated_tables():
    section = config_doc.generated_section((ROOT / "docs" / "CONFIG.md").read_text())
    assert section == config_doc.markdown(), "run: python -m lmcache_vllm.config.doc --update-docs"
    for name in list(LMCACHE_KEYS) + [f.name for f in dataclasses.fields(ExtraConfig)]:
        assert f"`{name}`" in section or f"`extra_config.{name}`" in section


def test_check_command_over_files():
    ok = DATA / "LMCache__examples__kv_cache_reuse__remote_backends__resp__resp.yaml"
    refused = DATA / "LMCache__examples__example.yaml"
    run = subprocess.run([sys.executable, "-m", "lmcache_vllm.config.doc", "--check", str(ok), str(refused)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 1
    assert f"{ok}: loads" in run.stdout and f"{refused}: refused" in run.stdout
    assert "error: remote_url='lm://localhost:65432'" in run.stdout


@pytest.mark.parametrize("value,expected", [("naive", "naive"), ("fp8", "fp8"), ("lossless", "lossless"),
                                            ("torch", "naive"), ("FP8", "fp8")])
def test_remote_serde_takes_lmcache_values_that_we_implement(value, expected):
    report = inspect(LMCACHE_REMOTE_SERDE=value, LMCACHE_REMOTE_URL="redis://127.0.0.1:6379")
    assert not report.problems and report.config.remote_serde == expected


@pytest.mark.parametrize("value", ["cachegen", "kivi", "asym_k16_v8"])
def test_gpu_serdes_are_refused_naming_what_to_use_instead(value):
    report = inspect({"remote_serde": value, "remote_url": "redis://127.0.0.1:6379"})
    (problem,) = report.problems
    assert problem.key == "remote_serde" and "lossless" in problem.message and "fp8" in problem.message


def test_codec_keys_of_the_disk_and_the_wire_are_checked_with_every_other_problem():
    report = inspect({"extra_config": {"local_disk_serde": "zstd", "transfer_serde": "cachegen"},
                      "chunk_size": 0})
    assert {p.key for p in report.problems} == {"extra_config.local_disk_serde", "extra_config.transfer_serde",
                                                "chunk_size"}
    ok = inspect({"extra_config": {"local_disk_serde": "fp8", "transfer_serde": "lossless"}})
    assert ok.config.extra_config.local_disk_serde == "fp8" and ok.config.extra_config.transfer_serde == "lossless"


def test_the_config_names_exactly_the_codecs_storage_implements():
    from lmcache_vllm.config.extra import SERDES
    from lmcache_vllm.storage.coders import CODER_NAMES

    assert SERDES == CODER_NAMES
