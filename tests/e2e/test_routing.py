"""End to end behind vLLM's own router: two real `lmcache-vllm serve` instances (A, B: the tiny local model, our
L1 and KV events on vLLM's ZMQ publisher, vLLM's prefix cache on a small device cache) and a real `vllm-router`
process with `--policy kv_aware`, one `--kv-event-source` per instance, vLLM's block size and a host credit of
0.8 (docs/ROUTING.md).

A text prompt P is served by A (sent to A directly); two more prompts push P's blocks out of A's device cache
while its chunks stay in our L1 (A's vLLM published BlockRemoved for its GPU blocks, we had published BlockStored
for our CPU copy). Through the router, P goes back to A: the router tokenized it through each instance's render
endpoint, its debug log credits A with P's whole L1 blocks at the host credit, and A serves them from our L1. More
prompts then push P out of A's L1 too (we publish BlockRemoved): through the router, P is credited to no one.
"""
from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import e2e_harness as h
import pytest

from lmcache_vllm.integration.vllm.testing.openai_server import cached_tokens, free_port, post, serve
from lmcache_vllm.integration.vllm.testing.router import decisions, route

pytest.importorskip("vllm")
pytest.importorskip("vllm_router")
pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size
CHUNK = h.CHUNK  # 256: two of vLLM's blocks a chunk
HOST_CREDIT = 0.8
MAX_MODEL_LEN = 768
# vLLM's device cache: 8 blocks (one is vLLM's null block): a 540-token prompt takes 5, so two more evict it.
DEVICE_BLOCKS = 8
# Our L1: 8 chunks of the tiny model (512 KiB each): P and two more prompts fit; six more push P out.
L1_GIB = 8 * 512 * 1024 / 2 ** 30
WORDS = ("cache", "router", "block", "token", "prefix", "instance", "tier", "event", "memory", "disk", "vllm",
         "layer", "batch", "request", "answer", "model", "host", "device", "chunk", "stream")


def text_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


def prompt_of(base: str, model: str, seed: int, low: int = 530, high: int = 600) -> tuple[str, int]:
    """A text prompt whose token count (the instance's own /tokenize) is in [low, high]: two whole chunks."""
    words = 150
    for _ in range(40):
        text = text_prompt(seed, words)
        count = post(f"{base}/tokenize", {"model": model, "prompt": text})["count"]
        if low <= count <= high:
            return text, count
        words = max(1, words + (1 if count < low else -1) * max(1, abs(count - (low + high) // 2) // 4))
    raise AssertionError(f"no prompt of {low}-{high} tokens")


def body(model: str, prompt: str | list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def host_credit(tokens: int) -> int:
    """What kv_aware credits for a prompt whose whole chunks are in our L1 only: its blocks at the host credit,
    as the prompt tokens it need not compute (the rest rounded up)."""
    blocks = (tokens // CHUNK) * CHUNK // BLOCK
    return tokens - math.ceil(tokens - min(blocks * BLOCK * HOST_CREDIT, tokens - 1))


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e_routing")

    def start(name: str, core: str, port: int):
        # vLLM binds a wildcard endpoint (it connects to any other tcp one); the router wants tcp://HOST:PORT
        extra = {"max_local_cpu_size": L1_GIB, "enable_kv_events": True}
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        args = ["--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
                "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
                "--enable-prompt-tokens-details", "--enable-scale-out",  # the router tokenizes at /render
                "--kv-transfer-config", json.dumps(h.connector(extra)), "--kv-events-config", json.dumps(events)]
        env = h.vllm_env(tmp / name, multiprocessing=True, threads_bind=core)
        return stack.enter_context(serve(tiny_model, args, tmp, env))[0]

    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:  # the two start side by side
        ports = [free_port(), free_port()]
        bases = [f.result() for f in [pool.submit(start, "a", "0", ports[0]), pool.submit(start, "b", "1", ports[1])]]
        endpoints = {base: f"tcp://127.0.0.1:{port}" for base, port in zip(bases, ports)}
        router, log = stack.enter_context(route(bases, "kv_aware", tmp, events=endpoints, block_size=BLOCK,
                                                model=tiny_model, credits={"host": HOST_CREDIT}))
        yield router, bases, log, tiny_model


def routed(router: str, instance: str, model: str, prompt: str) -> dict:
    """P through the router, once the events of the instance's last request are out: the connector hands its
    workers' events to vLLM at the next step (one more short request) and the router applies them at once."""
    post(f"{instance}/v1/completions", body(model, h.random_tokens(99, 8)))
    time.sleep(0.5)
    return post(f"{router}/v1/completions", body(model, prompt))


def test_a_prefix_in_our_l1_is_routed_back_to_its_instance_and_not_once_we_dropped_it(fleet):
    router, (a, b), log, model = fleet
    prompt, tokens = prompt_of(a, model, seed=1)
    assert cached_tokens(post(f"{a}/v1/completions", body(model, prompt))) == 0  # P, served by A
    for seed in (2, 3):  # P's blocks leave A's device cache; its chunks stay in our L1
        post(f"{a}/v1/completions", body(model, h.random_tokens(seed, 540)))

    answer = routed(router, a, model, prompt)
    decision = decisions(log)[-1]
    assert decision["worker"] == a and decision["outcome"] == "prefix_cost", (decision, log.read_text()[-4000:])
    assert int(decision["input_tokens"]) == tokens  # the router tokenized P through the instances' /render
    assert int(decision["credited_prefix_tokens"]) == host_credit(tokens) > 0  # our L1's blocks, as host copies
    assert cached_tokens(answer) == tokens // CHUNK * CHUNK  # and A served them from our L1

    for seed in range(4, 10):  # P's chunks leave our L1 too (LRU), and its blocks A's device cache
        post(f"{a}/v1/completions", body(model, h.random_tokens(seed, 540)))
    routed(router, a, model, prompt)
    decision = decisions(log)[-1]
    assert int(decision["credited_prefix_tokens"]) == 0, (decision, log.read_text()[-4000:])
    assert "kv_index decode batch" not in log.read_text()  # every batch of ours and vLLM's decoded
