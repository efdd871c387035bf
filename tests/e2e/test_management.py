"""End to end, issue 40's "done when": two `lmcache-vllm serve` instances (TP 1, the tiny model, host memory only,
P2P over one redis-server), each with its management API on and registered with the real coordinator process
(`lmcache-vllm coordinator`), all steered with curl (a client nobody here wrote) and the CLI:

- a lookup through the coordinator names the instance and tier that then serves the hit;
- a pinned prompt stays a hit after its instance's L1 was flooded past capacity, and unpinning lets it go;
- a token delete (tier all, force) turns the next request into a cold one, and the P2P directory forgets it;
- a write without the token changes nothing;
- the examples of docs/MANAGEMENT.md run as written;
- a move to the second instance makes the prompt a local L1 hit there, still after the source is SIGKILLed.

Like with like (lmcache_vllm/integration/vllm/testing/reference.py): the reference is vLLM alone in the same engine
mode and binding with its own prefix cache, replaying each prompt cold and then repeated (512 of 600 tokens
cached, what our 256-token chunks serve).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import e2e_harness as h
import pytest
from management_helpers import TOKEN, Coordinator, write_token

from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.integration.vllm.testing.openai_server import (
    cached_tokens,
    free_port,
    launcher,
    post,
    scrape,
    serve,
)
from lmcache_vllm.management.agent import KEYSPACE_FIELD
from lmcache_vllm.management.keys import KeySpace
from lmcache_vllm.storage.p2p.directory import chunk_id
from lmcache_vllm.storage.redis.client import ClientSettings, sync_client

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
LOOKED_UP, PINNED, DELETED, MOVED = (h.random_tokens(s, 600) for s in (401, 402, 403, 404))
FLOOD = [h.random_tokens(500 + i, 1000) for i in range(8)]  # 3 chunks each: 24 chunks, L1 holds 16
L1_GIB = 16 * 512 / (1 << 20)  # 16 chunks of 512 KiB (the tiny model: 256 tokens x 4 layers x K,V x 128 x bf16)
PREFIX = f"e2e-mgmt-{uuid.uuid4().hex[:8]}:"
# Each instance's P2P port, and the peers both trust without a MAC key: each other's ports (loopback is nobody's).
P2P_PORTS = {"A": free_port(), "B": free_port()}
PEERS = [f"127.0.0.1:{port}" for port in P2P_PORTS.values()]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> dict[str, dict]:
    phases = [{"name": f"{name}{n}", "prompts": [prompt], "max_tokens": MAX_TOKENS}
              for name, prompt in (("pinned", PINNED), ("moved", MOVED), ("deleted", DELETED)) for n in (0, 1)]
    job = h.reference_job({"model": tiny_model, "llm_kwargs": h.llm_kwargs(), "phases": phases})
    result = h.run_job(tmp_path_factory.mktemp("e2e_mgmt_ref"), "reference", job, multiprocessing=True)
    return {p["name"]: h.phase(result, p["name"])[0] for p in phases}


@pytest.fixture(scope="module")
def fleet(redis_server, tmp_path_factory) -> Iterator[dict[str, Any]]:
    redis_server.ensure_running()
    tmp = tmp_path_factory.mktemp("e2e_mgmt")
    token_file = write_token(tmp)
    coordinator = Coordinator(redis_server.url, str(token_file), PREFIX, tmp / "coordinator.log")
    try:
        yield {"redis": redis_server.url, "token_file": token_file, "coordinator": coordinator.base, "tmp": tmp}
    finally:
        coordinator.stop()


def instance(model: str, tmp: Path, fleet: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    port = free_port()
    extra = {"enable_p2p": True, "p2p_host": "127.0.0.1", "p2p_init_ports": [P2P_PORTS[name]],
             "max_local_cpu_size": L1_GIB,
             "extra_config": {"p2p_directory_url": fleet["redis"], "remote_key_prefix": PREFIX, "pd_peers": PEERS,
                              "p2p_lookup_timeout_secs": 2.0, "p2p_pull_timeout_secs": 10.0,
                              "max_pinned_fraction": 0.5, "max_pinned_fraction_per_salt": 0.25,
                              "management_port": port, "management_token_file": str(fleet["token_file"]),
                              "coordinator_url": fleet["coordinator"], "coordinator_heartbeat_secs": 1.0}}
    args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--max-num-batched-tokens", "8192",
            "--kv-transfer-config", json.dumps(h.connector(extra))]
    with serve(model, args, tmp, h.vllm_env(tmp, multiprocessing=True)) as (base, log):
        api = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # registered once its workers answer (the key space is known after the engine is built)
            status, got = curl("GET", f"{fleet['coordinator']}/instances")
            ids = [i["instance_id"] for i in got["instances"] if i["http_port"] == port]
            if ids:
                break
            assert time.monotonic() < deadline, f"{name} did not register:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        yield {"base": base, "api": api, "id": ids[0], "log": log, "name": name}


@pytest.fixture(scope="module")
def a(tiny_model, tmp_path_factory, fleet, reference) -> Iterator[dict[str, Any]]:
    yield from instance(tiny_model, tmp_path_factory.mktemp("e2e_mgmt_a"), fleet, "A")


@pytest.fixture(scope="module")
def b(tiny_model, tmp_path_factory, fleet, a) -> Iterator[dict[str, Any]]:
    yield from instance(tiny_model, tmp_path_factory.mktemp("e2e_mgmt_b"), fleet, "B")


def curl(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """One call made by curl: (HTTP status, JSON answer)."""
    args = ["curl", "-sS", "-m", "60", "-X", method, "-w", "\n%{http_code}", url]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    if token is not None:
        args += ["-H", f"Authorization: Bearer {token}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=90, check=True).stdout
    text, _, code = out.rpartition("\n")
    return int(code), json.loads(text) if text.strip() else None


def complete(inst: dict[str, Any], model: str, prompt: list[int]) -> dict[str, Any]:
    answer = post(f"{inst['base']}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0.0, "ignore_eos": True,
                                                      "return_token_ids": True})
    return {"tokens": answer["choices"][0]["token_ids"], "num_cached_tokens": cached_tokens(answer)}


def hits(inst: dict[str, Any], model: str, tier: str) -> float:
    """hit_tokens{tier} of an instance (after a tiny request: our stats reach the API server with steps)."""
    post(f"{inst['base']}/v1/completions", {"model": model, "prompt": h.random_tokens(9, 4), "max_tokens": 1})
    return scrape(inst["base"]).get(("lmcache_vllm:hit_tokens_total", tier), 0.0)


def tokens_form(model: str, prompt: list[int], **more: Any) -> dict[str, Any]:
    return {"model_name": model, "world_size": 1, "token_ids": prompt, **more}


def placements(fleet: dict[str, Any], model: str, prompt: list[int]) -> list[list[tuple[str, str]]]:
    status, got = curl("POST", f"{fleet['coordinator']}/directory/lookup", tokens_form(model, prompt))
    assert status == 200, got
    return [[(p["instance_id"], p["tier"]) for p in r["placements"]] for r in got["results"]]


def listed(fleet: dict[str, Any], model: str, prompt: list[int]) -> list[bool]:
    """Whether the P2P directory lists each chunk of `prompt` (under any instance): the keys resolved with the key
    space an instance registered, their ids looked up in every server's chunk set."""
    instances = curl("GET", f"{fleet['coordinator']}/instances")[1]["instances"]
    space = KeySpace.from_json(instances[0]["metadata"][KEYSPACE_FIELD])
    ids = [chunk_id(key.to_str()) for key in space.resolve(prompt)]
    client = sync_client(parse_remote_url(fleet["redis"]), ClientSettings())
    try:
        found = [False] * len(ids)
        for name in client.scan_iter(match=f"{PREFIX}p2p:*:chunks"):
            found = [f or bool(m) for f, m in zip(found, client.smismember(name, ids))]
        return found
    finally:
        client.close()


