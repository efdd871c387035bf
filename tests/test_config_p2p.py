"""The P2P keys: LMCache's `enable_p2p`, `p2p_host`, `p2p_init_ports` as ours, the directory (its own URL or
remote_url), the allow-list, and one error listing every problem."""
from __future__ import annotations

import pytest

from lmcache_vllm.config import ConfigError, load_config
from lmcache_vllm.config.schema import p2p_directory_url


def problems(overrides: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ={})
    return {p.key: str(p) for p in info.value.problems}


def test_lmcache_keys_load_as_ours(tmp_path):
    path = tmp_path / "p2p.yaml"
    path.write_text("enable_p2p: true\np2p_host: localhost\np2p_init_ports: 8200\nremote_url: redis://r:6379\n")
    cfg = load_config(environ={"LMCACHE_CONFIG_FILE": str(path)})
    assert cfg.enable_p2p and cfg.p2p_host == "localhost" and cfg.p2p_init_ports == [8200]
    assert p2p_directory_url(cfg) == "redis://r:6379"  # the directory defaults to remote_url
    cfg = load_config({"enable_p2p": True, "p2p_init_ports": [8200, 8300],
                       "extra_config": {"p2p_directory_url": "redis-cluster://a:1,b:2",
                                        "pd_peers": ["10.0.0.0/8:8200-8300", "gpu-7.lan:8200"]}},
                      environ={"LMCACHE_ENABLE_P2P": "true"})
    assert p2p_directory_url(cfg) == "redis-cluster://a:1,b:2" and cfg.remote_url is None
    assert cfg.extra_config.pd_peers == ["10.0.0.0/8:8200-8300", "gpu-7.lan:8200"]


def test_every_p2p_problem_in_one_error():
    found = problems({"enable_p2p": True, "p2p_init_ports": [0, 70000],
                      "extra_config": {"p2p_lookup_timeout_secs": 0, "pd_peers": ["not a host!"],
                                       "p2p_lease_secs": 0.5}})
    assert set(found) == {"enable_p2p", "p2p_init_ports", "extra_config.p2p_lookup_timeout_secs",
                          "extra_config.pd_peers", "extra_config.p2p_lease_secs"}
    assert "needs a directory on Redis" in found["enable_p2p"]
    assert "extra_config.p2p_directory_url" in problems({"extra_config": {"p2p_directory_url": "http://x"}})


def test_the_directory_password_is_redacted():
    cfg = load_config({"enable_p2p": True, "extra_config": {"p2p_directory_url": "redis://u:s3cret-pw@r:6379"}},
                      environ={})
    assert "s3cret-pw" not in repr(cfg) and "s3cret-pw" not in cfg.summary()
