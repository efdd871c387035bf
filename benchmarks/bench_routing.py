"""Routing: vLLM's own router (vllm-router) in front of 2 (or 3) instances of ours, on vLLM's multi-turn conversations.

    python benchmarks/bench_routing.py [--quick] [--instances N] [--only NAME ...] [--credits TIER=CREDIT ...]
                                       [--json FILE] [--keep DIR]

The client, the conversations and the recording proxy are bench_conversations.py's (vLLM's own multi-turn benchmark
client from its source distribution, run unchanged; answers restricted to tokens that round-trip, as a trained
model's mostly do); the proxy sits in front of the router, the router in front of the instances. Every instance is
`lmcache-vllm serve` with our L1 (`--l1-fraction` of the conversations' KV each), its own disk directory and
`save_decode_cache` (what docs/BENCHMARKS.md recommends for chat: an answer's KV is kept where it was generated,
which only a router that sends the next turn there can use), vLLM's prefix cache on a device cache that holds the
requests in flight and little more, KV events on vLLM's ZMQ publisher, `--enable-scale-out` (vllm-router's kv_aware
tokenizes at /render), instance i computing on one thread on core i (mod the cores) and the same everywhere else, so
every configuration pays the same overheads.

Configurations (docs/ROUTING.md), each on emptied caches (vLLM's `/reset_prefix_cache?reset_external=true` with
`reset_lower_tiers`: device, L1 and disk) behind a fresh router: `round_robin`; `cache_aware` (the router's
approximate tree of what it sent where); `kv_aware` fed by our events and vLLM's (`--kv-event-source` per instance,
vLLM's block size, docs/ROUTING.md's tier credits for CPU: host 0.95, disk 0.9, or `--credits`); each also
with P2P sharing (`<policy>_p2p`: `enable_p2p`, the directory in a local redis-server, each instance trusting the
others' transfer ports, `p2p_serve_disk`), on a second set of instances.

Per configuration: requests/s, TTFT p50/p99 (the client's), prompt tokens by where their KV came from summed over
the instances (vLLM's prefix cache; our L1, disk, P2P), recomputed tokens, the requests each instance served, the
servers' CPU seconds, our counters of hits that did not become loads (failed_load_tokens, read_alloc_failures,
timeouts, p2p_pull_failures, p2p_skipped_peers), and for kv_aware the router's decisions (how many credited a cached
prefix, how many tokens, and how many later turns of a conversation it sent elsewhere than the previous turn).
Ratios (> 1: kv_aware better): `kv_aware.throughput_vs_<other>_ratio`, `kv_aware.ttft_p50_<other>_over_kv_aware_ratio`,
the same for kv_aware_p2p. Goals (issue 41): kv_aware >= 1.3x round_robin's throughput and its TTFT
p50 <= 0.6x; >= 1.1x cache_aware; never below round_robin_p2p. --quick: the tiny model, a small workload (a smoke
test of the plumbing: its figures mean nothing). The figures that count come from a quiet machine.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
from _chat_trace import RecordingProxy, conversation_moves, round_trip_word_tokens, unbounded_hits  # noqa: E402
from bench_conversations import (  # noqa: E402
    BLOCK_SIZE,
    CHAT_TEMPLATE,
    FULL,
    QUICK,
    Workload,
    client_script,
    kv_bytes_per_token,
    percentile,
    run_client,
    write_conversations,
)
from bench_serving import cache_tokens, server_args  # noqa: E402

from lmcache_vllm.integration.vllm.testing.openai_server import (  # noqa: E402
    free_port,
    post,
    reset_prefix_cache,
    scrape,
    serve,
    wait_for,
)
from lmcache_vllm.integration.vllm.testing.router import decisions, route  # noqa: E402
from lmcache_vllm.integration.vllm.testing.vllm_jobs import CONNECTOR, vllm_env  # noqa: E402

OUT = os.path.join(_common.REPO_ROOT, "bench_out")
POLICIES = ("round_robin", "cache_aware", "kv_aware")
TIERS = ("local_cpu", "local_disk", "p2p")
FAULT_COUNTERS = ("failed_load_tokens", "read_alloc_failures", "async_load_timeouts", "lookup_timeouts",
                  "p2p_pull_failures", "p2p_skipped_peers")


class Fleet:
    """`n` instances of ours with one configuration (`extra`: our connector's), started side by side."""

    def __init__(self, stack: ExitStack, tmp: Path, model: str, n: int, extra: dict, args: list[str]) -> None:
        cores = sorted(os.sched_getaffinity(0))
        self.events: dict[str, str] = {}
        self.logs: list[Path] = []
        # With P2P, each instance's transfer server on a port of its own, and every instance trusting the
        # others' ports (loopback is nobody's by default: without pd_peers no peer is ever pulled from).
        p2p_ports = [free_port() for _ in range(n)] if extra.get("enable_p2p") else []
        peers = {"pd_peers": [f"127.0.0.1:{p}" for p in p2p_ports]} if p2p_ports else {}

        def start(i: int) -> str:
            port = free_port()
            p2p = {"p2p_init_ports": [p2p_ports[i]]} if p2p_ports else {}
            kv = dict(CONNECTOR, kv_connector_extra_config={
                **extra, **p2p, "local_disk": str(tmp / f"l2-{i}"), "max_local_disk_size": 8.0,
                "enable_kv_events": True,
                "extra_config": {"reset_lower_tiers": True, **peers, **extra.get("extra_config", {})}})
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
            env = dict(vllm_env(tmp / f"i{i}", multiprocessing=True, threads_bind=str(cores[i % len(cores)])),
                       VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache between configurations
            base, log = stack.enter_context(serve(model, [*args, "--kv-transfer-config", json.dumps(kv),
                                                          "--kv-events-config", json.dumps(events)], tmp, env,
                                                  timeout_s=900))
            self.events[base] = f"tcp://127.0.0.1:{port}"
            self.logs.append(log)
            return base

        with ThreadPoolExecutor(n) as pool:
            self.bases = list(pool.map(start, range(n)))

    def reset(self, model: str) -> None:
        """Every cache empty (vLLM's device cache, our L1 and disk), seen in our gauges after a short request
        (which also warms the instance; our gauges reach /metrics with a step)."""
        for base in self.bases:
            reset_prefix_cache(base)
            for _ in range(30):
                post(f"{base}/v1/completions", {"model": model, "prompt": "warm-up", "max_tokens": 2}, timeout=600)
                resident = wait_for(base, lambda m: True)
                if not any(resident.get(("lmcache_vllm:resident_chunks", t), 0) for t in ("local_cpu", "local_disk")):
                    break
                time.sleep(1)
            else:
                raise RuntimeError(f"{base}: the caches did not empty")


def measure(name: str, policy: str, fleet: Fleet, tmp: Path, model: str, w: Workload, conversations: Path,
            script: Path, allowed: list[int] | None, credits: dict[str, float] | None = None) -> dict:
    print(f"\n-- {name}", flush=True)
    fleet.reset(model)
    kv = policy == "kv_aware"
    with route(fleet.bases, policy, tmp, events=fleet.events if kv else None, block_size=BLOCK_SIZE, model=model,
               credits=credits if kv else None, log_level="debug" if kv else "info") as (router, log):
        proxy = RecordingProxy(router, allowed)
        url = proxy.start()
        groups = [_common.server_process_group(server_log.read_text()) for server_log in fleet.logs]
        try:
            before = [scrape(b) for b in fleet.bases]
            cpu_before = sum(map(_common.process_group_cpu_seconds, groups))
            stats = run_client(script, url, model, conversations, w, tmp, name)
            cpu = sum(map(_common.process_group_cpu_seconds, groups)) - cpu_before
            time.sleep(2)  # vLLM's counters reach /metrics a step after the work
            after = [scrape(b) for b in fleet.bases]
        finally:
            exchanges = proxy.take()
            proxy.stop()
        chosen = decisions(log) if kv else []
        unprepared = log.read_text(errors="replace").count("Prefix input preparation unavailable") if kv else 0
    ttft = [s["ttft_ms"] for s in stats]
    start = min(s["start_time_ms"] for s in stats)
    end = max(s["start_time_ms"] + s["latency_ms"] for s in stats)
    row: dict = {"policy": policy, "requests": len(stats), "server_cpu_s": cpu,
                 "request_throughput": len(stats) / ((end - start) / 1e3), "p50_ttft_ms": percentile(ttft, 50),
                 "p99_ttft_ms": percentile(ttft, 99)}
    for b, a in zip(before, after):
        for key, value in cache_tokens(b, a).items():
            row[key] = row.get(key, 0.0) + value
        row["ours_p2p_tokens"] = row.get("ours_p2p_tokens", 0.0) + (
            a.get(("lmcache_vllm:hit_tokens_total", "p2p"), 0.0) - b.get(("lmcache_vllm:hit_tokens_total", "p2p"), 0.0))
        # hits that did not become loads, and why (a P2P run that pulls nothing says why too)
        for counter in FAULT_COUNTERS:
            row[counter] = row.get(counter, 0.0) + growth(b, a, f"lmcache_vllm:{counter}_total")
    served = [growth(b, a, "vllm:request_success_total") for b, a in zip(before, after)]
    row["served_by_instance"] = "/".join(str(int(x)) for x in served)  # requests (the warm-ups excluded)
    row["recomputed_tokens"] = row["prompt_tokens"] - row["vllm_prefix_cache_tokens"] - row["connector_tokens"]
    row["unbounded_tokens"] = sum(unbounded_hits(exchanges, BLOCK_SIZE))
    if kv:
        credited = [int(d.get("credited_prefix_tokens", 0)) for d in chosen]
        # `unprepared`: an instance did not render the prompt within the router's 1 s (no credit for it)
        # later turns of a conversation and those the router sent to another instance than the previous turn
        turns, moved = conversation_moves(exchanges, served_by(exchanges, chosen))
        row.update(router_credits=json.dumps(credits or "vllm-router's defaults"), later_turns=turns,
                   moved_turns=moved,
                   router_decisions=len(chosen), router_credited_decisions=sum(c > 0 for c in credited),
                   router_credited_tokens=sum(credited), router_unprepared_inputs=unprepared)
    print(f"   {name}: {row['request_throughput']:.3f} req/s, TTFT p50 {row['p50_ttft_ms']:.0f} ms "
          f"p99 {row['p99_ttft_ms']:.0f} ms; recomputed {int(row['recomputed_tokens'])} of "
          f"{int(row['prompt_tokens'])} prompt tokens; per instance {row['served_by_instance']}", flush=True)
    return row


def growth(before: dict, after: dict, sample: str) -> float:
    """How much a counter grew between two scrapes, summed over its labels."""
    return sum(v for (n, _), v in after.items() if n == sample) - sum(v for (n, _), v in before.items() if n == sample)


def served_by(exchanges: list, chosen: list[dict[str, str]]) -> list[str | None]:
    """The instance kv_aware chose for each exchange: its decisions matched by prompt length, in order."""
    workers: dict[int, list[str]] = {}
    for decision in chosen:
        workers.setdefault(int(decision.get("input_tokens", -1)), []).append(decision.get("worker", ""))
    return [workers[n].pop(0) if workers.get(n) else None for n in (len(e.prompt_ids) for e in exchanges)]


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ours in ("kv_aware", "kv_aware_p2p"):
        if ours not in rows:
            continue
        for other in ("round_robin", "cache_aware", "round_robin_p2p", "cache_aware_p2p", "kv_aware"):
            if other in rows and other != ours:
                a, b = rows[ours], rows[other]
                out[f"{ours}.throughput_vs_{other}_ratio"] = a["request_throughput"] / b["request_throughput"]
                out[f"{ours}.ttft_p50_{other}_over_{ours}_ratio"] = b["p50_ttft_ms"] / a["p50_ttft_ms"]
                out[f"{ours}.ttft_p99_{other}_over_{ours}_ratio"] = b["p99_ttft_ms"] / a["p99_ttft_ms"]
    return out


def main() -> None:
    def add_arguments(p) -> None:
        p.add_argument("--instances", type=int, default=2, help="instances behind the router (default 2; 3 needs "
                       "a third core to be a fair test)")
        p.add_argument("--only", nargs="*", help="run only these configurations: " + " ".join(
            f"{policy}{p2p}" for p2p in ("", "_p2p") for policy in POLICIES))
        p.add_argument("--l1-fraction", type=float, default=0.25, help="each instance's L1 as a fraction of the "
                       "conversations' KV (default 0.25)")
        p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (server, router and client logs)")
        p.add_argument("--credits", nargs="*", default=["host=0.95", "disk=0.9"], metavar="TIER=CREDIT",
                       help="kv_aware's tier credits (vllm-router's --kv-penalty-TIER; TIER: host, disk, external); "
                       "default: docs/ROUTING.md's for vLLM on CPU, host=0.95 disk=0.9 (none given: the router's own)")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    args.json = args.json or os.path.join(OUT, "routing.json")
    from transformers import AutoTokenizer

    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    credits = {tier: float(value) for tier, value in (c.split("=", 1) for c in args.credits)}
    size = "tiny" if args.quick else "medium"
    model = str(build_model(size))
    w = replace(QUICK, users=8, turns=3) if args.quick else FULL
    max_model_len = BLOCK_SIZE * math.ceil((w.max_prompt_tokens() + 2 * w.answer_tokens) / BLOCK_SIZE)
    num_blocks = max(max_model_len // BLOCK_SIZE + 1, math.ceil(w.clients * w.mean_prompt_tokens() / BLOCK_SIZE))
    l1_gib = round(args.l1_fraction * w.working_set_tokens() * kv_bytes_per_token(model) / (1 << 30), 4)
    allowed = round_trip_word_tokens(AutoTokenizer.from_pretrained(model))
    script = client_script()
    print(f"workload: {asdict(w)}; {args.instances} instances, each: vLLM KV cache {num_blocks * BLOCK_SIZE} tokens, "
          f"L1 {l1_gib} GiB; max_model_len {max_model_len}; CPU {_common.cpu_model()}", flush=True)
    server = server_args(max_model_len, None) + ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
                                                 str(num_blocks), "--chat-template", CHAT_TEMPLATE,
                                                 "--enable-scale-out"]
    rows: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmpdir:
        tmp = Path(args.keep or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        conversations = write_conversations(tmp, w)
        redis_proc, redis_url = _common.start_redis(tmpdir)
        try:
            # p2p_serve_disk: each L1 holds a quarter of the conversations' KV, so most reusable chunks are on disk
            p2p = {"enable_p2p": True, "p2p_host": "127.0.0.1", "extra_config": {
                "p2p_directory_url": redis_url, "remote_key_prefix": f"bench-routing-{uuid.uuid4().hex[:6]}:",
                "p2p_serve_disk": True}}
            for suffix, extra in (("", {}), ("_p2p", p2p)):
                names = [n for n in (f"{policy}{suffix}" for policy in POLICIES) if not args.only or n in args.only]
                if not names:
                    continue
                try:
                    with ExitStack() as stack:
                        print(f"\n-- starting {args.instances} instances{' with P2P' if suffix else ''}", flush=True)
                        ours = {"max_local_cpu_size": l1_gib, "save_decode_cache": True, **extra}
                        fleet = Fleet(stack, tmp, model, args.instances, ours, server)
                        for name in names:
                            try:
                                rows[name] = measure(name, name.removesuffix(suffix), fleet, tmp, model, w,
                                                     conversations, script, allowed, credits)
                            except Exception as exc:  # one failed configuration must not lose the others
                                failed[name] = repr(exc)[-2000:]
                                print(f"   {name} FAILED: {exc!r}"[:3000], flush=True)
                except Exception as exc:
                    for name in names:
                        failed.setdefault(name, repr(exc)[-2000:])
                    print(f"   instances{suffix} FAILED: {exc!r}"[:3000], flush=True)
        finally:
            redis_proc.kill()
            redis_proc.wait(10)
    report(rows, failed, size, w, args.instances, args.json)


def report(rows: dict[str, dict], failed: dict[str, str], size: str, w: Workload, instances: int,
           json_path: str) -> None:
    headers = ("config", "req/s", "TTFT p50", "p99", "server CPU s", "prompt tok", "vLLM cache", "ours L1",
               "ours disk", "ours P2P", "recomputed", "unbounded", "per instance")
    _common.print_table(f"routing, {size} model, {instances} instances, {w.users} users x {w.turns} turns, "
                        f"{w.clients} clients", [
        (n, r["request_throughput"], r["p50_ttft_ms"], r["p99_ttft_ms"], r["server_cpu_s"], int(r["prompt_tokens"]),
         int(r["vllm_prefix_cache_tokens"]), int(r["ours_local_cpu_tokens"]), int(r["ours_local_disk_tokens"]),
         int(r["ours_p2p_tokens"]), int(r["recomputed_tokens"]), r["unbounded_tokens"],
         r["served_by_instance"]) for n, r in rows.items()], headers)
    for name, row in rows.items():
        if "router_decisions" in row:
            print(f"{name}: the router credited a cached prefix in {row['router_credited_decisions']} of "
                  f"{row['router_decisions']} decisions ({row['router_credited_tokens']} tokens); an instance did "
                  f"not render the prompt in time {row['router_unprepared_inputs']} times; it sent "
                  f"{row['moved_turns']} of {row['later_turns']} later turns to another instance than the "
                  f"conversation's previous turn")
    for name, row in rows.items():
        faults = {c: int(row[c]) for c in FAULT_COUNTERS if row.get(c)}
        print(f"{name}: {faults or 'no failed loads, read allocation failures, timeouts or skipped peers'}")
    _common.write_configurations(json_path, {"model": size, "cpu": _common.cpu_model(), "instances": instances,
                                             **{f"workload.{k}": v for k, v in asdict(w).items()}, **ratios(rows)},
                                 rows, failed)


if __name__ == "__main__":
    main()
