"""Tests for lmcache_vllm.config: every source, their order, typed parsing and every error."""

import pytest

from lmcache_vllm import config as config_mod
from lmcache_vllm import tokens
from lmcache_vllm.config import ConfigError, LMCacheConfig, load_config


def write_yaml(tmp_path, text):
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return {"LMCACHE_CONFIG_FILE": str(path)}


def test_defaults():
    cfg = load_config(environ={})
    assert cfg == LMCacheConfig()
    assert cfg.chunk_size == 256 and cfg.local_cpu and cfg.local_disk is None and cfg.remote_url is None
    assert cfg.max_local_cpu_bytes == 5 * (1 << 30) and cfg.max_local_disk_bytes == 0
    assert cfg.pre_caching_hash_algorithm == tokens.DEFAULT_HASH_ALGORITHM
    assert cfg.extra_config == {} and cfg.get_extra("x", 3) == 3
    assert set(config_mod.SUPPORTED_HASH_ALGORITHMS) == set(tokens.SUPPORTED_HASH_ALGORITHMS)


def test_source_order_yaml_env_overrides(tmp_path):
    env = write_yaml(tmp_path, "chunk_size: 64\nmax_local_cpu_size: 1\nsave_unfull_chunk: true\n"
                               "local_disk: file:///tmp/l2\nmax_local_disk_size: 2.5\n"
                               "extra_config: {a: 1}\n")
    cfg = load_config(environ=env)
    assert (cfg.chunk_size, cfg.max_local_cpu_size, cfg.save_unfull_chunk) == (64, 1.0, True)
    assert cfg.local_disk == "/tmp/l2" and cfg.max_local_disk_bytes == int(2.5 * (1 << 30))
    assert cfg.extra_config == {"a": 1}
    env.update(LMCACHE_CHUNK_SIZE="128", LMCACHE_SAVE_UNFULL_CHUNK="false",
               LMCACHE_EXTRA_CONFIG='{"b": [1, 2]}', LMCACHE_MAX_LOCAL_CPU_SIZE="0.5")
    cfg = load_config(environ=env)
    assert (cfg.chunk_size, cfg.save_unfull_chunk, cfg.max_local_cpu_size) == (128, False, 0.5)
    assert cfg.extra_config == {"b": [1, 2]}  # the env value replaces the file's dict
    cfg = load_config({"chunk_size": 32, "remote_url": "redis://127.0.0.1:6379/0"}, environ=env)
    assert cfg.chunk_size == 32 and cfg.remote_url == "redis://127.0.0.1:6379/0"
    assert cfg.local_disk == "/tmp/l2"  # untouched keys keep earlier sources


def test_config_file_from_real_environment(tmp_path, monkeypatch):
    env = write_yaml(tmp_path, "chunk_size: 512\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", env["LMCACHE_CONFIG_FILE"])
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "1")
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "DEBUG")  # someone else's LMCACHE_ variable: ignored
    cfg = load_config()
    assert cfg.chunk_size == 512 and cfg.use_layerwise is True


@pytest.mark.parametrize("text,expected", [("true", True), ("1", True), ("YES", True), ("on", True),
                                           ("false", False), ("0", False), ("No", False),
                                           ("'true'", True)])
def test_env_bool_parsing(text, expected):
    assert load_config(environ={"LMCACHE_SAVE_DECODE_CACHE": text}).save_decode_cache is expected


def test_env_typed_values():
    cfg = load_config(environ={"LMCACHE_BLOCKING_TIMEOUT_SECS": "2.5", "LMCACHE_LOOKUP_TIMEOUT_MS": "50",
                               "LMCACHE_REMOTE_URL": "unix:///run/redis.sock",
                               "LMCACHE_LOCAL_DISK": "", "LMCACHE_CACHE_POLICY": "lru",
                               "LMCACHE_PRE_CACHING_HASH_ALGORITHM": "sha256"})
    assert cfg.blocking_timeout_secs == 2.5 and cfg.lookup_timeout_ms == 50
    assert cfg.remote_url == "unix:///run/redis.sock" and cfg.local_disk is None
    assert cfg.cache_policy == "LRU" and cfg.pre_caching_hash_algorithm == "sha256"
    assert load_config(environ={"LMCACHE_REMOTE_URL": "none"}).remote_url is None


@pytest.mark.parametrize("env,fragment", [
    ({"LMCACHE_CHUNK_SIZE": "abc"}, "LMCACHE_CHUNK_SIZE='abc' (environment): cannot parse as int"),
    ({"LMCACHE_LOCAL_CPU": "maybe"}, "cannot parse as bool"),
    ({"LMCACHE_EXTRA_CONFIG": "[1]"}, "expected a JSON object"),
    ({"LMCACHE_EXTRA_CONFIG": "{bad"}, "cannot parse as dict"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "x"}, "cannot parse as float"),
])
def test_env_parse_errors(env, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(environ=env)
    assert fragment in str(info.value)


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match="unknown configuration key 'chunk_sise'.*did you mean 'chunk_size'"):
        load_config({"chunk_sise": 3}, environ={})
    env = write_yaml(tmp_path, "max_local_cpu_sz: 1\n")
    with pytest.raises(ConfigError, match="'max_local_cpu_sz'.*file .*did you mean 'max_local_cpu_size'"):
        load_config(environ=env)
    with pytest.raises(ConfigError, match="valid keys: chunk_size"):
        load_config({"zzzzzzzz": 1}, environ={})


