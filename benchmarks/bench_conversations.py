"""Conversations: vLLM's own multi-turn benchmark client against vLLM alone, ours and LMCache's server mode.

The client is `benchmarks/multi_turn/benchmark_serving_multi_turn.py` of the installed vLLM's source
distribution, fetched and sha256-checked (`testing/vllm_sources.py`, as the toy proxy) and run unchanged. It
generates the conversations from a JSON configuration this script writes: `--users` conversations of
`--turns` user turns, a long system prompt shared by all (`common_prefix_num_tokens`, at the start of each
first message), a per-user document (`prefix_num_tokens`), questions and answers of realistic length (the
answer's length is the request's max_tokens). Text comes from the Python standard library's sources (no
network), the server renders the messages with a chat template of role markers and end-of-turn tokens.

Sessions and think time: `--clients` clients send one request at a time; each keeps `--users / --clients`
conversations open and serves them round robin, so a conversation's next turn comes after the client's other
conversations had theirs (the session pauses, its KV must survive elsewhere meanwhile), and each client
sleeps an exponential think time after every request (the client's `--request-rate`, per client: it cannot
express a pause per conversation). The think time counts in the throughput of every configuration alike.

Working set: vLLM's KV cache (`--num-gpu-blocks-override`) holds the requests in flight and little more; our
L1 (`max_local_cpu_size`) a quarter of the conversations' KV (`--l1-fraction`); the rest is on disk (ours)
or in LMCache's L2 (its `fs` adapter). Configurations, one after another, all bound the same way
(`VLLM_CPU_OMP_THREADS_BIND=0`; our threads, the servers' front ends, the proxy and the client on the other cores:
`extra_config.background_cpus`, `_common.front_ends_beside_compute`): vLLM alone
(its prefix cache on), ours with defaults (L1 + disk), ours with `save_decode_cache`, ours with L1's
`cache_policy: LIP`, ours with lossless (`ours_lossless`) and fp8 (`ours_fp8`) chunk files (the disk's codec,
`extra_config.local_disk_serde`; default naive; these two only when `--only` names them), ours with
`save_decode_cache` off whatever the default (`ours_no_decode`, the base of `*_vs_ours_no_decode_ratio`; only when
`--only` names it), ours with chunk files written through the page cache (`ours_buffered`,
`extra_config.disk_direct_io: false`; only when named), LMCache's server mode (`--vs-lmcache PYTHON`). Each of
ours also replays its trace through other L1 eviction policies (`_l1_replay.py`: LRU, ARC, Belady's optimum;
chunk counts).

Between the client and each server sits a recording proxy (`_chat_trace.py`): it sees every prompt's and
answer's token ids, from which the unbounded-cache hit (`unbounded_hits`: whole vLLM blocks and whole chunks
of ours that an earlier request's prompt + answer covered) is counted for the requests actually sent; it also
restricts the random-weight model's answers to tokens that survive retokenisation, as a trained model's
mostly do (`--free-answers`: not). Per configuration: requests/s, TTFT p50/p99 (the client's), the CPU seconds
the server's processes used for the run (LMCache's server included: on a busy machine the one figure of cost
that other processes barely stretch), prompt tokens, tokens from vLLM's prefix cache and from the connector
(vLLM's counters), ours by tier (our counters), evictions, recomputed prompt tokens, and ratios to vLLM alone,
to LMCache and to the unbounded cache; and the seconds of the run in which a sleeping process beside the
client got no CPU (`MachineStalls`, as `bench_serving.py`: a run with some compares with none without).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repo root on sys.path)
from _chat_trace import Exchange, RecordingProxy, round_trip_word_tokens, unbounded_hits  # noqa: E402
from _l1_replay import compare as compare_l1_policies  # noqa: E402
from bench_serving import cache_tokens, lmcache_peer, lmcache_running, ours, server_args  # noqa: E402

from lmcache_vllm.integration.vllm.testing.machine_stalls import MachineStalls  # noqa: E402
from lmcache_vllm.integration.vllm.testing.openai_server import post, scrape, serve  # noqa: E402
from lmcache_vllm.integration.vllm.testing.vllm_jobs import vllm_env  # noqa: E402

OUT = os.path.join(_common.REPO_ROOT, "bench_out")
CLIENT_DIR = "benchmarks/multi_turn"
CLIENT_FILES = ("benchmark_serving_multi_turn.py", "bench_dataset.py", "bench_utils.py")
BLOCK_SIZE = 128  # vLLM's CPU block size, set explicitly for every server
# Role markers and an end-of-turn token around every message, as chat models' templates have.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@dataclass(frozen=True)
class Workload:
    """The conversations (sizes in the tiny/medium model's tokens) and how the client sends them."""

    users: int
    turns: int  # user turns per conversation
    system_tokens: int  # shared by every conversation
    document_tokens: int  # per user (uniform 0.5x to 1.5x)
    question_tokens: int  # per user turn (uniform 0.8x to 1.2x)
    answer_tokens: int  # per answer (uniform 0.8x to 1.2x)
    clients: int
    think_rate: float  # requests/s per client of the exponential think time (0: none)

    def max_prompt_tokens(self) -> int:
        return int(self.system_tokens + 1.5 * self.document_tokens
                   + self.turns * 1.2 * (self.question_tokens + self.answer_tokens)) + 16 * self.turns

    def mean_prompt_tokens(self) -> int:
        return int(self.system_tokens + self.document_tokens
                   + (self.turns - 1) / 2 * (self.question_tokens + self.answer_tokens) + self.question_tokens)

    def working_set_tokens(self) -> int:
        """KV tokens of every conversation at its end: what a cache must keep to serve every turn."""
        return self.system_tokens + self.users * (self.document_tokens
                                                  + self.turns * (self.question_tokens + self.answer_tokens))


QUICK = Workload(users=12, turns=4, system_tokens=400, document_tokens=500, question_tokens=80, answer_tokens=48,
                 clients=4, think_rate=2.0)
FULL = Workload(users=16, turns=6, system_tokens=1000, document_tokens=1500, question_tokens=120,
                answer_tokens=100, clients=4, think_rate=1.0)


CODEC_RUNS = ("ours_lossless", "ours_fp8")  # run only when --only names them (bench_codecs.py says how)
ONLY_NAMED = ("ours_no_decode", "ours_buffered", "vllm_device")  # likewise


def client_script() -> Path:
    """vLLM's multi-turn client (its two helper modules beside it), from the installed vLLM's sdist."""
    from lmcache_vllm.integration.vllm.testing.vllm_sources import vllm_source_file

    paths = [vllm_source_file(f"{CLIENT_DIR}/{name}") for name in CLIENT_FILES]
    return paths[0]


def text_file(path: Path, min_chars: int) -> Path:
    """The standard library's sources, concatenated: the text the client's generator cuts prompts from."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_text(errors="replace")
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    path.write_text("".join(parts))
    return path


def write_conversations(tmp: Path, w: Workload) -> Path:
    """The conversations file vLLM's client reads, its text drawn from a file of enough words, under `tmp`."""
    text = text_file(tmp / "stdlib.txt", 8 * (w.system_tokens + w.users * (3 * w.document_tokens + 4 * w.turns)
                                              + 4 * w.turns * w.question_tokens))
    conversations = tmp / "conversations.json"
    conversations.write_text(json.dumps(generator_config(w, text)))
    return conversations


def generator_config(w: Workload, text: Path) -> dict:
    """The client's `generate_conversations` input (benchmarks/multi_turn/README.md in vLLM's sources)."""
    def uniform(value: int, low: float, high: float) -> dict:
        return {"distribution": "uniform", "min": max(1, int(value * low)), "max": max(1, int(value * high))}
    return {"filetype": "generate_conversations", "num_conversations": w.users, "text_files": [str(text)],
            "print_stats": False,
            "prompt_input": {"num_turns": {"distribution": "constant", "value": 2 * w.turns},
                             "common_prefix_num_tokens": {"distribution": "constant", "value": w.system_tokens},
                             "prefix_num_tokens": uniform(w.document_tokens, 0.5, 1.5),
                             "num_tokens": uniform(w.question_tokens, 0.8, 1.2)},
            "prompt_output": {"num_tokens": uniform(w.answer_tokens, 0.8, 1.2)}}


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def our_chunk_size(kv_config: dict) -> int:
    """The chunk size our connector runs with under `kv_config` (the configuration's, or our default)."""
    from lmcache_vllm.config import LMCacheConfig

    value = kv_config["kv_connector_extra_config"].get("chunk_size") or LMCacheConfig().chunk_size
    return value if isinstance(value, int) and value > 0 else BLOCK_SIZE  # unset: vLLM's block size


def run_client(script: Path, base: str, model: str, conversations: Path, w: Workload, out: Path,
               name: str) -> list[dict]:
    """One run of vLLM's multi-turn client against `base`: its per-request stats."""
    stats = out / f"{name}.stats.json"
    cmd = [sys.executable, str(script), "-m", model, "-u", base, "-i", str(conversations),
           "-p", str(w.clients), "-k", str(w.users), "--request-rate", str(w.think_rate), "--seed", "0",
           "--no-early-stop", "--request-timeout-sec", "1800", "--stats-json-output", str(stats),
           "-o", str(out / f"{name}.conversations.json")]
    log = out / f"{name}.client.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=script.parent, timeout=4 * 3600,
                              env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if proc.returncode != 0 or not stats.exists():
        raise RuntimeError(f"the multi-turn client failed for {name}:\n{log.read_text()[-4000:]}")
    return json.loads(stats.read_text())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def counters(before: dict, after: dict) -> dict:
    """Prompt tokens of the run by where their KV came from (bench_serving's), our L1's evictions and stores,
    and the prompt tokens computed again."""
    out = cache_tokens(before, after)
    for key, (name, label) in {"ours_local_cpu_evictions": ("evictions_total", "local_cpu"),
                               "ours_stored_tokens": ("stored_tokens_total", ""),
                               "ours_store_skipped_tokens": ("store_skipped_tokens_total", ""),
                               "ours_failed_load_tokens": ("failed_load_tokens_total", ""),
                               "ours_save_wait_seconds": ("save_wait_seconds_total", ""),
                               "ours_load_requests": ("load_requests_total", ""),
                               "ours_async_load_requests": ("async_load_requests_total", ""),
                               # disk hits read while their lookup waited (loaded inside the step), or not
                               "ours_read_waits_ready": ("lookup_read_waits_total", "ready"),
                               "ours_read_waits_late": ("lookup_read_waits_total", "late"),
                               "preemptions": ("vllm:num_preemptions_total", ""),
                               # time requests waited to be scheduled (blocks held by others' saves show here)
                               "queue_seconds": ("vllm:request_queue_time_seconds_sum", ""),
                               "prefill_seconds": ("vllm:request_prefill_time_seconds_sum", "")}.items():
        name = name if name.startswith("vllm:") else f"lmcache_vllm:{name}"
        out[key] = after.get((name, label), 0.0) - before.get((name, label), 0.0)
    out["recomputed_tokens"] = out["prompt_tokens"] - out["vllm_prefix_cache_tokens"] - out["connector_tokens"]
    return out


def measure(name: str, tmp: Path, model: str, kv_config: dict | None, w: Workload, conversations: Path,
            script: Path, num_blocks: int, max_model_len: int, allowed: list[int] | None,
            chunk_size: int = BLOCK_SIZE, python: str | None = None, other_groups: tuple[int, ...] = ()
            ) -> tuple[dict, list[Exchange]]:
    """One configuration: a server, the client through the recording proxy, its figures; `chunk_size` is the
    granularity of the connector's hits (vLLM alone: its blocks); `other_groups`: process groups whose CPU
    time counts with the server's (LMCache's server). Returns its row and the recorded trace (also
    written to NAME.trace.json in the work directory)."""
    env = vllm_env(tmp / name, multiprocessing=True)
    if python is not None:  # the peer: LMCache's connector must import in the server's interpreter
        env["PYTHONPATH"] = _common.REPO_ROOT
    args = server_args(max_model_len, kv_config) + ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
                                                    str(num_blocks), "--chat-template", CHAT_TEMPLATE]
    print(f"\n-- {name}: starting the server", flush=True)
    with serve(model, args, tmp, env, timeout_s=900, python=python) as (base, log):
        post(f"{base}/v1/completions", {"model": model, "prompt": "warm-up", "max_tokens": 2}, timeout=600)
        proxy = RecordingProxy(base, allowed)
        url = proxy.start()
        groups = (_common.server_process_group(log.read_text()), *other_groups)
        try:
            before, cpu_before = scrape(base), sum(map(_common.process_group_cpu_seconds, groups))
            with MachineStalls() as stalls:  # (as bench_serving: a run with stalls compares with none without)
                started = time.monotonic()
                stats = run_client(script, url, model, conversations, w, tmp, name)
                ended = time.monotonic()
            cpu = sum(map(_common.process_group_cpu_seconds, groups)) - cpu_before
            time.sleep(2)  # vLLM's counters reach /metrics a step after the work
            row = {"name": name, "server_cpu_s": cpu, "machine_stall_s": stalls.stalled(started, ended),
                   **counters(before, scrape(base))}
        finally:
            exchanges = proxy.take()
            proxy.stop()
    ttft = [s["ttft_ms"] for s in stats]
    start = min(s["start_time_ms"] for s in stats)
    end = max(s["start_time_ms"] + s["latency_ms"] for s in stats)
    row.update(requests=len(stats), exchanges=len(exchanges), request_throughput=len(stats) / ((end - start) / 1e3),
               p50_ttft_ms=percentile(ttft, 50), p99_ttft_ms=percentile(ttft, 99), mean_ttft_ms=statistics.mean(ttft),
               output_tokens=sum(len(e.output_ids) for e in exchanges))
    row["chunk_size"] = chunk_size
    by_block, by_chunk = unbounded_hits(exchanges, BLOCK_SIZE), unbounded_hits(exchanges, chunk_size)
    row.update(unbounded_block_tokens=sum(by_block), unbounded_chunk_tokens=sum(by_chunk),
               unbounded_tokens=sum(max(b, c) for b, c in zip(by_block, by_chunk)),
               unbounded_prompts_only_tokens=sum(unbounded_hits(exchanges, BLOCK_SIZE, with_answers=False)),
               trace_prompt_tokens=sum(len(e.prompt_ids) for e in exchanges))
    row["cached_tokens"] = row["vllm_prefix_cache_tokens"] + row["connector_tokens"]
    row["ours_hit_tokens"] = row["ours_local_cpu_tokens"] + row["ours_local_disk_tokens"]  # our /metrics
    print(f"   {name}: {row['request_throughput']:.3f} req/s, TTFT p50 {row['p50_ttft_ms']:.0f} ms "
          f"p99 {row['p99_ttft_ms']:.0f} ms; cached {int(row['cached_tokens'])} of {int(row['prompt_tokens'])} "
          f"prompt tokens (unbounded: {row['unbounded_tokens']}; in whole blocks {row['unbounded_block_tokens']}, "
          f"whole {chunk_size}-token chunks {row['unbounded_chunk_tokens']}); the machine stalled "
          f"{row['machine_stall_s']:.1f} s", flush=True)
    if row["ours_load_requests"]:
        print(f"   {name}: {int(row['ours_load_requests'])} loads, "
              f"{int(row['ours_async_load_requests'])} asynchronous; hits from below read while the lookup "
              f"waited: {int(row['ours_read_waits_ready'])} (and "
              f"{int(row['ours_read_waits_late'])} waited for in vain)", flush=True)
    (tmp / f"{name}.trace.json").write_text(json.dumps([asdict(e) for e in exchanges]))
    return row, exchanges


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, row in rows.items():
        if row.get("unbounded_tokens"):
            out[f"{name}.cached_vs_unbounded_ratio"] = row["cached_tokens"] / row["unbounded_tokens"]
            if row["ours_hit_tokens"]:  # the same from our counters: vLLM's own hits + what our tiers served
                out[f"{name}.ours_counted_vs_unbounded_ratio"] = (
                    (row["vllm_prefix_cache_tokens"] + row["ours_hit_tokens"]) / row["unbounded_tokens"])
        for base in ("vllm", "vllm_device", "lmcache", "ours_no_decode"):
            other = rows.get(base)
            if other is None or base == name:
                continue
            out[f"{name}.throughput_vs_{base}_ratio"] = row["request_throughput"] / other["request_throughput"]
            # CPU seconds the servers used for the same requests: robust to a busy machine, unlike times
            out[f"{name}.server_cpu_{base}_over_ours_ratio"] = other["server_cpu_s"] / row["server_cpu_s"]
            out[f"{name}.ttft_p50_{base}_over_ours_ratio"] = other["p50_ttft_ms"] / row["p50_ttft_ms"]
            out[f"{name}.ttft_p99_{base}_over_ours_ratio"] = other["p99_ttft_ms"] / row["p99_ttft_ms"]
            if other["cached_tokens"]:
                out[f"{name}.cached_tokens_vs_{base}_ratio"] = row["cached_tokens"] / other["cached_tokens"]
    return out


