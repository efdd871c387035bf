"""examples/pd_proxy.py passes only the prefill instance's kv_transfer_params to the decode instance: a
client's own params (which could name any host for the decode instance to connect to) never get through, also
when the prefill call fails (issue 30 #1). Real processes and sockets: the proxy, a dead prefill port and a
stand-in decode instance that records what it is sent."""
from __future__ import annotations

import json
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
          "remote_request_id": "x\r\nFLUSHALL", "tp_size": 1, "lmcache_vllm": {"version": 2, "ports": [6379]}}


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


def test_a_clients_own_params_never_reach_the_decode_instance(tmp_path):
    decode = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=decode.serve_forever, daemon=True).start()
    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--port", str(port),
           "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(free_port()),  # nothing listens: it fails
           "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode.server_address[1])]
    log = open(tmp_path / "proxy.log", "w")
    proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthcheck", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
                time.sleep(0.3)
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": FORGED}
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read())["choices"][0]["text"] == "ok"
        (sent,) = Recorder.bodies
        assert "kv_transfer_params" not in sent and sent["prompt"] == [1, 2, 3]
        with urllib.request.urlopen(f"{base}/healthcheck", timeout=5) as health:
            assert json.loads(health.read())["prefill_failures"] == 1
    finally:
        proxy.kill()
        proxy.wait(10)
        decode.shutdown()
