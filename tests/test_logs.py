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
