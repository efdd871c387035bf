"""End to end through the console script: `lmcache-vllm serve MODEL --kv-transfer-config ...` starts
vLLM's OpenAI server (multiprocess engine, as users run it) on 127.0.0.1 and the second identical
completion is served from our cache. The server has all three tiers (L1, a disk directory, the test's
Redis); the same server then shows our metrics at its own `/metrics` (hits per tier matching vLLM's
`cached_tokens` and its hit sources), resets through `/reset_prefix_cache`, and survives Redis being
killed; a restarted server finds the disk directory, and the CLI inspects what the run left there.

The reference is vLLM alone in the same engine mode (multiprocess, the same thread binding) with its own
prefix cache, sent the prompt twice: the cold answer and the 512-token hit are compared with the request
computed with the same split."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import e2e_harness as h
import pytest

from lmcache_vllm.integration.vllm.testing.openai_server import (
    cached_tokens,
    reset_prefix_cache,
    scrape,
    serve,
    wait_for,
)
from lmcache_vllm.integration.vllm.testing.openai_server import launcher as _launcher
from lmcache_vllm.integration.vllm.testing.openai_server import post as _post

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPT = h.random_tokens(40, 600)
FREE_CPUS = sorted(os.sched_getaffinity(0) - {0})  # what VLLM_CPU_OMP_THREADS_BIND=0 leaves


@contextlib.contextmanager
def _serve(tmp: Path, model: str, extra: dict, args: tuple[str, ...] = ()):
    """`lmcache-vllm serve` with our connector (config `extra`); yields (base URL, log path)."""
    server_args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
                   "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--kv-transfer-config", json.dumps(h.connector(extra)), *args]
    env = dict(h.vllm_env(tmp, multiprocessing=True), VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
    with serve(model, server_args, tmp, env) as (base, log):
        yield base, log


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e_serve_disk")


@pytest.fixture(scope="module")
def events_endpoint() -> str:
    return f"ipc://{tempfile.mkdtemp(prefix='lmv-ev-')}/events.sock"  # short: a socket path holds 107 bytes


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, disk_dir, redis_server, events_endpoint):
    redis_server.ensure_running()
    extra = {"local_disk": str(disk_dir), "max_local_disk_size": 1.0, "remote_url": redis_server.url,
             "enable_kv_events": True,
             "extra_config": {"remote_key_prefix": "e2e-serve:", "remote_timeout_secs": 0.5,
                              "max_pinned_fraction": 0.25,  # pins are off unless configured
                              # vLLM computes on core 0 (an explicit binding): our threads on the others
                              "background_cpus": ",".join(map(str, FREE_CPUS)) or "inherit"}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint}
    with _serve(tmp_path_factory.mktemp("e2e_serve"), tiny_model, extra,
                ("--kv-events-config", json.dumps(events))) as (base, log):
        yield base, tiny_model, log


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    phases = [{"name": name, "prompts": [PROMPT], "max_tokens": 8} for name in ("first", "second")]
    job = h.reference_job({"model": tiny_model, "llm_kwargs": h.llm_kwargs(), "phases": phases})
    return h.run_job(tmp_path_factory.mktemp("e2e_serve_ref"), "reference", job, multiprocessing=True)


def test_serve_answers_twice_second_from_cache(server, reference):
    base, model, log = server
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    first = _post(f"{base}/v1/completions", body)
    second = _post(f"{base}/v1/completions", body)
    details = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
               for r in (first, second)]
    assert details[0] == 0
    assert details[1] == h.floor_chunk(len(PROMPT)) == 512, (details, log)
    assert first["usage"]["completion_tokens"] == 8
    for name, answer, cached in (("first", first, details[0]), ("second", second, details[1])):
        ours = {"tokens": answer["choices"][0]["token_ids"], "num_cached_tokens": cached}
        h.assert_like_with_like(ours, h.phase(reference, name)[0], what=name)


# ---------------------------------------------------------------- metrics, reset, Redis faults, CLI
def _completion(base: str, model: str, prompt: list[int]) -> dict:
    return _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                            "temperature": 0.0})


_cached = cached_tokens
_scrape, _wait_for = scrape, wait_for


HIT = "lmcache_vllm:hit_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


@pytest.mark.skipif(not FREE_CPUS, reason="needs two CPUs")
def test_our_threads_run_beside_vllms_compute_core(server):
    """vLLM computes on core 0 (VLLM_CPU_OMP_THREADS_BIND=0); `background_cpus` names the rest: our threads
    (storage loop, disk readers and writers, save thread) run there, off the model's core. The lookup server
    alone stays on the worker's core: the scheduler asks only between steps, while the worker waits."""
    workers = h.group_processes(h.server_group(server[2]), "VLLM::Worker")
    assert len(workers) == 1, workers
    threads = h.thread_cpus(workers[0])
    ours = {name: cpus for name, cpus in threads if name.startswith("lmcache")}
    assert {"lmcache-storage", "lmcache-lookup-"} <= {name[:15] for name in ours}, threads
    assert all(cpus == ({0} if name.startswith("lmcache-lookup") else set(FREE_CPUS))
               for name, cpus in ours.items()), ours
    assert os.sched_getaffinity(workers[0]) == {0}  # the model's own (main) thread stays on its core


