"""Tests for lmcache_vllm.config: every source, their order, typed parsing, extra_config's schema, and every
problem of every source reported in one ConfigError that names key, value and origin."""

import dataclasses
import math

import pytest

from lmcache_vllm import tokens
from lmcache_vllm.config import HASH_ALGORITHMS, ConfigError, ExtraConfig, LMCacheConfig, load_config
from lmcache_vllm.config import loader as config_mod
from lmcache_vllm.memory import prefault


def write_yaml(tmp_path, text, name="lmcache.yaml"):
    path = tmp_path / name
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return {"LMCACHE_CONFIG_FILE": str(path)}


def problems_of(overrides=None, environ=None):
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ=environ or {})
    return info.value


def test_defaults():
    cfg = load_config(environ={})
    assert cfg == LMCacheConfig()
    # chunk_size: not set, so the connector takes vLLM's block size (integration/vllm/chunk_size.py)
    assert cfg.chunk_size is None and cfg.local_cpu and cfg.local_disk is None and cfg.remote_url is None
    with pytest.raises(ValueError, match="not set"):
        _ = cfg.resolved_chunk_size
    assert load_config({"chunk_size": 256}, environ={}).resolved_chunk_size == 256  # LMCache's default, if set
    assert load_config({"chunk_size": None}, environ={}).chunk_size is None
    assert cfg.max_local_cpu_bytes == 5 * (1 << 30) and cfg.max_local_disk_bytes == 0
    assert cfg.pre_caching_hash_algorithm == tokens.DEFAULT_HASH_ALGORITHM
    assert cfg.extra_config == ExtraConfig() and cfg.extra_config.async_save is True
    assert cfg.extra_config.write_queue_depth == 64 and cfg.extra_config.prefault_local_cpu == "off"
    assert set(HASH_ALGORITHMS) == set(tokens.SUPPORTED_HASH_ALGORITHMS)
    prefault_field = {f.name: f for f in dataclasses.fields(ExtraConfig)}["prefault_local_cpu"]
    assert set(prefault_field.metadata["choices"]) == set(prefault.MODES)


def test_source_order_yaml_env_overrides(tmp_path):
    env = write_yaml(tmp_path, "chunk_size: 64\nmax_local_cpu_size: 1\nsave_unfull_chunk: true\n"
                               "local_disk: file:///tmp/l2\nmax_local_disk_size: 2.5\n"
                               "extra_config: {disk_fsync: true, write_workers: 2}\n")
    cfg = load_config(environ=env)
    assert (cfg.chunk_size, cfg.max_local_cpu_size, cfg.save_unfull_chunk) == (64, 1.0, True)
    assert cfg.local_disk == "/tmp/l2" and cfg.max_local_disk_bytes == int(2.5 * (1 << 30))
    assert cfg.extra_config.disk_fsync is True and cfg.extra_config.write_workers == 2
    env.update(LMCACHE_CHUNK_SIZE="128", LMCACHE_SAVE_UNFULL_CHUNK="false",
               LMCACHE_EXTRA_CONFIG='{"write_workers": 3}', LMCACHE_MAX_LOCAL_CPU_SIZE="0.5")
    cfg = load_config(environ=env)
    assert (cfg.chunk_size, cfg.save_unfull_chunk, cfg.max_local_cpu_size) == (128, False, 0.5)
    # extra_config merges key by key: the environment's write_workers, the file's disk_fsync
    assert cfg.extra_config.write_workers == 3 and cfg.extra_config.disk_fsync is True
    cfg = load_config({"chunk_size": 32, "remote_url": "redis://127.0.0.1:6379/0",
                       "extra_config": {"write_workers": 1}}, environ=env)
    assert cfg.chunk_size == 32 and cfg.remote_url == "redis://127.0.0.1:6379/0"
    assert cfg.extra_config.write_workers == 1 and cfg.local_disk == "/tmp/l2"


