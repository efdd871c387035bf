"""P2P sharing (docs/P2P.md) against no sharing and against sharing through Redis payloads.

    python benchmarks/bench_p2p.py [--quick] [--json FILE] [--only serving|transfer]

1. Serving: two `lmcache-vllm serve` instances behind examples/p2p_proxy.py (round robin), driven by vLLM's own
   `bench serve` (`prefix_repetition`, concurrency 4), in three configurations, each on fresh servers:
   (a) `none`: each instance its own L1, no sharing; (b) `redis`: L1 + a Redis payload tier both instances
   share (`remote_url`); (c) `p2p`: L1 + `enable_p2p`, the directory in the same redis-server. The working set
   (the prefixes' whole chunks) is larger than one instance's L1 and smaller than two (L1 = 0.7 of it;
   `--l1-fraction`). vLLM's own prefix cache is off in all three, so every hit is ours. Every instance computes
   on one thread, instance i on core i (mod the cores), the same binding in every configuration.
   Ratios (> 1: P2P better): `p2p_hits_vs_<a|b>_ratio` (prompt tokens served by our tiers), throughput, TTFT p50
   (a's or b's over P2P's); `directory_vs_redis_memory_ratio` = the directory's Redis memory over (b)'s Redis
   memory for the same workload (`MEMORY USAGE` of every key; goal <= 0.02), and bytes per chunk of each.
2. Transfer: a child process holds chunks in its L1 (medium model's 2 MiB chunks) and lists them; this process
   reads them the way a P2P miss does (`StorageManager.prefetch`: a directory lookup, then FETCH, every chunk
   checked and promoted into L1), alternating with the same bytes over a raw loopback socket into a
   preallocated buffer. `pull_vs_raw_ratio` = our GB/s / raw GB/s (medians).
The machine may be shared: ratios compare runs of the same invocation; the figures that count are measured on a
quiet machine. --quick: the tiny model, small workload, few repeats (a smoke test of the plumbing).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
from bench_serving import run_load, server_args, shared_prefixes  # noqa: E402

from lmcache_vllm.integration.vllm.testing.openai_server import free_port, post, scrape, serve  # noqa: E402
from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, vllm_env  # noqa: E402

CHUNK = 256
CHUNK_SHAPE = (8, 2, 256, 256)  # the medium model's stored chunk: 2 MiB of bf16
TIERS = ("local_cpu", "local_disk", "redis", "p2p")
P2P_COUNTS = ("p2p_lookups", "p2p_lookup_failures", "p2p_pulled_chunks", "p2p_pull_failures", "p2p_skipped_peers",
              "pending_lookups", "failed_load_tokens")


def chunk_bytes(model_dir: str) -> int:
    """Bytes of one stored chunk of the model (layers x K/V x tokens x KV heads x head size x 2 bytes)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * CHUNK * cfg["num_key_value_heads"] * head * 2


def connector(l1_gb: float, extra: dict) -> dict:
    config = {"chunk_size": CHUNK, "max_local_cpu_size": l1_gb, **extra}
    return dict(CONNECTOR, kv_connector_extra_config=config)