def test_metrics_count_l1_hits_as_vllm_does(server):
    base, model, log = server
    prompt = h.random_tokens(41, 600)
    before = _scrape(base)
    assert _cached(_completion(base, model, prompt)) == 0
    warm = _cached(_completion(base, model, prompt))
    assert warm == 512, log
    got = _wait_for(base, lambda m: m.get((HIT, "local_cpu"), 0) - before.get((HIT, "local_cpu"), 0) >= warm)
    assert got[(HIT, "local_cpu")] - before.get((HIT, "local_cpu"), 0) == warm
    assert got[(BY_SOURCE, "host")] - before.get((BY_SOURCE, "host"), 0) == warm
    # One help text per metric of the table reached vLLM's registry, with the tier labels.
    assert got[("lmcache_vllm:capacity_bytes", "local_cpu")] > 0
    assert got[("lmcache_vllm:capacity_bytes", "local_disk")] == 2 ** 30
    assert got.get(("lmcache_vllm:loaded_tokens_total", ""), 0) >= warm


def test_kv_events_tell_a_router_what_each_tier_holds(server, events_endpoint):
    """Our events as vLLM publishes its own (vLLM's typed decoder): per chunk one BlockStored of its vLLM blocks
    (integer hashes, the previous block as parent, complete token ids, vLLM's block size), L1 as vLLM's CPU, the
    disk as STORAGE (both LOCAL), the Redis pool as a REMOTE STORAGE copy owned by "redis" (docs/ROUTING.md)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    base, model, log = server
    tiers = {("CPU", "LOCAL", None): "local_cpu", ("STORAGE", "LOCAL", None): "local_disk",
             ("STORAGE", "REMOTE", "redis"): "redis"}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_endpoint)
    prompt = h.random_tokens(45, 600)
    try:
        time.sleep(1.0)  # a subscriber only gets what is published after it joined
        _completion(base, model, prompt)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ours: dict[str, list] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and min(len(ours.get(t, ())) for t in tiers.values()) < 2:
            if sub.poll(500):
                _, _, payload = sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    tier = tiers.get((event.medium, event.locality, event.ownership))
                    if isinstance(event, BlockStored) and tier and event.token_ids[:8] in (prompt[:8], prompt[256:264]):
                        ours.setdefault(tier, []).append(event)
            else:
                _completion(base, model, h.random_tokens(46, 10))  # a step: worker events reach vLLM
    finally:
        sub.close(linger=0)
    assert all(len(ours.get(t, ())) >= 2 for t in tiers.values()), (ours, log)
    first, second = ours["local_cpu"][:2]
    assert first.token_ids == prompt[:256] and first.parent_block_hash is None and first.block_size == 128
    assert second.token_ids == prompt[256:512] and second.parent_block_hash == first.block_hashes[-1]
    assert all(isinstance(x, int) for x in first.block_hashes + second.block_hashes) and len(first.block_hashes) == 2
    for tier in ("local_disk", "redis"):  # the same blocks, in every tier
        assert {x for e in ours[tier] for x in e.block_hashes} == {*first.block_hashes, *second.block_hashes}


def test_per_request_hints_skip_save_and_pin_a_prefix(server):
    """kv_transfer_params from the client: lmcache.skip_save stores nothing (the repeat is computed again),
    lmcache.pin_tokens pins the prompt's whole chunks in L1, a key we do not follow is counted, not an error."""
    base, model, log = server
    skipped, pinned = h.random_tokens(47, 600), h.random_tokens(48, 600)
    before = _scrape(base)
    hints = {"lmcache.skip_save": True, "lmcache.tag.user": "x"}
    answer = _post(f"{base}/v1/completions", {"model": model, "prompt": skipped, "max_tokens": 8,
                                              "temperature": 0.0, "kv_transfer_params": hints})
    assert answer["usage"]["completion_tokens"] == 8
    assert _cached(_completion(base, model, skipped)) == 0, log  # nothing of the first was stored
    _post(f"{base}/v1/completions", {"model": model, "prompt": pinned, "max_tokens": 8, "temperature": 0.0,
                                     "kv_transfer_params": {"lmcache.pin_tokens": 10_000}})
    got = _wait_for(base, lambda m: m.get(("lmcache_vllm:pinned_bytes", ""), 0) > 0)
    assert got[("lmcache_vllm:pinned_prefixes", "")] == 1, log
    def total(scraped: dict, name: str) -> float:  # over every label (hint, reason)
        return sum(v for (n, _), v in scraped.items() if n == f"lmcache_vllm:{name}")
    assert total(got, "request_hints_total") - total(before, "request_hints_total") == 2  # skip_save, pin
    assert total(got, "refused_request_hints_total") - total(before, "refused_request_hints_total") == 1


