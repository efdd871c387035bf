"""End to end disaggregated prefill with vLLM's protocol: two `lmcache-vllm serve` processes (kv_both, no Redis)
and examples/pd_proxy.py in front of them, on the tiny local model, configured as docs/DISAGGREGATED.md shows
first: `extra_config.pd: on` and one chunk MAC key in both environments (P signs its params, D pulls only
from signed params, every request and chunk between them carries the MAC).

The proxy sends each prompt to the prefill instance P (max_tokens 1, `kv_transfer_params: do_remote_decode`),
then to the decode instance D with the params P answered; D pulls the prompt's KV from P's transfer server.

Like with like (lmcache_vllm/integration/vllm/testing/reference.py): D loads all PROMPT_LEN tokens and computes
the last one alone, so the KV it loads must have been computed the way the reference computes it. P runs
with `max_num_batched_tokens = PROMPT_LEN - 1`: it computes a PROMPT_LEN-token prompt in two steps (all but
the last token, then the last), exactly as the reference (vLLM alone, the same setting) does; the reference's
second step is D's single-token step. Shorter prompts (COLD_LEN) are computed in one step by everyone: they
are the reference for D recomputing a prompt itself (a refused or failed pull). Every vLLM process computes on
one thread (P bound to core 0, D to core 1, the reference to core 0).

What D pulled is read from its metrics: the `cached_tokens` of D's answer are P's own prefix hits (vLLM reports
`remote_prefill_cached_tokens` there, as for its NIXL connector), not the pulled ones.

vLLM's own toy proxy (toy_proxy_server.py, taken unchanged from the sdist of the installed vLLM) drives the
same two instances for completions and chat completions.

Last in the module, P is frozen and then SIGKILLed while D pulls: D answers (recomputed) within a bounded time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import e2e_harness as h
import pytest
from ci import skip_or_fail

from lmcache_vllm.integration.vllm.testing.openai_server import free_port, post, scrape, serve
from lmcache_vllm.integration.vllm.testing.vllm_sources import TOY_PROXY, SourceUnavailable, vllm_source_file

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPT_LEN = 700  # two whole 256-token chunks and a partial one
COLD_LEN = 600
PROMPT = h.random_tokens(200, PROMPT_LEN)
STREAMED = h.random_tokens(201, PROMPT_LEN)
TOY = h.random_tokens(202, PROMPT_LEN)
# A chat template for the tokenizer-only local model: the messages' contents, nothing added.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
CHAT_TEXT = " ".join(f"line {i} says {i * 7919 % 1000} to {i % 13}" for i in range(150))
CONCURRENT = [h.random_tokens(210 + i, PROMPT_LEN) for i in range(8)]
TP_PROMPT = h.random_tokens(220, COLD_LEN)
KILLED = h.random_tokens(221, COLD_LEN)
MAX_TOKENS = 8
HOLD_S = 20.0  # pd_hold_secs of P: long enough for D to pull on a loaded machine, short for the expiry test
HELD_PROMPTS = 12  # P's pd_max_held_bytes: the KV of this many PROMPT_LEN prompts (and less than one more)
TINY_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # the tiny model: layers x K/V x KV heads x head size x bf16
PULL_TIMEOUT_S = 3.0  # pd_pull_timeout_secs of D
P_STATE = "lmcache_vllm:pd_holds"
FLEET_KEY = "e2e-pd-fleet-key-0123456789abcdef"  # LMCACHE_VLLM_CHUNK_MAC_KEY of P and D


def pd_env(tmp: Path, core: str) -> dict[str, str]:
    """A vLLM server's environment with the fleet's chunk MAC key (where docs/SECURITY.md says to put it)."""
    return {**h.vllm_env(tmp, multiprocessing=True, threads_bind=core), "LMCACHE_VLLM_CHUNK_MAC_KEY": FLEET_KEY}


def server_args(model: str, extra: dict, max_batched: int) -> list[str]:
    return ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(max_batched), "--chat-template", CHAT_TEMPLATE,
            "--kv-transfer-config", json.dumps(h.connector(extra))]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """vLLM alone with P's scheduler setting: PROMPT_LEN-token prompts in two steps, COLD_LEN ones in one."""
    kwargs = h.llm_kwargs(max_num_batched_tokens=PROMPT_LEN - 1, enable_chunked_prefill=True)
    phases = [{"name": "prompt", "prompts": [PROMPT], "max_tokens": MAX_TOKENS},
              {"name": "streamed", "prompts": [STREAMED], "max_tokens": MAX_TOKENS},
              {"name": "toy", "prompts": [TOY], "max_tokens": MAX_TOKENS},
              {"name": "tp", "prompts": [TP_PROMPT], "max_tokens": MAX_TOKENS},
              {"name": "killed", "prompts": [KILLED], "max_tokens": MAX_TOKENS}]
    result = h.run_job(tmp_path_factory.mktemp("e2e_pdp_ref"), "reference",
                       {"model": tiny_model, "llm_kwargs": kwargs, "phases": phases}, multiprocessing=True)
    return {p: h.phase(result, p)[0]["tokens"] for p in ("prompt", "streamed", "toy", "tp", "killed")}


