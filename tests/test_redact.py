"""Secrets (a Redis password in remote_url, as user:password@ or ?password=, and the chunk MAC secret) never
reach logs, error messages, reprs or the CLI's output: each is searched for in everything captured."""
from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from lmcache_vllm import cli
from lmcache_vllm.config import ConfigError, LMCacheConfig, inspect_config, load_config
from lmcache_vllm.config.redact import redact_text, redact_url
from lmcache_vllm.observability import logs
from lmcache_vllm.storage.redis import RedisBackend

MAC = "Mac4secret-of-at-least-128-bits"
SECRETS = ("Pw4userinfo", "Pw4query", "Mac4secret")


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_clean(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} in {text!r}"


def test_urls_and_text_are_redacted():
    assert redact_url("redis://:Pw4userinfo@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:Pw4userinfo@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://h:1/0?db=2&password=Pw4query") == "redis://h:1/0?db=2&password=***"
    assert redact_url("unix:///run/r.sock?password=Pw4query&db=1") == "unix:///run/r.sock?password=***&db=1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    text = ("failed: redis://u:Pw4userinfo@h/0 and {\"chunk_mac_key\": \"Mac4secret\"}, chunk_mac_key=Mac4secret,"
            " 'password': 'Pw4query'")
    assert_clean(redact_text(text))


def test_config_reprs_summaries_and_logs_hold_no_secret(caplog):
    caplog.set_level(logging.DEBUG)
    for url in ("redis://user:Pw4userinfo@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?password=Pw4query"):
        cfg = LMCacheConfig(remote_url=url, extra_config={"chunk_mac_key": MAC})
        assert_clean(repr(cfg), str(cfg), repr(cfg.extra_config), cfg.summary(), logs.describe_config(cfg))
    # LMCache's resp:// with separate username/password keys: the translation's warning names the URL.
    report = inspect_config({"remote_url": "resp://:Pw4userinfo@127.0.0.1:6379"}, environ={})
    assert report.config is not None
    assert_clean(*report.warnings, repr(report.config))
    load_config({"remote_url": "resp://127.0.0.1:6379", "extra_config": {"username": "u", "password": "Pw4query"}},
                environ={})
    assert_clean(caplog.text)


@pytest.mark.parametrize("source", ["overrides", "environment"])
def test_config_errors_hold_no_secret(source, caplog):
    caplog.set_level(logging.DEBUG)
    bad = {"remote_url": "redis://:Pw4userinfo@127.0.0.1:99999/0",  # a bad port: the URL is in the error
           "extra_config": {"chunk_mac_kye": "Mac4secret", "chunk_mac_key": ["Mac4secret"]}}
    environ = {"LMCACHE_EXTRA_CONFIG": '{"chunk_mac_key": "Mac4secret", broken',
               "LMCACHE_REMOTE_URL": "redis://h:99999/0?password=Pw4query"}  # a bad port
    with pytest.raises(ConfigError) as err:
        if source == "overrides":
            load_config(bad, environ={})
        else:
            load_config(environ=environ)
    assert len(err.value.problems) >= 2
    assert_clean(str(err.value), repr(err.value), *(str(p) for p in err.value.problems), caplog.text)


async def test_redis_backend_logs_and_repr_hold_no_secret(caplog):
    caplog.set_level(logging.DEBUG)
    port = dead_port()
    for url in (f"redis://:Pw4userinfo@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0?password=Pw4query"):
        backend = RedisBackend(LMCacheConfig(remote_url=url, extra_config={"remote_timeout_secs": 0.5}),
                               breaker_base_secs=0.01)
        assert not await backend.ping()
        await asyncio.sleep(0.02)
        assert not await backend.ping()
        assert_clean(repr(backend), str(backend), caplog.text)
        await backend.close()


def test_cli_output_holds_no_secret(capsys):
    url = f"redis://:Pw4userinfo@127.0.0.1:{dead_port()}/0"
    assert cli.main(["ping", "--redis", url, "--timeout", "0.5", "--count", "1"]) != cli.EXIT_OK
    assert cli.main(["clear", "--redis", url]) == cli.EXIT_ABORTED  # asks first: no terminal here
    assert cli.main(["inspect", "--redis", url.replace(":Pw4userinfo@", "@") + "?password=Pw4query",
                     "--timeout", "0.5"]) == cli.EXIT_ERROR
    out = capsys.readouterr()
    assert_clean(out.out, out.err)


async def test_a_password_with_url_characters_authenticates_and_is_never_shown(tmp_path, caplog):
    """A password holding `/`, `#`, `?` and `@` (which end a URL's user info for urllib and redis-py) is taken
    whole by our parser, given to redis-py quoted, and masked where the parser takes it from (issue 30 #7)."""
    import torch
    from redis_servers import Process, free_port, server_args

    from lmcache_vllm.config.remote_url import parse_remote_url
    from lmcache_vllm.memory import HostAllocator

    password = "Pw4/with#odd?chars@in"
    port = free_port()
    server = Process(server_args(port, tmp_path, "--requirepass", password), port, ping={"password": password})
    server.start()
    caplog.set_level(logging.DEBUG)
    try:
        for url in (f"redis://:{password}@127.0.0.1:{port}/0", f"redis-sentinel://:{password}@127.0.0.1:1/m"):
            target = parse_remote_url(url)
            assert target.password == password
            assert password not in target.display() and password not in repr(target)
        cfg = LMCacheConfig(remote_url=f"redis://:{password}@127.0.0.1:{port}/0")
        backend = RedisBackend(cfg)
        assert backend.start_problem is None, backend.start_problem
        arena = HostAllocator(1 << 20)
        obj = arena.allocate((2, 2, 16, 64), torch.bfloat16)
        assert await backend.put("m@1@0@bfloat16@v1@" + "0" * 64, obj)
        obj.ref_down()
        await backend.close()
        assert_clean(repr(cfg), cfg.summary(), logs.describe_config(cfg))
        assert password not in caplog.text and "Pw4/with" not in caplog.text
    finally:
        server.kill()
