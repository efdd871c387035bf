"""Serving under load: vLLM's own load generator against `lmcache-vllm serve`, one configuration after another.

`lmcache-vllm bench serve` (vLLM's `vllm bench serve` through our launcher) drives `lmcache-vllm serve` on
the medium local model (`lmcache-vllm build-model --size medium`), with vLLM's KV cache (1 GiB,
VLLM_CPU_KVCACHE_SPACE=1) smaller than the working set, vLLM's prefix caching on, one compute thread
(VLLM_CPU_OMP_THREADS_BIND=0, as every comparison here; the servers' front ends and the load generator on the
other cores: `_common.front_ends_beside_compute`). Workloads and configurations, all in one run:

- reuse (`prefix_repetition`: many long shared prefixes, short suffixes, concurrency 4): vLLM alone;
  + ours with L1 only; + ours with L1 + disk, then the same prompts again (pass 2: all in L1); + ours
  restarted on that warm disk (a fresh L1, compared with pass 2); with
  `--vs-lmcache PYTHON`: LMCache's server mode (`lmcache server` + vLLM's LMCacheMPConnector, L1 only).
- the device limit: vLLM alone with a KV cache that holds every prefix (`--device-kv-gib`, default 4 GiB
  for the full workload's ~1.5 GB of KV), the reuse prompts twice: its pass 2 is all hits from vLLM's own
  cache, the limit our pass 2 (all hits from our L1, vLLM's 1 GiB too small to keep the prefixes) is
  compared with: `warm_l1_vs_device_throughput_ratio` (goal >= 0.9) and
  `warm_l1_ttft_p50_device_over_ours_ratio` (goal >= 1 / 1.2). With `--quick` the tiny model's prefixes fit
  vLLM's 1 GiB too, so there both passes 2 are mostly vLLM's own hits: a smoke test of the plumbing only.
  Our chunks are the connector's default (no chunk_size set: vLLM's block size, 128, on the CPU backend) unless
  `--chunk-size N` sets one; with 256 on a 3064-token prompt vLLM hits 2944 tokens and 256-token chunks 2816.
  LMCache's server runs at the same chunk size as ours (like with like: a larger chunk recomputes more of
  every repeat).
- no reuse (`random`): vLLM alone and + ours with L1 + disk: what the connector costs when it cannot help.
- with `--decode-cost`, no reuse with long answers (`random_long`: 256 generated tokens, so every answer
  completes chunks while it decodes): vLLM alone, ours with `save_decode_cache` off and on: what storing the
  generated tokens' KV costs a workload that never sends an answer back (`save_decode_cache_cost_ratio`,
  throughput on / off); its gain on one that does is `bench_conversations.py --only ours ours_decode`.
- slow tier (reuse, vLLM's prefix cache off, a small L1 over a real Redis): Redis answering, then Redis
  frozen (DEBUG SLEEP) for a while every few seconds: the TTFT of the requests that wait for it rises, the
  inter-token latency of the others should not.

Per run: request throughput, TTFT mean/p50/p99, inter-token latency mean/p99, end-to-end latency
mean/p99, and the prompt tokens served by vLLM's own prefix cache and by each of our tiers (from the
server's /metrics), and the seconds of it in which a sleeping process beside the load got no CPU
(`MachineStalls`: on the shared 2-core VMs spells of 1-3.5 s happen; a pass with some is noise, not a
result). Ratios (> 1: lmcache-vllm better) against the baselines of the same run. Writes the
JSON (`--json`, default bench_out/serving.json) and a PNG (`--png`). A full run took 25 minutes on 2
cores (Intel Xeon), `--vs-lmcache` included; `--quick` (tiny model, small workloads) about 5.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)

from lmcache_vllm.integration.vllm.testing.machine_stalls import MachineStalls  # noqa: E402
from lmcache_vllm.integration.vllm.testing.openai_server import launcher, post, scrape, serve  # noqa: E402
from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, vllm_env  # noqa: E402

OUT = os.path.join(_common.REPO_ROOT, "bench_out")
PERCENTILES = "50,99"
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's default block size on its CPU backend (no server here sets another)


def shared_prefixes(prefixes: int, prefix_len: int, suffix_len: int, output_len: int, prompts: int) -> list[str]:
    """vLLM's `prefix_repetition` dataset: `prefixes` long shared prefixes, each with short suffixes."""
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-prefix-len", str(prefix_len), "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-output-len", str(output_len), "--num-prompts", str(prompts)]


