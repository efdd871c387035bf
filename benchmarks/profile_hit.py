"""Where a cached request's time goes: cProfile over warm hits of an in-process `LLM()` with the connector.

    python benchmarks/profile_hit.py [--quick] [--model medium|tiny] [--len N] [--hits N] [--chunk-size N]
                                     [--top N] [--out FILE] [--overlap-loads auto|on|off] [--ab ROUNDS]
                                     [--from l1|disk]

One vLLM engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, model bound to core 0 as in
`bench_e2e_ttft.py`), our connector with L1 only. A prompt is computed once (cold, stored), then asked for
again `--hits` times with max_tokens=1 under cProfile: every hit loads from L1. Printed: the wall time per
hit, the connector's own functions (cumulative time per hit: lookup, load, the compiled scatter, stats), and
the top functions by cumulative and by own time. The profiler adds its own cost to every Python call, so the
per-call Python is overstated a little against the compiled copy; compare runs of this script, not with
timings taken without it.

`--ab ROUNDS` measures instead of profiling: vLLM's prefix cache is on, and each round asks the prompt twice,
once served by vLLM's own prefix cache (the prompt was just computed) and once by ours (vLLM's cache reset
first, so our L1 serves the same 3840 tokens); the rounds alternate which goes first. Both run in this one
process with the same thread binding, so the ratio of the medians (ours / vLLM's own hit) is the load's cost
without the differences between processes; the connector's counters say how long the forward waited for the
load thread (`load_wait_seconds`) and how long the step spent starting loads (`load_seconds`).

`--from disk` adds a disk tier and empties L1 (after the writes to disk are done) before each of our hits,
so that every one is served from the disk tier's files: what the disk path costs beyond L1's, in either mode.
The chunk files are written with O_DIRECT, so only the first (unmeasured) hit reads them from the device; the
measured hits find them in the page cache. A fresh process's first hit of what another process stored reads
the device (`bench_e2e_ttft.py` measures that).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

# What the connector does per hit: a label, then the function that does it (file suffix:function name).
CONNECTOR_FUNCTIONS = """
lookup: scheduler asks the worker     = integration/vllm/scheduler.py:get_num_new_matched_tokens
lookup: worker answers                = integration/vllm/loads.py:lookup
lookup: keys and holds                = engine/cache_engine.py:lookup_and_hold
load: start_load_kv                   = integration/vllm/worker.py:start_load_kv
load: the pipeline's load             = integration/vllm/load_pipeline.py:_load
load: engine.retrieve                 = engine/cache_engine.py:retrieve
load: storage.get                     = storage/manager.py:get
load: compiled scatter (per chunk)    = lmcache_vllm/ops.py:transfer
load: compiled scatter (all chunks)   = lmcache_vllm/ops.py:transfer_chunks
save: wait_for_save                   = integration/vllm/worker.py:wait_for_save
meta: build_connector_meta            = integration/vllm/scheduler.py:build_connector_meta
stats: take_stats                     = integration/vllm/stats.py:take_stats
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1400 tokens, 5 hits")
    parser.add_argument("--model", default=None, help="local model size (default medium; tiny with --quick)")
    parser.add_argument("--len", type=int, default=None, help="prompt tokens (default 3900; 1400 with --quick)")
    parser.add_argument("--hits", type=int, default=None, help="warm requests profiled (default 10; 5 with --quick)")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk_size (default: unset, the connector's)")
    parser.add_argument("--top", type=int, default=25, help="rows of each top list")
    parser.add_argument("--out", default=None, help="also write the raw profile (pstats) to this file")
    parser.add_argument("--timer", choices=("thread", "wall"), default="thread",
                        help="the profile's clock: this thread's CPU time (default: steadier on a shared machine, "
                             "waits not counted) or wall time")
    parser.add_argument("--overlap-loads", choices=("auto", "on", "off"), default=None,
                        help="extra_config.overlap_loads (default: unset, the connector's default)")
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                        help="measure our hit against vLLM's own prefix-cache hit in this process (no profile)")
    parser.add_argument("--from", dest="tier", choices=("l1", "disk"), default="l1",
                        help="the tier our hits come from (default l1; disk: L1 emptied before each)")
    args = parser.parse_args(argv)
    size = args.model or ("tiny" if args.quick else "medium")
    prompt_len = args.len or (1400 if args.quick else 3900)
    hits = args.hits or (5 if args.quick else 10)

    from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, random_tokens, vllm_env

    tmp = Path(tempfile.mkdtemp(prefix="lmv-profile-"))
    os.environ.update(vllm_env(tmp, kv_cache_gib=2))  # before torch loads OpenMP, which reads its variables then
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    extra: dict = {"max_local_cpu_size": 2}
    if args.chunk_size:
        extra["chunk_size"] = args.chunk_size
    if args.overlap_loads:
        extra["extra_config"] = {"overlap_loads": args.overlap_loads}
    if args.tier == "disk":
        extra.update(local_disk=str(tmp / "l2"), max_local_disk_size=4)
    llm = LLM(model=str(build_model(size)), dtype="bfloat16", max_model_len=prompt_len + 256, enforce_eager=True,
              seed=0, enable_prefix_caching=bool(args.ab), max_num_batched_tokens=max(8192, prompt_len + 64),
              kv_transfer_config=KVTransferConfig(**dict(CONNECTOR, kv_role="kv_both",
                                                         kv_connector_extra_config=extra)))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = TokensPrompt(prompt_token_ids=random_tokens(5, prompt_len))
    llm.generate([TokensPrompt(prompt_token_ids=random_tokens(6, 300))], one, use_tqdm=False)  # warm-up
    llm.generate([prompt], one, use_tqdm=False)  # cold: computed and stored
    time.sleep(1.0)  # the cold request's background save finishes
    before_hit = drop_l1 if args.tier == "disk" else (lambda: None)
    before_hit()
    out = llm.generate([prompt], one, use_tqdm=False)  # first hit: unprofiled (one-time costs)
    cached = out[0].num_cached_tokens
    if args.ab:
        ab_rounds(llm, prompt, one, args.ab, before_hit)
        llm.llm_engine.engine_core.shutdown()
        return 0
    profiler = cProfile.Profile(time.thread_time if args.timer == "thread" else time.perf_counter)
    walls = []
    for _ in range(hits):
        before_hit()
        t0 = time.perf_counter()
        profiler.enable()
        llm.generate([prompt], one, use_tqdm=False)
        profiler.disable()
        walls.append(time.perf_counter() - t0)
    stats = pstats.Stats(profiler)
    if args.out:
        stats.dump_stats(args.out)
    print(f"model {size}, prompt {prompt_len} tokens, {cached} from our {args.tier} per hit; {hits} hits profiled "
          f"({args.timer} clock): wall per hit best {min(walls) * 1e3:.1f} ms, median "
          f"{sorted(walls)[len(walls) // 2] * 1e3:.1f} ms")
    entries = stats.stats  # type: ignore[attr-defined]
    print("\nthe connector's work per hit (cumulative ms; calls per hit):")
    for line in CONNECTOR_FUNCTIONS.strip().splitlines():
        label, _, where = (part.strip() for part in line.partition("="))
        suffix, _, name = where.partition(":")
        found = [(v[3], v[1]) for (path, _line, fn), v in entries.items() if fn == name and path.endswith(suffix)]
        if found:
            cum, calls = sum(f[0] for f in found), sum(f[1] for f in found)
            print(f"  {label:<40}{cum / hits * 1e3:>8.2f} ms {calls / hits:>7.1f}")
    print(f"\ntop {args.top} by cumulative time:")
    stats.sort_stats("cumulative").print_stats(args.top)
    print(f"top {args.top} by own time:")
    stats.sort_stats("tottime").print_stats(args.top)
    llm.llm_engine.engine_core.shutdown()
    return 0


