"""`lmcache-vllm inspect / clear / ping / stats` on real tiers: chunk files written by the disk tier, values
written by the Redis tier into the test's redis-server, corrupt entries planted the way a bad disk or a
foreign writer would leave them, and a real Prometheus exposition of our metrics."""
from __future__ import annotations

import json
import os
import time

import redis
import redis.cluster

from lmcache_vllm import cli
from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.storage.codec import FORMAT_VERSION
from lmcache_vllm.storage.local_disk import filename_for
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.tokens import CacheKey

CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16


def key(model: str, i: int, fingerprint: str = "ab12") -> str:
    return CacheKey(model, 1, 0, "bfloat16", FORMAT_VERSION, i.to_bytes(16, "big"),
                    fingerprint=fingerprint).to_str()


def fill(cfg: LMCacheConfig, keys: list[str], make_chunk) -> None:
    with StorageManager(cfg) as mgr:
        for i, k in enumerate(keys):
            t = make_chunk(i, CHUNK)
            obj = mgr.allocate(t.shape, t.dtype)
            obj.tensor.copy_(t)
            mgr.put(k, obj)
            obj.ref_down()
        assert mgr.flush()


def run(capsys, *args: str) -> tuple[int, str]:
    rc = cli.main(list(args))
    return rc, capsys.readouterr().out


def test_inspect_and_clear_a_disk_directory(tmp_path, make_chunk, capsys):
    llama = [key("llama", i) for i in range(3)]
    qwen = [key("qwen2", i, fingerprint="cd34") for i in range(2)]
    fill(LMCacheConfig(max_local_cpu_size=0.01, local_disk=str(tmp_path), max_local_disk_size=0.01),
         llama + qwen, make_chunk)
    (tmp_path / "notes.txt").write_text("not a chunk")

    rc, out = run(capsys, "inspect", "--disk", str(tmp_path), "--json")
    report = json.loads(out)
    assert rc == cli.EXIT_OK and report["chunks"] == 5 and report["num_corrupt"] == 0
    assert report["namespaces"]["llama@ab12"]["chunks"] == 3
    assert report["namespaces"]["qwen2@cd34"]["chunks"] == 2
    assert report["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*.lmc"))
    assert report["oldest"] <= report["newest"] <= time.time()

    # A truncated file (found from its size) and flipped payload bytes (found only by --verify).
    truncated = tmp_path / filename_for(llama[2])
    truncated.write_bytes(truncated.read_bytes()[:5000])
    flipped = tmp_path / filename_for(qwen[1])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    rc, out = run(capsys, "inspect", "--disk", str(tmp_path), "--json")
    assert rc == cli.EXIT_CORRUPT and json.loads(out)["num_corrupt"] == 1
    rc, out = run(capsys, "inspect", "--disk", str(tmp_path), "--verify")
    assert rc == cli.EXIT_CORRUPT and "corrupt entries: 2" in out and "checksum" in out
    assert "llama@ab12" in out and "qwen2@cd34" in out  # the table for people

    # Without a terminal and without --yes nothing is removed.
    rc, _ = run(capsys, "clear", "--disk", str(tmp_path), "--model", "llama")
    assert rc == cli.EXIT_ABORTED and truncated.exists()
    rc, out = run(capsys, "clear", "--disk", str(tmp_path), "--model", "llama", "--yes", "--json")
    assert rc == cli.EXIT_OK and json.loads(out)["files"] == 2  # the valid llama chunks, not the corrupt one
    assert not (tmp_path / filename_for(llama[0])).exists() and (tmp_path / filename_for(qwen[0])).exists()
    rc, out = run(capsys, "clear", "--disk", str(tmp_path), "--yes", "--json")
    assert json.loads(out) == {"files": 3, "bytes": json.loads(out)["bytes"], "corrupt_files": 1,
                               "temp_files": 0, "dry_run": False}
    # What is not ours stays (and the usage count the disk tiers sharing the directory keep there).
    assert sorted(os.listdir(tmp_path)) == [".lmcache-usage", "notes.txt"]


