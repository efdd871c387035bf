"""The one metrics model of lmcache-vllm: the table of every metric (`METRICS`, kept in
`metric_table.py` and re-exported here) and the process recorder.

- `METRICS` names each counter, gauge and histogram once, with its unit, help text and labels (`tier`:
  local_cpu / local_disk / redis / peer; `node`: a Redis server or cluster node). Prometheus exposes them as
  `lmcache_vllm:<name>` (counters with `_total`); the metric table in docs/METRICS.md is generated from it.
- Code anywhere in the process records with `inc(name, n, **labels)`, `observe(name, seconds, **labels)`
  or `timed(name)`; gauges are read when asked for, from functions given to `register_gauges` (a tier
  reports its bytes used, a breaker its state) so nothing has to keep them up to date.
- `snapshot()` gives the process's totals as a plain dict; `flat(snapshot)` / `value(name, **labels)`
  read it by name. `take()` gives what changed since the previous `take()` (vLLM asks every step) as a
  plain dict that crosses processes; `merge` combines such dicts across TP ranks and steps.
- Scope across tensor-parallel ranks: a `rank` metric is counted by every rank and summed (bytes, errors);
  an `engine` metric is counted once per engine, by the scheduler or by TP rank 0 (`set_primary`), so
  tokens are not counted once per rank. A gauge is reported per process (`source`) and combined
  across processes by its `gauge_agg`: the latest value of each source, then sum / max / min.

No vLLM, torch or prometheus import here: the model is plain Python and cheap (one lock, a dict update).
"""
from __future__ import annotations

import bisect
import os
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterable, Iterator

from lmcache_vllm.observability.metric_table import LATENCY_BUCKETS as LATENCY_BUCKETS
from lmcache_vllm.observability.metric_table import METRIC_LIST as METRIC_LIST
from lmcache_vllm.observability.metric_table import METRICS as METRICS
from lmcache_vllm.observability.metric_table import PREFIX as PREFIX
from lmcache_vllm.observability.metric_table import MetricDef as MetricDef

_MAX_PENDING_OBSERVATIONS = 4096  # per series between two take()s; more are counted in totals only

GaugeFn = Callable[[], Iterable[tuple[str, dict[str, str], float]]]  # yields (metric name, labels, value)


def _label_key(d: MetricDef, labels: dict[str, Any]) -> str:
    if len(labels) != len(d.labels):
        raise ValueError(f"metric {d.name!r} takes labels {d.labels}, got {tuple(labels)}")
    return ",".join(str(labels[name]) for name in d.labels)


def _definition(name: str, kind: str) -> MetricDef:
    d = METRICS.get(name)
    if d is None:
        raise KeyError(f"unknown metric {name!r}: declare it in lmcache_vllm/observability/metrics.py")
    if d.kind != kind:
        raise TypeError(f"metric {name!r} is a {d.kind}, not a {kind}")
    return d


_GAUGE_AGGREGATES: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}