def start_proxy(backends: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(_common.REPO_ROOT, "examples", "p2p_proxy.py"), "--port",
                             str(port), "--backends", *backends], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            scrape_ok = json.loads(_get(f"{base}/proxy/health"))
            if scrape_ok.get("status") == "ok":
                return proc, base
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the proxy did not start: {log.read_text()[-2000:]}")


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def redis_memory(url: str, match: str) -> tuple[int, int]:
    """(keys, bytes) of every key matching `match` (MEMORY USAGE, nested values sampled whole)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=match, count=1000))
        return len(keys), sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)
    finally:
        client.close()


def directory_entries(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sum(int(client.scard(k)) for k in client.scan_iter(match=f"{prefix}p2p:*:chunks", count=1000))
    finally:
        client.close()


def serving_run(name: str, tmp: Path, model: str, kv_config, workload: list[str], cores: list[int],
                max_model_len: int, measure_redis=None) -> dict:
    """Two instances with `kv_config` (a dict, or one per instance: `kv_config(i)`) behind the proxy, the load
    through it: one row (with `measure_redis()`'s figures, taken after the load while the instances still run)."""
    print(f"\n-- {name}: starting two servers", flush=True)
    with ExitStack() as stack:
        bases = []
        for i in range(2):
            env = vllm_env(tmp / f"{name}{i}", multiprocessing=True, threads_bind=str(cores[i % len(cores)]))
            args = server_args(max_model_len, kv_config(i) if callable(kv_config) else kv_config,
                               prefix_caching=False)
            base, _log = stack.enter_context(serve(model, args, tmp, env, timeout_s=900))
            post(f"{base}/v1/completions", {"model": model, "prompt": "warm-up", "max_tokens": 2}, timeout=600)
            bases.append(base)
        proxy, proxy_base = start_proxy(bases, tmp / f"{name}_proxy.log")
        try:
            before = [scrape(b) for b in bases]
            result = run_load(proxy_base, model, workload, tmp, name)
            time.sleep(2)  # our stats reach vLLM's API server with the next steps
            for b in bases:
                post(f"{b}/v1/completions", {"model": model, "prompt": "nudge", "max_tokens": 1})
            after = [scrape(b) for b in bases]
            stored = measure_redis() if measure_redis is not None else {}
        finally:
            proxy.kill()
            proxy.wait(10)
    row = {"name": name}
    for key in ("request_throughput", "p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "total_input_tokens"):
        row[key] = result.get(key)
    for tier in TIERS:
        row[f"hit_{tier}_tokens"] = sum(a.get(("lmcache_vllm:hit_tokens_total", tier), 0.0)
                                        - b.get(("lmcache_vllm:hit_tokens_total", tier), 0.0)
                                        for a, b in zip(after, before))
    row["hit_tokens"] = sum(row[f"hit_{t}_tokens"] for t in TIERS)
    for count in P2P_COUNTS:  # what P2P did (and where it lost hits), summed over both instances
        metric = f"lmcache_vllm:{count}_total"
        row[count] = sum(a.get((metric, ""), 0.0) - b.get((metric, ""), 0.0) for a, b in zip(after, before))
    row.update(stored)
    print(f"   {name}: {row['request_throughput']:.3f} req/s, TTFT p50 {row['p50_ttft_ms']:.0f} ms, "
          f"hits {row['hit_tokens']:.0f} tokens", flush=True)
    return row


def serving(quick: bool, tmp: Path, redis_url: str, l1_fraction: float) -> dict:
    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    model = str(build_model("tiny" if quick else "medium"))
    # Every whole chunk of a prompt lies inside its prefix (the suffix only in the partial last chunk, which is
    # not stored): what is stored is the prefixes' chunks, the working set; unique chunks would churn L1.
    prefixes, prefix_len, suffix_len = (8, 1100, 32) if quick else (40, 3000, 64)
    whole = (prefix_len + suffix_len) // CHUNK
    assert whole * CHUNK <= prefix_len, "a stored chunk would hold suffix tokens"
    workload = shared_prefixes(prefixes, prefix_len, suffix_len, 8 if quick else 16,
                               4 * prefixes if quick else 5 * prefixes)
    working_set = prefixes * whole * chunk_bytes(model)
    l1_gb = l1_fraction * working_set / (1 << 30)
    cores = sorted(os.sched_getaffinity(0))
    redis_prefix, p2p_prefix = f"bench-p2p-r-{uuid.uuid4().hex[:6]}:", f"bench-p2p-d-{uuid.uuid4().hex[:6]}:"
    p2p_ports = [free_port(), free_port()]
    plan = {"none": connector(l1_gb, {}),
            "redis": connector(l1_gb, {"remote_url": redis_url, "extra_config": {"remote_key_prefix": redis_prefix}}),
            # each instance's transfer port, and the peers trusted without a key: both (and nothing else)
            "p2p": lambda i: connector(l1_gb, {"enable_p2p": True, "p2p_host": "127.0.0.1",
                                               "p2p_init_ports": [p2p_ports[i]],
                                               "extra_config": {"p2p_directory_url": redis_url,
                                                                "remote_key_prefix": p2p_prefix,
                                                                "pd_peers": [f"127.0.0.1:{p}" for p in p2p_ports]}})}
    def payloads() -> dict:
        keys, used = redis_memory(redis_url, f"{redis_prefix}*")
        return {"redis_keys": keys, "redis_bytes": used}

    def directory() -> dict:
        keys, used = redis_memory(redis_url, f"{p2p_prefix}p2p:*")
        return {"directory_bytes": used, "directory_entries": directory_entries(redis_url, p2p_prefix)}

    memory = {"redis": payloads, "p2p": directory}
    max_model_len = 2048 if quick else 4096
    rows = {name: serving_run(name, tmp, model, kv_config, workload, cores, max_model_len, memory.get(name))
            for name, kv_config in plan.items()}
    return {"model": "tiny" if quick else "medium", "working_set_bytes": working_set, "l1_gb_per_instance": l1_gb,
            "rows": rows}


_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[5])
from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.storage.base import InstanceIdentity
from lmcache_vllm.storage.manager import StorageManager
url, prefix, n, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), tuple(int(x) for x in sys.argv[4].split(","))
port = int(sys.argv[6])
nbytes = n * torch.Size(shape).numel() * 2
cfg = LMCacheConfig(max_local_cpu_size=(nbytes * 1.3 + (64 << 20)) / (1 << 30), enable_p2p=True, p2p_host="127.0.0.1",
                    p2p_init_ports=[port], extra_config={"p2p_directory_url": url, "remote_key_prefix": prefix,
                                                         "pd_peers": [f"127.0.0.1:{port}"]})