def test_config_file_from_real_environment(tmp_path, monkeypatch):
    env = write_yaml(tmp_path, "chunk_size: 512\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", env["LMCACHE_CONFIG_FILE"])
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "1")
    cfg = load_config()
    assert cfg.chunk_size == 512 and cfg.use_layerwise is True


@pytest.mark.parametrize("text,expected", [("true", True), ("1", True), ("YES", True), ("on", True),
                                           ("false", False), ("0", False), ("No", False),
                                           ("'true'", True), (" off ", False)])
def test_bool_parsing_env_and_extra_config(text, expected):
    assert load_config(environ={"LMCACHE_SAVE_DECODE_CACHE": text}).save_decode_cache is expected
    # the same words inside extra_config, from code and from the environment's JSON
    assert load_config({"extra_config": {"async_save": text.strip("' ")}},
                       environ={}).extra_config.async_save is expected
    env = {"LMCACHE_EXTRA_CONFIG": '{"async_save": "%s"}' % text.strip("' ")}
    assert load_config(environ=env).extra_config.async_save is expected


def test_extra_config_async_save_false_string_turns_async_saves_off(tmp_path):
    env = write_yaml(tmp_path, 'extra_config:\n  async_save: "false"\n  disk_direct_io: "no"\n')
    extra = load_config(environ=env).extra_config
    assert extra.async_save is False and extra.disk_direct_io is False


def test_env_typed_values():
    cfg = load_config(environ={"LMCACHE_BLOCKING_TIMEOUT_SECS": "2.5", "LMCACHE_LOOKUP_TIMEOUT_MS": "50",
                               "LMCACHE_REMOTE_URL": "unix:///run/redis.sock",
                               "LMCACHE_LOCAL_DISK": "", "LMCACHE_CACHE_POLICY": "lru",
                               "LMCACHE_PRE_CACHING_HASH_ALGORITHM": "sha256"})
    assert cfg.blocking_timeout_secs == 2.5 and cfg.lookup_timeout_ms == 50
    assert cfg.remote_url == "unix:///run/redis.sock" and cfg.local_disk is None
    assert cfg.cache_policy == "LRU" and cfg.pre_caching_hash_algorithm == "sha256"
    assert load_config(environ={"LMCACHE_REMOTE_URL": "none"}).remote_url is None


def test_string_values_are_not_stripped(tmp_path):
    env = write_yaml(tmp_path, 'extra_config:\n  remote_key_prefix: " spaced: "\n')
    assert load_config(environ=env).extra_config.remote_key_prefix == " spaced: "


@pytest.mark.parametrize("env,key,fragment", [
    ({"LMCACHE_CHUNK_SIZE": "abc"}, "chunk_size", "chunk_size='abc' (environment LMCACHE_CHUNK_SIZE): "
                                                  "expected an integer"),
    ({"LMCACHE_LOCAL_CPU": "maybe"}, "local_cpu", "expected true or false"),
    ({"LMCACHE_EXTRA_CONFIG": "[1]"}, "extra_config", "expected a mapping"),
    ({"LMCACHE_EXTRA_CONFIG": "{bad"}, "extra_config", "expected a JSON object"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "x"}, "max_local_cpu_size", "expected a number"),
])
def test_env_parse_errors(env, key, fragment):
    error = problems_of(environ=env)
    assert error.keys == {key} and fragment in str(error)


def test_unknown_key_suggests_only_a_likely_typo_of_the_same_type(tmp_path):
    error = problems_of({"chunk_sise": 3})
    assert "did you mean 'chunk_size'?" in str(error) and error.keys == {"chunk_sise"}
    env = write_yaml(tmp_path, "chunk_size: 16\nmax_local_cpu_sz: 1\n")
    error = problems_of(environ=env)
    assert f"max_local_cpu_sz=1 (file {env['LMCACHE_CONFIG_FILE']}, line 2): unknown key; did you mean " \
           "'max_local_cpu_size'?" in str(error)
    # close in spelling but a value of another type: no suggestion
    assert "did you mean" not in str(problems_of({"chunk_sise": "big"}))
    # far apart: no suggestion
    assert "unknown key: neither lmcache-vllm nor LMCache has it" in str(problems_of({"kv_cache_dir": "/x"}))
    error = problems_of({"extra_config": {"async_sav": False}})
    assert error.keys == {"extra_config.async_sav"}
    assert "did you mean 'extra_config.async_save'?" in str(error)