def combine_gauge(d: MetricDef, values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        return 0.0
    return _GAUGE_AGGREGATES[d.gauge_agg](values)


class Recorder:
    """Counts of one process (thread-safe). Use the module functions, which record into `RECORDER`."""

    def __init__(self, source: str | None = None, gauge_interval_s: float = 0.0):
        self.source = source or f"{socket.gethostname()}:{os.getpid()}"
        self.primary = True  # False on TP ranks other than 0: `engine` metrics are not counted there
        # `take()` reads the gauges when it carries counts, else at most this often (see `take`).
        self.gauge_interval_s = gauge_interval_s
        self._gauges_read_at = float("-inf")
        self._lock = threading.Lock()
        self._gauge_fns: list[Callable[[], GaugeFn | None]] = []
        self.reset()

    def reset(self) -> None:
        """Forgets every count (tests); gauge functions stay registered."""
        with self._lock:
            self._counters: dict[str, dict[str, float]] = {}
            self._hists: dict[str, dict[str, list[Any]]] = {}  # lk -> [count, sum, bucket counts]
            self._pending_counters: dict[str, dict[str, float]] = {}
            self._pending_obs: dict[str, dict[str, list[float]]] = {}
            self._sent_gauges: dict[str, dict[str, float]] = {}

    # ---- recording ------------------------------------------------------------------------------
    def inc(self, name: str, n: float = 1, **labels: Any) -> None:
        d = _definition(name, "counter")
        if not n or (d.scope == "engine" and not self.primary):
            return
        lk = _label_key(d, labels)
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[lk] = series.get(lk, 0) + n
            pending = self._pending_counters.setdefault(name, {})
            pending[lk] = pending.get(lk, 0) + n

    def observe(self, name: str, value: float, **labels: Any) -> None:
        d = _definition(name, "histogram")
        if d.scope == "engine" and not self.primary:
            return
        lk = _label_key(d, labels)
        with self._lock:
            hist = self._hists.setdefault(name, {}).get(lk)
            if hist is None:
                hist = self._hists[name][lk] = [0, 0.0, [0] * (len(d.buckets) + 1)]
            hist[0] += 1
            hist[1] += value
            hist[2][bisect.bisect_left(d.buckets, value)] += 1
            pending = self._pending_obs.setdefault(name, {}).setdefault(lk, [])
            if len(pending) < _MAX_PENDING_OBSERVATIONS:  # nobody asking (no vLLM): totals only
                pending.append(value)

    @contextmanager
    def timed(self, name: str, **labels: Any) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - t0, **labels)

    def register_gauges(self, fn: GaugeFn) -> Callable[[], None]:
        """Adds a function reporting gauges; returns the function that removes it. A bound method is
        held weakly, so an object that is never closed does not live on because of it."""
        ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        with self._lock:
            self._gauge_fns.append(ref)

        def unregister() -> None:
            with self._lock:
                if ref in self._gauge_fns:
                    self._gauge_fns.remove(ref)
        return unregister

    # ---- reading ---------------------------------------------------------------------------------
    def _gauges(self) -> dict[str, dict[str, float]]:
        """Current gauge values of this process (several reporters of one series combine by agg)."""
        with self._lock:
            refs = list(self._gauge_fns)
        parts: dict[str, dict[str, list[float]]] = {}
        for ref in refs:
            fn = ref()
            if fn is None:
                with self._lock:
                    if ref in self._gauge_fns:
                        self._gauge_fns.remove(ref)
                continue
            try:
                for name, labels, value in fn():
                    d = _definition(name, "gauge")
                    parts.setdefault(name, {}).setdefault(_label_key(d, labels), []).append(float(value))
            except Exception:  # a gauge must never break the stats path
                continue
        return {name: {lk: combine_gauge(METRICS[name], vals) for lk, vals in series.items()}
                for name, series in parts.items()}

    def snapshot(self) -> dict[str, Any]:
        """Totals since start (or `reset`) as a plain dict."""
        gauges = self._gauges()
        with self._lock:
            counters = {n: dict(s) for n, s in self._counters.items()}
            hists = {n: {lk: {"count": h[0], "sum": h[1], "buckets": list(h[2])} for lk, h in s.items()}
                     for n, s in self._hists.items()}
        return {"source": self.source, "counters": counters,
                "gauges": {n: {lk: {self.source: v} for lk, v in s.items()} for n, s in gauges.items()},
                "histograms": hists}

    def take(self) -> dict[str, Any]:
        """What changed since the previous `take()` (or since start): counter increments, observations,
        and gauges whose value changed (the first call reports every gauge).

        vLLM asks every step, and reading every gauge function (tiers, breakers, queues) took ~0.1 ms: on a
        5 ms decode step, most of what the connector cost a request that reuses nothing. A gauge moves when
        something is counted (a store, a load, an eviction), so the gauges are read with any take that
        carries counts or observations, and otherwise at most every `gauge_interval_s`."""
        with self._lock:
            quiet = not self._pending_counters and not self._pending_obs
        now = time.monotonic()
        gauges: dict[str, dict[str, float]] = {}
        if not quiet or now - self._gauges_read_at >= self.gauge_interval_s:
            gauges, self._gauges_read_at = self._gauges(), now
        with self._lock:
            counters, self._pending_counters = self._pending_counters, {}
            obs, self._pending_obs = self._pending_obs, {}
            changed: dict[str, dict[str, dict[str, float]]] = {}
            for name, series in gauges.items():
                sent = self._sent_gauges.setdefault(name, {})
                for lk, v in series.items():
                    if sent.get(lk) != v:
                        sent[lk] = v
                        changed.setdefault(name, {})[lk] = {self.source: v}
        return {"counters": counters, "gauges": changed, "observations": obs}