def drop_l1() -> None:
    """Empties our L1 once the writes to the disk tier are done: the next hit of ours comes from disk."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from lmcache_vllm.integration.vllm.offline_job import flush_writes

    flush_writes()
    get_kv_transfer_group()._worker.engine.clear(lower_tiers=False)


def ab_rounds(llm, prompt, one, rounds: int, before_hit) -> None:
    """Our hit against vLLM's own prefix-cache hit of the same prompt, alternating, in this process
    (`before_hit()` before each of ours, untimed)."""
    from vllm.inputs import TokensPrompt

    from lmcache_vllm.integration.vllm.testing.vllm_jobs import random_tokens
    from lmcache_vllm.observability import metrics

    short = TokensPrompt(prompt_token_ids=random_tokens(8, 16))  # never stored: only moves the engine on

    def reset() -> None:
        """Empties vLLM's own prefix cache (ours stays). vLLM frees a request's blocks once our saves of it are
        reported over, in a later step: short requests make those steps."""
        for _ in range(20):
            if llm.reset_prefix_cache():
                return
            llm.generate([short], one, use_tqdm=False)
            time.sleep(0.05)
        raise RuntimeError("vLLM did not reset its prefix cache")

    def hit(ours: bool) -> tuple[float, int]:
        if ours:
            reset()  # vLLM's own cache only: ours serves the next request
            before_hit()
        else:
            llm.generate([prompt], one, use_tqdm=False)  # computed or loaded: now in vLLM's prefix cache
        t0 = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - t0, out[0].num_cached_tokens

    times: dict[bool, list[float]] = {True: [], False: []}
    before = metrics.flat(metrics.snapshot())
    for r in range(rounds):
        for ours in ((True, False) if r % 2 else (False, True)):
            seconds, cached = hit(ours)
            times[ours].append(seconds)
    after = metrics.flat(metrics.snapshot())
    ours_s, vllm_s = statistics.median(times[True]), statistics.median(times[False])
    waited = after.get("load_wait_seconds", 0.0) - before.get("load_wait_seconds", 0.0)
    started = after.get("load_seconds.sum", 0.0) - before.get("load_seconds.sum", 0.0)
    loads = after.get("load_seconds.count", 0.0) - before.get("load_seconds.count", 0.0)
    print(f"{rounds} rounds, {cached} tokens cached per hit: ours median {ours_s * 1e3:.1f} ms (best "
          f"{min(times[True]) * 1e3:.1f}), vLLM's own hit median {vllm_s * 1e3:.1f} ms (best "
          f"{min(times[False]) * 1e3:.1f}); ours / vLLM's = {ours_s / vllm_s:.3f} (medians), "
          f"{min(times[True]) / min(times[False]):.3f} (bests)")
    print(f"per load of ours: the step started it in {1e3 * started / max(1, loads):.2f} ms, the forward waited "
          f"{1e3 * waited / max(1, loads):.2f} ms for the load thread ({int(loads)} loads)")


if __name__ == "__main__":
    sys.exit(main())