@pytest.mark.parametrize("overrides,key,fragment", [
    ({"chunk_size": 0}, "chunk_size", "chunk_size=0 (kv_connector_extra_config): expected an integer >= 1"),
    ({"chunk_size": 1.5}, "chunk_size", "expected an integer"),
    ({"chunk_size": True}, "chunk_size", "not a bool"),
    ({"max_local_cpu_size": -1}, "max_local_cpu_size", "expected a size in GiB from 0 to 1048576"),
    ({"max_local_cpu_size": 0}, "max_local_cpu_size", "a size > 0 while local_cpu is true"),
    ({"max_local_cpu_size": "1e300"}, "max_local_cpu_size", "expected a size in GiB"),
    ({"max_local_cpu_size": 10 ** 400}, "max_local_cpu_size", "expected a size in GiB"),
    ({"max_local_disk_size": float("nan")}, "max_local_disk_size", "max_local_disk_size=nan"),
    ({"local_disk": "/tmp/x"}, "max_local_disk_size", "a size > 0 when local_disk is set"),
    ({"local_disk": "/a,/b", "max_local_disk_size": 1}, "local_disk", "comma-separated"),
    ({"local_disk": 5, "max_local_disk_size": 1}, "local_disk", "local_disk=5"),
    ({"remote_url": "lm://localhost:65000"}, "remote_url",
     "not supported by lmcache-vllm: LMCache's own cache server (lmcache server); run redis-server"),
    ({"remote_url": "s3://bucket"}, "remote_url", "LMCache's s3:// connector"),
    ({"remote_url": "localhost:6379"}, "remote_url", "expected redis://host:port[/db] (or rediss:// with "
                                                     "TLS; valkey://, valkeys://), unix:///path/to/redis.sock, "
                                                     "redis-cluster://host:port[,host:port...] (or rediss-cluster://, "
                                                     "valkey-cluster://), redis-sentinel://host:port[,host:port...]"
                                                     "[/master_name] (or rediss-sentinel://); a user and password go "
                                                     "before the host(s) as user:password@"),
    ({"remote_url": "redis://[::1:6379"}, "remote_url", "not a valid URL: '[::1:6379' is no host[:port]"),
    ({"remote_url": "redis://h1:6379,h2:6379"}, "remote_url", "redis:// names one server; for several nodes use "
                                                              "redis-cluster://"),
    ({"remote_url": "redis-cluster://h1:7000/1"}, "remote_url", "a Redis Cluster has only database 0"),
    ({"remote_url": "redis-sentinel://h1/m/x"}, "remote_url", "the database ('x') must be a number"),
    ({"remote_url": "rediss-cluster://h1:7000,:7001"}, "remote_url", "no host given"),
    ({"remote_url": "redis://host:63799x"}, "remote_url", "not a valid URL"),
    ({"remote_url": "redis://host:70000"}, "remote_url", "not a valid URL"),
    ({"remote_url": "redis://:6379"}, "remote_url", "no host given"),
    ({"remote_url": "redis://host:6379/x"}, "remote_url", "must be a number"),
    ({"remote_url": "unix://"}, "remote_url", "unix:///path"),
    ({"remote_serde": "cachegen", "remote_url": "redis://h:6379"}, "remote_serde",
     "remote_serde='cachegen' (kv_connector_extra_config): not supported by lmcache-vllm: CacheGen"),
    ({"remote_serde": "zstd"}, "remote_serde", "expected one of 'naive'"),
    ({"cache_policy": "LFU"}, "cache_policy", "L1 evicts the least recently used chunk (LRU), not LFU"),
    ({"cache_policy": "random"}, "cache_policy", "expected one of 'LRU'"),
    ({"cache_policy": "LIP"}, "cache_policy", "LIP drops newly stored chunks first: set local_disk or remote_url"),
    ({"blocking_timeout_secs": 0}, "blocking_timeout_secs", "blocking_timeout_secs=0"),
    ({"blocking_timeout_secs": math.inf}, "blocking_timeout_secs", "expected seconds > 0"),
    ({"lookup_timeout_ms": -5}, "lookup_timeout_ms", "lookup_timeout_ms=-5"),
    ({"pre_caching_hash_algorithm": "md5"}, "pre_caching_hash_algorithm", "expected one of 'xxh3_128'"),
    ({"extra_config": [1]}, "extra_config",
     "extra_config=[1] (kv_connector_extra_config): expected a mapping"),
    ({"use_layerwise": "sometimes"}, "use_layerwise", "expected true or false"),
    ({"extra_config": {"write_queue_depth": 0}}, "extra_config.write_queue_depth",
     "expected an integer >= 1"),
    ({"extra_config": {"prefault_local_cpu": "yes"}}, "extra_config.prefault_local_cpu",
     "extra_config.prefault_local_cpu='yes' (kv_connector_extra_config): expected one of 'off', "
     "'background', 'sync', False (= 'off'), True (= 'background')"),
    ({"extra_config": {"remote_ttl_secs": -1}}, "extra_config.remote_ttl_secs", "expected seconds > 0"),
])
def test_value_errors_name_key_value_origin_and_accepted(overrides, key, fragment):
    error = problems_of(overrides)
    assert error.keys == {key} and fragment in str(error)