def wait_until(check, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return got


def flood(inst: dict[str, Any], model: str) -> None:
    for prompt in FLOOD:
        complete(inst, model, prompt)


def test_a_lookup_through_the_coordinator_names_the_instance_and_tier_that_serves_the_hit(fleet, a, b, tiny_model):
    assert complete(a, tiny_model, LOOKED_UP)["num_cached_tokens"] == 0
    found = wait_until(lambda: (p := placements(fleet, tiny_model, LOOKED_UP)) and all(p) and p, "the lookup")
    assert found == [[(a["id"], "l1")]] * 2  # two whole chunks, in A's L1; nothing of B
    before = hits(a, tiny_model, "local_cpu")
    assert complete(a, tiny_model, LOOKED_UP)["num_cached_tokens"] == 512
    assert hits(a, tiny_model, "local_cpu") - before == 512  # served by A, from L1, as the lookup said
    status, got = curl("GET", f"{a['api']}/status")  # loopback: a read needs no token
    assert status == 200 and got["storage_manager"]["l1"]["chunks"] >= 2 and TOKEN not in json.dumps(got)


def test_the_examples_of_the_management_doc_run_as_written(fleet, a, b, tiny_model):
    text = (ROOT / "docs" / "MANAGEMENT.md").read_text()
    blocks = re.findall(r"<!-- runs in tests/e2e/test_management.py -->\n```bash\n(.*?)```", text, re.S)
    assert blocks, "docs/MANAGEMENT.md has no examples marked to run"
    env = dict(os.environ, COORD=fleet["coordinator"], API=a["api"], INSTANCE=a["id"], TARGET=b["id"],
               MODEL=tiny_model, TOKEN_FILE=str(fleet["token_file"]), PATH=f"{Path(launcher()[0]).parent}:"
               f"{os.environ.get('PATH', '')}", TOKENS=json.dumps(LOOKED_UP), IDS=",".join(map(str, LOOKED_UP)))
    for block in blocks:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, f"{block}\n---\n{out.stdout}\n{out.stderr}"


def test_a_pinned_prompt_stays_a_hit_through_a_flood_and_unpinning_lets_it_go(fleet, a, b, tiny_model, reference):
    cold = complete(a, tiny_model, PINNED)
    h.assert_like_with_like(cold, reference["pinned0"], what="A, cold")
    status, got = curl("POST", f"{fleet['coordinator']}/cache/pins", tokens_form(tiny_model, PINNED), TOKEN)
    assert (status, got["requested"], got["affected"]) == (200, 2, 2), got
    flood(a, tiny_model)
    warm = complete(a, tiny_model, PINNED)
    assert warm["num_cached_tokens"] == 512, a["log"]
    h.assert_like_with_like(warm, reference["pinned1"], what="A, pinned through the flood")
    status, got = curl("DELETE", f"{fleet['coordinator']}/cache/pins", tokens_form(tiny_model, PINNED), TOKEN)
    assert status == 200 and got["instances"][a["id"]]["pin_count"] == 0
    flood(a, tiny_model)
    again = complete(a, tiny_model, PINNED)
    assert again["num_cached_tokens"] == 0  # let go: the flood evicted it, no instance holds it
    h.assert_like_with_like(again, reference["pinned0"], what="A, cold again after the unpin")


def test_a_forced_token_delete_makes_the_next_request_cold_and_the_directory_forgets_it(fleet, a, b, tiny_model,
                                                                                       reference):
    complete(a, tiny_model, DELETED)
    wait_until(lambda: all(listed(fleet, tiny_model, DELETED)), "A to list the prompt")
    status, got = curl("POST", f"{fleet['coordinator']}/cache/delete",
                       tokens_form(tiny_model, DELETED, instance_id=a["id"], tier="all", force=True), TOKEN)
    assert (status, got["status"], got["affected"]) == (200, "deleted", 2), got
    wait_until(lambda: not any(listed(fleet, tiny_model, DELETED)), "the directory to forget the prompt")
    assert placements(fleet, tiny_model, DELETED) == [[], []]
    again = complete(b, tiny_model, DELETED)  # B finds it nowhere either
    assert again["num_cached_tokens"] == 0
    h.assert_like_with_like(again, reference["deleted0"], what="B, cold after the delete")


def test_a_write_without_the_token_changes_nothing(fleet, a, b, tiny_model):
    complete(a, tiny_model, LOOKED_UP)
    body = tokens_form(tiny_model, LOOKED_UP, instance_id=a["id"], tier="all", force=True)
    assert curl("POST", f"{fleet['coordinator']}/cache/delete", body)[0] == 401
    assert curl("POST", f"{fleet['coordinator']}/cache/delete", body, "not-the-token-" + TOKEN)[0] == 403
    assert curl("POST", f"{a['api']}/cache/clear", {"tier": "all"})[0] == 401
    assert curl("POST", f"{a['api']}/cache/clear", {"tier": "all"}, TOKEN + "x")[0] == 403
    assert curl("POST", f"{fleet['coordinator']}/cache/pins", tokens_form(tiny_model, LOOKED_UP))[0] == 401
    assert placements(fleet, tiny_model, LOOKED_UP) == [[(a["id"], "l1")]] * 2
    assert complete(a, tiny_model, LOOKED_UP)["num_cached_tokens"] == 512
    assert curl("GET", f"{fleet['coordinator']}/cache/pins")[1]["total"] == 0


def test_a_move_makes_the_prompt_a_local_l1_hit_at_the_target_even_after_the_source_dies(fleet, a, b, tiny_model,
                                                                                         reference):
    cold = complete(a, tiny_model, MOVED)
    h.assert_like_with_like(cold, reference["moved0"], what="A, cold")
    out = subprocess.run([*launcher(), "cache", "move", "--coordinator", fleet["coordinator"], "--token-file",
                          str(fleet["token_file"]), "--model", tiny_model, "--token-ids", ",".join(map(str, MOVED)),
                          "--instance", a["id"], "--to", b["id"], "--wait", "--timeout", "120", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    moved = json.loads(out.stdout)
    assert (moved["status"], moved["loaded"], moved["deleted"]) == ("completed", 2, 2), moved
    assert placements(fleet, tiny_model, MOVED) == [[(b["id"], "l1")]] * 2
    before = hits(b, tiny_model, "local_cpu")
    warm = complete(b, tiny_model, MOVED)
    assert warm["num_cached_tokens"] == 512, b["log"]
    h.assert_like_with_like(warm, reference["moved1"], what="B, after the move")
    assert hits(b, tiny_model, "local_cpu") - before == 512  # B's own L1, not a pull from A
    os.killpg(h.server_group(a["log"]), signal.SIGKILL)  # A's API server, engine and worker
    again = complete(b, tiny_model, MOVED)
    assert again["num_cached_tokens"] == 512
    h.assert_like_with_like(again, reference["moved1"], what="B, with A gone")
    assert hits(b, tiny_model, "local_cpu") - before == 1024

