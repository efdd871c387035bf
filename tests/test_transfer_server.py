"""What anyone who reaches a prefill instance's transfer port can make it spend, with real sockets: a request
is bounded part by part before a byte of it is kept (a 32 MiB message grows the server process by far less
than 16 MiB), a peer that sends nothing or trickles a byte now and then is dropped at the request deadline,
80 idle connections cannot shut out a real pull (the idlest is closed to make room; only slots that all
serve pulls refuse), the listener works with file descriptors above 1024 (selectors, not select) and keeps
expiring holds, a slow reader cannot keep chunks pinned past the hold's lease, duplicate keys and requests
without the MAC are refused. Every refusal is counted in pd_server_refusals."""
from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from test_transfer import CHUNK, ROOT, MiB, Prefill, assert_chunks, d_config, key, pull, read_reply, wait_until

from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.transfer import wire

BIG = (8, 2, 256, 256)  # 2 MiB of bf16


@pytest.fixture
def prefill():
    side = Prefill()
    yield side
    side.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the other end closed `sock` within `timeout` (what it sent before is skipped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ---------------------------------------------------------------- memory before authentication
_RSS_CHILD = textwrap.dedent("""
    import sys, time
    from lmcache_vllm.storage.transfer.holds import PeerHolds
    from lmcache_vllm.storage.transfer.server import TransferServer
    server = TransferServer(PeerHolds(60.0), host="127.0.0.1", port=0, unknown_grace_s=0.1)
    print(server.port, flush=True)
    sys.stdin.read()
""")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _send_all(port: int, prefix: bytes, body_bytes: int) -> None:
    """A message's prefix, then `body_bytes` of key-like bytes, as fast as the server takes them."""
    block = b"0123456789abcdef\n" * 3855  # ~64 KiB
    with connect(port) as sock:
        try:
            sock.sendall(prefix)
            left = body_bytes
            while left > 0:
                sock.sendall(block[:left])
                left -= len(block)
            sock.shutdown(socket.SHUT_WR)
            closed_by_peer(sock, 10)
        except OSError:
            pass  # refused and closed before the body was all sent: what a bound should do


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_a_32_mib_message_before_authentication_grows_the_server_by_less_than_16_mib():
    child = subprocess.Popen([sys.executable, "-c", _RSS_CHILD], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        port = int(child.stdout.readline())
        with connect(port) as sock:  # warm: one real request answered
            sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, "warm", [key(0)])))
            assert read_reply(sock)[2] == b"unknown"
        before = _peak_rss(child.pid)
        body = 32 * MiB - 64  # a 32 MiB message
        # As one part of five (what a transfer server of protocol 2 took), and as the keys of a request.
        _send_all(port, struct.pack("<I5Q", 5, 6, 4, 1, body, 0), body)
        _send_all(port, struct.pack("<I6Q", 6, 6, 4, 1, 2, body, 0), body)
        # The largest request the bounds allow: MAX_KEYS keys with 64-character digests, for no hold.
        keys = [f"m@-@tp1.0@pp1.0@bfloat16@v3@{i:064x}" for i in range(wire.MAX_KEYS)]
        largest = wire.frame_bytes(wire.encode_request(wire.PULL, "nobody", keys))
        assert len(largest) <= wire.MAX_REQUEST_BYTES < 5 * MiB
        with connect(port) as sock:
            sock.sendall(largest)
            assert read_reply(sock)[2] == b"unknown"
        grown = _peak_rss(child.pid) - before
        assert grown < 16 * MiB, f"the server's peak RSS grew by {grown / MiB:.1f} MiB"
    finally:
        child.kill()
        child.wait(10)