def test_crash_cases_are_config_errors_naming_key_and_file(tmp_path):
    env = write_yaml(tmp_path, "remote_url: 'redis://[::1:6379'\nmax_local_cpu_size: 1e300\n")
    error = problems_of(environ=env)
    path = env["LMCACHE_CONFIG_FILE"]
    assert error.keys == {"remote_url", "max_local_cpu_size"}
    assert f"remote_url='redis://[::1:6379' (file {path}, line 1)" in str(error)
    assert f"max_local_cpu_size=1e+300 (file {path}, line 2)" in str(error)
    error = problems_of(environ=write_yaml(tmp_path, b"chunk_size: 256\n# caf\xe9\n", "latin1.yaml"))
    assert error.keys == {"LMCACHE_CONFIG_FILE"} and "line 2" in str(error) and "not UTF-8" in str(error)


def test_every_problem_of_every_source_in_one_error(tmp_path):
    env = write_yaml(tmp_path, "chunk_size: -3\nlocal_cpu: maybe\nmax_local_cpu_size: 1\n")
    env["LMCACHE_LOOKUP_TIMEOUT_MS"] = "soon"
    error = problems_of({"extra_config": {"write_workers": 0}}, environ=env)
    assert error.keys == {"chunk_size", "local_cpu", "lookup_timeout_ms", "extra_config.write_workers"}
    text = str(error)
    assert text.startswith("4 problems in the lmcache-vllm configuration:")
    path = env["LMCACHE_CONFIG_FILE"]
    for fragment in (f"chunk_size=-3 (file {path}, line 1)", f"local_cpu='maybe' (file {path}, line 2)",
                     "lookup_timeout_ms='soon' (environment LMCACHE_LOOKUP_TIMEOUT_MS)",
                     "extra_config.write_workers=0 (kv_connector_extra_config)"):
        assert fragment in text


WEIRD_VALUES = [None, [], {}, "x", "", -1, 0, 3.5, 1e300, -math.inf, math.nan, True, {"a": [1]}, [None],
                "\x00", 10 ** 400, "1e300", "[", "{", "redis://[::1", b"bytes", 2 ** 63, "9" * 30]


