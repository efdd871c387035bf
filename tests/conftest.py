"""Shared test fixtures: a real `redis-server` for the session (`redis_server`), a fresh key prefix per
test (`redis_prefix`), `make_chunk` for deterministic chunk tensors, an arena checked for leaks
(`allocator`), and fresh process metrics for every test (`lmcache_vllm.observability.metrics` counts per
process; `lmcache_vllm.observability.logs` rate-limits per process)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest
import torch
from ci import IN_CI, missing_in_ci


def pytest_configure(config: pytest.Config) -> None:
    """In CI (CI=true), what the suite would otherwise skip for must be there: a skip would hide it (ci.py)."""
    if IN_CI and (missing := missing_in_ci()):
        raise pytest.UsageError("CI=true, but what the tests need is missing or broken (they would be skipped "
                                "and CI pass): " + "; ".join(missing))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on 127.0.0.1:<free port>, no persistence; can be killed and restarted."""

    def __init__(self, binary: str, workdir: str):
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no",
             "--proto-max-bulk-len", "1gb", "--loglevel", "warning",
             "--enable-debug-command", "local"],  # DEBUG SLEEP freezes it for slow-tier tests
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            if _pings(self.port):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()


@pytest.fixture(autouse=True)
def fresh_metrics():
    from lmcache_vllm.observability import kv_events, logs, metrics

    metrics.RECORDER.reset()
    metrics.set_primary(True)
    logs.reset()  # rate-limited warnings start afresh
    kv_events.RECORDER.reset()
    kv_events.RECORDER.enabled = False
    yield


@pytest.fixture(scope="session")
def redis_server():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make test` (it installs it) or "
                    "`apt-get install -y redis-server`", pytrace=False)
    workdir = tempfile.mkdtemp(prefix="lmcache-test-redis-")
    server = RedisServer(binary, workdir)
    server.start()
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def redis_prefix(redis_server) -> str:
    """A key prefix no other test uses; the server is (re)started if a fault test left it down."""
    redis_server.ensure_running()
    return f"test-{uuid.uuid4().hex[:12]}:"


def make_chunk_tensor(seed: int, shape=(2, 2, 16, 64), dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.fixture
def make_chunk():
    return make_chunk_tensor


@pytest.fixture
def allocator():
    """An 8 MiB L1 arena for a tier's reads and writes; the test fails if it left MemoryObjs allocated."""
    from lmcache_vllm.memory import HostAllocator

    alloc = HostAllocator(8 << 20)
    yield alloc
    assert alloc.used_bytes == 0, "a test leaked MemoryObjs"


def open_fds() -> set[str]:
    """Targets of this process's open file descriptors (sockets, files), for leak checks."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


# ---- Redis Cluster / Sentinel / TLS deployments (tests/redis_servers.py) --------------------------------
@pytest.fixture(scope="session")
def redis_deployments_dir():
    workdir = tempfile.mkdtemp(prefix="lmcache-test-redis-deploy-")
    yield workdir
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster(redis_deployments_dir):
    """A 3-node Redis Cluster shared by the tests that leave it as they found it."""
    from pathlib import Path

    from redis_servers import ClusterProcesses

    cluster = ClusterProcesses(Path(redis_deployments_dir) / "shared-cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def make_cluster(tmp_path):
    """Starts a fresh 3-node Redis Cluster for a test that kills or reshards nodes; stopped afterwards."""
    from redis_servers import ClusterProcesses

    made: list = []

    def make(**kwargs):
        cluster = ClusterProcesses(tmp_path / f"cluster{len(made)}", **kwargs)
        made.append(cluster)
        return cluster.start()
    yield make
    for cluster in made:
        cluster.stop()