def random_prompts(input_len: int, output_len: int, prompts: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--num-prompts", str(prompts)]


def workloads(quick: bool) -> dict[str, list[str]]:
    """`vllm bench serve` dataset arguments of each workload."""
    if quick:
        return {"reuse": shared_prefixes(6, 1000, 32, 8, 24), "random": random_prompts(1000, 8, 8),
                "slow": shared_prefixes(6, 1000, 32, 32, 24), "random_long": random_prompts(1000, 256, 8)}
    return {"reuse": shared_prefixes(60, 3000, 64, 16, 180), "random": random_prompts(3000, 16, 40),
            "slow": shared_prefixes(20, 3000, 64, 32, 60), "random_long": random_prompts(3000, 256, 24)}


def ours(extra: dict, chunk_size: int | None) -> dict:
    """Our connector with `extra` (and `chunk_size`; None: our default); our background threads on the cores
    vLLM's compute (bound to core 0 here) leaves free, as a user who binds vLLM explicitly sets it
    (`extra_config.background_cpus`)."""
    config = {**({"chunk_size": chunk_size} if chunk_size is not None else {}), **extra}
    free = _common.cpus_beside_compute()
    if free:
        config["extra_config"] = {"background_cpus": ",".join(map(str, free)), **config.get("extra_config", {})}
    return dict(CONNECTOR, kv_connector_extra_config=config)


def lmcache_peer(port: int) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


def server_args(max_model_len: int, kv_config: dict | None, prefix_caching: bool = True) -> list[str]:
    args = ["--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
            "--enable-prompt-tokens-details"]
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    return args


def run_load(base: str, model: str, workload: list[str], out: Path, name: str) -> dict:
    """One `vllm bench serve` run against `base`; its saved result."""
    cmd = [*launcher(), "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", model,
           *workload, "--max-concurrency", "4", "--request-rate", "inf", "--ignore-eos", "--seed", "0",
           "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", PERCENTILES,
           "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    log = out / f"{name}.bench.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ), timeout=4 * 3600)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed for {name}:\n{log.read_text()[-4000:]}")
    return json.loads((out / f"{name}.json").read_text())


def cache_tokens(before: dict, after: dict) -> dict:
    """Prompt tokens of the run and where their KV came from (vLLM's prefix cache, each of our tiers)."""
    def delta(name: str, label: str = "") -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)
    by_source = "vllm:prompt_tokens_by_source_total"
    if (by_source, "local_compute") in after:
        # Counted once per request's prefill. vLLM's prefix_cache_hits counts a request at each admission, and a
        # request whose load failed from its first block is admitted again (vLLM's recovery): counted twice.
        local, external = delta(by_source, "local_cache_hit"), delta(by_source, "external_kv_transfer")
    else:  # a vLLM without the per-source counters
        local, external = delta("vllm:prefix_cache_hits_total"), delta("vllm:external_prefix_cache_hits_total")
    # connector_tokens: what vLLM counts as loaded by the connector, ours or LMCache's alike
    out = {"prompt_tokens": delta("vllm:prompt_tokens_total"), "vllm_prefix_cache_tokens": local,
           "connector_tokens": external}
    for tier in ("local_cpu", "local_disk", "redis"):
        out[f"ours_{tier}_tokens"] = delta("lmcache_vllm:hit_tokens_total", tier)
    # Where a hit's time goes on the worker: starting its loads in the step, and the forward waiting for
    # layers the load thread had not copied yet (both 0 without our connector).
    out["ours_load_s"] = delta("lmcache_vllm:load_seconds_sum")
    out["ours_loads"] = delta("lmcache_vllm:load_seconds_count")
    out["ours_load_wait_s"] = delta("lmcache_vllm:load_wait_seconds_total")
    # The scheduler's lookups (a socket round trip when vLLM's worker is another process): its step waits.
    out["ours_lookup_s"] = delta("lmcache_vllm:lookup_seconds_sum")
    out["ours_lookups"] = delta("lmcache_vllm:lookup_seconds_count")
    return out


