"""Our metrics through vLLM's own connector-metrics classes (`KVConnectorLogging`, `KVConnectorProm`, which
find `LMCacheConnector` by its module path): stats of two TP ranks and the scheduler aggregate as vLLM
aggregates them, reach Prometheus as `lmcache_vllm:*` with tier labels, and summarise in the log line."""
import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from lmcache_vllm.observability import metrics  # noqa: E402
from lmcache_vllm.observability.metrics import Recorder  # noqa: E402


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import KVTransferConfig, VllmConfig

    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="LMCacheConnector", kv_connector_module_path="lmcache_vllm.integration.vllm",
        kv_role="kv_both"))


def _scrape() -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith(metrics.PREFIX):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name",)))
                out[(sample.name, labels)] = sample.value
    return out


def _step(ranks: list[Recorder]):
    """What vLLM does per step: each worker's stats, aggregated over ranks, then the scheduler's."""
    from lmcache_vllm.integration.vllm.stats import LMCacheConnectorStats

    total = None
    for rec in ranks:
        delta = rec.take()
        if metrics.is_empty(delta):
            continue
        stats = LMCacheConnectorStats(data=delta)
        total = stats if total is None else total.aggregate(stats)
    return None if total is None else total.to_dict()


def test_ranks_and_scheduler_reach_prometheus_and_the_log_line(vllm_config):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    logging_ = KVConnectorLogging(vllm_config.kv_transfer_config)
    scheduler, rank0, rank1 = Recorder("s"), Recorder("w0"), Recorder("w1")
    rank1.primary = False
    for rec in (scheduler, rank0, rank1):
        rec.take()  # vLLM asks from the first step on
    breaker = {"w0": 0, "w1": 0}
    for name, rec in (("w0", rank0), ("w1", rank1)):
        rec.register_gauges(lambda name=name: [("used_bytes", {"tier": "local_cpu"}, 1000),
                                               ("breaker_open", {"tier": "redis"}, breaker[name])])
    scheduler.inc("hit_tokens", 512, tier="local_disk")
    scheduler.observe("lookup_seconds", 0.002)
    for rec in (rank0, rank1):
        rec.inc("loaded_tokens", 512)  # engine scope: only rank 0 counts
        rec.inc("chunk_hits", 2, tier="local_disk")
        rec.inc("read_bytes", 4096, tier="local_disk")
        rec.observe("load_seconds", 0.01)
    data = _step([rank0, rank1, scheduler])
    prom.observe(data, 0)
    logging_.observe(data)

    breaker["w1"] = 1  # Redis failed on rank 1 only: only rank 1 reports a change
    rank1.inc("failed_reads", tier="redis")
    data2 = _step([rank0, rank1, scheduler])
    assert set(data2["gauges"]) == {"breaker_open"}
    prom.observe(data2, 0)
    logging_.observe(data2)

    got = _scrape()
    e = (("engine", "0"),)
    assert got[("lmcache_vllm:hit_tokens_total", (("engine", "0"), ("tier", "local_disk")))] == 512
    assert got[("lmcache_vllm:loaded_tokens_total", e)] == 512
    assert got[("lmcache_vllm:chunk_hits_total", (("engine", "0"), ("tier", "local_disk")))] == 4
    assert got[("lmcache_vllm:read_bytes_total", (("engine", "0"), ("tier", "local_disk")))] == 8192
    assert got[("lmcache_vllm:load_seconds_count", e)] == 2
    assert got[("lmcache_vllm:load_seconds_bucket", (("engine", "0"), ("le", "0.01")))] == 2
    assert got[("lmcache_vllm:lookup_seconds_count", e)] == 1
    assert got[("lmcache_vllm:failed_reads_total", (("engine", "0"), ("tier", "redis")))] == 1
    # gauges: the latest value of each rank, summed (bytes) or the worst (breaker)
    assert got[("lmcache_vllm:used_bytes", (("engine", "0"), ("tier", "local_cpu")))] == 2000
    assert got[("lmcache_vllm:breaker_open", (("engine", "0"), ("tier", "redis")))] == 1

    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("KV Transfer metrics: ")
    assert "hit_tokens=512" in line and "loaded_tokens=512" in line and "local_disk_hit_chunks=4" in line
    assert "avg_load_ms=10.0" in line and "errors=1" in line


def test_an_idle_step_sends_nothing():
    from lmcache_vllm.integration.vllm.stats import take_stats

    take_stats()
    assert take_stats() is None
    metrics.inc("lookups")
    assert take_stats().data["counters"] == {"lookups": {"": 1}}


def test_api_server_import_of_the_connector_is_light():
    """vLLM's API-server process imports the connector class to build the metrics: that must not pull
    in the cache itself (engine, the storage tiers, arena) nor touch an accelerator; naming a tier
    (`storage.tier`) is fine."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
            "from vllm.config import KVTransferConfig\n"
            "cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector='LMCacheConnector',"
            " kv_connector_module_path='lmcache_vllm.integration.vllm', kv_role='kv_both'))\n"
            "heavy = [m for m in ('lmcache_vllm.engine.cache_engine', 'lmcache_vllm.storage.manager',"
            " 'lmcache_vllm.storage.base', 'lmcache_vllm.memory', 'lmcache_vllm.layouts') if m in sys.modules]\n"
            "print(cls.__name__, heavy, torch.cuda.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "LMCacheConnector [] False"
