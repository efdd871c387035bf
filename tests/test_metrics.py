"""Tests for lmcache_vllm.observability.metrics: the recorder's totals and deltas, gauges, scope across TP ranks, and
the plain-dict helpers (merge across ranks and steps, flat names)."""
import gc
import json
import threading

import pytest

from lmcache_vllm.observability import metrics
from lmcache_vllm.observability.metrics import METRICS, Recorder


def test_counters_histograms_and_flat_names():
    rec = Recorder(source="a")
    rec.inc("loaded_tokens", 256)
    rec.inc("loaded_tokens", 256)
    rec.inc("chunk_hits", 2, tier="redis")
    rec.observe("load_seconds", 0.003)
    rec.observe("load_seconds", 20.0)  # past the last bucket: counted in +Inf
    snap = json.loads(json.dumps(rec.snapshot()))  # plain data
    flat = metrics.flat(snap)
    assert flat["loaded_tokens"] == 512 and flat["chunk_hits.redis"] == 2
    assert flat["load_seconds.count"] == 2 and flat["load_seconds.sum"] == pytest.approx(20.003)
    buckets = snap["histograms"]["load_seconds"][""]["buckets"]
    assert len(buckets) == len(METRICS["load_seconds"].buckets) + 1 and buckets[-1] == 1
    assert metrics.value("loaded_tokens", snap) == 512 and metrics.value("load_seconds", snap) == 2


def test_wrong_names_kinds_and_labels_are_errors():
    rec = Recorder()
    with pytest.raises(KeyError, match="declare it"):
        rec.inc("no_such_metric")
    with pytest.raises(TypeError):
        rec.observe("loaded_tokens", 1.0)
    with pytest.raises(ValueError, match="tier"):
        rec.inc("chunk_hits")


def test_take_gives_changes_since_last_take():
    rec = Recorder(source="w0")
    rec.inc("stored_tokens", 100)  # before the first take (a server's first request): not lost
    first = rec.take()
    assert first["counters"] == {"stored_tokens": {"": 100}}
    rec.inc("stored_tokens", 256)
    rec.observe("store_seconds", 0.5)
    delta = rec.take()
    assert delta["counters"] == {"stored_tokens": {"": 256}}
    assert delta["observations"] == {"store_seconds": {"": [0.5]}}
    assert metrics.is_empty(rec.take())
    assert metrics.value("stored_tokens", rec.snapshot()) == 356


def test_gauges_are_read_when_asked_and_sent_when_changed():
    rec = Recorder(source="w0")

    class Tier:
        used = 10

        def gauges(self):
            yield "used_bytes", {"tier": "local_cpu"}, self.used

    tier = Tier()
    rec.register_gauges(tier.gauges)
    assert rec.take()["gauges"] == {"used_bytes": {"local_cpu": {"w0": 10.0}}}
    assert rec.take()["gauges"] == {}  # unchanged
    tier.used = 30
    assert rec.take()["gauges"] == {"used_bytes": {"local_cpu": {"w0": 30.0}}}
    del tier
    gc.collect()  # held weakly: a reporter that is gone reports nothing
    assert rec.snapshot()["gauges"] == {}


def test_a_take_with_nothing_counted_reads_the_gauges_at_most_every_interval(monkeypatch):
    # vLLM takes every step: a decode step that counted nothing must not call every gauge function.
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    rec = Recorder(source="w0", gauge_interval_s=1.0)
    reads = []

    def gauges():
        reads.append(now[0])
        yield "used_bytes", {"tier": "local_cpu"}, len(reads)

    rec.register_gauges(gauges)
    assert rec.take()["gauges"] == {"used_bytes": {"local_cpu": {"w0": 1.0}}}  # the first take reads them
    now[0] += 0.5
    assert metrics.is_empty(rec.take()) and len(reads) == 1  # quiet, within the interval: not read
    rec.inc("stored_tokens", 128)  # something counted: the gauges it moved go with it
    assert rec.take()["gauges"] == {"used_bytes": {"local_cpu": {"w0": 2.0}}}
    now[0] += 0.9
    assert rec.take()["gauges"] == {} and len(reads) == 2
    now[0] += 0.2  # the interval passed since the last read: a gauge that moved alone is sent now
    assert rec.take()["gauges"] == {"used_bytes": {"local_cpu": {"w0": 3.0}}}
    assert metrics.RECORDER.gauge_interval_s == metrics.GAUGE_INTERVAL_S > 0


def test_engine_scope_counts_once_per_engine_and_ranks_merge():
    rank0, rank1 = Recorder(source="r0"), Recorder(source="r1")
    rank1.primary = False
    for rec in (rank0, rank1):
        rec.take()
        rec.inc("loaded_tokens", 512)  # engine scope: rank 0 only
        rec.inc("read_bytes", 1000, tier="local_cpu")  # rank scope: summed
        rec.register_gauges(lambda: [("breaker_open", {"tier": "redis"}, 0),
                                     ("used_bytes", {"tier": "local_cpu"}, 5)])
    rank1.register_gauges(lambda: [("breaker_open", {"tier": "redis"}, 1)])
    step = metrics.merge(rank0.take(), rank1.take())
    flat = metrics.flat(step)
    assert flat["loaded_tokens"] == 512 and flat["read_bytes.local_cpu"] == 2000
    assert flat["used_bytes.local_cpu"] == 10  # sum over processes
    assert flat["breaker_open.redis"] == 1  # max: one rank's breaker is open
    # across steps a gauge keeps each process's latest value
    later = metrics.merge(step, {"gauges": {"used_bytes": {"local_cpu": {"r0": 7}}}})
    assert metrics.flat(later)["used_bytes.local_cpu"] == 12


def test_recording_from_many_threads_loses_nothing():
    rec = Recorder()
    rec.take()

    def work():
        for _ in range(2000):
            rec.inc("chunk_hits", tier="local_cpu")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert metrics.value("chunk_hits", rec.snapshot(), tier="local_cpu") == 8000
    assert rec.take()["counters"]["chunk_hits"]["local_cpu"] == 8000


def test_every_definition_is_well_formed():
    for d in METRICS.values():
        assert d.kind in ("counter", "gauge", "histogram") and d.scope in ("rank", "engine")
        assert d.gauge_agg in ("sum", "max", "min") and d.help and d.unit
        assert d.name.replace("_", "").isalnum() and d.name.islower()
        if d.kind == "counter":
            assert not d.name.endswith("_total")  # prometheus_client adds it