def main() -> None:
    def add_arguments(p) -> None:  # (the codec runs only when --only names them)
        p.add_argument("--vs-lmcache", metavar="PYTHON", help="an interpreter with LMCache 0.5.6 "
                       "(scripts/make_lmcache_venv.sh): also run LMCache's server mode")
        p.add_argument("--only", nargs="*", help="run only these configurations: vllm vllm_device ours ours_decode "
                       "ours_no_decode ours_lip ours_buffered ours_lossless ours_fp8 lmcache")
        p.add_argument("--chunk-size", type=int, default=None, help="our chunk size (default: our default)")
        p.add_argument("--users", type=int, help="conversations (default 16, --quick 12)")
        p.add_argument("--turns", type=int, help="user turns per conversation (default 6, --quick 4)")
        p.add_argument("--think-rate", type=float, help="think time: requests/s per client of the client's "
                       "exponential pause after each request (default 1, --quick 2; 0: none)")
        p.add_argument("--l1-fraction", type=float, default=0.25, help="our L1 (and LMCache's) as a fraction of "
                       "the conversations' KV (default 0.25)")
        p.add_argument("--disk-fraction", type=float, default=None, help="our disk tier as a fraction of the "
                       "conversations' KV (default: 8 GiB, never full): below 1, the disk's codec decides how much "
                       "of it stays (--only ours ours_lossless ours_fp8)")
        p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (server, client and LMCache logs)")
        p.add_argument("--free-answers", action="store_true", help="let the random-weight model generate any "
                       "token (its answers then do not tokenise back to the same ids)")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments)
    _common.front_ends_beside_compute()
    args.json = args.json or os.path.join(OUT, "conversations.json")
    from transformers import AutoTokenizer

    from lmcache_vllm.integration.vllm.testing.local_model import build_model

    size = "tiny" if args.quick else "medium"
    model = str(build_model(size))
    w = QUICK if args.quick else FULL
    w = replace(w, **{k: v for k, v in (("users", args.users), ("turns", args.turns),
                                        ("think_rate", args.think_rate)) if v is not None})
    max_model_len = BLOCK_SIZE * math.ceil((w.max_prompt_tokens() + 2 * w.answer_tokens) / BLOCK_SIZE)
    # vLLM's KV cache: the requests in flight at their mean length (and one at max_model_len, which vLLM
    # insists on), so that it keeps little besides them.
    num_blocks = max(max_model_len // BLOCK_SIZE + 1, math.ceil(w.clients * w.mean_prompt_tokens() / BLOCK_SIZE))
    per_token = kv_bytes_per_token(model)
    l1_gib = round(args.l1_fraction * w.working_set_tokens() * per_token / (1 << 30), 4)
    allowed = None if args.free_answers else round_trip_word_tokens(AutoTokenizer.from_pretrained(model))
    script = client_script()
    print(f"workload: {asdict(w)}; KV {per_token} B/token; conversations' KV ~{w.working_set_tokens()} tokens; "
          f"vLLM KV cache {num_blocks * BLOCK_SIZE} tokens; L1 {l1_gib} GiB "
          f"(~{int(l1_gib * (1 << 30) / per_token)} tokens); max_model_len {max_model_len}", flush=True)
    rows: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_conversations_") as tmpdir:
        tmp = Path(args.keep or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        conversations = write_conversations(tmp, w)
        disk_gib = 8.0 if args.disk_fraction is None else \
            round(args.disk_fraction * w.working_set_tokens() * per_token / (1 << 30), 4)
        tiers = {"max_local_cpu_size": l1_gib, "local_disk": str(tmp / "l2"), "max_local_disk_size": disk_gib}
        plan = [("vllm", None), ("vllm_device", None), ("ours", ours(tiers, args.chunk_size)),
                ("ours_decode", ours({**tiers, "save_decode_cache": True}, args.chunk_size)),
                ("ours_no_decode", ours({**tiers, "save_decode_cache": False}, args.chunk_size)),
                ("ours_lip", ours({**tiers, "cache_policy": "LIP"}, args.chunk_size)),
                # chunk files written through the page cache: a turn's reads of the last turn's chunks from memory
                ("ours_buffered", ours({**tiers, "extra_config": {"disk_direct_io": False}}, args.chunk_size)),
                # the disk tier's codec (ours: naive, the default): lossless and fp8 chunk files against it
                ("ours_lossless", ours({**tiers, "extra_config": {"local_disk_serde": "lossless"}}, args.chunk_size)),
                ("ours_fp8", ours({**tiers, "extra_config": {"local_disk_serde": "fp8"}}, args.chunk_size))]
        common = dict(model=model, w=w, conversations=conversations, script=script, num_blocks=num_blocks,
                      max_model_len=max_model_len, allowed=allowed)
        for name, kv_config in plan:
            if (args.only and name not in args.only) or (not args.only and name in CODEC_RUNS + ONLY_NAMED):
                continue  # the codecs, ours_no_decode and ours_buffered only when named
            if kv_config is not None:  # a fresh disk tier for each of ours
                subprocess.run(["rm", "-rf", str(tmp / "l2")], check=True)
            try:
                chunk = our_chunk_size(kv_config) if kv_config is not None else BLOCK_SIZE
                # vllm_device: vLLM alone with room for every conversation's KV beside what runs (a quarter
                # more for the chat template's tokens): no turn recomputes what it served, nothing is loaded.
                blocks = num_blocks + math.ceil(1.25 * w.working_set_tokens() / BLOCK_SIZE) \
                    if name == "vllm_device" else num_blocks
                rows[name], trace = measure(name, tmp, kv_config=kv_config, chunk_size=chunk,
                                            **{**common, "num_blocks": blocks})
                if kv_config is not None:  # our L1 under other eviction policies, replayed on this trace
                    capacity = int(l1_gib * (1 << 30) // (chunk * per_token))
                    device = num_blocks * BLOCK_SIZE // chunk  # vLLM's own cache in front of L1
                    for policy, (l1, disk) in compare_l1_policies(trace, chunk, capacity, device).items():
                        rows[name][f"replay_{policy}_l1_chunks"], rows[name][f"replay_{policy}_disk_chunks"] = l1, disk
            except Exception as exc:  # one failed configuration must not lose the others' figures
                failed[name] = repr(exc)[-2000:]
                print(f"   {name} FAILED: {exc!r}"[:3000], flush=True)
        if args.vs_lmcache and (not args.only or "lmcache" in args.only):
            chunk = our_chunk_size(ours({}, args.chunk_size))  # LMCache's chunks as ours
            l2 = json.dumps({"type": "fs", "base_path": str(tmp / "lmcache_l2")})
            try:
                with lmcache_running(args.vs_lmcache, tmp, l1_gib, chunk, ("--l2-adapter", l2)) as (port, group):
                    rows["lmcache"], _ = measure("lmcache", tmp, kv_config=lmcache_peer(port), chunk_size=chunk,
                                                 python=args.vs_lmcache, other_groups=(group,), **common)
            except Exception as exc:
                failed["lmcache"] = repr(exc)[-2000:]
                print(f"   lmcache FAILED: {exc!r}"[:3000], flush=True)
    report(rows, failed, size, w, args.json)


def report(rows: dict[str, dict], failed: dict[str, str], size: str, w: Workload, json_path: str) -> None:
    headers = ("config", "req/s", "TTFT p50", "p99", "server CPU s", "prompt tok", "vLLM cache", "connector", "ours L1",
               "ours disk", "L1 evict", "recomputed", "unbounded", "cached/unb.", "stalled s")
    _common.print_table(f"conversations, {size} model, {w.users} users x {w.turns} turns, {w.clients} clients", [
        (n, r["request_throughput"], r["p50_ttft_ms"], r["p99_ttft_ms"], r["server_cpu_s"], int(r["prompt_tokens"]),
         int(r["vllm_prefix_cache_tokens"]), int(r["connector_tokens"]), int(r["ours_local_cpu_tokens"]),
         int(r["ours_local_disk_tokens"]), int(r["ours_local_cpu_evictions"]), int(r["recomputed_tokens"]),
         r["unbounded_tokens"], r["cached_tokens"] / r["unbounded_tokens"] if r["unbounded_tokens"] else 0.0,
         r["machine_stall_s"])
        for n, r in rows.items()], headers)
    replays = [(n, p, r[f"replay_{p}_l1_chunks"], r[f"replay_{p}_disk_chunks"]) for n, r in rows.items()
               for p in ("lru", "lip", "arc", "belady") if f"replay_{p}_l1_chunks" in r]
    if replays:
        _common.print_table("our L1 replayed under eviction policies (chunks a lookup found)", replays,
                            ("config", "policy", "from L1", "from disk"))
    _common.write_configurations(json_path, {"model": size, "cpu": _common.cpu_model(),
                                             **{f"workload.{k}": v for k, v in asdict(w).items()}, **ratios(rows)},
                                 rows, failed)


if __name__ == "__main__":
    main()
