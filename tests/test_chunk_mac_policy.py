"""Tiers that others can write (Redis; a disk directory configured as shared) without a chunk MAC key: one
warning at start saying so and how to fix it, the `unprotected_shared_tier` gauge, and
`extra_config.require_chunk_mac: true` refusing to start. `lmcache-vllm keygen` prints a fresh key."""
from __future__ import annotations

import logging

import pytest

from lmcache_vllm import cli
from lmcache_vllm.config import ConfigError, LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.registry import MAC_KEY_ENV

MiB = 1 << 20


def config(**kw) -> LMCacheConfig:
    extra = kw.pop("extra", {})
    return LMCacheConfig(max_local_cpu_size=4 * MiB / (1 << 30), extra_config={"close_drain_secs": 1.0, **extra},
                         **kw)


def mac_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "MAC" in r.getMessage()]


def test_keygen_prints_a_fresh_key(capsys):
    keys = []
    for _ in range(2):
        assert cli.main(["keygen"]) == cli.EXIT_OK
        keys.append(capsys.readouterr().out.strip())
    assert keys[0] != keys[1] and len(keys[0]) >= 43 and keys[0].isascii() and " " not in keys[0]
    codec.ChunkMac(keys[0])  # usable as the secret as printed


def test_shared_tiers_without_a_mac_key_warn_once_and_are_counted(tmp_path, redis_server, redis_prefix, caplog,
                                                                   monkeypatch):
    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    caplog.set_level(logging.WARNING)
    shared = tmp_path / "shared"
    cfg = config(local_disk=str(shared), max_local_disk_size=0.01, remote_url=redis_server.url,
                 extra={"remote_key_prefix": redis_prefix, "local_disk_shared": True})
    with StorageManager(cfg):
        (warning,) = mac_warnings(caplog)
        assert "redis" in warning and "local_disk" in warning and MAC_KEY_ENV in warning and "keygen" in warning
        assert "require_chunk_mac" in warning
        snap = metrics.snapshot()
        assert metrics.value("unprotected_shared_tier", snap, tier="redis") == 1
        assert metrics.value("unprotected_shared_tier", snap, tier="local_disk") == 1


@pytest.mark.parametrize("setup", ["key_in_env", "key_in_config", "private_disk_only"])
def test_no_warning_when_nothing_others_can_write_goes_unsigned(tmp_path, redis_server, redis_prefix, caplog,
                                                                monkeypatch, setup):
    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    caplog.set_level(logging.WARNING)
    extra = {"remote_key_prefix": redis_prefix, "require_chunk_mac": True}
    kw: dict = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    if setup == "key_in_env":
        monkeypatch.setenv(MAC_KEY_ENV, "a fleet secret of 128 bits at least")
    elif setup == "key_in_config":
        extra["chunk_mac_key"] = "a fleet secret of 128 bits at least"
    if setup != "private_disk_only":
        kw["remote_url"] = redis_server.url
    with StorageManager(config(extra=extra, **kw)):
        assert mac_warnings(caplog) == []
        snap = metrics.snapshot()
        assert all(metrics.value("unprotected_shared_tier", snap, tier=t) == 0 for t in ("redis", "local_disk"))


