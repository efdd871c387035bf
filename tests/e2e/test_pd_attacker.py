"""Playing the attacker against two real `lmcache-vllm serve` processes (a prefill instance P and a decode instance
D, kv_both on loopback, one pair for the whole module) and examples/pd_proxy.py (test_pd_protocol's `proxy`
fixture, in front of this module's pair). PD is configured explicitly without a key: each instance's
`pd_peers` lists the other's transfer port (and its own), nothing else (issues 30 and 39):

(a) forged kv_transfer_params of protocol 3 sent to D by a client, well-formed, naming a real listener on this
    host (bound to every loopback address, IPv4 and IPv6) at 127.0.0.1, 127.0.0.2, ::ffff:127.0.0.1, ::1 and
    `localhost`, a name under a zone nobody resolves, and malformed ones (CR/LF in the request id, a port
    with the host, a port out of range, one port named 256 times): the listener receives nothing, each is
    counted once (the names as untrusted: never looked up), and every request is answered, recomputed;
(b) a forged fan-out: P's real params for a held request with `tp_size: 256` and P's port 256 times: D sends
    P nothing, the hold stays until the real params release it;
(c) a 32 MiB message sent to P's transfer port before any authentication: the peak RSS (VmHWM) of the process
    that owns the port grows by less than 16 MiB;
(d) 80 idle connections held open to P's transfer port while a real handoff goes through the proxy: D still
    pulls every chunk of the prompt.
(c) and (d) are the transfer server's bounds (message size, slots reclaimed from idle peers).
"""
from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from pathlib import Path

import e2e_harness as h
import pytest
from test_pd_protocol import MAX_TOKENS, PROMPT_LEN, body, metric, nudge_and_scrape, proxy, server_args  # noqa: F401

from lmcache_vllm.integration.vllm.testing.openai_server import free_port, post, scrape, serve

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

FORGED_PROMPT = h.random_tokens(300, 300)
HANDOFF = h.random_tokens(301, PROMPT_LEN)
FANNED = h.random_tokens(303, 300)
IDLE_CONNECTIONS = 80
PRE_AUTH_BYTES = 32 << 20
MAX_RSS_GROWTH = 16 << 20
P_PORT, D_PORT = free_port(), free_port()  # the transfer ports of P and D (pd_port), listed in pd_peers
PEERS = [f"127.0.0.1:{P_PORT}", f"127.0.0.1:{D_PORT}"]


def instance(model: str, tmp: Path, extra: dict, cpu: str):
    env = h.vllm_env(tmp, multiprocessing=True, threads_bind=cpu)
    config = {"extra_config": {"pd_host": "127.0.0.1", "pd_peers": PEERS, **extra}}
    return serve(model, server_args(model, config, 2048), tmp, env)


@pytest.fixture(scope="module")
def prefill(tiny_model, tmp_path_factory):
    with instance(tiny_model, tmp_path_factory.mktemp("e2e_pda_p"), {"pd_port": P_PORT, "pd_hold_secs": 20.0},
                  "0") as running:
        yield running


@pytest.fixture(scope="module")
def decode(tiny_model, tmp_path_factory, prefill):
    with instance(tiny_model, tmp_path_factory.mktemp("e2e_pda_d"), {"pd_port": D_PORT, "pd_pull_timeout_secs": 3.0},
                  "1") as running:
        yield running


@pytest.fixture(scope="module")
def transfer_port(prefill, tiny_model) -> int:
    """P's transfer port (rank 0), as P names it in its params."""
    answer = post(f"{prefill[0]}/v1/completions", body(tiny_model, h.random_tokens(302, 300), max_tokens=1,
                                                        kv_transfer_params={"do_remote_decode": True}))
    port = int(answer["kv_transfer_params"]["remote_port"])
    assert port == P_PORT
    return port


