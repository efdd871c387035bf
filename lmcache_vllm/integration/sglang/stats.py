"""What the backend tells SGLang's own storage metrics (`get_stats()`, asked when SGLang runs with its metrics on,
`--enable-metrics`: SGLang's `enable_storage_metrics`): pages and GB/s per backup and prefetch call, SGLang's
`StorageMetrics` lists; and the time of every call, into our metrics model (`sglang_call_seconds`).

The lists are kept only while SGLang asks for them (`enable_storage_metrics`), and at most `MAX_PENDING` calls
between two asks, so a server nobody scrapes does not grow them.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from lmcache_vllm.observability import metrics

MAX_PENDING = 4096


class Call:
    def __init__(self) -> None:
        self.pages = 0
        self.bytes = 0

    def done(self, pages: int, page_bytes: int) -> None:
        self.pages = pages
        self.bytes = pages * page_bytes


class CallStats:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._lists: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                               "backup_bandwidth": []}

    @contextmanager
    def call(self, op: str) -> Iterator[Call]:
        call = Call()
        t0 = time.perf_counter()
        try:
            yield call
        finally:
            seconds = time.perf_counter() - t0
            metrics.observe("sglang_call_seconds", seconds, op=op)
            if self.enabled and op in ("get", "set") and call.pages:
                kind = "prefetch" if op == "get" else "backup"
                with self._lock:
                    pages, bandwidth = self._lists[f"{kind}_pgs"], self._lists[f"{kind}_bandwidth"]
                    if len(pages) < MAX_PENDING:
                        pages.append(call.pages)
                        bandwidth.append(call.bytes / 1e9 / max(seconds, 1e-9))

    def take(self) -> Optional[Any]:
        """SGLang's `StorageMetrics` with the calls since the last take (None when not enabled)."""
        if not self.enabled:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._lock:
            for name, values in self._lists.items():
                getattr(out, name).extend(values)
                values.clear()
        return out