@pytest.mark.parametrize("tier", ["redis", "shared_disk"])
def test_require_chunk_mac_refuses_to_start(tmp_path, redis_server, redis_prefix, monkeypatch, tier):
    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    extra = {"remote_key_prefix": redis_prefix, "require_chunk_mac": True}
    if tier == "redis":
        cfg = config(remote_url=redis_server.url, extra=extra)
    else:
        cfg = config(local_disk=str(tmp_path / "d"), max_local_disk_size=0.01,
                     extra={**extra, "local_disk_shared": True})
    with pytest.raises(ConfigError, match="require_chunk_mac") as refused:
        StorageManager(cfg)
    assert MAC_KEY_ENV in str(refused.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_require_chunk_mac_covers_a_prefill_instances_transfer_port(monkeypatch, caplog, host):
    """A role that serves a KV transfer port, without a MAC key: anyone who reaches the port pulls a request's
    KV by its id. `require_chunk_mac` refuses to start; without it, a port beyond loopback gets the warning."""
    from lmcache_vllm.storage.registry import check_chunk_mac

    monkeypatch.delenv(MAC_KEY_ENV, raising=False)
    caplog.set_level(logging.WARNING)
    with pytest.raises(ConfigError, match="require_chunk_mac") as refused:
        check_chunk_mac(config(extra={"require_chunk_mac": True}), None, transfer_host=host)
    assert "transfer port" in str(refused.value) and MAC_KEY_ENV in str(refused.value)
    check_chunk_mac(config(extra={"require_chunk_mac": True}), codec.ChunkMac("s"), transfer_host=host)  # a key
    check_chunk_mac(config(), None, transfer_host=host)
    warnings = mac_warnings(caplog)
    if host == "0.0.0.0":
        assert len(warnings) == 1 and "transfer port" in warnings[0] and "require_chunk_mac" in warnings[0]
    else:
        assert warnings == []  # loopback only, the default: no warning


@pytest.mark.parametrize("source", ["extra_config", "environment"])
def test_a_short_mac_key_is_refused_at_start_with_every_other_problem(source, monkeypatch):
    """Issue 39 #6: any one-character key was accepted. At least 128 bits now, wherever the key comes from."""
    from lmcache_vllm.config import load_config
    from lmcache_vllm.storage.registry import chunk_mac

    environ = {MAC_KEY_ENV: "a"} if source == "environment" else {}
    extra = {"chunk_mac_key": "a"} if source == "extra_config" else {}
    with pytest.raises(ConfigError) as refused:
        load_config({"chunk_size": -1, "extra_config": extra}, environ=environ)
    keys = refused.value.keys
    assert "chunk_size" in keys and ("extra_config.chunk_mac_key" in keys or MAC_KEY_ENV in keys)
    assert "128 bits" in str(refused.value) and "keygen" in str(refused.value)
    for short in ("a", "0123456789abcdef", "passwordpassword", "a-valid-key-of-128-bits,short"):
        monkeypatch.setenv(MAC_KEY_ENV, short)
        with pytest.raises(ConfigError):
            chunk_mac(LMCacheConfig())
    for good in ("0123456789abcdef0123456789abcdef", "z" * 22, "a passphrase: 16+ bytes", "new-key-0123456789abcd,"
                 "old-key-0123456789abcd"):
        monkeypatch.setenv(MAC_KEY_ENV, good)
        assert chunk_mac(LMCacheConfig()) is not None
    monkeypatch.setenv(MAC_KEY_ENV, "new-key-0123456789abcd,old-key-0123456789abcd")
    mac = chunk_mac(LMCacheConfig())
    assert mac is not None and mac.key_ids == [codec.ChunkMac(k).key_id for k in ("new-key-0123456789abcd",
                                                                                  "old-key-0123456789abcd")]


def test_a_key_in_kv_connector_extra_config_or_hiding_the_environments_is_warned(caplog):
    """vLLM logs kv_connector_extra_config at start-up, a key there with it; and that key silently beat the
    environment's."""
    from lmcache_vllm.config import inspect_config

    key = "a-fleet-key-0123456789abcdef"
    report = inspect_config({"extra_config": {"chunk_mac_key": key}}, environ={MAC_KEY_ENV: "another-key-0123456789ab"})
    assert report.config is not None
    (logged,) = [w for w in report.warnings if "vLLM logs" in w]
    assert "LMCACHE_VLLM_CHUNK_MAC_KEY" in logged and key not in logged
    (hidden,) = [w for w in report.warnings if "ignored" in w and MAC_KEY_ENV in w]
    assert "extra_config.chunk_mac_key" in hidden
    assert [w for w in inspect_config({}, environ={MAC_KEY_ENV: key}).warnings if "chunk_mac" in w.lower()] == []
