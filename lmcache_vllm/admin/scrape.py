"""`stats`: reads a running server's `/metrics` and keeps our part (`lmcache_vllm:*`, plus vLLM's
`vllm:prompt_tokens_cached_by_source`), summed over vLLM's engines. Histograms are summarised as count,
mean and percentiles estimated from the buckets (the upper bound of the bucket holding the rank)."""
from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from lmcache_vllm.admin.report import human_bytes, table
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.tier import TIER_NAMES

_VLLM_LABELS = {"model_name", "engine"}


def fetch(url: str, timeout: float = 10.0) -> str:
    base = url.rstrip("/")
    target = base if base.endswith("/metrics") else base + "/metrics"
    with urllib.request.urlopen(target, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body.decode("utf-8", "replace")


def _label_key(labels: dict[str, str], names: tuple[str, ...]) -> str:
    return ",".join(labels.get(n, "") for n in names)


def parse(text: str) -> dict[str, Any]:
    """Our metrics from a Prometheus exposition text: `{"counters"|"gauges": {name: {label key: value}},
    "histograms": {name: {label key: {count, sum, buckets: [(le, cumulative count)]}}},
    "cached_by_source": {source: tokens}}`, names without the prefix (and without `_total`)."""
    out: dict[str, Any] = {"counters": {}, "gauges": {}, "histograms": {}, "cached_by_source": {}}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prompt_tokens_cached_by_source":
            for s in family.samples:
                if s.name.endswith("_total"):
                    src = s.labels.get("source", "")
                    out["cached_by_source"][src] = out["cached_by_source"].get(src, 0) + s.value
            continue
        if not family.name.startswith(metrics.PREFIX):
            continue
        name = family.name[len(metrics.PREFIX):]
        d = metrics.METRICS.get(name)
        if d is None:
            continue  # a metric of another lmcache-vllm version
        if d.kind == "histogram":
            series = out["histograms"].setdefault(name, {})
            for s in family.samples:
                lk = _label_key(s.labels, d.labels)
                h = series.setdefault(lk, {"count": 0.0, "sum": 0.0, "buckets": {}})
                if s.name.endswith("_count"):
                    h["count"] += s.value
                elif s.name.endswith("_sum"):
                    h["sum"] += s.value
                elif s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h["buckets"][le] = h["buckets"].get(le, 0.0) + s.value
            for h in series.values():
                h["buckets"] = sorted(h["buckets"].items())
            continue
        part = out["counters" if d.kind == "counter" else "gauges"].setdefault(name, {})
        for s in family.samples:
            if d.kind == "counter" and not s.name.endswith("_total"):
                continue  # the _created sample
            lk = _label_key(s.labels, d.labels)
            if d.kind == "gauge" and d.gauge_agg == "max":
                part[lk] = max(part.get(lk, s.value), s.value)
            else:
                part[lk] = part.get(lk, 0.0) + s.value
    return out


def quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    if not count:
        return None
    rank = q * count
    for le, cumulative in buckets:
        if cumulative >= rank:
            return le
    return float("inf")


def summary(scraped: dict[str, Any]) -> dict[str, Any]:
    """`parse`'s result with histograms as count / mean / p50 / p95 / p99 in milliseconds."""
    hists = {}
    for name, series in scraped["histograms"].items():
        for lk, h in series.items():
            ms: dict[str, float | None] = {"count": int(h["count"])}
            if h["count"]:
                ms["mean_ms"] = round(1000 * h["sum"] / h["count"], 3)
                for q in (0.5, 0.95, 0.99):
                    v = quantile(h["buckets"], h["count"], q)
                    ms[f"p{int(q * 100)}_ms_le"] = None if v is None else round(1000 * v, 3)
            hists[name + (f"{{{lk}}}" if lk else "")] = ms
    return {"counters": scraped["counters"], "gauges": scraped["gauges"], "histograms": hists,
            "cached_by_source": scraped["cached_by_source"]}


def _fmt(name: str, value: float) -> str:
    unit = metrics.METRICS[name].unit
    if unit == "bytes":
        return human_bytes(value)
    if unit == "seconds":
        return f"{value:.3f} s"
    return f"{value:g}"


def format_summary(s: dict[str, Any]) -> str:
    per_tier: dict[str, dict[str, float]] = {}
    other: list[tuple[str, str]] = []
    for part in ("counters", "gauges"):
        for name, series in s[part].items():
            d = metrics.METRICS[name]
            for lk, v in series.items():
                if d.labels == ("tier",):
                    per_tier.setdefault(name, {})[lk] = v
                else:
                    label = f"{name}{{{d.labels[0]}={lk}}}" if d.labels else name
                    other.append((label, _fmt(name, v)))
    lines = []
    if per_tier:
        rows = [(name, *(_fmt(name, per_tier[name][t]) if t in per_tier[name] else "-" for t in TIER_NAMES))
                for name in sorted(per_tier)]
        lines += [table(("per tier", *TIER_NAMES), rows), ""]
    if other:
        lines += [table(("metric", "value"), sorted(other)), ""]
    if s["histograms"]:
        rows = [(name, h["count"], h.get("mean_ms", "-"), h.get("p50_ms_le", "-"), h.get("p95_ms_le", "-"),
                 h.get("p99_ms_le", "-")) for name, h in sorted(s["histograms"].items())]
        lines += [table(("latency", "count", "mean ms", "p50 <= ms", "p95 <= ms", "p99 <= ms"), rows), ""]
    if s["cached_by_source"]:
        rows = sorted((src, f"{v:g}") for src, v in s["cached_by_source"].items())
        lines += [table(("vllm:prompt_tokens_cached_by_source", "tokens"), rows)]
    return "\n".join(lines).rstrip() or "no lmcache_vllm metrics at this address"
