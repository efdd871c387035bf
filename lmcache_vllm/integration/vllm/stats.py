"""Our metrics through vLLM's connector-stats hooks: `vllm serve`'s `/metrics` and its periodic log line.

vLLM asks every worker's connector, and the scheduler's, for `get_kv_connector_stats()` once per step;
each answers `take_stats()`: what `lmcache_vllm.observability.metrics` recorded in its process since it last asked.
vLLM combines the answers of all TP ranks and the scheduler with `LMCacheConnectorStats.aggregate`,
sends the plain dict to its API-server process, and there
- `LMCachePromMetrics.observe` turns it into the `lmcache_vllm:*` Prometheus metrics, one per entry of
  `metrics.METRICS`, labelled with vLLM's model_name/engine labels plus ours (tier, reason, op);
- `LMCacheConnectorStats.reduce` gives the short summary of vLLM's "KV Transfer metrics" log line.
Gauges come as the latest value of each reporting process; the Prometheus side remembers them per process
and combines them (sum / max) as the metric table says. Counts a background save makes after a burst's
last step reach vLLM with the next step.

The API server imports this module to build the metrics: it needs vLLM's metrics base classes and
`lmcache_vllm.observability.metrics` only (no torch, no GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.tier import TIER_NAMES

# The short summary in vLLM's periodic log line: these counters over the interval (all labels summed).
_SUMMARY_COUNTERS = ("hit_tokens", "loaded_tokens", "stored_tokens", "failed_load_tokens")
_ERROR_COUNTERS = ("failed_stores", "failed_reads", "failed_writes", "corrupt_chunks", "dropped_stores",
                   "storage_timeouts", "storage_errors", "lookup_timeouts")


@dataclass
class LMCacheConnectorStats(KVConnectorStats):
    """`data` is a `metrics.take()` dict (or several merged): counters, gauges, observations."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LMCacheConnectorStats":
        self.data = metrics.merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return metrics.is_empty(self.data)

    def reduce(self) -> dict[str, int | float]:
        flat = metrics.flat(self.data)
        out: dict[str, int | float] = {}
        for name in _SUMMARY_COUNTERS:
            out[name] = int(sum(v for k, v in flat.items() if k.split(".")[0] == name))
        for tier in TIER_NAMES:
            out[f"{tier}_hit_chunks"] = int(flat.get(f"chunk_hits.{tier}", 0))
        for name in ("load_seconds", "store_seconds", "lookup_seconds"):
            count = flat.get(f"{name}.count", 0)
            if count:
                out[f"avg_{name[:-len('_seconds')]}_ms"] = round(1000 * flat[f"{name}.sum"] / count, 3)
        out["errors"] = int(sum(v for k, v in flat.items() if k.split(".")[0] in _ERROR_COUNTERS))
        return out


def take_stats() -> LMCacheConnectorStats | None:
    """This process's changes since the last call, or None when nothing changed."""
    delta = metrics.take()
    return None if metrics.is_empty(delta) else LMCacheConnectorStats(data=delta)


def _unregister_ours() -> None:
    """A second stat logger in one process (tests, engine restarts) must not find our names taken;
    vLLM does the same for its own `vllm:` metrics."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(metrics.PREFIX):
            REGISTRY.unregister(collector)


class LMCachePromMetrics(KVConnectorPromMetrics):
    """One Prometheus metric per `metrics.METRICS` entry, created through vLLM's metric types."""

    def __init__(self, vllm_config, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()
        self._families: dict[str, Any] = {}
        for d in metrics.METRIC_LIST:
            kwargs: dict[str, Any] = {"name": metrics.PREFIX + d.name,
                                      "documentation": f"{d.help} [{d.unit}]",
                                      "labelnames": list(labelnames) + list(d.labels)}
            if d.kind == "counter":
                cls = self._counter_cls
            elif d.kind == "gauge":
                cls = self._gauge_cls
                kwargs["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kwargs["buckets"] = list(d.buckets)
            self._families[d.name] = cls(**kwargs)
        self._children: dict[tuple[int, str, str], Any] = {}
        # (engine, metric, label key) -> {source process: latest value}
        self._gauge_values: dict[tuple[int, str, str], dict[str, float]] = {}

    def _child(self, engine_idx: int, name: str, lk: str):
        key = (engine_idx, name, lk)
        child = self._children.get(key)
        if child is None:
            ours = lk.split(",") if metrics.METRICS[name].labels else []
            child = self._families[name].labels(*self.per_engine_labelvalues[engine_idx], *ours)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for name, series in (data.get("counters") or {}).items():
            if name in self._families:
                for lk, n in series.items():
                    if n > 0:
                        self._child(engine_idx, name, lk).inc(n)
        for name, series in (data.get("observations") or {}).items():
            if name in self._families:
                for lk, values in series.items():
                    child = self._child(engine_idx, name, lk)
                    for v in values:
                        child.observe(v)
        for name, series in (data.get("gauges") or {}).items():
            if name in self._families:
                for lk, by_source in series.items():
                    latest = self._gauge_values.setdefault((engine_idx, name, lk), {})
                    latest.update(by_source)
                    self._child(engine_idx, name, lk).set(
                        metrics.combine_gauge(metrics.METRICS[name], latest.values()))