def test_no_value_of_any_key_crashes():
    keys = list(config_mod.TOP_FIELDS) + list(config_mod.LMCACHE_KEYS)
    extra = list(config_mod.EXTRA_FIELDS) + list(config_mod.LMCACHE_EXTRA_KEYS)
    for value in WEIRD_VALUES:  # every outcome is a config, or problems: never an exception
        for key in keys:
            config_mod.inspect_config({key: value}, environ={})
            config_mod.inspect_config(environ={f"LMCACHE_{key.upper()}": str(value)})
        for key in extra:
            config_mod.inspect_config({"extra_config": {key: value}}, environ={})
    assert "expected an integer (at most 9223372036854775807)" in str(problems_of({"chunk_size": 10 ** 400}))


def test_lookup_read_wait_is_bounded():
    # vLLM's scheduler stands still while a lookup waits: no wait longer than a second is accepted
    for value in (-1, 1001, math.inf):
        error = problems_of({"extra_config": {"lookup_read_wait_ms": value}})
        assert "milliseconds from 0 to 1000" in str(error)
    assert load_config({"extra_config": {"lookup_read_wait_ms": 0}}, environ={}).extra_config.lookup_read_wait_ms == 0
    error = problems_of({"lookup_timeout_ms": 50, "extra_config": {"lookup_read_wait_ms": 50}})
    assert "expected less than lookup_timeout_ms (50)" in str(error)


@pytest.mark.parametrize("text,loads", [
    ("!!python/object:os.system {}\n", False), ("a: &x [*x]\n", False), ("? [1, 2]\n: 3\n", False),
    ("\tchunk_size: 1\n", False), ("---\na: 1\n---\nb: 2\n", False), ("null\n", True), ("[]\n", False),
    ("extra_config:\n  ? [1]\n  : 2\n", False), ("<<: {chunk_size: 64}\n", True),
    ("chunk_size: !!binary aGVsbG8=\n", False), ("local_disk: 2001-01-01\n", False),
    ("\ufeffchunk_size: 64\r\nlocal_cpu: true\r\n", True), ("x" * 100000 + ": 1\n", False)])
def test_no_yaml_shape_crashes(tmp_path, text, loads):
    report = config_mod.inspect_config(environ=write_yaml(tmp_path, text))
    assert (report.config is not None) == loads and all(p.origin is not None for p in report.problems)


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="chunk_size"):
        LMCacheConfig(chunk_size=-1)
    cfg = LMCacheConfig(local_disk="file:///var/cache/l2/", max_local_disk_size=1, remote_serde=None,
                        extra_config={"disk_direct_io": "false"})
    assert cfg.local_disk == "/var/cache/l2" and cfg.remote_serde == "naive"
    assert cfg.extra_config.disk_direct_io is False
    with pytest.raises(ConfigError, match=r"extra_config.write_worker=2 \(code\): unknown key; did you mean"):
        LMCacheConfig(extra_config={"write_worker": 2})


def test_relative_and_false_local_disk(tmp_path):
    cfg = load_config({"local_disk": "file://local_disk/", "max_local_disk_size": 1}, environ={})
    assert cfg.local_disk == "local_disk"  # relative to the working directory, as LMCache does
    assert load_config({"local_disk": False}, environ={}).local_disk is None
    assert load_config(environ=write_yaml(tmp_path, "local_disk: null\n")).local_disk is None


@pytest.mark.parametrize("key,value", [("enable_blending", "true"),
                                       ("gds_path", "/mnt/gds"), ("maru_path", "/dev/dax0"),
                                       ("enable_controller", True), ("enable_pd", True),
                                       ("priority_limit", 3)])
def test_unsupported_lmcache_keys(key, value):
    error = problems_of({key: value})
    assert error.keys == {key} and "not supported by lmcache-vllm" in str(error)