def test_inspect_clear_and_ping_redis(redis_server, redis_prefix, make_chunk, capsys):
    keys = [key("llama", i) for i in range(3)] + [key("qwen2", 9)]
    fill(LMCacheConfig(max_local_cpu_size=0.01, remote_url=redis_server.url,
                       extra_config={"remote_key_prefix": redis_prefix}), keys, make_chunk)
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(redis_prefix + key("llama", 7), b"LMCV" + bytes(100))  # garbage under a valid key name
    raw.set(redis_prefix + "unrelated", b"hello")
    url = redis_server.url
    rc, out = run(capsys, "inspect", "--redis", url, "--prefix", redis_prefix, "--json")
    report = json.loads(out)
    assert rc == cli.EXIT_CORRUPT and report["chunks"] == 4 and report["num_corrupt"] == 1
    assert report["ignored"] == 1 and report["namespaces"]["llama@ab12"]["chunks"] == 3
    assert report["corrupt"][0]["entry"] == redis_prefix + key("llama", 7)

    rc, out = run(capsys, "clear", "--redis", url, "--prefix", redis_prefix, "--model", "qwen2@cd34",
                  "--yes", "--json")
    assert json.loads(out)["keys"] == 0  # no such fingerprint
    rc, out = run(capsys, "clear", "--redis", url, "--prefix", redis_prefix, "--model", "qwen2", "--dry-run",
                  "--json")
    assert json.loads(out)["keys"] == 1 and raw.exists(redis_prefix + key("qwen2", 9))
    rc, out = run(capsys, "clear", "--redis", url, "--prefix", redis_prefix, "--yes", "--json")
    assert rc == cli.EXIT_OK and json.loads(out)["keys"] == 6
    assert raw.keys(redis_prefix + "*") == []

    rc, out = run(capsys, "ping", "--redis", url, "--json")
    result = json.loads(out)
    assert rc == cli.EXIT_OK and result["ok"] and result["tls"] is False and result["auth"] == "none"
    assert 0 < result["ping_ms"]["min"] <= result["ping_ms"]["max"] and result["server"]["redis_version"]
    user = redis_prefix.rstrip(":")
    raw.acl_setuser(user, enabled=True, passwords=["+right"], keys=["*"], commands=["+@all"])
    try:
        authed = url.replace("redis://", f"redis://{user}:right@")
        rc, out = run(capsys, "ping", "--redis", authed, "--json")
        assert rc == cli.EXIT_OK and json.loads(out)["auth"] == "user+password"
        assert "right" not in out  # the password is never printed
        rc, out = run(capsys, "ping", "--redis", authed.replace(":right@", ":wrong@"), "--json")
        assert rc == cli.EXIT_AUTH and "authentication failed" in json.loads(out)["error"]
    finally:
        raw.acl_deluser(user)
        raw.close()


def test_inspect_clear_and_ping_a_redis_cluster(redis_cluster, redis_prefix, make_chunk, capsys):
    keys = [key("llama", i) for i in range(12)] + [key("qwen2", i, fingerprint="cd34") for i in range(6)]
    url = redis_cluster.url
    fill(LMCacheConfig(max_local_cpu_size=0.01, remote_url=url, extra_config={"remote_key_prefix": redis_prefix}),
         keys, make_chunk)
    planted = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    planted.set(redis_prefix + key("llama", 99), b"LMCV" + bytes(100))  # garbage under a valid key name
    planted.close()
    rc, out = run(capsys, "inspect", "--redis", url, "--prefix", redis_prefix, "--json")
    report = json.loads(out)
    assert rc == cli.EXIT_CORRUPT and report["num_corrupt"] == 1 and report["chunks"] == 18
    assert report["namespaces"]["qwen2@cd34"]["chunks"] == 6
    assert len(report["nodes"]) == 3 and sum(report["nodes"].values()) == 18 and min(report["nodes"].values()) > 0
    rc, out = run(capsys, "inspect", "--redis", url, "--prefix", redis_prefix)
    assert "node" in out and all(name in out for name in report["nodes"])  # chunks per node, for people
    rc, out = run(capsys, "clear", "--redis", url, "--prefix", redis_prefix, "--model", "qwen2", "--yes", "--json")
    assert rc == cli.EXIT_OK and json.loads(out)["keys"] == 6
    rc, out = run(capsys, "clear", "--redis", url, "--prefix", redis_prefix, "--yes", "--json")
    assert json.loads(out)["keys"] == 13
    assert sum(redis_cluster.keys_per_node(redis_prefix + "*").values()) == 0
    rc, out = run(capsys, "ping", "--redis", url, "--json")
    result = json.loads(out)
    assert rc == cli.EXIT_OK and result["topology"] == "cluster" and len(result["nodes"]) == 3


