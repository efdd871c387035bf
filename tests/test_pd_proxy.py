"""examples/pd_proxy.py passes only the prefill instance's kv_transfer_params to the decode instance: a
client's own params (which could name any host for the decode instance to connect to) never get through, also
when the prefill call fails (issue 30 #1). Real processes and sockets: the proxy, a dead prefill port and a
stand-in decode instance that records what it is sent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lmcache_vllm.integration.vllm.testing.openai_server import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FORGED = {"do_remote_prefill": True, "remote_host": "10.9.8.7", "remote_port": 6379,
          "remote_request_id": "x\r\nFLUSHALL", "tp_size": 1, "lmcache_vllm": {"version": 3, "ports": [6379]}}


class Recorder(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        Recorder.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        answer = json.dumps({"choices": [{"text": "ok"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def run_proxy(tmp_path: Path, prefill_port: int, decode_port: int, env: dict | None = None):
    """examples/pd_proxy.py in front of one prefill and one decode port: (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--port", str(port),
           "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill_port),
           "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode_port)]
    log = open(tmp_path / "proxy.log", "w")
    proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/healthcheck", timeout=2).close()
            return proxy, base
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                proxy.kill()
                raise AssertionError((tmp_path / "proxy.log").read_text()) from None
            time.sleep(0.3)


def post(base: str, body: dict) -> dict:
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_a_clients_own_params_never_reach_the_decode_instance(tmp_path):
    decode = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=decode.serve_forever, daemon=True).start()
    Recorder.bodies = []
    # nothing listens on the prefill port: the prefill fails
    proxy, base = run_proxy(tmp_path, free_port(), decode.server_address[1])
    try:
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": FORGED}
        assert post(base, body)["choices"][0]["text"] == "ok"
        (sent,) = Recorder.bodies
        assert "kv_transfer_params" not in sent and sent["prompt"] == [1, 2, 3]
        with urllib.request.urlopen(f"{base}/healthcheck", timeout=5) as health:
            assert json.loads(health.read())["prefill_failures"] == 1
    finally:
        proxy.kill()
        proxy.wait(10)
        decode.shutdown()


def test_with_the_fleets_key_the_proxy_authorizes_its_prefill_requests(tmp_path):
    """Issue 39 #4: a prefill instance without explicit PD holds only for a proxy holding the key."""
    from lmcache_vllm.integration.vllm.pd.params import proxy_authorized
    from lmcache_vllm.storage.codec import ChunkMac

    both = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)  # stands in for the prefill and the decode instance
    threading.Thread(target=both.serve_forever, daemon=True).start()
    Recorder.bodies = []
    key = "the-fleet-key-0123456789abcdef"
    proxy, base = run_proxy(tmp_path, both.server_address[1], both.server_address[1],
                            env={**os.environ, "LMCACHE_VLLM_CHUNK_MAC_KEY": f"{key},an-older-key-0123456789ab"})
    try:
        post(base, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
        prefill, decode = Recorder.bodies
        assert prefill["max_tokens"] == 1 and proxy_authorized(prefill["kv_transfer_params"], ChunkMac(key)) is True
        assert proxy_authorized(prefill["kv_transfer_params"], ChunkMac("another-key-0123456789abcdef")) is False
        assert "kv_transfer_params" not in decode  # the stand-in answered none
    finally:
        proxy.kill()
        proxy.wait(10)
        both.shutdown()