def measure(name: str, tmp: Path, model: str, kv_config: dict | None, workload: list[str],
            max_model_len: int, python: str | None = None, during=None, prefix_caching: bool = True,
            passes: int = 1, kv_cache_gib: int = 1) -> dict[str, dict]:
    """Starts a server (ours, vLLM alone or the peer) with `kv_cache_gib` of vLLM KV cache, warms it with one
    request, runs the load `passes` times (the same prompts again: pass 2 finds them cached):
    {name, name_pass2, ...: row}."""
    env = vllm_env(tmp / name, multiprocessing=True, kv_cache_gib=kv_cache_gib)
    if python is not None:  # the peer: LMCache's connector must import in the server's interpreter
        env["PYTHONPATH"] = _common.REPO_ROOT
    print(f"\n-- {name}: starting the server", flush=True)
    t0 = time.monotonic()
    with serve(model, server_args(max_model_len, kv_config, prefix_caching), tmp, env, timeout_s=900,
               python=python) as (base, log):
        post(f"{base}/v1/completions", {"model": model, "prompt": "warm-up", "max_tokens": 2}, timeout=600)
        rows = {}
        for i in range(passes):
            pass_name = name if i == 0 else f"{name}_pass{i + 1}"
            before = scrape(base)
            stop = threading.Event()
            helper = threading.Thread(target=during, args=(stop,), daemon=True) if during else None
            if helper:
                helper.start()
            try:
                with MachineStalls() as stalls:
                    started = time.monotonic()
                    result = run_load(base, model, workload, tmp, pass_name)
                    ended = time.monotonic()
            finally:
                stop.set()
                if helper:
                    helper.join(30)
            row = {"name": pass_name, "server_s": time.monotonic() - t0, **cache_tokens(before, scrape(base))}
            # Seconds of the pass in which a sleeping process beside the load got no CPU (the machine's, not
            # the configuration's: a pass with several is not comparable with one without).
            row["machine_stall_s"] = stalls.stalled(started, ended)
            for key in ("duration", "completed", "request_throughput", "mean_ttft_ms", "p50_ttft_ms",
                        "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
                        "total_input_tokens"):
                row[key] = result.get(key)
            print(f"   {pass_name}: {row['request_throughput']:.3f} req/s, TTFT p50 {row['p50_ttft_ms']:.0f} ms "
                  f"p99 {row['p99_ttft_ms']:.0f} ms, ITL p99 {row['p99_itl_ms']:.1f} ms; our loads "
                  f"{row['ours_loads']:.0f}: {row['ours_load_s']:.2f} s in the step, the forward waited "
                  f"{row['ours_load_wait_s']:.2f} s for the load thread; {row['ours_lookups']:.0f} lookups took "
                  f"{row['ours_lookup_s']:.2f} s of the scheduler's; the machine stalled "
                  f"{row['machine_stall_s']:.1f} s", flush=True)
            rows[pass_name] = row
    return rows


def freezer(url: str, freeze_s: float, every_s: float):
    """A `during` helper: freezes Redis (DEBUG SLEEP) for `freeze_s` every `every_s` until stopped."""
    import redis

    def run(stop: threading.Event) -> None:
        client = redis.Redis.from_url(url)
        try:
            while not stop.wait(every_s - freeze_s):
                client.execute_command("DEBUG", "SLEEP", freeze_s)
        finally:
            client.close()
    return run


