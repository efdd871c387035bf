"""`lmcache-vllm serve` as a child process for tests: a free loopback port, the wait until it is healthy,
JSON requests, and a stop of its whole process group (vLLM's engine core and workers included)."""
from __future__ import annotations

import contextlib
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
from typing import Iterator

from lmcache_vllm.testing.vllm_jobs import REPO_ROOT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher() -> list[str]:
    script = Path(sys.executable).with_name("lmcache-vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmcache_vllm.cli"]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def cached_tokens(answer: dict) -> int:
    """Prompt tokens an OpenAI completion says came from a cache (needs --enable-prompt-tokens-details)."""
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


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
          timeout_s: float = 300) -> Iterator[tuple[str, Path]]:
    """Runs `lmcache-vllm serve MODEL --host 127.0.0.1 --port P ARGS...` (output to
    `log_dir/serve-P.log`) and yields (base URL, log path) once it answers /health; stops its process
    group afterwards."""
    port = free_port()
    log = Path(log_dir) / f"serve-{port}.log"
    cmd = [*launcher(), "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log, timeout_s)
        yield base, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the server's own session, started above
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