def test_unsupported_keys_at_lmcache_default_are_accepted(tmp_path):
    # A YAML written for LMCache that leaves its other features off loads unchanged.
    env = write_yaml(tmp_path, "chunk_size: 256\nenable_p2p: false\nenable_blending: False\n"
                               "gds_path: null\nmp_port: 5555\nblend_special_str: ' # # '\n")
    env["LMCACHE_ENABLE_CONTROLLER"] = "false"
    cfg = load_config(environ=env)
    assert cfg.chunk_size == 256 and cfg.enable_p2p is False
    assert problems_of(environ={"LMCACHE_ENABLE_CONTROLLER": "1"}).keys == {"enable_controller"}


@pytest.mark.parametrize("text,fragment", [
    ("chunk_size: [1\n", "not valid YAML"), ("- a\n- b\n", "must hold a mapping"),
    ("chunk_size: 1\nchunk_size: 2\n", "given twice (first on line 1)")])
def test_bad_yaml_files(tmp_path, text, fragment):
    assert fragment in str(problems_of(environ=write_yaml(tmp_path, text)))


def test_missing_or_empty_yaml_file(tmp_path):
    error = problems_of(environ={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    assert error.keys == {"LMCACHE_CONFIG_FILE"} and "cannot read the file" in str(error)
    assert load_config(environ=write_yaml(tmp_path, "")) == LMCacheConfig()


def test_to_dict_round_trips_and_summary_masks_passwords():
    cfg = load_config({"chunk_size": 16, "remote_url": "redis://u:secret@h:6379/0",
                       "extra_config": {"remote_key_prefix": "p:"}}, environ={})
    assert load_config(cfg.to_dict(), environ={}) == cfg
    summary = cfg.summary()
    assert "chunk_size=16" in summary and "secret" not in summary and "redis://u:***@h:6379/0" in summary
    assert "extra_config={'remote_key_prefix': 'p:'}" in summary


# ---- bounded reading: a configuration can not exhaust memory, time or the stack
def _laughs(levels: int = 9, width: int = 10, key: str = "not_a_key") -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{key}: *a{levels}\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bomb,bound", [
    (_laughs(), "aliases"),  # "billion laughs": 10**9 strings from 90 aliases
    (_laughs(key="chunk_size"), "aliases"),
    (_laughs(levels=7, width=4, key="extra_config"), "aliases"),  # 29 aliases, still an expansion
    ("chunk_size: " + "[" * 20000 + "]" * 20000 + "\n", "deep"),
    ("extra_config: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", "deep"),
    ("# " + "x" * (4 << 20) + "\nchunk_size: 256\n", "larger than"),
])
def test_yaml_bombs_are_refused_with_a_clear_error(tmp_path, bomb, bound):
    with pytest.raises(ConfigError, match=bound) as err:
        load_config(environ=write_yaml(tmp_path, bomb))
    assert err.value.keys == {"LMCACHE_CONFIG_FILE"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("environ,overrides", [
    ({"LMCACHE_EXTRA_CONFIG": "[" * 100000}, None),  # JSON nested beyond the stack
    ({"LMCACHE_EXTRA_CONFIG": '{"a": ' * 100000 + "1" + "}" * 100000}, None),
    ({"LMCACHE_CHUNK_SIZE": "9" * (1 << 20)}, None),  # a megabyte of digits
    ({}, {"extra_config": {"cache_namespace": "x" * (1 << 20)}}),
])
def test_oversized_or_deep_values_from_env_and_code_are_refused(environ, overrides):
    nested: dict = {}
    for _ in range(5000):
        nested = {"a": nested}
    for env, over in ((environ, overrides), ({}, {"extra_config": nested}), ({}, {"not_a_key": nested})):
        with pytest.raises(ConfigError):
            load_config(over, environ=env)


@pytest.mark.timeout(60)
def test_control_characters_and_long_unknown_keys_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):  # the reader refuses it before parsing
        load_config(environ=write_yaml(tmp_path, "chunk_size: 256\n\x1f\n"))
    with pytest.raises(ConfigError, match="unknown key"):  # no len x len edit distance per known key
        load_config({"k" * 60000: 1}, environ={})
