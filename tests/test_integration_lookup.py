"""Lookup sockets between vLLM's scheduler and workers (real ZMQ over ipc:// in a temp dir)."""
from __future__ import annotations

import os
import shutil
import stat
import struct
import threading
import time

import numpy as np
import pytest
import zmq

from lmcache_vllm.extra_keys import NO_EXTRA_KEYS, ExtraKeys, ExtraSpan
from lmcache_vllm.integration.vllm.lookup import (
    LookupAnswer,
    LookupClient,
    LookupQuery,
    LookupServer,
    decode_tokens,
    encode_tokens,
    lookup_socket_path,
    private_socket_dir,
)
from lmcache_vllm.observability import metrics


def hit(end: int, start: int = 0, tiers: tuple = ()) -> LookupAnswer:
    return LookupAnswer(end, tiers or ("local_cpu",) * ((end - start + 255) // 256), start)


def query(tokens, req_id: str = "r", start: int = 0, extra=NO_EXTRA_KEYS) -> LookupQuery:
    return LookupQuery(req_id, np.asarray(tokens, dtype=np.int64), start, extra)


@pytest.fixture
def sock_dir(tmp_path_factory):
    # Short path: unix socket names are limited to ~107 bytes.
    import tempfile
    d = tempfile.mkdtemp(prefix="lk")
    yield d
    shutil.rmtree(d)


def test_tokens_roundtrip_as_int64():
    ids = [0, 1, 4095, 2**40]
    assert decode_tokens(encode_tokens(ids)).tolist() == ids
    with pytest.raises(ValueError):
        decode_tokens(b"\x00" * 7)


def test_socket_path_is_per_instance_and_rank(sock_dir):
    a0 = lookup_socket_path("engine-a", 0, sock_dir)
    assert a0 != lookup_socket_path("engine-a", 1, sock_dir)
    assert a0 != lookup_socket_path("engine-a", 0, sock_dir, pp_rank=1)  # PP stages never share a socket
    assert a0 == lookup_socket_path("engine-a", 0, sock_dir, pp_rank=0)
    assert a0 != lookup_socket_path("engine-b", 0, sock_dir)
    assert a0 == lookup_socket_path("engine-a", 0, sock_dir)
    long_dir = "/" + "x" * 120
    assert len(lookup_socket_path("e", 0, long_dir)) <= 110  # falls back to a short directory


def test_client_gets_servers_answer_and_minimum_over_ranks(sock_dir):
    seen = []
    s0 = LookupServer(lookup_socket_path("e", 0, sock_dir),
                      lambda q: (seen.append((q.req_id, q.start, q.token_ids.tolist(), q.extra)), hit(512))[1])
    s1 = LookupServer(lookup_socket_path("e", 1, sock_dir), lambda q: hit(512, tiers=("local_cpu", "local_disk")))
    client = LookupClient([s0.address, s1.address], timeout_ms=2000, direct=False)
    try:
        result = client.lookup(query(range(600), "req-7", start=128))
        assert (result.start, result.hit_tokens) == (0, 512)
        # rank 1 has half of it on disk only: the combined answer needs the slower tier
        assert result.chunk_tiers == ("local_cpu", "local_disk") and not result.in_l1
        extra = ExtraKeys(b"salt", (ExtraSpan(10, 20, b"mm:x"),))
        assert client.lookup(query(range(600), "req-8", extra=extra)).hit_tokens == 512
        assert seen == [("req-7", 128, list(range(600)), NO_EXTRA_KEYS), ("req-8", 0, list(range(600)), extra)]
        assert metrics.value("lookups_in_process") == 0
    finally:
        client.close()
        s0.close()
        s1.close()
    assert not os.listdir(os.path.dirname(s0.address[len("ipc://"):]))  # closing removes the sockets


def test_answer_wire_format_and_minimum_over_ranks():
    for answer in (LookupAnswer(0), hit(768, 256, ("local_cpu", "local_disk")), LookupAnswer(0, pending=True)):
        assert LookupAnswer.decode(answer.encode()) == answer
    assert LookupAnswer.minimum([hit(512), LookupAnswer(0, pending=True)]).pending
    assert LookupAnswer.minimum([hit(512, 256), hit(256, 0)]).hit_tokens == 0  # no run both ranks hold
    both = LookupAnswer.minimum([hit(512), hit(512, tiers=("local_cpu", "redis"))])
    assert both == LookupAnswer(512, ("local_cpu", "redis")) and not both.in_l1


def test_ready_answers_cross_the_wire_and_need_every_rank():
    read = LookupAnswer(512, ("local_cpu", "local_disk"), ready=True)
    for answer in (read, read._replace(ready=False), LookupAnswer(0, pending=True, ready=True)):
        assert LookupAnswer.decode(answer.encode()) == answer
    assert read.loads_now and not read._replace(ready=False).loads_now and hit(512).loads_now
    flags = len(read.encode()) - 2 - 1  # the flags byte, before the two tier codes
    unknown = bytearray(read.encode())
    unknown[flags] |= 0xFC  # bits no version sets are ignored
    assert LookupAnswer.decode(bytes(unknown)) == read
    assert LookupAnswer.minimum([read, read]).ready
    assert not LookupAnswer.minimum([read, read._replace(ready=False)]).ready  # one rank still reads


def test_missing_or_slow_server_counts_as_zero_hits(sock_dir):
    client = LookupClient([lookup_socket_path("nobody", 0, sock_dir)], timeout_ms=50)
    try:
        t0 = time.monotonic()
        assert client.lookup(query([1, 2, 3])).hit_tokens == 0
        assert time.monotonic() - t0 < 1.0
        assert metrics.value("lookup_timeouts") == 1
    finally:
        client.close()

    release = threading.Event()

    def slow(q):
        release.wait(2)
        return hit(999)

    server = LookupServer(lookup_socket_path("slow", 0, sock_dir), slow)
    client = LookupClient([server.address], timeout_ms=100, direct=False)
    try:
        assert client.lookup(query([1])).hit_tokens == 0  # timed out
        release.set()
        time.sleep(0.2)  # the late answer arrives and must not be taken for the next question
        server._lookup_fn = lambda q: hit(7)
        assert client.lookup(query([1])).hit_tokens == 7
    finally:
        client.close()
        server.close()


def test_failing_lookup_and_malformed_requests_answer_safely(sock_dir):
    def broken(q):
        raise RuntimeError("storage down")

    server = LookupServer(lookup_socket_path("bad", 0, sock_dir), broken)
    client = LookupClient([server.address], timeout_ms=2000, direct=False)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        raw.send_multipart([b"garbage"])  # wrong frame count: an error reply, the server keeps serving
        assert raw.poll(2000)
        assert LookupAnswer.decode(raw.recv_multipart()[1]).hit_tokens == 0
        start = b"\x00" * 8
        for bad in ([b"\x01" * 8, b"r", start, b"\x00" * 5, b""],  # not whole int64s
                    [b"\x01" * 8, b"r", start, b"\x00" * 8, b"junk"],  # extra keys that do not parse
                    [b"\x01" * 8, b"\xff\xfe", start, b"\x00" * 8, b""]):  # request id not UTF-8
            raw.send_multipart(bad)  # answered as 0 hits
            assert raw.poll(2000)
            assert LookupAnswer.decode(raw.recv_multipart()[1]).hit_tokens == 0
        assert metrics.value("lookup_rejected") == 4
        assert client.lookup(query([1, 2])).hit_tokens == 0
    finally:
        raw.close()
        client.close()
        server.close()


def test_out_of_range_fields_get_an_error_reply_and_the_server_survives(sock_dir):
    """A start >= 2**63 (or beyond the tokens sent) used to raise struct.error in the server thread: the
    thread died and every later lookup timed out. Every field is checked; a bad one is answered 0 hits."""
    def like_the_worker(q):  # the worker answers from the chunk-aligned start it was asked about
        return LookupAnswer(len(q.token_ids), start=q.start // 256 * 256)

    server = LookupServer(lookup_socket_path("range", 0, sock_dir), like_the_worker)
    client = LookupClient([server.address], timeout_ms=2000, direct=False)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        tokens = encode_tokens(range(512))
        for start in (2**63, 2**64 - 1, 513):
            raw.send_multipart([b"\x02" * 8, b"r", struct.pack("<Q", start), tokens, b""])
            assert raw.poll(2000), f"no reply to start={start}"
            seq, payload = raw.recv_multipart()
            assert seq == b"\x02" * 8 and LookupAnswer.decode(payload).hit_tokens == 0
        assert metrics.value("lookup_rejected") == 3
        assert client.lookup(query(range(512), start=256)) == LookupAnswer(512, start=256)
        assert server._thread.is_alive()
    finally:
        raw.close()
        client.close()
        server.close()


def test_a_failing_answer_gets_an_error_reply_and_a_dead_loop_restarts(sock_dir, monkeypatch):
    huge = LookupAnswer(2**64)  # a lookup function's answer that does not fit the wire format
    server = LookupServer(lookup_socket_path("restart", 0, sock_dir), lambda q: huge,
                          commands={"big": lambda: 2**70})
    client = LookupClient([server.address], timeout_ms=2000, direct=False)
    try:
        assert client.lookup(query([1, 2])).hit_tokens == 0  # answered: 0 hits, not silence
        assert client.command("big") == [-1]
        # A fault outside any one message (here: sending the reply; real ones are ZMQ errors) ends the
        # serving loop: it is counted and the loop serves again.
        real_send = server._socket.send_multipart
        calls = []

        def send_once_fails(frames):
            calls.append(1)
            if len(calls) == 1:
                raise zmq.ZMQError(zmq.EFSM)
            real_send(frames)

        monkeypatch.setattr(server._socket, "send_multipart", send_once_fails)
        server._lookup_fn = lambda q: hit(7)
        assert client.lookup(query([1])).hit_tokens == 0  # its reply was lost: a timeout, one miss
        assert client.lookup(query([1])).hit_tokens == 7
        assert metrics.value("lookup_server_restarts") == 1 and server._thread.is_alive()
    finally:
        client.close()
        server.close()


def test_servers_in_the_same_process_are_called_directly(sock_dir):
    s0 = LookupServer(lookup_socket_path("local", 0, sock_dir), lambda q: hit(512))
    s1 = LookupServer(lookup_socket_path("local", 1, sock_dir),
                      lambda q: hit(int(q.token_ids[-1]) + len(q.extra.prefix)))
    client = LookupClient([s0.address, s1.address], timeout_ms=50)
    try:
        assert client.lookup(query(range(300))).hit_tokens == 299  # minimum over ranks, as over the sockets
        assert client.lookup(query(range(300), extra=ExtraKeys(b"ab"))).hit_tokens == 301  # extra keys reach it
        assert metrics.value("lookups_in_process") == 2
        s1._lookup_fn = lambda q: 1 // 0  # a failing lookup is 0 hits here too
        assert client.lookup(query([5])).hit_tokens == 0
        s1.close()  # a rank no longer local: the sockets are used (and time out here)
        assert client.lookup(query([5])).hit_tokens == 0
        assert metrics.value("lookups_in_process") == 3 and metrics.value("lookup_timeouts") == 1
    finally:
        client.close()
        s0.close()


def test_sockets_are_private_to_this_user(sock_dir):
    server = LookupServer(lookup_socket_path("priv", 0, sock_dir), lambda q: hit(1))
    try:
        path = server.address[len("ipc://"):]
        directory = os.path.dirname(path)
        assert os.path.dirname(directory) == sock_dir
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.stat(directory).st_uid == os.getuid()
    finally:
        server.close()
    # A directory of ours with a loose mode is tightened; a symlink or a file there is refused.
    loose = os.path.join(sock_dir, "loose")
    os.mkdir(loose, 0o755)
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(os.stat(private_socket_dir(loose)).st_mode) == 0o700
    os.symlink(loose, os.path.join(sock_dir, "link"))
    with pytest.raises(PermissionError):
        private_socket_dir(os.path.join(sock_dir, "link"))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a directory owned by another user")
def test_directory_of_another_user_is_refused(sock_dir):
    theirs = os.path.join(sock_dir, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match="not a directory owned"):
        private_socket_dir(theirs)


def test_frames_are_bounded(sock_dir):
    seen = []
    server = LookupServer(lookup_socket_path("bound", 0, sock_dir),
                          lambda q: seen.append(len(q.token_ids)) or hit(5), max_tokens=100)
    client = LookupClient([server.address], timeout_ms=1000, direct=False)
    try:
        assert client.lookup(query(range(100))).hit_tokens == 5
        assert client.lookup(query(range(101))).hit_tokens == 0  # more tokens than max_model_len: no lookup at all
        assert seen == [100] and metrics.value("lookup_rejected") == 1
        # A message over MAXMSGSIZE is never buffered: ZMQ drops the peer, the server keeps serving.
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        raw.send_multipart([b"\x01" * 8, b"r", b"\x00" * 8, b"\x00" * (8 << 20), b""])
        assert not raw.poll(300)
        raw.close()
        assert client.lookup(query(range(10))).hit_tokens == 5
    finally:
        client.close()
        server.close()


def test_tiers_of_the_hit_and_commands_cross_the_sockets(sock_dir):
    answers = {0: LookupAnswer(768, ("local_cpu", "local_disk", "local_cpu")),
               1: LookupAnswer(512, ("local_cpu", "redis"))}
    calls = []
    servers = [LookupServer(lookup_socket_path("tiers", r, sock_dir), lambda q, r=r: answers[r],
                            commands={"reset_l1": lambda r=r: calls.append(r) or 1})
               for r in (0, 1)]
    for direct in (False, True):
        client = LookupClient([s.address for s in servers], timeout_ms=2000, direct=direct)
        try:
            # The shortest hit; each chunk where the slowest rank holds it.
            assert client.lookup(query([1, 2, 3])) == LookupAnswer(512, ("local_cpu", "redis"))
            assert client.command("reset_l1") == [1, 1]
            assert client.command("no_such_command") == [-1, -1]
        finally:
            client.close()
    assert sorted(calls[:2]) == [0, 1] and calls[2:] == [0, 1]  # sockets: both ranks at once; direct: in order
    servers[1].close()  # a rank that does not answer: the command failed
    client = LookupClient([s.address for s in servers], timeout_ms=100, direct=False)
    try:
        assert client.command("reset_l1") is None
    finally:
        client.close()
        servers[0].close()
