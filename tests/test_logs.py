"""Rate-limited warnings (one per kind of failure per interval, the traceback once) and the start-up
line with the resolved configuration; plus a dead Redis tier through the real StorageManager logging
one warning while every failed call is counted."""
import logging
import time

from lmcache_vllm.config import load_config
from lmcache_vllm.observability import logs, metrics


def test_one_warning_per_kind_and_interval(caplog):
    log = logging.getLogger("test.logs")
    caplog.set_level(logging.WARNING, logger="test.logs")
    for i in range(100):
        try:
            raise OSError(f"disk gone {i}")
        except OSError:
            logs.warn(log, "disk_gone", "read %d failed", i, exc_info=True, interval=0.2)
    logs.warn(log, "other_kind", "something else")
    assert [r.getMessage() for r in caplog.records] == ["read 0 failed", "something else"]
    assert caplog.records[0].exc_info is not None  # the first one carries the traceback
    time.sleep(0.25)
    try:
        raise OSError("still gone")
    except OSError:
        assert logs.warn(log, "disk_gone", "read %d failed", 100, exc_info=True, interval=0.2)
    last = caplog.records[-1]
    assert last.getMessage().startswith("read 100 failed [99 more like this in the last")
    assert not last.exc_info  # no traceback the second time


def test_startup_line_names_tiers_sizes_and_what_is_off():
    config = load_config(overrides={"chunk_size": 128, "max_local_cpu_size": 2.5, "local_disk": "/data/kv",
                                    "max_local_disk_size": 40, "remote_url": "redis://me:secret@host:6379/0"})
    line = logs.describe_config(config, layout="CpuVecLayout", world_size=2, role="kv_both")
    assert line.startswith("lmcache-vllm: chunk_size=128, L1 host memory 2.5 GiB")
    assert "L2 disk /data/kv 40 GiB" in line and "redis://me:***@host:6379/0" in line
    assert "secret" not in line
    assert "layout CpuVecLayout" in line and "tp=2" in line and "off: layerwise" in line


def test_dead_redis_logs_once_and_counts_every_failure(redis_server, redis_prefix, make_chunk, caplog):
    from lmcache_vllm.storage.manager import StorageManager

    caplog.set_level(logging.WARNING)
    cfg = load_config(overrides={"max_local_cpu_size": 0.01, "remote_url": redis_server.url,
                                 "extra_config": {"remote_key_prefix": redis_prefix,
                                                  "remote_timeout_secs": 0.5,
                                                  "remote_breaker_max_secs": 0.05}})
    key = "m@-@tp1.0@pp1.0@bfloat16@v1@" + "00" * 16
    with StorageManager(cfg) as mgr:
        redis_server.kill()
        try:
            for _ in range(20):
                assert mgr.contains_prefix([key]) == 0
                time.sleep(0.01)
        finally:
            redis_server.restart()
    assert metrics.value("failed_reads", tier="redis") == 20
    redis_lines = [r for r in caplog.records if "redis" in r.getMessage().lower()]
    assert len(redis_lines) <= 2, [r.getMessage() for r in redis_lines]


def test_rate_limited_kinds_are_bounded(caplog):
    """A kind can carry a peer's text (an ERR code): however many distinct ones arrive, `warn` remembers at
    most MAX_KINDS, the least recently logged forgotten first."""
    log = logging.getLogger("test.logs")
    caplog.set_level(logging.WARNING, logger="test.logs")
    for i in range(3 * logs.MAX_KINDS):
        logs.warn(log, f"peer_code_{i}", "peer said %d", i)
        logs.warn(log, f"peer_code_{i}", "peer said %d", i)  # suppressed: counted under its kind
    assert len(logs._last) <= logs.MAX_KINDS and len(logs._suppressed) <= logs.MAX_KINDS
    assert len(caplog.records) == 3 * logs.MAX_KINDS
    # A recent kind is still rate-limited.
    assert not logs.warn(log, f"peer_code_{3 * logs.MAX_KINDS - 1}", "again")


def test_peer_text_cannot_forge_log_lines():
    forged = "r1\r\n2026-01-01 INFO lmcache: all good\x1b[2J\u2028x"
    shown = logs.peer_text(forged)
    assert "\n" not in shown and "\r" not in shown and "\x1b" not in shown and "\u2028" not in shown
    assert shown == "r1\\r\\n2026-01-01 INFO lmcache: all good\\x1b[2J\\u2028x"
    assert logs.peer_text(b"id\n\xff") == "id\\n\\xff"
    long = logs.peer_text("a" * 10_000)
    assert long.startswith("a" * logs.PEER_TEXT_CHARS) and len(long) < logs.PEER_TEXT_CHARS + 16
    assert logs.peer_text("cmpl-3f2a-0") == "cmpl-3f2a-0"