GAUGE_INTERVAL_S = 1.0  # the process recorder's: a gauge that moves with nothing counted is at most this late
RECORDER = Recorder(gauge_interval_s=GAUGE_INTERVAL_S)


def inc(name: str, n: float = 1, **labels: Any) -> None:
    RECORDER.inc(name, n, **labels)


def observe(name: str, value: float, **labels: Any) -> None:
    RECORDER.observe(name, value, **labels)


def timed(name: str, **labels: Any) -> ContextManager[None]:
    return RECORDER.timed(name, **labels)


def register_gauges(fn: GaugeFn) -> Callable[[], None]:
    return RECORDER.register_gauges(fn)


def set_primary(primary: bool) -> None:
    """False on TP ranks other than 0 (their `engine` metrics are counted by rank 0)."""
    RECORDER.primary = bool(primary)


def snapshot() -> dict[str, Any]:
    return RECORDER.snapshot()


def take() -> dict[str, Any]:
    return RECORDER.take()


# ---- plain-dict helpers (deltas from take() and snapshots alike) -------------------------------------
def is_empty(delta: dict[str, Any]) -> bool:
    return not any(delta.get(part) for part in ("counters", "gauges", "observations", "histograms"))


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` and `b` combined (neither is modified): counters and observations add up, histogram totals
    add up, gauges keep each source's value (from `b` when both have it)."""
    out: dict[str, Any] = {}
    for n, s in (a.get("counters") or {}).items():
        out.setdefault("counters", {})[n] = dict(s)
    for n, s in (b.get("counters") or {}).items():
        dst = out.setdefault("counters", {}).setdefault(n, {})
        for lk, v in s.items():
            dst[lk] = dst.get(lk, 0) + v
    for part in ("gauges",):
        for src in (a, b):
            for n, s in (src.get(part) or {}).items():
                dst = out.setdefault(part, {}).setdefault(n, {})
                for lk, by_source in s.items():
                    dst.setdefault(lk, {}).update(by_source)
    for src in (a, b):
        for n, s in (src.get("observations") or {}).items():
            dst = out.setdefault("observations", {}).setdefault(n, {})
            for lk, values in s.items():
                dst[lk] = dst.get(lk, []) + list(values)
        for n, s in (src.get("histograms") or {}).items():
            dst = out.setdefault("histograms", {}).setdefault(n, {})
            for lk, h in s.items():
                have = dst.get(lk)
                dst[lk] = dict(h, buckets=list(h["buckets"])) if have is None else {
                    "count": have["count"] + h["count"], "sum": have["sum"] + h["sum"],
                    "buckets": [x + y for x, y in zip(have["buckets"], h["buckets"])]}
    return out


def _series_name(name: str, lk: str) -> str:
    return f"{name}.{lk}" if lk else name


def flat(data: dict[str, Any]) -> dict[str, float]:
    """A snapshot or delta as `{"name" or "name.label": value}`: counters, combined gauges, and for
    histograms `name[.label].count` / `.sum` (tests, benchmarks, offline job output)."""
    out: dict[str, float] = {}
    for n, s in (data.get("counters") or {}).items():
        for lk, v in s.items():
            out[_series_name(n, lk)] = v
    for n, s in (data.get("gauges") or {}).items():
        for lk, by_source in s.items():
            out[_series_name(n, lk)] = combine_gauge(METRICS[n], by_source.values())
    for n, s in (data.get("histograms") or {}).items():
        for lk, h in s.items():
            out[_series_name(n, lk) + ".count"] = h["count"]
            out[_series_name(n, lk) + ".sum"] = h["sum"]
    for n, s in (data.get("observations") or {}).items():
        for lk, values in s.items():
            out[_series_name(n, lk) + ".count"] = len(values)
            out[_series_name(n, lk) + ".sum"] = sum(values)
    return out


def value(name: str, data: dict[str, Any] | None = None, **labels: Any) -> float:
    """One series of `data` (default: this process's snapshot); a histogram gives its count; 0 when
    nothing was recorded."""
    d = METRICS[name]
    key = _series_name(name, _label_key(d, labels))
    if d.kind == "histogram":
        key += ".count"
    return flat(snapshot() if data is None else data).get(key, 0)
