"""What the connector costs when nothing is ever reused: request throughput of batches of new prompts with and
without the connector, a second run without it as the noise floor, and `save_decode_cache` on and off.

    python benchmarks/bench_zero_reuse.py [--quick] [--rounds N] [--output-tokens N] [--json FILE]

Each round runs every configuration once, each in its own vLLM process (in-process engine, the same thread
binding as every job: `VLLM_CPU_OMP_THREADS_BIND=0`), so that a slow spell of the shared machine hits all of
them; a process first runs one unmeasured batch. Round r starts r places further into the list (round 0:
plain first, round 1: the second configuration first...): the position of a process in a round was seen to
matter more than its configuration (the 2nd and 3rd processes of a round ran ~5 % slower, whatever they ran),
so with as many rounds as configurations each one runs once in every position. Configurations:

- `plain`: vLLM alone (the baseline of every ratio);
- `plain_again`: vLLM alone once more: its ratio to `plain` is what two identical processes differ by on
  this machine, the noise floor the other ratios are read against;
- `ours`: the connector's defaults with a disk tier (`max_local_cpu_size` 2 GiB populated before serving,
  `local_disk` 4 GiB);
- `ours_decode` / `ours_no_decode`: the same with `save_decode_cache` on / off (whatever the default is),
  so that a default can be decided from the no-reuse cost of storing every generated chunk (the benefit is
  measured on conversations: bench_conversations.py);
- `ours_l1` (no disk tier) and `ours_load_only` (`kv_consumer`: lookups and loads, no saves), only when named
  with `--only`: which part of the connector costs what.

Full: the `medium` local Llama, 4 prompts x 3900 tokens per batch, 256 output tokens (two whole 128-token
chunks generated per request), 3 measured batches. --quick: the `tiny` model, 1400-token prompts, 2 batches.
Reported per configuration: requests/s of its best and median batch, their ratios to `plain`, and the CPU
seconds per batch of the connector's own threads (by OS thread name, from /proc: `lmcache-*`), which are
bound off vLLM's compute core. Every output is compared with `plain`'s: same
prompts, same scheduler settings, no hits, so the tokens must be identical (`outputs_identical`).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from _common import parse_args, print_table, write_json

from lmcache_vllm.integration.vllm.offline_job import connector_thread_cpu
from lmcache_vllm.integration.vllm.testing.local_model import build_model
from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, random_tokens, run_job

CONFIGS = ("plain", "plain_again", "ours", "ours_decode", "ours_no_decode", "ours_l1", "ours_load_only")
DEFAULT_CONFIGS = CONFIGS[:5]


def _connector(name: str, l2: Path) -> dict | None:
    if name.startswith("plain"):
        return None
    extra: dict = {"max_local_cpu_size": 2.0, "extra_config": {"prefault_local_cpu": "sync"}}
    if name != "ours_l1":
        extra.update(local_disk=str(l2), max_local_disk_size=4.0)
    if name in ("ours_decode", "ours_no_decode"):
        extra["save_decode_cache"] = name == "ours_decode"
    role = "kv_consumer" if name == "ours_load_only" else "kv_both"
    return dict(CONNECTOR, kv_role=role, kv_connector_extra_config=extra)


def main() -> None:
    def add_arguments(p) -> None:
        p.add_argument("--rounds", type=int, default=None, help="processes per configuration (default: as many "
                       "as configurations, so each runs once in every position of a round)")
        p.add_argument("--output-tokens", type=int, default=256, help="generated tokens per request")
        p.add_argument("--batches", type=int, default=None, help="measured batches per process (default 3, "
                       "--quick 2)")
        p.add_argument("--only", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS),
                       help="configurations to run (plain is always run: it is the baseline)")

    args = parse_args(__doc__.splitlines()[0], add_arguments)
    size, prompt_len, batch, batches = ("tiny", 1400, 4, 2) if args.quick else ("medium", 3900, 4, 3)
    batches = args.batches or batches
    configs = ["plain"] + [c for c in args.only if c != "plain"]
    rounds = args.rounds or len(configs)
    model = str(build_model(size))
    kwargs = {"dtype": "bfloat16", "max_model_len": prompt_len + args.output_tokens + 64, "enforce_eager": True,
              "seed": 0, "max_num_batched_tokens": max(8192, batch * (prompt_len + 64)),
              "enable_prefix_caching": False}
    prompts = [[random_tokens(5000 + 50 * b + i, prompt_len) for i in range(batch)] for b in range(batches + 1)]
    phases = [{"name": "warmup" if b == 0 else f"batch{b}", "prompts": p, "max_tokens": args.output_tokens}
              for b, p in enumerate(prompts)]
    walls: dict[str, list[float]] = {c: [] for c in configs}
    thread_cpu: dict[str, float] = {c: 0.0 for c in configs}
    reference: list | None = None  # plain's first run: every run's outputs must equal it
    identical = True
    with tempfile.TemporaryDirectory(prefix="bench_zero_reuse_") as tmpdir:
        tmp = Path(tmpdir)
        for r in range(rounds):
            for name in configs[r % len(configs):] + configs[:r % len(configs)]:
                job = {"model": model, "llm_kwargs": kwargs, "phases": phases}
                connector = _connector(name, tmp / f"l2_{name}_{r}")
                if connector:
                    job["kv_transfer_config"] = connector
                result = run_job(tmp, f"{name}{r}", job, hash_seed=1, kv_cache_gib=2)
                measured = [p for p in result["phases"] if p["name"].startswith("batch")]
                walls[name] += [p["wall_s"] for p in measured]
                ours_cpu = connector_thread_cpu(result.get("threads", {}))
                thread_cpu[name] += ours_cpu
                out = [[res["tokens"] for res in p["results"]] for p in measured]
                reference = out if reference is None else reference
                identical = identical and out == reference
                shown = ", ".join(f"{p['wall_s']:.2f}" for p in measured)
                print(f"round {r} {name}: batches {shown} s, our threads {ours_cpu:.2f} CPU s", flush=True)
    base_best, base_median = min(walls["plain"]), statistics.median(walls["plain"])
    results: dict = {"model": size, "prompt_tokens": prompt_len, "batch_requests": batch,
                     "output_tokens": args.output_tokens, "rounds": rounds, "outputs_identical": identical}
    rows = []
    for name in configs:
        best, median = min(walls[name]), statistics.median(walls[name])
        cpu_per_batch = thread_cpu[name] / (rounds * (batches + 1))
        results[f"{name}_requests_per_s"] = batch / best
        results[f"{name}_batch_walls_s"] = ",".join(f"{w:.3f}" for w in walls[name])
        results[f"{name}_our_thread_cpu_s_per_batch"] = cpu_per_batch
        if name != "plain":
            results[f"{name}_vs_plain_ratio"] = base_best / best
            results[f"{name}_vs_plain_median_ratio"] = base_median / median
        rows.append((name, batch / best, batch / median, base_best / best, base_median / median, cpu_per_batch))
    print_table(f"0 % reuse, {batch} x {prompt_len}-token prompts, {args.output_tokens} output tokens, {size} model",
                rows, ("config", "req/s best", "req/s median", "vs plain best", "vs plain median",
                       "our threads CPU s/batch"))
    print(f"outputs identical to vLLM alone: {identical}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