def lmcache_server(python: str, tmp: Path, l1_gb: float, chunk_size: int, extra_args: tuple[str, ...] = ()):
    """`lmcache server` (LMCache 0.5.6's server mode) on a free port, with `extra_args` (e.g. an L2 adapter):
    (process, port)."""
    from lmcache_vllm.integration.vllm.testing.openai_server import free_port

    port = free_port()
    log = open(tmp / "lmcache_server.log", "w")
    proc = subprocess.Popen([str(Path(python).with_name("lmcache")), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                             "--chunk-size", str(chunk_size),
                             "--supported-transfer-mode", "auto", *extra_args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            # a front end beside the compute core, like vLLM's API server: no OpenMP binding
                            # (given the compute core's OMP_PLACES, libgomp printed an error and ignored it)
                            env=dict(vllm_env(tmp / "lmcache_server", threads_bind="nobind"), PYTHONHASHSEED="0"))
    time.sleep(15)  # it has no health endpoint; the vLLM server start that follows takes longer anyway
    if proc.poll() is not None:
        raise RuntimeError(f"lmcache server exited: {(tmp / 'lmcache_server.log').read_text()[-3000:]}")
    return proc, port


@contextlib.contextmanager
def lmcache_running(python: str, tmp: Path, l1_gb: float, chunk_size: int, extra_args: tuple[str, ...] = ()):
    """`lmcache_server` for the time of a `with` block: yields (its port, its process group), stops it afterwards."""
    proc, port = lmcache_server(python, tmp, l1_gb, chunk_size, extra_args)
    try:
        yield port, proc.pid  # its own session: the group is its pid
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def ratios(rows: dict) -> dict:
    def r(a: str, b: str, key: str, inverse: bool = False) -> float | None:
        if a not in rows or b not in rows or not rows[a].get(key) or not rows[b].get(key):
            return None
        return rows[b][key] / rows[a][key] if inverse else rows[a][key] / rows[b][key]
    out = {
        # reuse: ours (L1 + disk) against vLLM alone and against LMCache's server mode
        "reuse_throughput_vs_vllm_ratio": r("reuse_ours_l1_disk", "reuse_vllm", "request_throughput"),
        "reuse_ttft_p99_vllm_over_ours_ratio": r("reuse_ours_l1_disk", "reuse_vllm", "p99_ttft_ms", True),
        "reuse_throughput_vs_lmcache_ratio": r("reuse_ours_l1", "reuse_lmcache", "request_throughput"),
        "reuse_ttft_p50_lmcache_over_ours_ratio": r("reuse_ours_l1", "reuse_lmcache", "p50_ttft_ms", True),
        # a warm L1 (our pass 2) against vLLM's own cache holding every prefix (its pass 2): the device limit
        "warm_l1_vs_device_throughput_ratio": r("reuse_ours_l1_disk_pass2", "reuse_vllm_device_pass2",
                                                "request_throughput"),
        "warm_l1_ttft_p50_device_over_ours_ratio": r("reuse_ours_l1_disk_pass2", "reuse_vllm_device_pass2",
                                                     "p50_ttft_ms", True),
        # a fresh server on the warm disk against the same prompts again from a warm L1 (pass 2)
        "restart_vs_warm_l1_throughput_ratio": r("reuse_ours_restart", "reuse_ours_l1_disk_pass2",
                                                 "request_throughput"),
        # no reuse: what the connector costs
        "no_reuse_throughput_vs_vllm_ratio": r("random_ours", "random_vllm", "request_throughput"),
        "no_reuse_ttft_p99_vllm_over_ours_ratio": r("random_ours", "random_vllm", "p99_ttft_ms", True),
        # no reuse with long answers: storing the generated tokens' KV (save_decode_cache) on against off
        "save_decode_cache_cost_ratio": r("random_long_ours_decode", "random_long_ours", "request_throughput"),
        "no_reuse_long_throughput_vs_vllm_ratio": r("random_long_ours", "random_long_vllm", "request_throughput"),
        "no_reuse_long_decode_throughput_vs_vllm_ratio": r("random_long_ours_decode", "random_long_vllm",
                                                           "request_throughput"),
        # a frozen Redis: the TTFT of those waiting rises, the inter-token latency of the others should not
        "slow_tier_itl_p99_answering_over_frozen_ratio": r("slow_redis_frozen", "slow_redis", "p99_itl_ms", True),
        "slow_tier_ttft_p99_answering_over_frozen_ratio": r("slow_redis_frozen", "slow_redis", "p99_ttft_ms", True),
    }
    return {k: v for k, v in out.items() if v is not None}


def plot(path: str, rows: dict, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, key, label in ((axes[0], "request_throughput", "requests/s"),
                           (axes[1], "p50_ttft_ms", "TTFT p50 (ms, log)"),
                           (axes[2], "p99_ttft_ms", "TTFT p99 (ms, log)")):
        values = [rows[n].get(key) or 0 for n in names]
        ax.bar(range(len(names)), values, color="#2b7bba")
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_ylabel(label)
        if key != "request_throughput":
            ax.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    def add_arguments(p) -> None:
        p.add_argument("--png", default=os.path.join(OUT, "serving.png"))
        p.add_argument("--vs-lmcache", metavar="PYTHON", help="an interpreter with LMCache 0.5.6 "
                       "(scripts/make_lmcache_venv.sh): also run LMCache's server mode as the peer")
        p.add_argument("--only", nargs="*", help="run only these configurations (names as in the output)")
        p.add_argument("--chunk-size", type=int, default=None,
                       help="our chunk size (default: not set, the connector's choice: vLLM's block size, 128)")
        p.add_argument("--decode-cost", action="store_true",
                       help="also measure save_decode_cache off and on under no reuse with long answers")
        p.add_argument("--device-kv-gib", type=int, default=None,
                       help="vLLM's KV cache of the device-limit run (default 4, --quick 1): holds every prefix")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    _common.front_ends_beside_compute()
    args.json = args.json or os.path.join(OUT, "serving.json")
    from lmcache_vllm.integration.vllm.chunk_size import default_chunk_size
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    # Ours and LMCache's at one chunk size: ours unless --chunk-size, the connector's default for vLLM's CPU
    # block size (these servers run with vLLM's default).
    ours_chunk = args.chunk_size or default_chunk_size(VLLM_CPU_BLOCK_SIZE, on_cpu=True)[0]

    size = "tiny" if args.quick else "medium"
    model = str(build_model(size))
    max_model_len = 2048 if args.quick else 4096
    loads = workloads(args.quick)
    l1_gb = 0.5 if args.quick else 4.0
    slow_l1_gb = 0.02 if args.quick else 0.25  # smaller than the slow workload's prefixes: hits from Redis
    rows: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmpdir:
        tmp = Path(tmpdir)
        disk = {"local_disk": str(tmp / "l2"), "max_local_disk_size": 8.0}
        redis_proc, redis_url = _common.start_redis(tmpdir, "--enable-debug-command", "local")
        slow = {"max_local_cpu_size": slow_l1_gb, "remote_url": redis_url,
                "extra_config": {"remote_timeout_secs": 10.0}}
        plan = [
            ("reuse_vllm", None, "reuse", {}),
            # the device limit: every prefix in vLLM's own KV cache on pass 2
            ("reuse_vllm_device", None, "reuse", {"passes": 2,
                                                  "kv_cache_gib": args.device_kv_gib or (1 if args.quick else 4)}),
            ("reuse_ours_l1", ours({"max_local_cpu_size": l1_gb}, args.chunk_size), "reuse", {}),
            # pass 2: the same prompts again, every prefix in L1 (the warm run a restart is compared with)
            ("reuse_ours_l1_disk", ours({"max_local_cpu_size": l1_gb, **disk}, args.chunk_size), "reuse",
             {"passes": 2}),
            ("reuse_ours_restart", ours({"max_local_cpu_size": l1_gb, **disk}, args.chunk_size), "reuse", {}),
            ("random_vllm", None, "random", {}),
            ("random_ours", ours({"max_local_cpu_size": l1_gb, **disk}, args.chunk_size), "random", {}),
            # vLLM's prefix cache off: its 1 GiB would hold this workload, and every repeat must come from
            # our tiers (a small L1 over Redis) for the slow tier to matter
            ("slow_redis", ours(slow, args.chunk_size), "slow", {"prefix_caching": False}),
            ("slow_redis_frozen", ours(dict(slow, extra_config={"remote_timeout_secs": 10.0,
                                                                  "remote_key_prefix": "frozen:"}), args.chunk_size),
             "slow", {"during": freezer(redis_url, 1.0, 4.0), "prefix_caching": False}),
        ]
        if args.decode_cost:
            plan += [(f"random_long_{name}", None if decode is None else ours(
                {"max_local_cpu_size": l1_gb, **disk, "save_decode_cache": decode}, args.chunk_size), "random_long", {})
                for name, decode in (("vllm", None), ("ours", False), ("ours_decode", True))]
        try:
            for name, kv_config, workload, opts in plan:
                if args.only and name not in args.only:
                    continue
                try:
                    rows.update(measure(name, tmp, model, kv_config, loads[workload], max_model_len, **opts))
                except Exception as exc:  # one failed configuration must not lose the others' figures
                    failed[name] = repr(exc)[-2000:]
                    print(f"   {name} FAILED: {exc!r}"[:3000], flush=True)
            if args.vs_lmcache and (not args.only or "reuse_lmcache" in args.only):
                try:
                    with lmcache_running(args.vs_lmcache, tmp, l1_gb, ours_chunk) as (port, _):
                        rows.update(measure("reuse_lmcache", tmp, model, lmcache_peer(port), loads["reuse"],
                                            max_model_len, python=args.vs_lmcache))
                except Exception as exc:
                    failed["reuse_lmcache"] = repr(exc)[-2000:]
                    print(f"   reuse_lmcache FAILED: {exc!r}"[:3000], flush=True)
        finally:
            redis_proc.kill()
            redis_proc.wait()
    headers = ("config", "req/s", "TTFT mean", "p50", "p99", "ITL p99", "E2E mean", "prompt tok",
               "vLLM cache", "connector", "ours L1", "ours disk", "ours redis", "stalled s")
    _common.print_table(f"serving, {size} model, concurrency 4 (ms unless noted)", [
        (n, r["request_throughput"], r["mean_ttft_ms"], r["p50_ttft_ms"], r["p99_ttft_ms"], r["p99_itl_ms"],
         r["mean_e2el_ms"], int(r["prompt_tokens"]), int(r["vllm_prefix_cache_tokens"]), int(r["connector_tokens"]),
         int(r["ours_local_cpu_tokens"]), int(r["ours_local_disk_tokens"]), int(r["ours_redis_tokens"]),
         r["machine_stall_s"])
        for n, r in rows.items()], headers)
    res = {"model": size, "cpu": _common.cpu_model(), "chunk_size": ours_chunk, "lmcache_chunk_size": ours_chunk,
           **ratios(rows),
           **{f"{name}.failed": why for name, why in failed.items()}}
    for name, row in rows.items():
        for key, value in row.items():
            if key != "name" and value is not None:
                res[f"{name}.{key}"] = value
    for key, value in res.items():
        if key.endswith("_ratio"):
            print(f"{key}: {value:.2f}")
    _common.write_json(args.json, res)
    plot(args.png, rows, f"lmcache-vllm serving, {size} model, vLLM KV cache 1 GiB, concurrency 4")
    if failed:
        raise SystemExit(f"failed configurations: {', '.join(failed)}")


if __name__ == "__main__":
    main()