def test_unreachable_tiers_exit_with_one_line(tmp_path, capsys):
    assert cli.main(["inspect", "--disk", str(tmp_path / "missing")]) == cli.EXIT_ERROR
    assert cli.main(["ping", "--redis", "redis://127.0.0.1:1/0", "--timeout", "0.5"]) == cli.EXIT_ERROR
    assert cli.main(["stats", "--url", "http://127.0.0.1:1", "--timeout", "0.5"]) == cli.EXIT_ERROR
    assert cli.main(["inspect"]) == cli.EXIT_USAGE  # --disk or --redis is required
    err = capsys.readouterr().err
    assert "no such directory" in err and "Connection refused" in err


def test_stats_reads_our_metrics_from_an_exposition(capsys):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from lmcache_vllm.admin.scrape import format_summary, parse, summary

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    hits = Counter("lmcache_vllm:chunk_hits", "h", labels + ["tier"], registry=reg)
    used = Gauge("lmcache_vllm:used_bytes", "u", labels + ["tier"], registry=reg)
    load = Histogram("lmcache_vllm:load_seconds", "l", labels, registry=reg, buckets=(0.01, 0.1, 1.0))
    src = Counter("vllm:prompt_tokens_cached_by_source", "s", labels + ["source"], registry=reg)
    for engine in ("0", "1"):  # two engines are summed
        hits.labels("m", engine, "local_disk").inc(3)
        used.labels("m", engine, "local_cpu").set(2 << 20)
        for v in (0.005, 0.05, 0.5):
            load.labels("m", engine).observe(v)
    src.labels("m", "0", "host").inc(512)
    s = summary(parse(generate_latest(reg).decode()))
    assert s["counters"]["chunk_hits"] == {"local_disk": 6}
    assert s["gauges"]["used_bytes"] == {"local_cpu": 4 << 20}
    assert s["histograms"]["load_seconds"]["count"] == 6
    assert s["histograms"]["load_seconds"]["p50_ms_le"] == 100.0
    assert s["cached_by_source"] == {"host": 512}
    text = format_summary(s)
    assert "4.0 MiB" in text and "load_seconds" in text and "host" in text
    json.dumps(s)  # --json output


def test_inspect_counts_the_kv_cache_groups_of_a_hybrid_model(tmp_path, make_chunk, capsys):
    def grouped(i: int, group: str) -> str:
        return CacheKey("gemma3", 1, 0, "bfloat16", FORMAT_VERSION, i.to_bytes(16, "big"), fingerprint="ef56",
                        group=group).to_str()

    keys = [grouped(i, "full.l5.11") for i in range(3)] + [grouped(i, "swa1024.l0-4.6-10") for i in range(2)]
    fill(LMCacheConfig(max_local_cpu_size=0.01, local_disk=str(tmp_path), max_local_disk_size=0.01),
         keys + [key("llama", 0)], make_chunk)
    rc, out = run(capsys, "inspect", "--disk", str(tmp_path), "--json")
    report = json.loads(out)
    assert rc == cli.EXIT_OK and report["chunks"] == 6
    groups = report["namespaces"]["gemma3@ef56"]["groups"]
    assert {g: c["chunks"] for g, c in groups.items()} == {"full.l5.11": 3, "swa1024.l0-4.6-10": 2}
    one_chunk = groups["full.l5.11"]["bytes"] // 3
    assert report["namespaces"]["llama@ab12"]["groups"] == {"-": {"chunks": 1, "bytes": one_chunk}}
    rc, out = run(capsys, "inspect", "--disk", str(tmp_path))
    assert "KV cache group" in out and "swa1024.l0-4.6-10" in out
