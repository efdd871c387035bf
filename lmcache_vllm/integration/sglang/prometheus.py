"""Our metrics in SGLang's `/metrics`: every entry of the one metric table (`observability.metrics.METRICS`) as a
`prometheus_client` metric named `lmcache_vllm:<name>` (counters `_total`), labelled with the model and TP rank
of the scheduler process the backend lives in, plus the metric's own labels.

SGLang's scheduler processes (one per TP rank) hold the backends; with `--enable-metrics` SGLang points
prometheus_client at a multiprocess directory (`PROMETHEUS_MULTIPROC_DIR`) and its HTTP server's `/metrics`
collects every process's files, so metrics created and updated here appear there without a server of ours.
A daemon thread (`lmcache-sglang-metrics`) moves what the process recorded (`metrics.take()`) into them every
`INTERVAL_S`; it runs while a backend is open (reference-counted: `start` / `stop`) and flushes once more when
the last one closes. Gauges combine across processes as the table says (sum / max / min of the live processes).
"""
from __future__ import annotations

import threading
from typing import Any, Literal, Optional

from lmcache_vllm.observability import metrics

INTERVAL_S = 1.0
LABELS = ("model_name", "tp_rank")
_MODES: dict[str, Literal["livesum", "livemax", "livemin"]] = {"sum": "livesum", "max": "livemax",
                                                                "min": "livemin"}


class _Export:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        # Our own registry: in multiprocess mode the values go to SGLang's directory whatever the registry; in a
        # process that also holds vLLM's metrics of the same names (tests), nothing collides.
        self.registry = CollectorRegistry()
        self.families: dict[str, Any] = {}
        for d in metrics.METRIC_LIST:
            name, doc, labels = metrics.PREFIX + d.name, f"{d.help} [{d.unit}]", [*LABELS, *d.labels]
            if d.kind == "counter":
                self.families[d.name] = Counter(name, doc, labels, registry=self.registry)
            elif d.kind == "gauge":
                self.families[d.name] = Gauge(name, doc, labels, multiprocess_mode=_MODES[d.gauge_agg],
                                              registry=self.registry)
            else:
                self.families[d.name] = Histogram(name, doc, labels, buckets=list(d.buckets), registry=self.registry)
        self.base: tuple[str, str] = ("", "0")
        self.users = 0
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def child(self, name: str, lk: str) -> Any:
        ours = lk.split(",") if metrics.METRICS[name].labels else []
        return self.families[name].labels(*self.base, *ours)

    def flush(self) -> None:
        data = metrics.take()
        for name, series in (data.get("counters") or {}).items():
            for lk, n in series.items():
                if name in self.families and n > 0:
                    self.child(name, lk).inc(n)
        for name, series in (data.get("observations") or {}).items():
            for lk, values in series.items():
                if name in self.families:
                    child = self.child(name, lk)
                    for value in values:
                        child.observe(value)
        for name, series in (data.get("gauges") or {}).items():
            for lk, by_source in series.items():
                if name in self.families:
                    self.child(name, lk).set(metrics.combine_gauge(metrics.METRICS[name], by_source.values()))

    def run(self) -> None:
        while True:
            self.wake.wait(INTERVAL_S)
            with self.lock:
                self.wake.clear()
                self.flush()
                if self.users == 0:
                    self.thread = None
                    return


_export: Optional[_Export] = None
_export_lock = threading.Lock()


def start(model_name: str, tp_rank: int) -> None:
    """One more open backend in this process: the export runs (labelled with the first backend's model and rank)."""
    global _export
    with _export_lock:
        if _export is None:
            _export = _Export()
        export = _export
    with export.lock:
        if export.users == 0:
            export.base = (model_name, str(tp_rank))
        export.users += 1
        if export.thread is None:
            export.wake.clear()
            export.thread = threading.Thread(target=export.run, name="lmcache-sglang-metrics", daemon=True)
            export.thread.start()


def stop() -> None:
    """One backend fewer; with none left the thread flushes once more and ends (joined, bounded)."""
    export = _export
    if export is None:
        return
    with export.lock:
        export.users = max(0, export.users - 1)
        thread = export.thread if export.users == 0 else None
    if thread is not None:
        export.wake.set()
        thread.join(timeout=5.0)


def flush() -> Any:
    """Moves what was recorded so far into the Prometheus metrics now (tests; the thread does it every second);
    the registry that holds them in this process (None before any backend started)."""
    export = _export
    if export is None:
        return None
    with export.lock:
        export.flush()
    return export.registry
