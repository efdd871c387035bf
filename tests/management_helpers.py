"""Helpers of the management tests: an instance without vLLM (a real `CacheEngine` on plain tensors in vLLM's CPU
paged layout, its pin ledger, `RankOps`, the instance API on a free loopback port, optionally registered with a
coordinator), in this process (`LocalInstance`) or as a child process to SIGKILL (`python tests/management_helpers.py
CONFIG_JSON`: prints `READY <port>`), JSON calls with or without the token, and a coordinator child process.

The child stores the prompts its config names (token ids `range(base, base + n)`) before it serves, so a test
finds them in its L1 and, with P2P on, in the directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-" + "x" * 24
MODEL = "tiny-test"

sys.path.insert(0, str(ROOT / "tests"))


def call(base: str, method: str, path: str, body: Any = None, token: Optional[str] = TOKEN,
         raw: Optional[bytes] = None, headers: Optional[dict[str, str]] = None, timeout: float = 30.0
         ) -> tuple[int, Any]:
    """(status, JSON answer or None) of one HTTP call."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read(), exc.code
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def write_token(directory: Path) -> Path:
    path = directory / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@dataclass
class LocalInstance:
    engine: Any
    ledger: Any
    ops: Any
    api: Any
    server: Any
    agent: Any = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def store(self, tokens: list[int], salt: str = "", seed: int = 1) -> int:
        from test_engine import make_caches, slots_for

        from lmcache_vllm.extra_keys import for_salt

        stored: int = self.engine.store(tokens, make_caches(True, seed), slots_for(len(tokens), seed),
                                        extra=for_salt(salt))
        self.engine.storage.flush()
        return stored

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.server.stop()
        self.api.close()
        self.ops.close()
        self.ledger.close()
        self.engine.close()


def start_instance(instance_id: str = "inst-a", coordinator: Optional[str] = None, heartbeat_s: float = 0.5,
                   **config: Any) -> LocalInstance:
    """An instance API over a fresh engine (`test_engine.make_engine(**config)`), on a free loopback port."""
    from test_engine import make_engine

    from lmcache_vllm.management.agent import CoordinatorAgent
    from lmcache_vllm.management.control import LocalControl
    from lmcache_vllm.management.http import ServerThread
    from lmcache_vllm.management.instance import InstanceApi
    from lmcache_vllm.management.ops import RankOps
    from lmcache_vllm.storage.base import InstanceIdentity
    from lmcache_vllm.storage.pins import PinLedger

    engine = make_engine(**config)
    engine.storage.attach_instance(InstanceIdentity(instance_id, 0, 1))
    ledger = PinLedger.from_config(engine.config)
    ops = RankOps(engine, ledger)
    api = InstanceApi(LocalControl(lambda: [ops], 1), world_size=1, token=TOKEN.encode(), instance_id=instance_id,
                      model_names=[MODEL])
    server = ServerThread(api.app, "127.0.0.1", 0, f"mgmt-{instance_id}")
    server.start()
    inst = LocalInstance(engine, ledger, ops, api, server)
    if coordinator is not None:
        inst.agent = CoordinatorAgent(coordinator, TOKEN.encode(), api, "127.0.0.1", server.port,
                                      heartbeat_s=heartbeat_s)
    return inst


class Coordinator:
    """`lmcache-vllm coordinator` as a child process on a free loopback port."""

    def __init__(self, redis_url: str, token_file: Path, prefix: str, log: Path, port: int = 0, **flags: Any):
        from lmcache_vllm.integration.vllm.testing.openai_server import free_port, launcher

        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [*launcher(), "coordinator", "--port", str(self.port), "--redis-url", redis_url, "--token-file",
                str(token_file), "--prefix", prefix, "--move-poll-interval", "0.1"]
        for name, value in flags.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"the coordinator exited:\n{log.read_text()}"
            try:
                if call(self.base, "GET", "/healthz", token=None, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the coordinator did not start:\n{log.read_text()}"
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class ChildInstance:
    """`start_instance` in a child process (so a test can SIGKILL it), storing `prompts` first."""

    def __init__(self, instance_id: str, coordinator: str, config: dict[str, Any], prompts: list[tuple[int, int]],
                 log: Path):
        spec = {"instance_id": instance_id, "coordinator": coordinator, "config": config, "prompts": prompts}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "management_helpers.py"),
                                          json.dumps(spec)], stdout=subprocess.PIPE, stderr=out,
                                         env=dict(os.environ), start_new_session=True, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"the instance did not start:\n{log.read_text()}"
        self.base = f"http://127.0.0.1:{int(line.split()[1])}"
        self.instance_id = instance_id

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _child(spec: dict[str, Any]) -> None:
    inst = start_instance(spec["instance_id"], spec["coordinator"], **spec["config"])
    for base, n in spec["prompts"]:
        inst.store(list(range(base, base + n)))
    assert inst.agent is not None and inst.agent.registered.wait(30), "not registered with the coordinator"
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    print(f"READY {inst.server.port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    inst.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