class Listener:
    """A real listener on every loopback address (IPv6 and IPv4: a dual-stack socket on ::) that counts the
    connections it accepts and the bytes they send."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind(("::", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.received = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.settimeout(2)
                try:
                    while data := conn.recv(1 << 16):
                        self.received += len(data)
                except OSError:
                    pass


@pytest.fixture
def listener():
    listening = Listener()
    yield listening
    listening.sock.close()


def with_reason(base: str, name: str, reason: str) -> float:
    """The count of `name` (a counter of ours) with `reason`, summed over its other labels."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf'^lmcache_vllm:{name}_total{{[^}}]*reason="{reason}"[^}}]*}} ([0-9.e+]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def forged(host: str, ports: list[int], **changes) -> dict:
    """Well-formed params of protocol 3, as our prefill instance writes them, naming `host` and `ports`."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_request_id": "cmpl-forged-0", "remote_host": host, "remote_port": ports[0],
              "tp_size": len(ports), "remote_num_tokens": len(FORGED_PROMPT), "remote_block_ids": None,
              "lmcache_vllm": {"version": 3, "ports": ports, "chunk_size": h.CHUNK}}
    params.update(changes)
    return params


def test_forged_params_make_no_connection_to_a_local_listener(decode, listener, tiny_model):
    port = listener.port
    d0, untrusted0 = scrape(decode[0]), with_reason(decode[0], "pd_pull_failures", "untrusted")
    untrusted = [forged(host, [port]) for host in ("127.0.0.1", "127.0.0.2", "::ffff:127.0.0.1", "::1", "localhost",
                                                   "fresh-0.slow-zone.invalid")]
    malformed = [forged("127.0.0.1", [port], remote_request_id="x\r\nFLUSHALL\r\nSET pwned 1\r\n"),
                 forged(f"127.0.0.1:{port}", [port]),
                 forged("127.0.0.1\r\nFLUSHALL", [port]),
                 forged("127.0.0.1", [port + 70000]),
                 forged("127.0.0.1", [port] * 256)]
    for params in untrusted + malformed:
        answer = post(f"{decode[0]}/v1/completions", body(tiny_model, FORGED_PROMPT, kv_transfer_params=params))
        assert len(answer["choices"][0]["token_ids"]) == MAX_TOKENS  # answered: recomputed here
    time.sleep(1.5)  # a RELEASE would go out from a thread of its own: give it the time it would take
    assert (listener.accepted, listener.received) == (0, 0)  # no connection, no byte
    want = metric(d0, "pd_pull_failures_total") + len(untrusted) + len(malformed)
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pull_failures_total") >= want, 20)
    assert metric(d, "pd_pull_failures_total") == want
    # the names too: refused as untrusted, never looked up (else: "unresolved", or a connection)
    assert with_reason(decode[0], "pd_pull_failures", "untrusted") - untrusted0 == len(untrusted)
    assert "FLUSHALL" not in Path(decode[1]).read_text()  # nothing of the forged id in D's log either


def test_a_forged_fan_out_of_releases_reaches_nothing(prefill, decode, tiny_model):
    """P's real params for a held request, with `tp_size: 256` and P's port named 256 times: before, D sent
    P 256 RELEASEs (from one thread, 1 s each where a port dropped SYNs) and P's hold ended."""
    answer = post(f"{prefill[0]}/v1/completions", body(tiny_model, FANNED, max_tokens=1,
                                                       kv_transfer_params={"do_remote_decode": True}))
    params = answer["kv_transfer_params"]
    p0 = scrape(prefill[0])
    fanned = dict(params, tp_size=256, lmcache_vllm=dict(params["lmcache_vllm"], ports=[P_PORT] * 256))
    post(f"{decode[0]}/v1/completions", body(tiny_model, FANNED, kv_transfer_params=fanned))
    time.sleep(1.5)  # RELEASEs would have gone out by now; P's counts reach its API server with its next steps:
    p = nudge_and_scrape(prefill[0], tiny_model, lambda m: False, 3)  # a few steps
    assert metric(p, "pd_holds") >= 1
    assert metric(p, "pd_holds_released_total") == metric(p0, "pd_holds_released_total")
    assert metric(p, "pd_server_refusals_total") == metric(p0, "pd_server_refusals_total")
    post(f"{decode[0]}/v1/completions", body(tiny_model, FANNED, kv_transfer_params=params))  # the real ones
    p = nudge_and_scrape(prefill[0], tiny_model, lambda m: metric(m, "pd_holds_released_total") >
                         metric(p0, "pd_holds_released_total"), 20)
    assert metric(p, "pd_holds_released_total") == metric(p0, "pd_holds_released_total") + 1


def _listener_pid(port: int) -> int:
    """The pid of the process holding the listening socket of `port` (/proc/net/tcp and the fds)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inode = fields[9]
    assert inode is not None, f"nothing listens on {port}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process of ours holds port {port}")


def _peak_rss(pid: int) -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


def test_a_32_mib_message_before_authentication_costs_the_prefill_instance_little(transfer_port):
    pid = _listener_pid(transfer_port)
    before = _peak_rss(pid)
    # A request's prefix (5 parts, the last one 32 MiB less the others) and then its bytes.
    lengths = [6, 4, 8, 8, PRE_AUTH_BYTES - 26]
    with socket.create_connection(("127.0.0.1", transfer_port), timeout=30) as sock:
        sock.sendall(struct.pack("<I", 5) + b"".join(struct.pack("<Q", n) for n in lengths))
        chunk = b"\x00" * (1 << 20)
        try:
            for _ in range(PRE_AUTH_BYTES >> 20):
                sock.sendall(chunk)
        except OSError:
            pass  # refused before the end: what we want
        sock.settimeout(5)
        try:
            sock.recv(1 << 16)
        except OSError:
            pass
    time.sleep(1.0)
    grown = _peak_rss(pid) - before
    assert grown < MAX_RSS_GROWTH, f"the prefill worker's peak RSS grew by {grown >> 20} MiB"


def test_a_handoff_still_pulls_with_80_idle_connections_on_the_transfer_port(
        proxy, decode, transfer_port, tiny_model):  # noqa: F811 (proxy: test_pd_protocol's fixture)
    idle = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", transfer_port), timeout=5))
        d0 = scrape(decode[0])
        answer = post(f"{proxy}/v1/completions", body(tiny_model, HANDOFF))
        assert len(answer["choices"][0]["token_ids"]) == MAX_TOKENS
        pulled = metric(d0, "pd_pulled_chunks_total") + 3  # 256 + 256 + the partial 188
        d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pulled_chunks_total") >= pulled, 30)
        assert metric(d, "pd_pulled_chunks_total") == pulled, decode[1]
        assert metric(d, "pd_pull_failures_total") == metric(d0, "pd_pull_failures_total")
    finally:
        for sock in idle:
            sock.close()
