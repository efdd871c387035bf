"""The P2P operations tools: `lmcache-vllm inspect --p2p URL` on a real directory (one server and a Redis
Cluster), and examples/p2p_proxy.py sending requests round robin to real HTTP backends, skipping a dead one."""
from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import p2p_helpers as h
from redis_servers import free_port

from lmcache_vllm import cli


def test_inspect_lists_instances_and_their_entries(redis_server, redis_prefix, capsys):
    redis_server.ensure_running()
    url = redis_server.url
    with h.manager(url, redis_prefix, "A", rank=0, tp=2) as a0, h.manager(url, redis_prefix, "A", rank=1, tp=2) as a1, \
            h.manager(url, redis_prefix, "B") as b:
        h.store(a0, [h.key(i, tp="tp2.0") for i in range(3)])
        h.store(a1, [h.key(i, tp="tp2.1") for i in range(3)])
        h.store(b, [h.key(i) for i in range(5)])
        for mgr, n in ((a0, 3), (a1, 3), (b, 5)):
            h.wait_until(lambda mgr=mgr, n=n: h.entries(url, redis_prefix, mgr) == n)
        assert cli.main(["inspect", "--p2p", url, "--prefix", redis_prefix, "--json"]) == cli.EXIT_OK
        listing = json.loads(capsys.readouterr().out)
        by_instance = {i["instance"]: i for i in listing["instances"]}
        assert {k: v["entries"] for k, v in by_instance.items()} == {"A": 6, "B": 5}
        assert sorted(s["rank"] for s in by_instance["A"]["servers"]) == [0, 1]
        assert listing["entries"] == 11 and 0 < listing["bytes_per_entry"]
        assert cli.main(["inspect", "--p2p", url, "--prefix", redis_prefix]) == cli.EXIT_OK
        text = capsys.readouterr().out
        assert "2 instance(s), 11 entries" in text and f"{h.p2p_tier(b).info.host}:{h.p2p_tier(b).info.port}" in text


def test_inspect_a_directory_on_a_cluster(redis_cluster, redis_prefix, capsys):
    with h.manager(redis_cluster.url, redis_prefix, "A") as a:
        h.store(a, [h.key(i) for i in range(4)])
        h.wait_until(lambda: h.entries(redis_cluster.url, redis_prefix, a) == 4)
        assert cli.main(["inspect", "--p2p", redis_cluster.url, "--prefix", redis_prefix, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["entries"] == 4


def test_inspect_an_unreachable_directory_exits_with_one_line(capsys):
    assert cli.main(["inspect", "--p2p", f"redis://127.0.0.1:{free_port()}", "--timeout", "0.5"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err.count("\n") == 1


class _Backend(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        answer = json.dumps({"port": self.server.server_address[1], "echo": json.loads(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_round_robin_proxy_alternates_and_skips_a_dead_instance(tmp_path):
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    # The dead instance's port stays bound, never listening (a connection is refused), for the whole test: a
    # port only looked up could come back from the next free_port() as the proxy's own (seen in a CI run:
    # the proxy then forwarded the dead one's turns to itself, a turn more each time).
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.bind(("127.0.0.1", 0))
    dead = reserved.getsockname()[1]
    backends = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers] + [f"http://127.0.0.1:{dead}"]
    port = free_port()
    proxy = subprocess.Popen([sys.executable, str(h.ROOT / "examples" / "p2p_proxy.py"), "--port", str(port),
                              "--backends", *backends], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        h.wait_until(lambda: _reachable(port), timeout=30, what="the proxy")
        ports = [_post(port, {"n": i})["port"] for i in range(6)]
        first, second = (s.server_address[1] for s in servers)
        assert ports == [first, second, first] * 2  # the dead third's turn goes on to the next instance
        assert _post(port, {"n": 7})["echo"] == {"n": 7}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/proxy/health", timeout=5) as resp:
            assert json.loads(resp.read())["unreachable"][backends[2]] >= 2
    finally:
        proxy.kill()
        proxy.wait(10)
        for server in servers:
            server.shutdown()
        reserved.close()


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        time.sleep(0.1)
        return False


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())

