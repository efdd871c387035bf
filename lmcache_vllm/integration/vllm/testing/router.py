"""vLLM's router (`vllm-router`, the `vllm_router` package: Rust, runs on CPU) as a child process in front of
`lmcache-vllm serve` instances, for tests and benchmarks (docs/ROUTING.md).

`route(...)` starts it on a free loopback port with a policy (`round_robin`, `cache_aware`, `kv_aware`), and for
`kv_aware` one `--kv-event-source WORKER_URL=ENDPOINT` per instance (the ZMQ endpoint of that instance's
`--kv-events-config`), vLLM's block size and the tier credits; it yields once the router answers `/health` and,
with event sources, once each subscriber started (a subscriber gets only what is published after it joined).
`decisions(log)` reads back what `kv_aware` decided per request (its debug line "KV prefix decision": the worker,
the prompt's tokens, the tokens it credited as cached). The router is stopped with its process group.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from lmcache_vllm.integration.vllm.testing.openai_server import free_port, stop_group

_DECISION = re.compile(r"KV prefix decision")
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def router_command() -> list[str]:
    """`vllm-router` of this interpreter's environment (its console script, else the module)."""
    script = Path(sys.executable).with_name("vllm-router")
    if script.exists():
        return [str(script)]
    found = shutil.which("vllm-router")
    return [found] if found else [sys.executable, "-m", "vllm_router.launch_router"]


def router_args(workers: Sequence[str], policy: str, *, events: dict[str, str] | None = None,
                block_size: int = 128, model: str = "", credits: dict[str, float] | None = None) -> list[str]:
    """The router's options after `--host/--port`: its workers and policy, and for kv_aware the event source of
    each worker, vLLM's block size, the model's name and the tier credits (`host`, `disk`, `external`)."""
    args = ["--worker-urls", *workers, "--policy", policy]
    for worker, endpoint in (events or {}).items():
        args += ["--kv-event-source", f"{worker}={endpoint}"]
    if events:
        args += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    for tier, credit in (credits or {}).items():
        args += [f"--kv-penalty-{tier}", str(credit)]
    return args


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def route(workers: Sequence[str], policy: str, log_dir: Path, *, events: dict[str, str] | None = None,
          block_size: int = 128, model: str = "", credits: dict[str, float] | None = None,
          log_level: str = "debug", timeout_s: float = 120) -> Iterator[tuple[str, Path]]:
    """Runs the router (output to `log_dir/router-PORT.log`) and yields (base URL, log path)."""
    port = free_port()
    log = Path(log_dir) / f"router-{port}.log"
    cmd = [*router_command(), "--host", "127.0.0.1", "--port", str(port), "--log-level", log_level,
           *router_args(workers, policy, events=events, block_size=block_size, model=model, credits=credits)]
    env = dict(os.environ, NO_COLOR="1")
    env.pop("RUST_LOG", None)  # --log-level decides
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not (_healthy(base) and _subscribed(log, len(events or {}))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"vllm-router did not start ({proc.poll()}):\n{log.read_text()[-6000:]}")
            time.sleep(0.5)
        time.sleep(1.0)  # ZMQ: a subscription takes effect a moment after the connect
        yield base, log
    finally:
        stop_group(proc, signal.SIGTERM)


def _subscribed(log: Path, sources: int) -> bool:
    return _ANSI.sub("", log.read_text(errors="replace")).count("kv_index subscriber for") >= sources


def decisions(log: Path) -> list[dict[str, str]]:
    """kv_aware's decisions so far, oldest first: the fields of each "KV prefix decision" line (`worker`,
    `input_tokens`, `new_prefill_tokens`, `credited_prefix_tokens`, `outcome`, ...), quotes removed."""
    out = []
    for line in _ANSI.sub("", log.read_text(errors="replace")).splitlines():
        if _DECISION.search(line):
            out.append({k: v.strip('"') for k, v in _FIELD.findall(line)})
    return out
