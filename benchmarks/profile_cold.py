"""What the connector costs a request that reuses nothing, measured inside one process.

    python benchmarks/profile_cold.py [--quick] [--model medium|tiny] [--len N] [--prompts N]
                                      [--output-tokens N] [--rounds N] [--no-disk]

`bench_zero_reuse.py` compares whole processes, whose speeds differ by a few percent whatever they run (its
noise floor), so it cannot resolve a cost of 1 %. This script runs the same workload (batches of new prompts,
the connector's defaults with L1 and a disk tier, vLLM's prefix cache off) in one in-process engine, bound as
a worker is (`vllm_jobs.vllm_env`), and switches what the connector does between batches, on its scheduler
half, which alone decides what is looked up and saved (`SETTINGS`):

- `defaults`: lookups and saves, `save_decode_cache` on (the default);
- `no_decode`: the same with `save_decode_cache` off;
- `inert`: vLLM calls every hook, but nothing is looked up or saved.

Each round runs one batch per setting, in rotating order; the speed of a setting is the inert batch's wall
time over its own in the same round (the median over rounds is printed). So `defaults`' speed is what the
lookups, saves and their background work (the GIL they take, the memory they touch) cost vLLM's step; what
the hooks cost even when inert is measured directly: every public method of the connector that vLLM calls
is timed on vLLM's step thread (the scheduler's and the worker's halves both run on it in an in-process
engine), by method, against the batch's wall time. The CPU seconds of the connector's background threads
(`lmcache-*`, bound off the model's core) are shown per batch. After each batch the saves and disk writes it
handed out are waited for, untimed (how long after the batch they ended is shown), so no batch's time holds
another's writes.

Full: the `medium` local Llama, 4 prompts x 3900 tokens, 256 output tokens, 3 rounds. --quick: `tiny`, 1400
tokens, 32 output tokens, 8 rounds. Every batch's prompts are new (no hits: checked).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

STEP_TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # method -> [seconds, calls]
_depth = [0]  # public methods calling each other (get_transfer_results -> get_finished): the outer one counts


def time_connector_methods(cls: type) -> None:
    """Wraps `cls`'s public methods so that their time on the main thread (vLLM's step) is added up."""
    main_thread = threading.main_thread()
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not callable(fn) or isinstance(fn, (classmethod, staticmethod, type)):
            continue

        def timed(*args, __fn=fn, __name=name, **kwargs):
            if threading.current_thread() is not main_thread or _depth[0]:
                return __fn(*args, **kwargs)
            _depth[0] += 1
            t0 = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                _depth[0] -= 1
                entry = STEP_TIMES[__name]
                entry[0] += time.perf_counter() - t0
                entry[1] += 1

        setattr(cls, name, functools.wraps(fn)(timed))


# What the scheduler's half does, per setting: (can_load, can_save, save_decode_cache). `inert`: vLLM still calls
# every hook, but nothing is looked up or saved; the hooks' own time is what the step accounting shows.
SETTINGS = {"defaults": (True, True, True), "no_decode": (True, True, False), "inert": (False, False, True)}


def our_thread_cpu() -> float:
    from lmcache_vllm.integration.vllm.offline_job import connector_thread_cpu, thread_cpu

    return connector_thread_cpu(thread_cpu())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1400 tokens, 32 output tokens, 8 rounds")
    parser.add_argument("--model", default=None, help="local model size (default medium; tiny with --quick)")
    parser.add_argument("--len", type=int, default=None, help="prompt tokens (default 3900; 1400 with --quick)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per batch (default 4)")
    parser.add_argument("--output-tokens", type=int, default=None, help="generated tokens (default 256; --quick 32)")
    parser.add_argument("--no-disk", action="store_true", help="L1 only (default: L1 and a disk tier)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of one batch per setting (default 3; "
                        "--quick 8)")
    args = parser.parse_args(argv)
    size = args.model or ("tiny" if args.quick else "medium")
    prompt_len = args.len or (1400 if args.quick else 3900)
    output_tokens = args.output_tokens or (32 if args.quick else 256)
    rounds = args.rounds or (8 if args.quick else 3)

    from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, random_tokens, vllm_env

    tmp = Path(tempfile.mkdtemp(prefix="lmv-profile-cold-"))
    os.environ.update(vllm_env(tmp, kv_cache_gib=2))  # before torch loads OpenMP, which reads its variables then
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from lmcache_vllm.integration.vllm.connector import LMCacheConnector
    from lmcache_vllm.integration.vllm.offline_job import flush_writes
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    time_connector_methods(LMCacheConnector)
    extra: dict = {"max_local_cpu_size": 2.0, "extra_config": {"prefault_local_cpu": "sync"}}
    if not args.no_disk:
        extra.update(local_disk=str(tmp / "l2"), max_local_disk_size=4.0)
    llm = LLM(model=str(build_model(size)), dtype="bfloat16", max_model_len=prompt_len + output_tokens + 64,
              enforce_eager=True, seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=max(8192, args.prompts * (prompt_len + 64)),
              kv_transfer_config=KVTransferConfig(**dict(CONNECTOR, kv_role="kv_both",
                                                         kv_connector_extra_config=extra)))
    scheduler_half = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    sampling = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    seed = iter(range(10_000, 1_000_000, 100))

    def batch(setting: str) -> tuple[float, float, float, dict[str, float]]:
        scheduler_half.can_load, scheduler_half.can_save, scheduler_half.save_decode_cache = SETTINGS[setting]
        prompts = [TokensPrompt(prompt_token_ids=random_tokens(next(seed), prompt_len)) for _ in range(args.prompts)]
        STEP_TIMES.clear()
        cpu0, t0 = our_thread_cpu(), time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        flush_writes()  # untimed: what a batch stored does not spill into the next one's time
        flushed = time.perf_counter() - t0 - wall
        if any(o.num_cached_tokens for o in outs):
            raise RuntimeError("a new prompt was served from a cache: the batch is not a cold one")
        return wall, flushed, our_thread_cpu() - cpu0, {k: v[0] for k, v in STEP_TIMES.items()}

    batch("defaults")  # unmeasured: one-time costs
    walls: dict[str, list[float]] = defaultdict(list)
    flushes: dict[str, list[float]] = defaultdict(list)
    background: dict[str, list[float]] = defaultdict(list)
    step: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    speed: dict[str, list[float]] = defaultdict(list)  # per round: the inert connector's wall / this setting's
    names = list(SETTINGS)
    for r in range(rounds):
        this_round = {}
        for setting in names[r % len(names):] + names[:r % len(names)]:
            wall, flushed, cpu, methods = batch(setting)
            this_round[setting] = wall
            walls[setting].append(wall)
            flushes[setting].append(flushed)
            background[setting].append(cpu)
            for name, seconds in methods.items():
                step[setting][name] += seconds
            print(f"round {r} {setting:<9}: {wall:.3f} s (flushed {flushed:.3f} s later), connector on the step "
                  f"{sum(methods.values()) * 1e3:.1f} ms, background threads {cpu:.2f} CPU s", flush=True)
        for setting in names:
            speed[setting].append(this_round["inert"] / this_round[setting])
    print(f"\nmodel {size}, {args.prompts} x {prompt_len}-token new prompts, {output_tokens} output tokens, "
          f"{rounds} rounds")
    for setting in names:
        median = statistics.median(walls[setting])
        total = sum(step[setting].values()) / len(walls[setting])
        print(f"{setting:<9}: batch median {median:.3f} s (best {min(walls[setting]):.3f}), speed / inert "
              f"{statistics.median(speed[setting]):.4f} (rounds: {' '.join(f'{v:.4f}' for v in speed[setting])}); "
              f"connector on the step {total * 1e3:.1f} ms/batch = {100 * total / median:.2f} % of the batch; "
              f"background threads {statistics.median(background[setting]):.2f} CPU s/batch, flushed "
              f"{statistics.median(flushes[setting]) * 1e3:.0f} ms after the batch")
        for name, seconds in sorted(step[setting].items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {name:<36}{seconds / len(walls[setting]) * 1e3:>9.2f} ms/batch")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
