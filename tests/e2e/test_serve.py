"""End to end through the console script: `lmcache-vllm serve MODEL --kv-transfer-config ...` starts
vLLM's OpenAI server (multiprocess engine, as users run it) on 127.0.0.1 and the second identical
completion is served from our cache.

The reference is vLLM alone in the same engine mode (multiprocess, the same thread binding) with its own
prefix cache, sent the prompt twice: the cold answer and the 512-token hit are compared with the request
computed with the same split."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import e2e_harness as h

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

PROMPT = h.random_tokens(40, 600)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_vllm.cli"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"server not healthy after {timeout_s}s:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e_serve")
    port = _free_port()
    log = tmp / "serve.log"
    cmd = [*_launcher(), "serve", tiny_model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
           "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(h.connector())]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=h.REPO_ROOT, env=h.vllm_env(tmp, multiprocessing=True),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log)
        yield base, tiny_model, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the server's own session, started above
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


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