@pytest.mark.parametrize("overrides,fragment", [
    ({"chunk_size": 0}, "chunk_size=0: expected an int > 0"),
    ({"chunk_size": 1.5}, "chunk_size=1.5"),
    ({"chunk_size": True}, "chunk_size=True"),
    ({"max_local_cpu_size": -1}, "max_local_cpu_size=-1.0: expected a size in GiB >= 0"),
    ({"max_local_cpu_size": 0}, "a size > 0 while local_cpu is true"),
    ({"max_local_disk_size": float("nan")}, "max_local_disk_size=nan"),
    ({"local_disk": "/tmp/x"}, "max_local_disk_size=0.0: expected a size > 0 when local_disk is set"),
    ({"local_disk": "file://host/x", "max_local_disk_size": 1}, "no host part"),
    ({"local_disk": "/a,/b", "max_local_disk_size": 1}, "several local_disk paths"),
    ({"local_disk": 5, "max_local_disk_size": 1}, "local_disk=5"),
    ({"remote_url": "lm://localhost:65000"}, "remote_url='lm://localhost:65000': expected a URL with scheme redis/rediss/unix"),
    ({"remote_url": "redis://:6379"}, "redis://HOST"),
    ({"remote_url": "unix://"}, "unix:///path"),
    ({"remote_serde": "cachegen"}, "remote_serde='cachegen': expected one of naive"),
    ({"cache_policy": "LFU"}, "cache_policy='LFU': expected one of LRU"),
    ({"blocking_timeout_secs": 0}, "blocking_timeout_secs=0"),
    ({"lookup_timeout_ms": -5}, "lookup_timeout_ms=-5"),
    ({"pre_caching_hash_algorithm": "builtin"}, "'builtin' depends on PYTHONHASHSEED"),
    ({"extra_config": [1]}, "extra_config=[1]: expected a mapping"),
    ({"use_layerwise": "sometimes"}, "cannot parse as bool"),
    ({"local_cpu": 1}, "local_cpu=1: expected a bool"),
])
def test_value_errors_name_key_value_and_accepted(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ={})
    assert fragment in str(info.value)


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="chunk_size"):
        LMCacheConfig(chunk_size=-1)
    cfg = LMCacheConfig(local_disk="file:///var/cache/l2/", max_local_disk_size=1, remote_serde=None)
    assert cfg.local_disk == "/var/cache/l2" and cfg.remote_serde == "naive"


@pytest.mark.parametrize("key,value", [("enable_p2p", True), ("enable_blending", "true"),
                                       ("gds_path", "/mnt/gds"), ("nixl_buffer_size", 1024),
                                       ("enable_controller", True), ("enable_pd", True),
                                       ("local_disk_path_sharding", "by_rank")])
def test_unsupported_lmcache_keys(key, value):
    with pytest.raises(ConfigError, match=f"LMCache's '{key}' is not supported by lmcache-vllm"):
        load_config({key: value}, environ={})


def test_unsupported_keys_at_lmcache_default_are_accepted(tmp_path):
    # A YAML written for LMCache that leaves its other features off loads unchanged.
    env = write_yaml(tmp_path, "chunk_size: 256\nenable_p2p: false\nenable_blending: False\n"
                               "gds_path: null\nmp_port: 5555\n")
    env["LMCACHE_ENABLE_CONTROLLER"] = "false"
    cfg = load_config(environ=env)
    assert cfg.chunk_size == 256 and not hasattr(cfg, "enable_p2p")
    with pytest.raises(ConfigError, match="LMCACHE_ENABLE_P2P='1'|LMCACHE_ENABLE_P2P=True"):
        load_config(environ={"LMCACHE_ENABLE_P2P": "1"})


@pytest.mark.parametrize("text,fragment", [("chunk_size: [1\n", "not valid YAML"),
                                           ("- a\n- b\n", "must hold a mapping")])
def test_bad_yaml_files(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(environ=write_yaml(tmp_path, text))


def test_missing_or_empty_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read LMCACHE_CONFIG_FILE"):
        load_config(environ={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    assert load_config(environ=write_yaml(tmp_path, "")) == LMCacheConfig()


def test_to_dict_round_trips():
    cfg = load_config({"chunk_size": 16, "extra_config": {"k": "v"}}, environ={})
    assert load_config(cfg.to_dict(), environ={}) == cfg
