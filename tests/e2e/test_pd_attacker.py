"""Playing the attacker against two real `lmcache-vllm serve` processes (a prefill instance P and a decode instance
D, kv_both on loopback, one pair for the whole module) and examples/pd_proxy.py (test_pd_protocol's `proxy`
fixture, in front of this module's pair) (issue 30, "Done when"):

(a) forged kv_transfer_params sent to D by a client, naming a local redis-server (a real one on a free port) with
    CR/LF in the request id, a port with the host, a port out of range: D makes no connection (the server's
    `total_connections_received` does not move), counts each refusal and answers the request, recomputed;
(b) a 32 MiB message sent to P's transfer port before any authentication: the peak RSS (VmHWM) of the process
    that owns the port grows by less than 16 MiB;
(c) 80 idle connections held open to P's transfer port while a real handoff goes through the proxy: D still
    pulls every chunk of the prompt.
(b) and (c) are the transfer server's bounds (message size, slots reclaimed from idle peers).
"""
from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
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
IDLE_CONNECTIONS = 80
PRE_AUTH_BYTES = 32 << 20
MAX_RSS_GROWTH = 16 << 20


def instance(model: str, tmp: Path, extra: dict, cpu: str):
    env = h.vllm_env(tmp, multiprocessing=True, threads_bind=cpu)
    return serve(model, server_args(model, {"extra_config": {"pd_host": "127.0.0.1", **extra}}, 2048), tmp, env)


@pytest.fixture(scope="module")
def prefill(tiny_model, tmp_path_factory):
    with instance(tiny_model, tmp_path_factory.mktemp("e2e_pda_p"), {"pd_hold_secs": 20.0}, "0") as running:
        yield running


@pytest.fixture(scope="module")
def decode(tiny_model, tmp_path_factory, prefill):
    with instance(tiny_model, tmp_path_factory.mktemp("e2e_pda_d"), {"pd_pull_timeout_secs": 3.0}, "1") as running:
        yield running


@pytest.fixture(scope="module")
def transfer_port(prefill, tiny_model) -> int:
    """P's transfer port (rank 0), as P names it in its params."""
    answer = post(f"{prefill[0]}/v1/completions", body(tiny_model, h.random_tokens(302, 300), max_tokens=1,
                                                        kv_transfer_params={"do_remote_decode": True}))
    return int(answer["kv_transfer_params"]["remote_port"])


@pytest.fixture
def local_redis(tmp_path):
    """A real redis-server on a free loopback port: the service forged params point D at."""
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=2)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
    yield port, client
    client.close()
    proc.kill()
    proc.wait(10)


def forged(port: int, **changes) -> dict:
    """Params as our prefill instance writes them, naming `port` on loopback, with `changes`."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_request_id": "cmpl-forged-0", "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1,
              "remote_num_tokens": len(FORGED_PROMPT), "remote_block_ids": None,
              "lmcache_vllm": {"version": 2, "ports": [port], "chunk_size": 256}}
    params.update(changes)
    return params


def test_forged_params_make_no_connection_to_a_local_service(decode, local_redis, tiny_model):
    port, client = local_redis
    connections = client.info("stats")["total_connections_received"]  # (this client's own: already counted)
    d0 = scrape(decode[0])
    cases = [forged(port, remote_request_id="x\r\nFLUSHALL\r\nSET pwned 1\r\n"),
             forged(port, remote_host=f"127.0.0.1:{port}"),
             forged(port, remote_host="127.0.0.1\r\nFLUSHALL"),
             forged(port, lmcache_vllm={"version": 2, "ports": [port + 70000], "chunk_size": 256})]
    for params in cases:
        answer = post(f"{decode[0]}/v1/completions", body(tiny_model, FORGED_PROMPT, kv_transfer_params=params))
        assert len(answer["choices"][0]["token_ids"]) == MAX_TOKENS  # answered: recomputed here
    want = metric(d0, "pd_pull_failures_total") + len(cases)
    d = nudge_and_scrape(decode[0], tiny_model, lambda m: metric(m, "pd_pull_failures_total") >= want, 20)
    assert metric(d, "pd_pull_failures_total") == want
    time.sleep(1.5)  # a RELEASE would go out from a thread of its own: give it the time it would take
    assert client.info("stats")["total_connections_received"] == connections  # no connection, no byte
    assert client.get("pwned") is None
    assert "FLUSHALL" not in Path(decode[1]).read_text()  # nothing of the forged id in D's log either


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
