"""The control channel from the management API to every worker rank (`integration/vllm/control.py`), over its real
ZMQ sockets: a worker half started with the management API on serves its rank's calls beside its lookups, the
instance API reaches it through the sockets, a rank that is gone is a bounded `ControlUnavailable` (a 503), and
garbage on the socket never stops the server."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import zmq
from management_helpers import MODEL, TOKEN, call
from test_engine import BLOCK, CHUNK, make_caches, make_engine, slots_for, worker_config

pytest.importorskip("vllm")  # the worker half lives in the vLLM integration

from lmcache_vllm.integration.vllm.control import ControlClient, ControlServer, control_address  # noqa: E402
from lmcache_vllm.integration.vllm.lookup import lookup_socket_path  # noqa: E402
from lmcache_vllm.integration.vllm.worker import WorkerHalf  # noqa: E402
from lmcache_vllm.management.control import ControlUnavailable  # noqa: E402
from lmcache_vllm.management.http import ServerThread  # noqa: E402
from lmcache_vllm.management.instance import InstanceApi  # noqa: E402


def test_the_instance_api_reaches_a_worker_rank_through_its_control_socket(tmp_path):
    engine = make_engine()
    caches = make_caches(True)
    address = lookup_socket_path("mgmt", 0, str(tmp_path))
    worker = WorkerHalf(worker_config(engine), engine_factory=lambda _: engine, block_size=BLOCK,
                        lookup_address=address, management=True)
    worker.register_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)})
    client = ControlClient([control_address(address)], direct=False)
    api = InstanceApi(client, world_size=1, token=TOKEN.encode(), instance_id="w", model_names=[MODEL])
    server = ServerThread(api.app, "127.0.0.1", 0, "mgmt")
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert control_address(address).endswith("control-" + address.rsplit("lookup-", 1)[1])
        tokens = list(range(300, 300 + 2 * CHUNK))
        engine.store(np.asarray(tokens), caches, slots_for(len(tokens), seed=1))
        status, got = call(base, "POST", "/cache/lookup", {"token_ids": tokens, "model_name": MODEL})
        assert status == 200 and [r["placements"][0]["tier"] for r in got["results"]] == ["l1", "l1"]
        assert call(base, "POST", "/cache/clear", {"tier": "l1"})[0] == 200
        assert engine.lookup(tokens) == 0
    finally:
        server.stop()
        api.close()
        worker.shutdown()
    with pytest.raises(ControlUnavailable, match="did not answer"):
        ControlClient([control_address(address)], direct=False).call("info", {}, timeout=0.3)


def test_garbage_on_the_control_socket_never_stops_the_server(tmp_path):
    address = control_address(lookup_socket_path("junk", 0, str(tmp_path)))
    server = ControlServer(address, lambda op, body: {"op": op, "body": body})
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for frames in ([b"x"], [b"12345678", b"op"], [b"short", b"op", b"{}"], [b"\0" * 8, b"op", b"{}", b"more"]):
            sock.send_multipart(frames)  # not calls: nobody answered
        sock.send_multipart([b"\1" * 8, b"op", b"[1, 2]"])
        sock.send_multipart([b"\2" * 8, b"op", b"{not json"])
        sock.send_multipart([b"\3" * 8, b"op", b"[" * 100_000])
        replies = [sock.recv_multipart() for _ in range(3)]
        assert [json.loads(r[1])["error"] for r in replies] == ["bad_call"] * 3
        client = ControlClient([address], direct=False)
        assert client.call("echo", {"a": 1}, timeout=5.0) == [{"op": "echo", "body": {"a": 1}}]
        client.close()
    finally:
        sock.close()
        server.close()


def test_an_answer_that_came_too_late_is_not_taken_for_the_next_one(tmp_path):
    address = control_address(lookup_socket_path("slow", 0, str(tmp_path)))
    delays = [0.6, 0.0]

    def slow(op: str, body: dict) -> dict:
        time.sleep(delays.pop(0))
        return {"call": body["n"]}

    server = ControlServer(address, slow)
    client = ControlClient([address], direct=False)
    try:
        with pytest.raises(ControlUnavailable):
            client.call("x", {"n": 1}, timeout=0.2)
        assert client.call("x", {"n": 2}, timeout=5.0) == [{"call": 2}]
    finally:
        client.close()
        server.close()