def test_a_plain_clients_remote_decode_is_not_held_by_default(server):
    """Issue 39 #4: in the default configuration (kv_both, pd: auto, no key, no pd_peers) any client's
    `do_remote_decode: true` held a unique prompt's chunks for 30 s (up to half of L1) and was answered with the
    instance's host, transfer ports and engine id. Now: no hold, no params, counted."""
    base, model, log = server
    before = _scrape(base)

    def refused(scraped: dict) -> float:
        return sum(v for (n, _), v in scraped.items() if n == "lmcache_vllm:pd_remote_decode_refused_total")

    answer = _post(f"{base}/v1/completions", {"model": model, "prompt": h.random_tokens(49, 600), "max_tokens": 1,
                                              "temperature": 0.0, "kv_transfer_params": {"do_remote_decode": True}})
    assert not answer.get("kv_transfer_params"), answer.get("kv_transfer_params")  # no address, no engine id
    got = _wait_for(base, lambda m: refused(m) > refused(before))
    assert refused(got) - refused(before) == 1, log
    assert got.get(("lmcache_vllm:pd_holds", ""), 0) == 0


def test_reset_prefix_cache_empties_l1_and_the_disk_serves_next(server):
    base, model, log = server
    prompt = h.random_tokens(42, 600)
    _completion(base, model, prompt)
    assert _cached(_completion(base, model, prompt)) == 512
    before = _wait_for(base, lambda m: True)
    assert reset_prefix_cache(base, timeout=60) == {"success": True}
    again = _cached(_completion(base, model, prompt))
    assert again == 512  # all of it from the disk tier: nothing from L1
    got = _wait_for(base, lambda m: m.get((HIT, "local_disk"), 0) - before.get((HIT, "local_disk"), 0) >= again)
    assert got.get((HIT, "local_cpu"), 0) == before.get((HIT, "local_cpu"), 0)
    assert got[(HIT, "local_disk")] - before.get((HIT, "local_disk"), 0) == again
    assert got[(BY_SOURCE, "disk")] - before.get((BY_SOURCE, "disk"), 0) == again


def test_killed_redis_opens_the_breaker_and_counts_failed_reads(server, redis_server):
    base, model, log = server
    redis_server.kill()
    try:
        prompt = h.random_tokens(43, 600)
        answer = _completion(base, model, prompt)  # its lookup asks Redis, which is gone
        assert answer["usage"]["completion_tokens"] == 8 and _cached(answer) == 0
        got = _wait_for(base, lambda m: m.get(("lmcache_vllm:breaker_open", "redis")) == 1)
        assert got[("lmcache_vllm:breaker_open", "redis")] == 1
        assert got[("lmcache_vllm:failed_reads_total", "redis")] >= 1
        assert _cached(_completion(base, model, prompt)) == 512  # L1 still serves
    finally:
        redis_server.ensure_running()


def test_stats_cli_reads_the_server(server):
    base, model, log = server
    out = subprocess.run([*_launcher(), "stats", "--url", base, "--json"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=str(h.REPO_ROOT)))
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["counters"]["hit_tokens"]["local_cpu"] >= 1024
    assert stats["cached_by_source"]["disk"] >= 512
    assert stats["histograms"]["lookup_seconds"]["count"] >= 6


def test_restarted_server_finds_the_disk_and_the_cli_inspects_it(server, tiny_model, tmp_path_factory,
                                                                  disk_dir):
    base, model, log = server
    prompt = h.random_tokens(44, 600)
    _completion(base, model, prompt)
    with _serve(tmp_path_factory.mktemp("e2e_serve_restart"), tiny_model,
                {"local_disk": str(disk_dir), "max_local_disk_size": 1.0}) as (base2, log2):
        before = _scrape(base2)
        assert _cached(_completion(base2, model, prompt)) == 512, log2
        got = _wait_for(base2, lambda m: m.get((BY_SOURCE, "disk"), 0) - before.get((BY_SOURCE, "disk"), 0) >= 512)
        assert got[(BY_SOURCE, "disk")] - before.get((BY_SOURCE, "disk"), 0) == 512
        assert got[(HIT, "local_disk")] - before.get((HIT, "local_disk"), 0) == 512

    def inspect(*args):
        out = subprocess.run([*_launcher(), "inspect", "--disk", str(disk_dir), "--json", *args],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(h.REPO_ROOT)))
        return out.returncode, json.loads(out.stdout)

    rc, report = inspect()
    assert rc == 0 and report["num_corrupt"] == 0 and report["chunks"] >= 2 * 4  # 4 prompts, 2 chunks each
    assert len(report["namespaces"]) == 1
    victim = sorted(disk_dir.glob("*.lmc"))[0]
    h.flip_payload_bytes(victim)
    rc, report = inspect("--verify")
    assert rc == 3 and report["num_corrupt"] == 1 and report["corrupt"][0]["entry"] == victim.name
