"""Real Redis deployments on loopback for the tests and benchmarks: a Redis Cluster (`ClusterProcesses`), a
Sentinel set (`SentinelSet`: one master, one replica, three Sentinels) and a TLS server with certificates made
here with `openssl` (`TlsServer`, `make_certificates`). Every process is a child on free ports, without
persistence, under a directory the caller owns; `stop()` kills what is left.

Cluster nodes run with `cluster-require-full-coverage no` and `cluster-allow-reads-when-down yes`, the settings
docs/SCALING.md recommends for a cache: a dead primary makes only its own slots unavailable.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import redis

_CHILD_OUTPUT = subprocess.DEVNULL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install -y redis-server)")
    return path


def _wait(what: str, check, timeout: float = 30.0, interval: float = 0.05):
    """Polls `check()` until it returns something truthy; RuntimeError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (redis.RedisError, OSError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})"
                                                                          if last_exc else ""))


class Process:
    """One redis-server (or Sentinel) child process on `port`, started from `args`."""

    def __init__(self, args: list[str], port: int, *, ping: Optional[dict] = None):
        self.args = args
        self.port = port
        self.ping_kwargs = ping if ping is not None else {}
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(self.args, stdout=_CHILD_OUTPUT, stderr=_CHILD_OUTPUT)

        def answers() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} on port {self.port} exited at start")
            client = redis.Redis(port=self.port, socket_timeout=1, **self.ping_kwargs)
            try:
                return bool(client.ping())
            finally:
                client.close()
        try:
            _wait(f"port {self.port} to answer PING", answers, timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, **{**self.ping_kwargs, **kwargs})


