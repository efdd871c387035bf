"""`config/remote_url.py`: every remote_url form parsed into a `RedisTarget` (credentials kept out of its
repr and display), wrong forms refused with what is accepted, LMCache's Sentinel master-name variable."""

import pytest

from lmcache_vllm.config import inspect_config, load_config
from lmcache_vllm.config.remote_url import Topology, parse_remote_url, sentinel_master_name


@pytest.mark.parametrize("url, topology, tls, nodes, db, master", [
    ("redis://h:6380/2", Topology.SINGLE, False, (("h", 6380),), 2, None),
    ("rediss://h", Topology.SINGLE, True, (("h", 6379),), 0, None),
    ("valkey://h:7000", Topology.SINGLE, False, (("h", 7000),), 0, None),
    ("redis-cluster://a:7000,b:7001,[::1]:7002", Topology.CLUSTER, False,
     (("a", 7000), ("b", 7001), ("::1", 7002)), 0, None),
    ("valkeys-cluster://a:7000", Topology.CLUSTER, True, (("a", 7000),), 0, None),
    ("rediss-cluster://a:7000/0", Topology.CLUSTER, True, (("a", 7000),), 0, None),
    ("redis-sentinel://s1,s2:26380/cache-master/3", Topology.SENTINEL, False, (("s1", 26379), ("s2", 26380)), 3,
     "cache-master"),
    ("redis-sentinel://s1:26379,s2:26379", Topology.SENTINEL, False, (("s1", 26379), ("s2", 26379)), 0, None),
])
def test_forms(url, topology, tls, nodes, db, master):
    target = parse_remote_url(url)
    assert (target.topology, target.tls, target.nodes, target.db, target.master_name) == \
        (topology, tls, nodes, db, master)
    assert load_config({"remote_url": url}, environ={}).remote_url == url


def test_credentials_stay_out_of_repr_and_display():
    target = parse_remote_url("rediss-sentinel://svc%40x:p%3Ass@s1:1,s2:2/m")
    assert (target.username, target.password) == ("svc@x", "p:ss")
    assert "p:ss" not in repr(target) and "p%3Ass" not in repr(target)
    assert target.display() == "rediss-sentinel://svc%40x:***@s1:1,s2:2/m"
    assert parse_remote_url("redis-cluster://:pw@a:1").display() == "redis-cluster://:***@a:1"
    assert parse_remote_url("unix:///run/r.sock?db=2").display() == "unix:///run/r.sock?db=2"
    report = inspect_config({"remote_url": "redis-cluster://u:secret@a:1,b:2/9"})
    assert "secret" not in str(report.problems[0]) and "u:***@a:1,b:2" in str(report.problems[0])


def test_sentinel_master_name_as_lmcache_reads_it():
    target = parse_remote_url("redis-sentinel://s1:26379")
    assert sentinel_master_name(target, {"REDIS_SERVICE_NAME": "pool"}) == \
        ("pool", "the Sentinel master name comes from REDIS_SERVICE_NAME='pool' (as in LMCache)")
    name, note = sentinel_master_name(target, {})
    assert name == "redismaster" and "LMCache's default" in note
    assert sentinel_master_name(parse_remote_url("redis-sentinel://s1/m"), {"REDIS_SERVICE_NAME": "x"}) == ("m", None)
    warnings = inspect_config({"remote_url": "redis-sentinel://s1:26379"}, environ={"REDIS_TIMEOUT": "3"}).warnings
    assert any("asking the Sentinels for 'redismaster'" in w for w in warnings)
    assert any(w.startswith("REDIS_TIMEOUT (environment): ignored") for w in warnings)
    assert inspect_config({"remote_url": "redis-sentinel://s1/m"}, environ={"REDIS_TIMEOUT": "3"}).warnings != []
    assert inspect_config({"remote_url": "redis://h:1"}, environ={"REDIS_TIMEOUT": "3"}).warnings == []
