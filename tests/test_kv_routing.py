"""What stands between our instances and vLLM's router, without starting either: the warning `lmcache-vllm serve`
gives when a router could not tokenize through it, the router's command line, and its decisions read back from
its debug log (the e2e test tests/e2e/test_routing.py runs both for real)."""
from __future__ import annotations

import json
from pathlib import Path

from lmcache_vllm.integration.vllm.launcher import serve_warnings
from lmcache_vllm.integration.vllm.testing.router import decisions, router_args

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"})


def test_serve_warns_when_it_publishes_events_a_router_cannot_use():
    """vLLM answers 403 at /v1/completions/render without --enable-scale-out; vllm-router's kv_aware then credits
    no prefix for text prompts (403 is no fall-back to /tokenize for it)."""
    (warning,) = serve_warnings(["serve", "m", "--kv-events-config", EVENTS])
    assert "--enable-scale-out" in warning and "/v1/completions/render" in warning
    assert serve_warnings(["serve", "m", f"--kv-events-config={EVENTS}"]) == [warning]
    for quiet in (["serve", "m", "--kv-events-config", EVENTS, "--enable-scale-out"],
                  ["serve", "m", "--no-enable-scale-out", "--kv-events-config", EVENTS],
                  ["serve", "m"], ["serve", "m", "--kv-events-config", json.dumps({"enable_kv_cache_events": False})],
                  ["serve", "m", "--kv-events-config", "{not json"], ["bench", "serve", "--kv-events-config", EVENTS]):
        assert serve_warnings(quiet) == []


def test_router_command_line_names_each_event_source_and_the_tier_credits():
    args = router_args(["http://a:1", "http://b:2"], "kv_aware", events={"http://a:1": "tcp://a:5557"},
                       block_size=128, model="m", credits={"host": 0.8, "disk": 0.3})
    assert args == ["--worker-urls", "http://a:1", "http://b:2", "--policy", "kv_aware",
                    "--kv-event-source", "http://a:1=tcp://a:5557", "--kv-event-block-size", "128",
                    "--kv-event-model", "m", "--kv-penalty-host", "0.8", "--kv-penalty-disk", "0.3"]
    assert router_args(["http://a:1"], "round_robin") == ["--worker-urls", "http://a:1", "--policy", "round_robin"]


def test_decisions_are_read_from_the_routers_debug_log(tmp_path: Path):
    log = tmp_path / "router.log"
    log.write_text(  # as vllm-router 0.1.17 writes them (colours on when a terminal asks for them)
        "2026-11-29 08:20:15  INFO vllm_router_rs::kv_index::subscriber: kv_index subscriber for http://a rank0\n"
        "2026-11-29 08:20:17 \x1b[34mDEBUG\x1b[0m vllm_router_rs::policies::kv_aware: src/policies/kv_aware.rs:1314: "
        'KV prefix decision outcome="prefix_cost" worker="http://127.0.0.1:52763" input_tokens=542 '
        "new_prefill_tokens=133 credited_prefix_tokens=409 used_binding=false\n")
    assert decisions(log) == [{"outcome": "prefix_cost", "worker": "http://127.0.0.1:52763", "input_tokens": "542",
                               "new_prefill_tokens": "133", "credited_prefix_tokens": "409",
                               "used_binding": "false"}]
