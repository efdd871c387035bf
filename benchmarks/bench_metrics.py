"""Cost of the metrics model on the serving path.

1. `metrics.inc` (with a tier label), `metrics.observe` and a `timed` block, against the cheapest count there
   is, a plain dict increment, measured in the same run: `inc_vs_dict_ratio = t_dict / t_inc` (< 1: slower).
2. What vLLM asks every step (`get_kv_connector_stats` -> `metrics.take()`), after the counts one loaded
   request records (~20 counter increments, 3 observations), with a real StorageManager (L1 + disk tier)
   reporting its gauges; against the time the same records took to make.
"""
from __future__ import annotations

import tempfile

from _common import best_of, parse_args, print_table, write_json

from lmcache_vllm.config import load_config
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.manager import StorageManager


def per_call_ns(fn, n: int, repeats: int) -> float:
    def run():
        for _ in range(n):
            fn()
    return best_of(run, repeats) / n * 1e9


def one_request() -> None:
    """Roughly what one loaded and stored request records."""
    metrics.inc("lookups")
    metrics.inc("lookups_in_process")
    metrics.observe("lookup_seconds", 0.0002)
    metrics.inc("hit_tokens", 512, tier="local_cpu")
    metrics.inc("load_requests")
    for _ in range(2):
        metrics.inc("chunk_hits", tier="local_cpu")
        metrics.inc("read_bytes", 1 << 20, tier="local_cpu")
        metrics.inc("stored_chunks", tier="local_cpu")
        metrics.inc("stored_bytes", 1 << 20, tier="local_cpu")
        metrics.inc("stored_chunks", tier="local_disk")
        metrics.inc("stored_bytes", 1 << 20, tier="local_disk")
        metrics.observe("tier_write_seconds", 0.001, tier="local_disk")
    metrics.inc("loaded_tokens", 512)
    metrics.observe("load_seconds", 0.002)
    metrics.inc("stored_tokens", 256)
    metrics.inc("store_skipped_tokens", 512)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n, repeats = (20_000, 3) if args.quick else (200_000, 5)
    plain: dict[str, int] = {}

    def dict_inc():
        plain["chunk_hits"] = plain.get("chunk_hits", 0) + 1

    t_dict = per_call_ns(dict_inc, n, repeats)
    t_inc = per_call_ns(lambda: metrics.inc("chunk_hits", tier="local_cpu"), n, repeats)
    t_observe = per_call_ns(lambda: metrics.observe("load_seconds", 0.003), n, repeats)

    def timed_block():
        with metrics.timed("lookup_seconds"):
            pass
    t_timed = per_call_ns(timed_block, n // 4, repeats)

    with tempfile.TemporaryDirectory() as disk:
        cfg = load_config(overrides={"max_local_cpu_size": 0.05, "local_disk": disk, "max_local_disk_size": 0.1})
        with StorageManager(cfg):
            metrics.take()
            t_request = best_of(one_request, repeats * 20) * 1e6

            def step():
                one_request()
                metrics.take()
            t_step = best_of(step, repeats * 20) * 1e6
            t_take = t_step - t_request
            metrics.take()
            t_idle_take = best_of(metrics.take, repeats * 20) * 1e6

    results = {
        "dict_inc_ns": t_dict, "metrics_inc_ns": t_inc, "metrics_observe_ns": t_observe,
        "metrics_timed_ns": t_timed, "inc_vs_dict_ratio": t_dict / t_inc,
        "one_request_records_us": t_request, "take_after_one_request_us": t_take,
        "take_idle_us": t_idle_take,
    }
    print_table("metrics model costs", [(k, v) for k, v in results.items()], ("measure", "value"))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
