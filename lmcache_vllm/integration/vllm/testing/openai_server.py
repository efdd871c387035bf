"""`lmcache-vllm serve` as a child process for tests: a free loopback port, the wait until it is healthy,
JSON requests (plain and streamed), `/metrics` read back, and a stop of its whole process group (vLLM's
engine core and workers included)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from lmcache_vllm.integration.vllm.testing.vllm_jobs import REPO_ROOT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launcher(python: str | None = None) -> list[str]:
    """`lmcache-vllm` of this interpreter's environment, or `python -m lmcache_vllm.cli` under another."""
    if python is not None:
        return [python, "-m", "lmcache_vllm.cli"]
    script = Path(sys.executable).with_name("lmcache-vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_vllm.cli"]


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def reset_prefix_cache(base: str, timeout: float = 120) -> dict[str, Any]:
    """vLLM's `/reset_prefix_cache?reset_external=true` (the server needs VLLM_SERVER_DEV_MODE=1): its device cache
    and our L1 (and the lower tiers with `reset_lower_tiers`) emptied; vLLM's answer (`{"success": ...}`)."""
    req = urllib.request.Request(f"{base}/reset_prefix_cache?reset_external=true", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def cached_tokens(answer: dict[str, Any]) -> int:
    """Prompt tokens an OpenAI completion says came from a cache (needs --enable-prompt-tokens-details)."""
    cached: int = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return cached


def stream(url: str, body: dict, timeout: float = 120,
           times: list[float] | None = None) -> tuple[list[float], dict]:
    """A streamed completion: the arrival time (monotonic) of every chunk carrying text or tokens
    (appended to `times` as they come, when given), and the last chunk's usage."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    times = [] if times is None else times
    usage: dict = {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("choices"):
                times.append(time.monotonic())
            if event.get("usage"):
                usage = event["usage"]
    return times, usage


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def scrape(base: str) -> dict[tuple[str, str], float]:
    """`/metrics` as {(sample name, label value of tier, source or result): value}, summed over other labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        found = re.search(r'(?:tier|source|result)="([^"]*)"', labels or "")
        key = (name, found.group(1) if found else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_for(base: str, check, timeout_s: float = 20.0) -> dict:
    """Scrapes until `check(scraped)` holds (stats reach the API server a step after the work)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = scrape(base)
        if check(scraped) or time.monotonic() > deadline:
            return scraped
        time.sleep(0.5)


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
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


@contextlib.contextmanager
def serve(model: str, args: list[str], log_dir: Path, env: dict[str, str],
          timeout_s: float = 300, python: str | None = None) -> Iterator[tuple[str, Path]]:
    """Runs `lmcache-vllm serve MODEL --host 127.0.0.1 --port P ARGS...` (under `python` when given;
    output to `log_dir/serve-P.log`) and yields (base URL, log path) once it answers /health; stops its
    process group afterwards."""
    port = free_port()
    log = Path(log_dir) / f"serve-{port}.log"
    cmd = [*launcher(python), "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log, timeout_s)
        yield base, log
    finally:
        stop_group(proc, signal.SIGINT)


def stop_group(proc: subprocess.Popen, sig: int, timeout_s: float = 30) -> None:
    """Stops a child started in its own session (`start_new_session=True`) with its whole process group: `sig`,
    then SIGKILL if it is still there after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