mgr = StorageManager(cfg)
mgr.attach_instance(InstanceIdentity("serving-child"))
objs = []
for i in range(n):
    obj = mgr.allocate(shape, torch.bfloat16)
    obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
    mgr.put(f"bench@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}", obj)
    objs.append(obj)
mgr.flush()
sys.path.insert(0, sys.argv[5] + "/benchmarks")
from _common import serve_raw
print(serve_raw([obj.tensor.view(torch.uint8).numpy() for obj in objs]), flush=True)
sys.stdin.read()
"""


def transfer(quick: bool, redis_url: str) -> dict:
    import numpy as np
    import torch

    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.storage.base import InstanceIdentity
    from lmcache_vllm.storage.manager import StorageManager

    n, repeats = (12, 3) if quick else (64, 7)
    prefix = f"bench-p2p-t-{uuid.uuid4().hex[:6]}:"
    nbytes = n * torch.Size(CHUNK_SHAPE).numel() * 2
    port = free_port()  # the child's transfer port, the one peer this side trusts without a key
    child = subprocess.Popen([sys.executable, "-c", _CHILD, redis_url, prefix, str(n), ",".join(map(str, CHUNK_SHAPE)),
                              _common.REPO_ROOT, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        raw_port = int(child.stdout.readline())
        time.sleep(0.5)  # its entries written
        keys = [f"bench@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}" for i in range(n)]
        buffer = np.empty(nbytes, dtype=np.uint8)
        buffer.fill(0)
        config = LMCacheConfig(max_local_cpu_size=(nbytes * 1.3 + (64 << 20)) / (1 << 30), enable_p2p=True,
                               extra_config={"p2p_directory_url": redis_url, "remote_key_prefix": prefix,
                                             "prefault_local_cpu": "sync", "p2p_pull_timeout_secs": 30.0,
                                             "pd_peers": [f"127.0.0.1:{port}"]})
        with StorageManager(config) as mgr:
            mgr.attach_instance(InstanceIdentity("pulling"))
            ours, raw = _common.pulls_against_raw(mgr, keys, lambda rep: mgr.prefetch(keys), raw_port, buffer, repeats)
    finally:
        child.stdin.close()
        child.wait(30)
    ours_gbps, raw_gbps = _common.gbps(nbytes, statistics.median(ours)), _common.gbps(nbytes, statistics.median(raw))
    return {"transfer_bytes": nbytes, "pull_gbps": ours_gbps, "raw_gbps": raw_gbps,
            "pull_vs_raw_ratio": ours_gbps / raw_gbps}


def summarize(result: dict) -> dict:
    rows = result.pop("rows")
    out: dict = {k: v for k, v in result.items() if not k.endswith("_prefix")}
    for name, row in rows.items():
        for key, value in row.items():
            if key != "name" and value is not None:
                out[f"{name}.{key}"] = value
    a, b, c = rows["none"], rows["redis"], rows["p2p"]

    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x and y else None

    # the directory's Redis memory (c's instances listing what their L1 held) against (b)'s payloads
    out["directory_bytes_per_entry"] = ratio(c.get("directory_bytes"), c.get("directory_entries"))
    out["redis_bytes_per_chunk"] = ratio(b.get("redis_bytes"), b.get("redis_keys"))
    out["directory_vs_redis_memory_ratio"] = ratio(c.get("directory_bytes"), b.get("redis_bytes"))
    for other, row in (("none", a), ("redis", b)):
        out[f"p2p_hits_vs_{other}_ratio"] = ratio(c["hit_tokens"], row["hit_tokens"])
        out[f"p2p_throughput_vs_{other}_ratio"] = ratio(c["request_throughput"], row["request_throughput"])
        out[f"p2p_ttft_p50_{other}_over_p2p_ratio"] = ratio(row["p50_ttft_ms"], c["p50_ttft_ms"])
    return {k: v for k, v in out.items() if v is not None}


def main() -> None:
    def add_arguments(p) -> None:
        p.add_argument("--only", choices=("serving", "transfer"), help="run one part only")
        p.add_argument("--l1-fraction", type=float, default=0.7,
                       help="each instance's L1 as a fraction of the working set (0.5-1: larger than one, smaller "
                            "than two)")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    res: dict = {"cpu": _common.cpu_model()}
    with tempfile.TemporaryDirectory(prefix="bench_p2p_") as tmpdir:
        redis_proc, redis_url = _common.start_redis(tmpdir)
        try:
            if args.only != "transfer":
                res.update(summarize(serving(args.quick, Path(tmpdir), redis_url, args.l1_fraction)))
            if args.only != "serving":
                res.update(transfer(args.quick, redis_url))
        finally:
            redis_proc.kill()
            redis_proc.wait()
    for key, value in res.items():
        if key.endswith("_ratio") or key.endswith("_per_chunk") or key.endswith("_gbps"):
            print(f"{key}: {value:.4g}")
    _common.write_json(args.json, res)


if __name__ == "__main__":
    main()
