"""End to end beside another connector: `lmcache-vllm serve` with vLLM's `MultiConnector` holding our connector and
vLLM's `ExampleConnector` (docs/COMPOSING.md), on the tiny local model, stats logging on (vLLM's default).

Three servers, each `MultiConnector[LMCacheConnector, ExampleConnector]`:
- A: `extra_config.pd: off`, L1 and a disk directory, KV events on vLLM's ZMQ publisher, the MultiConnector's
  default `kv_load_failure_policy` ('fail', so one warning). It serves repeated prompts from our cache, shows our
  metrics at `/metrics`, publishes our events with vLLM's mediums, honours a request's `max_load_tokens`, and
  neither holds nor pulls for kv_transfer_params.
- P and D (`pd: auto`, which is on beside ExampleConnector; PD configured explicitly without a key: each one's
  `pd_peers` lists both transfer ports, `pd_port` fixed), driven by vLLM's own toy proxy: D pulls the prompt's
  KV from P through our transfer servers.

Like with like (lmcache_vllm/integration/vllm/testing/reference.py): every server and the reference (vLLM alone,
its prefix cache on) run with chunked prefill and `max_num_batched_tokens = PD_LEN - 1`, so a PD_LEN-token prompt
is computed in two steps everywhere (D loads all of it and computes its last token alone, the reference's second
step) and 600-token prompts in one. ExampleConnector stores every new prompt too; ours comes first in the list, so
vLLM loads from ours (MultiConnector takes the first child with a hit); where a test needs ExampleConnector to have
nothing, it empties its directory.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import e2e_harness as h
import pytest

# toy_proxy: test_pd_protocol's fixture (vLLM's own toy proxy) in front of this module's prefill and decode
from test_pd_protocol import metric, nudge_and_scrape, peer_hits, tokens_of, toy_proxy  # noqa: F401

from lmcache_vllm.integration.vllm.testing.openai_server import cached_tokens, free_port, post, scrape, serve

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PD_LEN = 700  # two whole 256-token chunks and a partial one
PROMPT = h.random_tokens(300, 600)
LIMITED = h.random_tokens(301, 600)
PD_PROMPT = h.random_tokens(302, PD_LEN)
PD_OFF = h.random_tokens(303, PD_LEN)
EVENTS = h.random_tokens(304, 600)
MAX_TOKENS = 8
HIT = "lmcache_vllm:hit_tokens_total"
POLICY_WARNING = "runs inside a MultiConnector whose kv_load_failure_policy is 'fail'"


def multi_config(ours_extra: dict, example_dir: Path, **top) -> dict:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", **top,
            "kv_connector_extra_config": {"connectors": [h.connector(ours_extra), example]}}


def server_args(transfer: dict, *extra: str) -> list[str]:
    return ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(PD_LEN - 1), "--kv-transfer-config", json.dumps(transfer), *extra]


def body(model: str, prompt: list[int], **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def ours(answer: dict) -> dict:
    return {"tokens": tokens_of(answer), "num_cached_tokens": cached_tokens(answer)}


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    kwargs = h.llm_kwargs(max_num_batched_tokens=PD_LEN - 1, enable_chunked_prefill=True)
    phases = [{"name": name, "prompts": [prompt], "max_tokens": MAX_TOKENS}
              for name, prompt in (("first", PROMPT), ("second", PROMPT), ("limited_first", LIMITED),
                                   ("limited_second", LIMITED), ("pd", PD_PROMPT), ("pd_off", PD_OFF))]
    job = h.reference_job({"model": tiny_model, "llm_kwargs": kwargs, "phases": phases})
    result = h.run_job(tmp_path_factory.mktemp("e2e_compose_ref"), "reference", job, multiprocessing=True)
    return {p["name"]: h.phase(result, p["name"])[0] for p in phases}


@pytest.fixture(scope="module")
def events_endpoint() -> str:
    return f"ipc://{tempfile.mkdtemp(prefix='lmv-ev-')}/events.sock"  # short: a socket path holds 107 bytes


@pytest.fixture(scope="module")
def server_a(tiny_model, tmp_path_factory, events_endpoint, reference):
    tmp = tmp_path_factory.mktemp("e2e_compose_a")
    example_dir = tmp / "example"
    example_dir.mkdir()
    extra = {"local_disk": str(tmp / "disk"), "max_local_disk_size": 1.0, "enable_kv_events": True,
             "extra_config": {"pd": "off"}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint}
    args = server_args(multi_config(extra, example_dir), "--kv-events-config", json.dumps(events))
    with serve(tiny_model, args, tmp, h.vllm_env(tmp, multiprocessing=True, threads_bind="0")) as (base, log):
        yield base, log, example_dir


P_PORT, D_PORT = free_port(), free_port()  # P's and D's transfer ports, the ones pd_peers lists


def pd_server(tiny_model, tmp: Path, extra_config: dict, threads_bind: str):
    example_dir = tmp / "example"
    example_dir.mkdir()
    peers = [f"127.0.0.1:{P_PORT}", f"127.0.0.1:{D_PORT}"]
    transfer = multi_config({"extra_config": {"pd_host": "127.0.0.1", "pd_peers": peers, **extra_config}},
                            example_dir, kv_load_failure_policy="recompute")
    return serve(tiny_model, server_args(transfer), tmp, h.vllm_env(tmp, multiprocessing=True,
                                                                     threads_bind=threads_bind))


@pytest.fixture(scope="module")
def prefill(tiny_model, tmp_path_factory, reference):
    with pd_server(tiny_model, tmp_path_factory.mktemp("e2e_compose_p"), {"pd_hold_secs": 20.0, "pd_port": P_PORT},
                   "0") as server:
        yield server


@pytest.fixture(scope="module")
def decode(tiny_model, tmp_path_factory, prefill):
    with pd_server(tiny_model, tmp_path_factory.mktemp("e2e_compose_d"),
                   {"pd_pull_timeout_secs": 3.0, "pd_port": D_PORT}, "1") as server:
        yield server


def assert_clean_log(log: Path) -> str:
    text = Path(log).read_text()
    assert "Traceback" not in text and "is not registered" not in text, text[-6000:]
    return text


# ---------------------------------------------------------------- A: the cache beside ExampleConnector
def test_repeated_prompts_hit_ours_with_stats_on(server_a, reference, tiny_model):
    base, log, _ = server_a
    before = scrape(base)
    first = post(f"{base}/v1/completions", body(tiny_model, PROMPT))
    second = post(f"{base}/v1/completions", body(tiny_model, PROMPT))
    assert cached_tokens(first) == 0 and cached_tokens(second) == 512
    h.assert_like_with_like(ours(first), reference["first"], what="cold")
    h.assert_like_with_like(ours(second), reference["second"], what="from our L1")
    got = nudge_and_scrape(base, tiny_model, lambda m: m.get((HIT, "local_cpu"), 0) - before.get((HIT, "local_cpu"), 0)
                           >= 512, 30)
    assert got[(HIT, "local_cpu")] - before.get((HIT, "local_cpu"), 0) == 512  # ours, not ExampleConnector's
    assert metric(got, "loaded_tokens_total") - metric(before, "loaded_tokens_total") == 512
    assert got[("lmcache_vllm:capacity_bytes", "local_disk")] == 2 ** 30
    assert assert_clean_log(log).count(POLICY_WARNING) == 1  # the MultiConnector's default policy, said once


def test_kv_events_with_vllms_mediums_reach_a_zmq_subscriber(server_a, events_endpoint, tiny_model):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    base, log, _ = server_a
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_endpoint)
    found: dict[str, list] = {}
    try:
        time.sleep(1.0)  # a subscriber only gets what is published after it joined
        post(f"{base}/v1/completions", body(tiny_model, EVENTS))
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and min(len(found.get(t, ())) for t in ("local_cpu", "local_disk")) < 2:
            if sub.poll(500):
                _, _, payload = sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    tier = {"CPU": "local_cpu", "STORAGE": "local_disk"}.get(event.medium)
                    if isinstance(event, BlockStored) and tier and event.token_ids[:8] in (EVENTS[:8], EVENTS[256:264]):
                        found.setdefault(tier, []).append(event)
            else:
                post(f"{base}/v1/completions", body(tiny_model, h.random_tokens(305, 10), max_tokens=1))  # a step
    finally:
        sub.close(linger=0)
    assert all(len(found.get(t, ())) >= 2 for t in ("local_cpu", "local_disk")), (found, log)
    assert {(e.locality, e.ownership) for t in found for e in found[t]} == {("LOCAL", None)}
    first, second = found["local_cpu"][:2]
    assert first.token_ids == EVENTS[:256] and first.parent_block_hash is None and first.block_size == 128
    assert second.token_ids == EVENTS[256:512] and second.parent_block_hash == first.block_hashes[-1]


def test_max_load_tokens_zero_disables_our_load_for_one_request(server_a, reference, tiny_model):
    base, log, example_dir = server_a
    stored = post(f"{base}/v1/completions", body(tiny_model, LIMITED))
    h.assert_like_with_like(ours(stored), reference["limited_first"], what="cold")
    for entry in example_dir.iterdir():  # ExampleConnector's copy gone: only ours could serve a load
        shutil.rmtree(entry)
    before = scrape(base)
    limited = post(f"{base}/v1/completions", body(tiny_model, LIMITED, kv_transfer_params={"max_load_tokens": 0}))
    assert cached_tokens(limited) == 0
    h.assert_like_with_like(ours(limited), reference["limited_first"], what="max_load_tokens 0")
    refused = post(f"{base}/v1/completions", body(tiny_model, LIMITED, kv_transfer_params={"max_load_tokens": "x"}))
    assert cached_tokens(refused) == 512  # a bad value is ignored: no cap
    plain = post(f"{base}/v1/completions", body(tiny_model, LIMITED))
    assert cached_tokens(plain) == 512  # the next request loads again
    h.assert_like_with_like(ours(plain), reference["limited_second"], what="after the limited request")
    got = nudge_and_scrape(base, tiny_model, lambda m: metric(m, "refused_request_params_total")
                           > metric(before, "refused_request_params_total"), 30)
    assert got[(HIT, "local_cpu")] - before.get((HIT, "local_cpu"), 0) == 2 * 512  # the refused one and the plain
    assert metric(got, "load_limited_requests_total") - metric(before, "load_limited_requests_total") == 1
    assert metric(got, "refused_request_params_total") - metric(before, "refused_request_params_total") == 1
    assert_clean_log(log)


# ---------------------------------------------------------------- P and D: ours the only PD child
def test_pd_through_multiconnector_driven_by_vllms_toy_proxy(toy_proxy, prefill, decode, reference,  # noqa: F811
                                                             tiny_model):
    d0 = scrape(decode[0])
    answer = post(f"{toy_proxy}/v1/completions", body(tiny_model, PD_PROMPT))
    assert tokens_of(answer) == reference["pd"]["tokens"]  # D loaded all PD_LEN tokens, computed the last
    pulled = metric(d0, "pd_pulled_chunks_total") + 3  # 256 + 256 + the partial 188
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= pulled, 30)
    assert metric(d, "pd_pulled_chunks_total") == pulled
    assert peer_hits(d) - peer_hits(d0) == PD_LEN
    assert metric(d, "pd_pull_failures_total") == metric(d0, "pd_pull_failures_total")
    p = nudge_and_scrape(prefill[0], tiny_model, lambda m: metric(m, "pd_holds") == 0, 40)
    assert metric(p, "pd_holds") == 0 and metric(p, "pd_holds_expired_total") == 0  # released by D's pull
    for server in (prefill, decode):
        assert POLICY_WARNING not in assert_clean_log(server[1])


def test_pd_off_neither_holds_nor_pulls(server_a, prefill, reference, tiny_model):
    """Last (P's hold of the params sent to A expires). A answers a prefill request without params, and a decode
    request carrying P's real params is recomputed by A, not pulled."""
    base, log, _ = server_a
    a0 = scrape(base)
    asked = post(f"{base}/v1/completions", body(tiny_model, h.random_tokens(306, PD_LEN), max_tokens=1,
                                                kv_transfer_params={"do_remote_decode": True}))
    assert not asked.get("kv_transfer_params")
    params = post(f"{prefill[0]}/v1/completions", body(tiny_model, PD_OFF, max_tokens=1,
                                                       kv_transfer_params={"do_remote_decode": True}))
    params = params["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["lmcache_vllm"]["ports"]  # P (pd on) answered its address
    answer = post(f"{base}/v1/completions", body(tiny_model, PD_OFF, kv_transfer_params=params))
    h.assert_like_with_like(ours(answer), reference["pd_off"], what="recomputed by A")
    a = nudge_and_scrape(base, tiny_model, lambda m: True, 5)
    assert peer_hits(a) == peer_hits(a0) and metric(a, "pd_pull_failures_total") == 0
    assert metric(a, "pd_prefill_requests_total") == 0 and metric(a, "pd_holds") == 0
    assert_clean_log(log)