@pytest.fixture(scope="module")
def prefill(tiny_model, tmp_path_factory, reference):
    tmp = tmp_path_factory.mktemp("e2e_pdp_p")
    extra = {"extra_config": {"pd": "on", "pd_host": "127.0.0.1", "pd_hold_secs": HOLD_S, "pd_max_held_bytes":
                              (HELD_PROMPTS * PROMPT_LEN + PROMPT_LEN // 2) * TINY_BYTES_PER_TOKEN}}
    env = pd_env(tmp, "0")
    with serve(tiny_model, server_args(tiny_model, extra, PROMPT_LEN - 1), tmp, env) as (base, log):
        yield base, log


@pytest.fixture(scope="module")
def decode(tiny_model, tmp_path_factory, prefill):
    tmp = tmp_path_factory.mktemp("e2e_pdp_d")
    extra = {"extra_config": {"pd": "on", "pd_host": "127.0.0.1", "pd_pull_timeout_secs": PULL_TIMEOUT_S}}
    env = pd_env(tmp, "1")
    with serve(tiny_model, server_args(tiny_model, extra, 2048), tmp, env) as (base, log):
        yield base, log


def start_proxy(prefill_base: str, decode_port: int, log_dir: Path,
                script: Path = h.REPO_ROOT / "examples" / "pd_proxy.py") -> tuple[subprocess.Popen, str]:
    """A proxy with vLLM's toy proxy's arguments (ours by default) in front of one P and one D."""
    port = free_port()
    cmd = [sys.executable, str(script), "--port", str(port),
           "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", prefill_base.rsplit(":", 1)[1],
           "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode_port)]
    log = open(log_dir / f"proxy-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/healthcheck", timeout=2):
                return proc, base
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.3)
    proc.kill()
    raise AssertionError((log_dir / f"proxy-{port}.log").read_text())


@pytest.fixture(scope="module")
def proxy(prefill, decode, tmp_path_factory):
    proc, base = start_proxy(prefill[0], int(decode[0].rsplit(":", 1)[1]), tmp_path_factory.mktemp("e2e_pdp_x"))
    yield base
    proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def toy_proxy(prefill, decode, tmp_path_factory):
    """vLLM's own toy proxy, unchanged, from the sdist of the installed vLLM (PyPI; CI must reach it)."""
    try:
        script = vllm_source_file(TOY_PROXY)
    except SourceUnavailable as exc:
        skip_or_fail(f"vLLM's toy proxy unavailable here: {exc}")
    proc, base = start_proxy(prefill[0], int(decode[0].rsplit(":", 1)[1]), tmp_path_factory.mktemp("e2e_pdp_toy"),
                             script)
    yield base
    proc.kill()
    proc.wait(10)


def body(model: str, prompt: list[int], **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def tokens_of(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def nudge_and_scrape(base: str, model: str, check, timeout_s: float) -> dict:
    """Scrapes `base` until `check(scraped)`, sending a tiny request now and then: our stats reach vLLM's
    API server only with engine steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        post(f"{base}/v1/completions", body(model, h.random_tokens(5, 4), max_tokens=1))
        scraped = scrape(base)
        if check(scraped) or time.monotonic() > deadline:
            return scraped
        time.sleep(0.5)


def metric(scraped: dict, name: str) -> float:
    return sum(v for (n, _), v in scraped.items() if n == f"lmcache_vllm:{name}")


def peer_hits(scraped: dict) -> float:
    return scraped.get(("lmcache_vllm:hit_tokens_total", "peer"), 0.0)


def assert_no_holds(prefill, model: str) -> dict:
    """The prefill instance holds nothing any more (every hold released or expired)."""
    scraped = nudge_and_scrape(prefill[0], model, lambda m: metric(m, "pd_holds") == 0, HOLD_S + 20)
    assert metric(scraped, "pd_holds") == 0, prefill[1]
    return scraped


def test_decode_answers_like_the_reference_through_the_proxy(proxy, prefill, decode, reference, tiny_model):
    p0, d0 = scrape(prefill[0]), scrape(decode[0])
    answer = post(f"{proxy}/v1/completions", body(tiny_model, PROMPT))
    # All PROMPT_LEN tokens pulled (below); vLLM recomputes the last one: the split of the reference.
    h.assert_like_with_like({"tokens": tokens_of(answer), "num_cached_tokens": PROMPT_LEN - 1},
                            {"tokens": reference["prompt"], "num_cached_tokens": PROMPT_LEN - 1}, what="prompt")
    pulled = metric(d0, "pd_pulled_chunks_total") + 3  # 256 + 256 + the partial 188
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= pulled, 20)
    assert metric(d, "pd_pulled_chunks_total") == pulled
    assert metric(d, "pd_pull_failures_total") == metric(d0, "pd_pull_failures_total")
    assert peer_hits(d) - peer_hits(d0) == PROMPT_LEN
    assert metric(d, "failed_load_tokens_total") == metric(d0, "failed_load_tokens_total")
    p = assert_no_holds(prefill, tiny_model)  # released by D's pull, not by expiry
    assert metric(p, "pd_prefill_requests_total") - metric(p0, "pd_prefill_requests_total") == 1
    assert metric(p, "pd_holds_expired_total") == metric(p0, "pd_holds_expired_total")


def test_a_streamed_answer_through_the_proxy(proxy, prefill, reference, tiny_model):
    req = urllib.request.Request(f"{proxy}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps(body(tiny_model, STREAMED, stream=True)).encode())
    tokens, events = [], []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(line[:300])
                for choice in json.loads(line[len("data: "):]).get("choices", []):
                    tokens += choice.get("token_ids") or []
    # Server-sent events came through the proxy; vLLM merges tokens into fewer events when its API server
    # falls behind the engine (a loaded machine), so only their concatenation is checked.
    assert events and tokens == reference["streamed"], events
    assert_no_holds(prefill, tiny_model)


def test_eight_concurrent_requests(proxy, prefill, decode, tiny_model):
    before = scrape(decode[0])
    answers: list = [None] * len(CONCURRENT)

    def run(i: int) -> None:
        answers[i] = post(f"{proxy}/v1/completions", body(tiny_model, CONCURRENT[i]), timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    assert all(a is not None and len(tokens_of(a)) == MAX_TOKENS for a in answers)
    want = metric(before, "pd_pulled_chunks_total") + 8 * 3
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= want, 30)
    assert metric(d, "pd_pulled_chunks_total") == want, decode[1]  # every prompt pulled, every chunk
    assert peer_hits(d) - peer_hits(before) == 8 * PROMPT_LEN
    assert metric(d, "pd_pull_failures_total") == metric(before, "pd_pull_failures_total")
    assert metric(d, "failed_load_tokens_total") == metric(before, "failed_load_tokens_total")
    assert_no_holds(prefill, tiny_model)


def test_vllms_own_toy_proxy_drives_it_unchanged(toy_proxy, prefill, decode, reference, tiny_model):
    d0 = scrape(decode[0])
    answer = post(f"{toy_proxy}/v1/completions", body(tiny_model, TOY))
    h.assert_like_with_like({"tokens": tokens_of(answer), "num_cached_tokens": PROMPT_LEN - 1},
                            {"tokens": reference["toy"], "num_cached_tokens": PROMPT_LEN - 1}, what="toy proxy")
    pulled = metric(d0, "pd_pulled_chunks_total") + 3
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= pulled, 20)
    assert metric(d, "pd_pulled_chunks_total") == pulled
    assert peer_hits(d) - peer_hits(d0) == PROMPT_LEN
    assert metric(d, "pd_pull_failures_total") == metric(d0, "pd_pull_failures_total")
    assert_no_holds(prefill, tiny_model)


def test_chat_completions_through_vllms_toy_proxy(toy_proxy, prefill, decode, tiny_model):
    """A chat request takes the same path: D pulls the rendered prompt from P. Like with like: the same rendered
    token ids sent as a completion through the same proxy give the same tokens (D loads the same KV, now from
    its own L1, where the pull put it, and computes the last token in both)."""
    messages = [{"role": "user", "content": CHAT_TEXT}]
    ids = post(f"{decode[0]}/tokenize", {"model": tiny_model, "messages": messages})["tokens"]
    assert PROMPT_LEN < len(ids) < 2048 - MAX_TOKENS, len(ids)
    d0 = scrape(decode[0])
    chat = post(f"{toy_proxy}/v1/chat/completions",
                {"model": tiny_model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                 "ignore_eos": True})
    assert chat["usage"]["prompt_tokens"] == len(ids)
    pulled = metric(d0, "pd_pulled_chunks_total") + -(-len(ids) // 256)
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= pulled, 20)
    assert metric(d, "pd_pulled_chunks_total") == pulled  # every chunk of the rendered prompt
    assert peer_hits(d) - peer_hits(d0) == len(ids)
    assert metric(d, "pd_pull_failures_total") == metric(d0, "pd_pull_failures_total")
    completion = post(f"{toy_proxy}/v1/completions", body(tiny_model, ids))
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert_no_holds(prefill, tiny_model)


def test_holds_expire_when_no_decode_instance_pulls(prefill, tiny_model, tmp_path):
    p_base = prefill[0]
    before = scrape(p_base)
    # D never asked: a client that sent only the prefill request ...
    direct = post(f"{p_base}/v1/completions", body(tiny_model, h.random_tokens(230, PROMPT_LEN), max_tokens=1,
                                                   kv_transfer_params={"do_remote_decode": True}))
    assert direct["kv_transfer_params"]["remote_request_id"]
    # ... and D down: the proxy gets P's answer and cannot reach D.
    proc, dead_proxy = start_proxy(p_base, free_port(), tmp_path)
    try:
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(f"{dead_proxy}/v1/completions", body(tiny_model, h.random_tokens(231, PROMPT_LEN)))
        assert failed.value.code == 502
    finally:
        proc.kill()
        proc.wait(10)
    p = assert_no_holds(prefill, tiny_model)
    assert metric(p, "pd_holds_expired_total") - metric(before, "pd_holds_expired_total") == 2


def test_a_prefill_instance_at_its_hold_cap_answers_without_params(prefill, tiny_model):
    """Prefill requests no decode instance pulls: P holds HELD_PROMPTS of them (pd_max_held_bytes); the next
    is answered without kv_transfer_params (its decode instance would recompute, with no pull to fail) and
    counted; the holds expire."""
    p_base = prefill[0]
    before = scrape(p_base)
    answers = [post(f"{p_base}/v1/completions", body(tiny_model, h.random_tokens(240 + i, PROMPT_LEN), max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}))
               for i in range(HELD_PROMPTS + 1)]
    assert all(a.get("kv_transfer_params") for a in answers[:-1]), [a.get("kv_transfer_params") for a in answers]
    assert not answers[-1].get("kv_transfer_params")
    p = assert_no_holds(prefill, tiny_model)
    assert metric(p, "pd_holds_refused_total") - metric(before, "pd_holds_refused_total") == 1
    assert metric(p, "pd_holds_expired_total") - metric(before, "pd_holds_expired_total") == HELD_PROMPTS


def test_params_changed_on_the_way_are_refused_and_the_prefill_instance_gets_nothing(prefill, decode, reference,
                                                                                     tiny_model):
    """P's signed params with another TP size (ports added): D refuses them (the signature covers every field),
    recomputes the prompt, and sends P nothing, not even a RELEASE (issue 39 #3); P's hold waits for the real
    params, with which D then releases it (the prompt is in D's L1 by now: nothing left to pull)."""
    p0, d0 = scrape(prefill[0]), scrape(decode[0])
    answer = post(f"{prefill[0]}/v1/completions", body(tiny_model, TP_PROMPT, max_tokens=1,
                                                       kv_transfer_params={"do_remote_decode": True}))
    params = answer["kv_transfer_params"]
    port = params["remote_port"]
    forged = dict(params, tp_size=2, lmcache_vllm=dict(params["lmcache_vllm"], ports=[port, free_port()]))
    answer = post(f"{decode[0]}/v1/completions", body(tiny_model, TP_PROMPT, kv_transfer_params=forged))
    assert tokens_of(answer) == reference["tp"]  # recomputed here: the right tokens
    assert "does not verify" in Path(decode[1]).read_text()
    failures = metric(d0, "pd_pull_failures_total") + 1
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pull_failures_total") >= failures, 20)
    assert metric(d, "pd_pull_failures_total") == failures
    assert peer_hits(d) == peer_hits(d0)  # nothing was pulled
    time.sleep(1.5)  # a RELEASE would have gone out by now; P's counts reach its API server with its next steps:
    p = nudge_and_scrape(prefill[0], tiny_model, lambda m: False, 3)  # a few steps
    assert metric(p, "pd_holds") == 1 and metric(p, "pd_holds_released_total") == metric(p0, "pd_holds_released_total")
    post(f"{decode[0]}/v1/completions", body(tiny_model, TP_PROMPT, kv_transfer_params=params))  # the real ones
    p = assert_no_holds(prefill, tiny_model)  # released by D
    assert metric(p, "pd_holds_expired_total") == metric(p0, "pd_holds_expired_total")


def test_prefill_killed_mid_transfer(prefill, decode, reference, tiny_model):
    """Last: P is frozen after it answered, D starts pulling, P is SIGKILLed; D recomputes in bounded time."""
    p_base, p_log = prefill
    d0 = scrape(decode[0])
    answer = post(f"{p_base}/v1/completions", body(tiny_model, KILLED, max_tokens=1,
                                                   kv_transfer_params={"do_remote_decode": True}))
    params = answer["kv_transfer_params"]
    group = h.server_group(p_log)
    os.killpg(group, signal.SIGSTOP)
    result: dict = {}

    def ask() -> None:
        t0 = time.monotonic()
        result["answer"] = post(f"{decode[0]}/v1/completions", body(tiny_model, KILLED, kv_transfer_params=params),
                                timeout=300)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(1.0)  # D's PULL is out and waits for frames
    os.killpg(group, signal.SIGKILL)
    thread.join(300)
    assert "answer" in result, decode[1]
    assert tokens_of(result["answer"]) == reference["killed"]  # recomputed after the failed pull
    assert result["seconds"] < PULL_TIMEOUT_S + 60  # the pull's timeout, the recompute, a loaded machine
    failures = metric(d0, "pd_pull_failures_total") + 1  # this pull's timeout
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pull_failures_total") >= failures, 20)
    assert metric(d, "pd_pull_failures_total") == failures
    assert metric(d, "failed_load_tokens_total") - metric(d0, "failed_load_tokens_total") == COLD_LEN
    assert metric(d, "prefetch_held_chunks") == 0  # nothing held on D