def test_a_request_is_refused_at_its_prefix_when_a_part_breaks_its_bound(prefill):
    t0 = time.monotonic()
    with connect(prefill.server.port) as sock:  # 52 bytes say 32 MiB of keys: nothing more is read
        sock.sendall(struct.pack("<I6Q", 6, 6, 4, 1, 2, 32 * MiB, 0))
        assert read_reply(sock)[:3] == [wire.PROTOCOL, wire.ERR, b"bad_request"]
        assert closed_by_peer(sock, 2)
    assert time.monotonic() - t0 < 2
    assert metrics.value("pd_server_refusals", reason="bad_request") == 1


# ---------------------------------------------------------------- slots and deadlines
def test_idle_and_trickling_peers_are_dropped_at_the_request_deadline(make_chunk):
    side = Prefill(request_timeout_s=0.5)
    stop = threading.Event()
    try:
        idle, trickle = connect(side.server.port), connect(side.server.port)
        request = wire.frame_bytes(wire.encode_request(wire.PULL, "r", [key(0)]))

        def send_slowly() -> None:  # a byte every 0.1 s for 4 s: each recv gets one, the request never ends
            for byte in request[:40]:
                if stop.wait(0.1):
                    return
                try:
                    trickle.sendall(bytes([byte]))
                except OSError:
                    return

        sender = threading.Thread(target=send_slowly)
        sender.start()
        t0 = time.monotonic()
        assert closed_by_peer(idle, 2) and closed_by_peer(trickle, 2)
        assert time.monotonic() - t0 < 2
        stop.set()
        sender.join()
        assert metrics.value("pd_server_refusals", reason="idle") == 1
        assert metrics.value("pd_server_refusals", reason="timeout") == 1
        idle.close()
        trickle.close()
        # The server still serves.
        tensors = [make_chunk(0, CHUNK)]
        keys = side.hold("r", tensors)
        with StorageManager(d_config()) as mgr:
            assert_chunks(pull(mgr, keys, side.source("r")), tensors)
    finally:
        stop.set()
        side.close()


def test_80_idle_connections_cannot_shut_out_a_real_pull(prefill, make_chunk):
    assert prefill.server.max_connections == 64
    idle = [connect(prefill.server.port) for _ in range(80)]
    try:
        time.sleep(0.3)
        tensors = [make_chunk(i, CHUNK) for i in range(3)]
        keys = prefill.hold("real", tensors)
        with StorageManager(d_config()) as mgr:
            assert_chunks(pull(mgr, keys, prefill.source("real")), tensors)
        assert metrics.value("pd_server_refusals", reason="evicted") >= 80 - 64 + 1
        assert metrics.value("pd_server_refusals", reason="busy") == 0
        assert metrics.value("pd_server_connections") <= 64
    finally:
        for sock in idle:
            sock.close()


