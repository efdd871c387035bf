"""A real Mooncake Store on loopback for the tests and benchmarks: a `mooncake_master` and `mooncake_client`
storage hosts (the memory of the pool), child processes on free ports from the pip package `mooncake`
(mooncake-transfer-engine-non-cuda), logging into a directory the caller owns. `MooncakeStore.stop()` kills
what is left; a master can be killed and restarted (empty) on its port, a storage host killed.

`raw_client()` is a Mooncake client of the test process itself, set up like our tier (TCP, no segment), to
look at or plant objects behind the tier's back.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Callable

from redis_servers import Process

# Mooncake clients advertise this address for their transfer engine (else possibly another interface's).
CHILD_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mooncake package is not installed (pip install "
                           "mooncake-transfer-engine-non-cuda; `make test` installs it)")
    return os.path.join(list(spec.submodule_search_locations)[0], name)


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Child(Process):
    """One child process from `args`, its output appended to `log` (`alive`, `kill`: redis_servers.Process)."""

    def __init__(self, args: list[str], log: Path):
        super().__init__(args, port=0)
        self.log = log
        self.killed = False  # by kill(); what exited on its own was not

    def kill(self) -> None:
        self.killed = True
        super().kill()

    def start(self, timeout: float = 0.0) -> None:
        """Starts it; the caller waits for what it needs (a port, a mounted segment)."""
        self.killed = False
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **CHILD_ENV})


class MooncakeStore:
    """A master (RPC on `port`, metrics on `metrics_port`) and `hosts` storage hosts of `segment` each."""

    def __init__(self, workdir: Path, *, hosts: int = 1, segment: str = "64MB", lease_ms: int = 10000):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.metrics_port = free_port(), free_port()
        self.master = Child([binary("mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                             f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
                             "--enable_metric_reporting=false", f"--default_kv_lease_ttl={lease_ms}",
                             "--logtostderr"], workdir / "master.log")
        self.hosts = [Child([binary("mooncake_client"), "--host=127.0.0.1", f"--port={free_port()}",
                             f"--master_server_address=127.0.0.1:{self.port}", "--metadata_server=P2PHANDSHAKE",
                             f"--global_segment_size={segment}", "--protocol=tcp", "--logtostderr"],
                            workdir / f"host{i}.log") for i in range(hosts)]

    @property
    def url(self) -> str:
        return f"mooncakestore://127.0.0.1:{self.port}"

    def start(self) -> "MooncakeStore":
        try:
            self.start_master()
            for host in self.hosts:
                host.start()
            self.wait_capacity(len(self.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Starts (or restarts: empty) the master on its port and waits until it listens."""
        self.master.start()
        wait_until(f"mooncake_master on port {self.port}",
                   lambda: _listens(self.port) and _listens(self.metrics_port) or not self.master.alive)
        if not self.master.alive:
            raise RuntimeError(f"mooncake_master exited at start; see {self.master.log}")

    def _metric_lines(self) -> list[str]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    def metrics(self) -> dict[str, float]:
        """The master's gauges and counters without labels (master_key_count, master_total_capacity_bytes...)."""
        out = {}
        for line in self._metric_lines():
            name, _, value = line.partition(" ")
            if "{" not in name:
                out[name] = float(value)
        return out

    def mounted_segments(self) -> int:
        """Storage segments the master has mounted now."""
        try:
            lines = self._metric_lines()
        except OSError:
            return 0
        return sum(1 for line in lines if line.startswith("segment_total_capacity_bytes{")
                   and float(line.rpartition(" ")[2]) > 0)

    def wait_capacity(self, hosts: int, timeout: float = 60.0) -> None:
        """Waits until `hosts` storage hosts' segments are mounted."""
        def mounted() -> bool:
            dead = [str(h.log) for h in self.hosts if h.proc is not None and not h.alive]
            if len(self.hosts) - len(dead) < hosts:
                raise RuntimeError(f"a mooncake_client exited; see {dead}")
            return self.mounted_segments() >= hosts
        wait_until(f"{hosts} Mooncake storage host(s) to mount their segments", mounted, timeout)

    def key_count(self) -> int:
        return int(self.metrics().get("master_key_count", 0))

    def restart_master(self) -> None:
        """Kills the master and starts a new, empty one on the same port; the hosts mount their segments again.

        A storage host that exited while its master was away (a `mooncake_client` once did, at the restart, on a
        loaded CI machine: Mooncake's fault, not the tier's under test) is started again, with a warning that
        pytest's summary shows, quoting the end of its log; hosts the caller killed stay dead."""
        self.master.kill()
        self.start_master()
        for host in self.hosts:
            if host.proc is not None and not host.killed and not host.alive:
                tail = host.log.read_text(errors="replace").splitlines()[-5:]
                warnings.warn(f"a mooncake_client exited (code {host.proc.returncode}) while its master was "
                              f"away; started again. The end of {host.log}: " + " | ".join(tail), stacklevel=2)
                host.start()
        self.wait_capacity(sum(1 for h in self.hosts if h.alive))

    def stop(self) -> None:
        for child in [*self.hosts, self.master]:
            child.kill()


def raw_client(port: int) -> Any:
    """A Mooncake client of this process (TCP, no segment of its own) on the master at `port`."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}")
    if rc != 0:
        raise RuntimeError(f"raw Mooncake client setup returned {rc}")
    return store