def server_args(port: int, workdir: Path, *extra: str) -> list[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    return [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--proto-max-bulk-len", "1gb",
            "--loglevel", "warning", *extra]


class Deployment:
    """Several processes started together: `start()` runs `_start()` and stops everything if it fails."""

    def start(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class ClusterProcesses(Deployment):
    """A Redis Cluster of `primaries` nodes (no replicas) made with `redis-cli --cluster create`.

    `url` is the redis-cluster:// URL naming every node; `extra` arguments go to every redis-server
    (e.g. TLS or requirepass); `cli_args` to every redis-cli call (the same credentials)."""

    def __init__(self, workdir: Path, primaries: int = 3, *, extra: tuple[str, ...] = (),
                 certs: Optional[dict[str, Path]] = None):
        """`certs` (from `make_certificates`): every node speaks only TLS, also on the cluster bus, and wants
        client certificates; the URL is then rediss-cluster://."""
        self.workdir = workdir
        self.cli_args: tuple[str, ...] = ()
        self.client_kwargs: dict = {}
        self.scheme = "redis-cluster"
        if certs is not None:
            self.cli_args = ("--tls", "--cacert", str(certs["ca.crt"]), "--cert", str(certs["client.crt"]),
                             "--key", str(certs["client.key"]))
            self.client_kwargs = {"ssl": True, "ssl_ca_certs": str(certs["ca.crt"]),
                                  "ssl_certfile": str(certs["client.crt"]), "ssl_keyfile": str(certs["client.key"])}
            self.scheme = "rediss-cluster"
        self.nodes: list[Process] = []
        self.bus_ports: list[int] = []
        for _ in range(primaries):
            port, bus = free_port(), free_port()
            self.bus_ports.append(bus)
            tls = ("--tls-port", str(port), "--tls-cluster", "yes", *tls_server_args(certs, client_certs=True)) \
                if certs is not None else ()
            args = server_args(0 if tls else port, workdir / str(port), *tls,
                                "--cluster-enabled", "yes", "--cluster-port", str(bus),
                                "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
                                "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "yes",
                                "--enable-debug-command", "local", *extra)
            self.nodes.append(Process(args, port, ping=self.client_kwargs))

    @property
    def url(self) -> str:
        return f"{self.scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        if len(self.nodes) >= 3:
            self.cli("--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas",
                     "0", "--cluster-yes")
        else:  # redis-cli wants 3 primaries at least: assign the slots and introduce the nodes by hand
            share = -(-16384 // len(self.nodes))
            for i, node in enumerate(self.nodes):
                client = node.client(**self.client_kwargs)
                try:
                    client.execute_command("CLUSTER ADDSLOTSRANGE", i * share, min(16383, (i + 1) * share - 1))
                    if i:
                        client.execute_command("CLUSTER MEET", "127.0.0.1", self.nodes[0].port, self.bus_ports[0])
                finally:
                    client.close()
        self.wait_agreed()

    def cli(self, *args: str, timeout: float = 120.0) -> str:
        run = subprocess.run([_binary("redis-cli"), *self.cli_args, *args], capture_output=True, text=True,
                             timeout=timeout)
        if run.returncode != 0 or "[ERR]" in run.stdout:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed ({run.returncode}):\n{run.stdout[-3000:]}"
                               f"\n{run.stderr[-2000:]}")
        return run.stdout

    def _slot_map(self, node: Process) -> tuple:
        client = node.client(**self.client_kwargs)
        try:
            if client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                return ()
            slots = client.execute_command("CLUSTER SLOTS")  # [[first, last, [host, port, id], ...], ...]
            return tuple(sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in slots))
        finally:
            client.close()

    def wait_agreed(self, timeout: float = 60.0) -> tuple:
        """Waits until every live node says cluster_state:ok and all agree on one slot map covering the
        16384 slots; returns that map ((first, last, port) per range)."""
        def agreed() -> tuple:
            maps = {self._slot_map(n) for n in self.nodes if n.alive}
            if len(maps) != 1:
                return ()
            (slot_map,) = maps
            return slot_map if slot_map and sum(b - a + 1 for a, b, _ in slot_map) == 16384 else ()
        return _wait("the cluster to agree on its slot map", agreed, timeout, interval=0.2)

    def node_of_port(self, port: int) -> Process:
        return next(n for n in self.nodes if n.port == port)

    def keys_per_node(self, pattern: str) -> dict[int, int]:
        """Keys matching `pattern` on each live node (port -> count)."""
        out = {}
        for node in self.nodes:
            if node.alive:
                client = node.client(**self.client_kwargs)
                try:
                    out[node.port] = sum(1 for _ in client.scan_iter(match=pattern, count=1000))
                finally:
                    client.close()
        return out

    def node_id(self, node: Process) -> str:
        client = node.client(**self.client_kwargs)
        try:
            return client.execute_command("CLUSTER MYID").decode()
        finally:
            client.close()

    def reshard(self, source: Process, target: Process, slots: int) -> str:
        """Moves `slots` slots with their keys from `source` to `target` (`redis-cli --cluster reshard`)."""
        return self.cli("--cluster", "reshard", f"127.0.0.1:{source.port}", "--cluster-from", self.node_id(source),
                        "--cluster-to", self.node_id(target), "--cluster-slots", str(slots), "--cluster-yes",
                        "--cluster-pipeline", "10")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class SentinelSet(Deployment):
    """One master, one replica and three Sentinels watching them as `master_name` (quorum 2, down after
    `down_after_ms`). `url` is the redis-sentinel:// URL naming the Sentinels and the master name."""

    def __init__(self, workdir: Path, master_name: str = "lmcache-test", down_after_ms: int = 1000,
                 password: Optional[str] = None):
        self.workdir = workdir
        self.master_name = master_name
        self.password = password
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        ping = {"password": password} if password else {}
        mport, rport = free_port(), free_port()
        self.master = Process(server_args(mport, workdir / "master", *auth), mport, ping=ping)
        self.replica = Process(server_args(rport, workdir / "replica", "--replicaof", "127.0.0.1", str(mport),
                                            *auth), rport, ping=ping)
        self.sentinels: list[Process] = []
        for i in range(3):
            port = free_port()
            conf = workdir / f"sentinel-{i}.conf"
            lines = [f"port {port}", "bind 127.0.0.1", f"dir {workdir}",
                     f"sentinel monitor {master_name} 127.0.0.1 {mport} 2",
                     f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
                     f"sentinel failover-timeout {master_name} 10000",
                     f"sentinel parallel-syncs {master_name} 1"]
            if password:
                lines.append(f"sentinel auth-pass {master_name} {password}")
            self._conf_lines = lines
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text("\n".join(lines) + "\n")
            self.sentinels.append(Process([_binary("redis-server"), str(conf), "--sentinel"], port))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        user = f":{self.password}@" if self.password else ""
        return f"redis-sentinel://{user}{hosts}/{self.master_name}"

    def _start(self) -> None:
        self.master.start()
        self.replica.start()
        _wait("the replica to sync", lambda: self._info(self.replica, "master_link_status") == "up")
        for sentinel in self.sentinels:
            sentinel.start()
        _wait("every Sentinel to see the replica and the other Sentinels", self._sentinels_ready)

    def _info(self, node: Process, field: str) -> str:
        client = node.client()
        try:
            return str(client.info("replication").get(field, ""))
        finally:
            client.close()

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                state = client.sentinel_master(self.master_name)
                if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
                    return False
            finally:
                client.close()
        return True

    def master_port(self) -> int:
        """The master's port as the first Sentinel sees it now."""
        client = self.sentinels[0].client()
        try:
            return int(client.sentinel_get_master_addr_by_name(self.master_name)[1])
        finally:
            client.close()

    def wait_failover(self, old_port: int, timeout: float = 60.0) -> int:
        """Waits until every Sentinel names a master other than `old_port` and that master takes writes."""
        def moved() -> int:
            ports = set()
            for sentinel in self.sentinels:
                client = sentinel.client()
                try:
                    ports.add(int(client.sentinel_get_master_addr_by_name(self.master_name)[1]))
                finally:
                    client.close()
            if len(ports) != 1 or old_port in ports:
                return 0
            port = ports.pop()
            node = self.master if self.master.port == port else self.replica
            return port if self._info(node, "role") == "master" else 0
        return _wait("the Sentinels to fail over", moved, timeout, interval=0.2)

    def stop(self) -> None:
        for proc in [*self.sentinels, self.replica, self.master]:
            proc.kill()


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate signed by it, and an
    unrelated CA (for the wrong-CA test): PEM files under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = _binary("openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60, cwd=directory)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
            "-days", "2", "-subj", f"/CN=lmcache-vllm test {ca}")
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            "/CN=127.0.0.1")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", str(ext))
    # A server certificate the CA signed for another host name (the host-name check must refuse it).
    (directory / "other-san.ext").write_text("subjectAltName=DNS:other-host.example\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "other-host.key", "-out", "other-host.csr", "-subj",
        "/CN=other-host.example")
    run("x509", "-req", "-in", "other-host.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "other-host.crt", "-days", "2", "-extfile", "other-san.ext")
    for key in directory.glob("*.key"):
        os.chmod(key, 0o600)
    return {name: directory / name for name in ("ca.crt", "other-ca.crt", "server.crt", "server.key",
                                                 "client.crt", "client.key", "other-host.crt", "other-host.key")}


def tls_server_args(certs: dict[str, Path], *, client_certs: bool) -> tuple[str, ...]:
    return ("--tls-cert-file", str(certs["server.crt"]), "--tls-key-file", str(certs["server.key"]),
            "--tls-ca-cert-file", str(certs["ca.crt"]), "--tls-auth-clients", "yes" if client_certs else "no")


class TlsServer(Process):
    """A redis-server speaking only TLS on `port` (`--port 0 --tls-port P`), optionally requiring client
    certificates and a password."""

    def __init__(self, workdir: Path, certs: dict[str, Path], *, client_certs: bool = False,
                 password: Optional[str] = None):
        port = free_port()
        args = server_args(0, workdir, "--tls-port", str(port), *tls_server_args(certs, client_certs=client_certs))
        if password:
            args += ["--requirepass", password]
        ping = {"ssl": True, "ssl_ca_certs": str(certs["ca.crt"]), "password": password}
        if client_certs:
            ping.update(ssl_certfile=str(certs["client.crt"]), ssl_keyfile=str(certs["client.key"]))
        super().__init__(args, port, ping=ping)