def _stuck_pull(side: Prefill, req_id: str, keys: list[str]) -> socket.socket:
    """A PULL whose peer reads (almost) nothing: its send blocks in the kernel's full buffers."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", side.server.port))
    sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, req_id, keys)))
    return sock


def test_only_a_server_whose_every_slot_serves_a_pull_refuses_a_connection():
    side = Prefill(arena_bytes=64 * MiB, max_connections=1)
    try:
        keys = side.hold("slow", [torch.zeros(BIG, dtype=torch.bfloat16)] * 16)
        stuck = _stuck_pull(side, "slow", keys)
        assert wait_until(lambda: metrics.value("pd_server_connections") == 1)
        time.sleep(0.2)
        with connect(side.server.port) as sock:
            assert read_reply(sock)[:3] == [wire.PROTOCOL, wire.ERR, b"busy"]
        assert metrics.value("pd_server_refusals", reason="busy") == 1
        stuck.close()
    finally:
        side.close()


# ---------------------------------------------------------------- the listener
def test_the_listener_serves_and_expires_holds_with_file_descriptors_above_1024(make_chunk):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    filler = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            filler.append(fd)
            if fd >= 1024:
                break
        side = Prefill(lease_s=0.5)
        try:
            assert side.server._listener.fileno() > 1024
            side.holds.expect("never-pulled")
            tensors = [make_chunk(0, CHUNK)]
            keys = side.hold("r", tensors)
            with StorageManager(d_config()) as mgr:
                assert_chunks(pull(mgr, keys, side.source("r")), tensors)
            assert wait_until(lambda: len(side.holds) == 0, 3)  # the hold nobody pulled expired
            assert metrics.value("pd_holds_expired") == 1
        finally:
            side.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------- holds: lease, duplicates, auth
def test_a_slow_reader_cannot_keep_chunks_pinned_past_the_lease():
    side = Prefill(lease_s=1.0, arena_bytes=64 * MiB)
    stop = threading.Event()
    try:
        keys = side.hold("slow", [torch.ones(BIG, dtype=torch.bfloat16)] * 24)  # 48 MiB: more than buffers hold
        stuck = _stuck_pull(side, "slow", keys)

        def read_slowly() -> None:  # 4 KiB every 50 ms: each send makes progress, the pull never ends
            while not stop.wait(0.05):
                try:
                    if not stuck.recv(4096):
                        return
                except OSError:
                    return

        reader = threading.Thread(target=read_slowly)
        reader.start()
        # The hold's lease ends at 1 s: then neither the hold nor the send in flight keeps a chunk.
        assert wait_until(lambda: side.arena.used_bytes == 0, 3.0)
        assert metrics.value("pd_server_refusals", reason="lease") == 1
        assert closed_by_peer(stuck, 2)
        stop.set()
        reader.join()
        stuck.close()
    finally:
        stop.set()
        side.close()


def test_a_pull_naming_a_key_twice_is_refused(prefill, make_chunk):
    keys = prefill.hold("r", [make_chunk(i, CHUNK) for i in range(2)])
    with connect(prefill.server.port) as sock:
        sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, "r", [keys[0], keys[1], keys[0]])))
        reply = read_reply(sock)
    assert reply[:3] == [wire.PROTOCOL, wire.ERR, b"bad_request"] and b"repeats" in reply[3]
    assert metrics.value("pd_served_chunks") == 0
    assert len(prefill.holds) == 1  # the hold is untouched


def test_every_request_without_the_mac_is_refused_and_changes_nothing(make_chunk):
    side = Prefill(mac=ChunkMac("secret"))
    try:
        keys = side.hold("r", [make_chunk(0, CHUNK)])
        for mac in (None, ChunkMac("other")):
            with connect(side.server.port) as sock:  # RELEASE: not answered, not done
                sock.sendall(wire.frame_bytes(wire.encode_request(wire.RELEASE, "r", mac=mac)))
                assert closed_by_peer(sock, 2)
            with connect(side.server.port) as sock:
                sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, "r", keys, mac=mac)))
                assert read_reply(sock)[:3] == [wire.PROTOCOL, wire.ERR, b"auth"]
        assert len(side.holds) == 1 and metrics.value("pd_served_chunks") == 0
        assert metrics.value("pd_server_refusals", reason="auth") == 4
        with connect(side.server.port) as sock:
            sock.sendall(wire.frame_bytes(wire.encode_request(wire.RELEASE, "r", mac=ChunkMac("secret"))))
        assert wait_until(lambda: len(side.holds) == 0)
    finally:
        side.close()


def test_request_ids_from_the_network_are_logged_escaped(caplog):
    side = Prefill(mac=ChunkMac("secret"))
    forged = "r1\r\n2026-01-01 00:00:00 INFO lmcache_vllm: hold released\x1b[2J"
    try:
        with caplog.at_level("WARNING"):
            with connect(side.server.port) as sock:
                sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, forged, [key(0)], ChunkMac("other"))))
                assert read_reply(sock)[2] == b"auth"
        (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
        text = record.getMessage()
        assert "r1\\r\\n2026" in text and "\n" not in text and "\r" not in text and "\x1b" not in text
    finally:
        side.close()


def test_a_hold_over_the_cap_is_refused_and_its_pull_answered_at_once(make_chunk, caplog):
    tensors = [make_chunk(i, CHUNK) for i in range(2)]
    side = Prefill(max_held_bytes=tensors[0].numel() * 2, grace_s=2.0)  # one chunk's bytes
    try:
        keys = side.hold("first", tensors[:1])
        side.hold("second", tensors[1:], keys=[key(1)])  # would take the held bytes over the cap
        assert len(side.holds) == 1 and metrics.value("pd_holds_refused") == 1
        assert not side.holds.expect("third")  # at the cap: refused when registered
        t0 = time.monotonic()
        with StorageManager(d_config()) as mgr, caplog.at_level("WARNING"):
            assert pull(mgr, [key(1)], side.source("second")) == []
            assert time.monotonic() - t0 < 1.5  # ERR full at once, not after a wait
            assert metrics.value("pd_pull_failures", reason="refused") == 1
            assert "pd_max_held_bytes" in caplog.text
            assert_chunks(pull(mgr, keys, side.source("first")), tensors[:1])  # what is held still serves
        assert metrics.value("pd_holds_refused") == 2
        assert wait_until(lambda: side.holds.held_bytes == 0)
        assert side.holds.expect("fourth")  # room again
        side.holds.release("fourth")
    finally:
        side.close()


# ---------------------------------------------------------------- any byte stream (tests/test_fuzz_transfer_wire.py
# sends many more)
def refused_by_protocol(data: bytes) -> bool:
    """Whether a transfer server must refuse `data` (sent, then the connection closed for writing): some
    message in it is malformed, breaks a bound, or is left incomplete."""
    reader, i = wire.RequestReader(), 0
    while i < len(data):
        n = min(reader.want(), len(data) - i)
        try:
            parts = reader.feed(data[i:i + n])
            i += n
            if parts is not None:
                wire.parse_request(parts)
                reader = wire.RequestReader()
        except wire.PeerProtocolError:
            return True
    return reader.started


def refusals() -> float:
    return sum(metrics.value("pd_server_refusals", reason=r) for r in (
        "bad_request", "auth", "busy", "evicted", "idle", "timeout", "incomplete", "lease", "stalled"))


def probe(port: int, data: bytes) -> None:
    """Sends `data` to a transfer server and checks how it ends: every reply is a reply of the protocol, the
    server closes the connection, a refusal is counted exactly when the bytes call for one, and no slot or
    buffered byte stays taken."""
    before = refusals()
    with connect(port) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # refused and closed while we sent
        sock.settimeout(5)
        try:
            while True:
                reply = wire.parse_reply(read_reply(sock))
                assert reply.kind == wire.ERR and reply.code in ("bad_request", "unknown"), reply
        except (ConnectionError, OSError):
            pass  # closed: the end of every stream
    assert wait_until(lambda: metrics.value("pd_server_connections") == 0, 5), "a connection stayed open"
    if refused_by_protocol(data):
        assert refusals() > before, f"no counted refusal for {data[:80]!r}"
    else:
        assert refusals() == before, f"a refusal for valid requests {data[:80]!r}"


def streams() -> list[bytes]:
    """Fixed byte streams: valid requests, each truncated and with a byte flipped, and random bytes."""
    valid = [wire.frame_bytes(wire.encode_request(wire.PULL, "nobody", [key(i) for i in range(3)])),
             wire.frame_bytes(wire.encode_request(wire.RELEASE, "nobody"))]
    out = [valid[0], valid[1], valid[1] + valid[0], b"", b"\x00" * 4, b"\x06\x00\x00\x00" + b"\xff" * 48]
    for message in valid:
        out += [message[:cut] for cut in (1, 4, 20, 52, len(message) - 1)]
        for pos in (0, 4, 12, 52, 58, len(message) - 1):
            flipped = bytearray(message)
            flipped[pos] ^= 0x41
            out.append(bytes(flipped))
    gen = torch.Generator().manual_seed(30)
    out += [bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).tolist()) for n in (3, 52, 200)]
    return out


def test_byte_streams_end_in_an_answer_or_a_counted_refusal(make_chunk):
    side = Prefill(grace_s=0.05)
    try:
        tensors = [make_chunk(i, CHUNK) for i in range(2)]
        keys = side.hold("real", tensors)
        for data in streams():
            probe(side.server.port, data)
        assert side.server._buffered == 0 and len(side.holds) == 1  # nothing reserved, the real hold untouched
        with StorageManager(d_config()) as mgr:
            assert_chunks(pull(mgr, keys, side.source("real")), tensors)
    finally:
        side.close()


# ---------------------------------------------------------------- parked pulls and FETCH (issue 39 #5)
def _parked_pull(port: int, req_id: str, n_keys: int) -> socket.socket:
    """A well-formed PULL of `n_keys` keys (64-character digests) for a request id the server does not know:
    it parks, waiting for a hold that never comes."""
    keys = [f"m@-@tp1.0@pp1.0@bfloat16@v3@{i:064x}" for i in range(n_keys)]
    sock = connect(port)
    sock.sendall(wire.frame_bytes(wire.encode_request(wire.PULL, req_id, keys)))
    return sock


def test_parked_pulls_count_against_the_request_buffer():
    """Before, a PULL parked on an unknown request id gave its bytes back when it was parsed: 64 slots of ~4 MB
    requests held ~270 MB outside max_request_buffer. Now a parked pull keeps them, and the longest parked is
    closed when the requests being read or parked would pass the buffer."""
    side = Prefill(grace_s=30.0, max_request_buffer=wire.MAX_REQUEST_BYTES)
    socks = []
    try:
        n = wire.MAX_KEYS * 2 // 5  # ~1.7 MB each: two fit into the buffer, a third does not
        for i in range(3):
            socks.append(_parked_pull(side.server.port, f"parked{i}", n))
            time.sleep(0.3)  # read, parsed and parked
        assert closed_by_peer(socks[0], 3)  # the longest parked made room
        assert not closed_by_peer(socks[2], 0.3)
        assert metrics.value("pd_server_refusals", reason="evicted") == 1
        assert side.server._buffered <= side.server.max_request_buffer
    finally:
        for sock in socks:
            sock.close()
        side.close()
    assert side.server._buffered == 0  # every parked pull's bytes went back


def test_a_fetch_naming_a_key_twice_is_refused_and_sends_nothing(make_chunk):
    """Before, a FETCH of one key repeated 65,536 times (a 2 MB request) was answered with the chunk 65,536
    times (and, with p2p_serve_disk, read from disk again for each)."""
    from lmcache_vllm.storage.transfer.keyed import KeyedChunks

    side = Prefill()
    tensors = [make_chunk(0, CHUNK)]
    held = side.hold("unused", tensors)
    got: list[str] = []

    def get(k: str):
        got.append(k)
        obj = side.holds.checkout("unused", [k]).objs
        return obj[0] if obj else None

    keyed = KeyedChunks(get, mac=None, trusted=lambda host: True)
    side.server.close()
    side.server = type(side.server)(side.holds, host="127.0.0.1", port=0, by_key=keyed.checkout)
    try:
        with connect(side.server.port) as sock:
            sock.sendall(wire.frame_bytes(wire.encode_request(wire.FETCH, "peer", [held[0]] * 1000)))
            assert read_reply(sock)[:3] == [wire.PROTOCOL, wire.ERR, b"bad_request"]
        assert got == [held[0]]  # the repeat was refused before it was looked up again
        assert metrics.value("pd_server_refusals", reason="bad_request") == 1
        assert metrics.value("p2p_served_chunks") == 0
        with StorageManager(d_config()) as mgr:  # a well-formed FETCH is still served
            source = side.source("peer")
            from dataclasses import replace

            assert_chunks(pull(mgr, held, replace(source, op=wire.FETCH)), tensors)
    finally:
        side.close()
