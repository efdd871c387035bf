"""Lookup sockets between vLLM's scheduler and workers (real ZMQ over ipc:// in a temp dir)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from lmcache_vllm import metrics
from lmcache_vllm.integration.vllm.lookup import (
    LookupClient,
    LookupServer,
    decode_tokens,
    encode_tokens,
    lookup_socket_path,
)


@pytest.fixture
def sock_dir(tmp_path_factory):
    # Short path: unix socket names are limited to ~107 bytes.
    import tempfile
    d = tempfile.mkdtemp(prefix="lk")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def test_tokens_roundtrip_as_int64():
    ids = [0, 1, 4095, 2**40]
    assert decode_tokens(encode_tokens(ids)).tolist() == ids
    with pytest.raises(ValueError):
        decode_tokens(b"\x00" * 7)


def test_socket_path_is_per_instance_and_rank(sock_dir):
    a0 = lookup_socket_path("engine-a", 0, sock_dir)
    assert a0 != lookup_socket_path("engine-a", 1, sock_dir)
    assert a0 != lookup_socket_path("engine-b", 0, sock_dir)
    assert a0 == lookup_socket_path("engine-a", 0, sock_dir)
    long_dir = "/" + "x" * 120
    assert len(lookup_socket_path("e", 0, long_dir)) <= 110  # falls back to a short directory


def test_client_gets_servers_answer_and_minimum_over_ranks(sock_dir):
    seen = []
    s0 = LookupServer(lookup_socket_path("e", 0, sock_dir), lambda t: (seen.append(t.tolist()), 512)[1])
    s1 = LookupServer(lookup_socket_path("e", 1, sock_dir), lambda t: 256)
    client = LookupClient([s0.address, s1.address], timeout_ms=2000, direct=False)
    try:
        assert client.lookup(list(range(600))) == 256
        assert seen == [list(range(600))]
        assert metrics.value("lookups_in_process") == 0
    finally:
        client.close()
        s0.close()
        s1.close()
    assert not os.listdir(sock_dir)  # closing removes the socket files


def test_missing_or_slow_server_counts_as_zero_hits(sock_dir):
    client = LookupClient([lookup_socket_path("nobody", 0, sock_dir)], timeout_ms=50)
    try:
        t0 = time.monotonic()
        assert client.lookup([1, 2, 3]) == 0
        assert time.monotonic() - t0 < 1.0
        assert metrics.value("lookup_timeouts") == 1
    finally:
        client.close()

    release = threading.Event()

    def slow(tokens):
        release.wait(2)
        return 999

    server = LookupServer(lookup_socket_path("slow", 0, sock_dir), slow)
    client = LookupClient([server.address], timeout_ms=100, direct=False)
    try:
        assert client.lookup([1]) == 0  # timed out
        release.set()
        time.sleep(0.2)  # the late answer arrives and must not be taken for the next question
        server._lookup_fn = lambda tokens: 7
        assert client.lookup([1]) == 7
    finally:
        client.close()
        server.close()


def test_failing_lookup_and_malformed_requests_answer_safely(sock_dir):
    def broken(tokens):
        raise RuntimeError("storage down")

    server = LookupServer(lookup_socket_path("bad", 0, sock_dir), broken)
    client = LookupClient([server.address], timeout_ms=2000, direct=False)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        raw.send_multipart([b"garbage"])  # wrong frame count: ignored, server keeps serving
        raw.send_multipart([b"\x01" * 8, b"\x00" * 5])  # not whole int64s: answered as 0 hits
        assert raw.poll(2000)
        assert raw.recv_multipart()[1] == (0).to_bytes(8, "little")
        assert client.lookup([1, 2]) == 0
    finally:
        raw.close()
        client.close()
        server.close()


def test_servers_in_the_same_process_are_called_directly(sock_dir):
    s0 = LookupServer(lookup_socket_path("local", 0, sock_dir), lambda t: 512)
    s1 = LookupServer(lookup_socket_path("local", 1, sock_dir), lambda t: int(t[-1]))
    client = LookupClient([s0.address, s1.address], timeout_ms=50)
    try:
        assert client.lookup(list(range(300))) == 299  # minimum over ranks, as over the sockets
        assert metrics.value("lookups_in_process") == 1
        s1._lookup_fn = lambda t: 1 // 0  # a failing lookup is 0 hits here too
        assert client.lookup([5]) == 0
        s1.close()  # a rank no longer local: the sockets are used (and time out here)
        assert client.lookup([5]) == 0
        assert metrics.value("lookups_in_process") == 2 and metrics.value("lookup_timeouts") == 1
    finally:
        client.close()
        s0.close()
