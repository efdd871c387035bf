"""The disaggregated-prefill transfer with real sockets: a prefill side (`PeerHolds` + `TransferServer` over
its own arena) and a decode side (`StorageManager.prefetch(keys, peer=PeerTier(...))`), in this process or
with the prefill side in a child process that is killed mid-transfer. Frames are checked like any tier's
bytes; garbage, truncation, silence and refusals are counted misses, and holds never leak."""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.integration.vllm.testing.openai_server import free_port
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier, send_release
from lmcache_vllm.storage.transfer.holds import PeerHolds
from lmcache_vllm.storage.transfer.server import TransferServer, recv_request

CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def key(i: int, model: str = "m") -> str:
    return f"{model}@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def d_config(**kw) -> LMCacheConfig:
    kw.setdefault("max_local_cpu_size", 32 * MiB / (1 << 30))
    return LMCacheConfig(blocking_timeout_secs=5.0, extra_config={"close_drain_secs": 1.0}, **kw)


class Prefill:
    """The prefill side: an arena, holds and a transfer server on loopback."""

    def __init__(self, lease_s: float = 30.0, mac: ChunkMac | None = None, grace_s: float = 0.2,
                 arena_bytes: int = 32 * MiB, max_held_bytes: int = 0, **server):
        self.arena = HostAllocator(arena_bytes)
        self.holds = PeerHolds(lease_s, mac=mac, max_bytes=max_held_bytes)
        self.server = TransferServer(self.holds, host="127.0.0.1", port=0, mac=mac, unknown_grace_s=grace_s,
                                     **server)

    def hold(self, req_id: str, tensors: list[torch.Tensor], keys: list[str] | None = None) -> list[str]:
        keys = keys or [key(i) for i in range(len(tensors))]
        objs = []
        for t in tensors:
            obj = self.arena.allocate(t.shape, t.dtype)
            obj.tensor.copy_(t)
            objs.append(obj)
        self.holds.expect(req_id)
        self.holds.fill(req_id, keys, objs)
        return keys

    def source(self, req_id: str) -> PeerSource:
        return PeerSource("127.0.0.1", self.server.port, req_id, "loopback")

    def close(self) -> None:
        self.server.close()
        self.holds.close()
        # every held chunk went back (a connection's thread still sending hands its references back as it ends:
        # `TransferServer.close` wakes it, it does not wait for it)
        assert wait_until(lambda: self.arena.used_bytes == 0), self.arena.used_bytes
        self.arena.close()


@pytest.fixture
def prefill():
    side = Prefill()
    yield side
    side.close()


def pull(mgr: StorageManager, keys: list[str], source: PeerSource, timeout_s: float = 2.0,
         mac: ChunkMac | None = None):
    """The decode side's prefetch with the peer in front; returns the chunks it holds (refs for the caller)."""
    handle = mgr.prefetch(keys, peer=PeerTier(source, timeout_s=timeout_s, mac=mac))
    handle.wait(20)
    return mgr.get(keys, owner=handle.owner, lower_tiers=False)


def assert_chunks(objs, tensors) -> None:
    assert len(objs) == len(tensors)
    for obj, t in zip(objs, tensors):
        assert torch.equal(obj.tensor, t)
        obj.ref_down()


def wait_until(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_pull_brings_every_held_chunk_verified_and_releases_the_hold(prefill, make_chunk):
    tensors = [make_chunk(i, CHUNK) for i in range(3)]
    keys = prefill.hold("r1", tensors)
    assert metrics.value("pd_holds") == 1
    with StorageManager(d_config()) as mgr:
        assert_chunks(pull(mgr, keys, prefill.source("r1")), tensors)
        assert mgr.contains(keys) == [True] * 3  # promoted into the decode side's L1
    assert wait_until(lambda: len(prefill.holds) == 0)  # the pull's RELEASE ended the hold
    label = "loopback"  # the scheduler's bounded label, not the host:port a client named
    assert metrics.value("pd_pulled_chunks", peer=label) == 3
    assert metrics.value("pd_pulled_bytes", peer=label) == 3 * tensors[0].numel() * 2
    assert metrics.value("pd_pull_seconds", peer=label) == 1
    assert metrics.value("chunk_hits", tier="peer") == 3
    assert metrics.value("pd_served_chunks") == 3
    assert metrics.value("pd_holds_released") == 1
    assert metrics.value("pd_holds") == 0
    assert metrics.value("pd_pull_failures", reason="missing") == 0


def test_pull_waits_for_a_hold_whose_saves_are_not_over(prefill, make_chunk):
    tensors = [make_chunk(i, CHUNK) for i in range(2)]
    keys = [key(i) for i in range(2)]
    prefill.holds.expect("r2")
    objs = []
    for t in tensors:
        obj = prefill.arena.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        objs.append(obj)
    threading.Timer(0.3, prefill.holds.fill, ("r2", keys, objs)).start()
    with StorageManager(d_config()) as mgr:
        assert_chunks(pull(mgr, keys, prefill.source("r2")), tensors)


def test_a_shorter_hold_serves_its_prefix_and_the_rest_comes_from_the_own_disk(prefill, make_chunk, tmp_path):
    tensors = [make_chunk(i, CHUNK) for i in range(3)]
    keys = [key(i) for i in range(3)]
    prefill.hold("r3", tensors[:2], keys[:2])
    cfg = d_config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    with StorageManager(cfg) as mgr:  # the third chunk is on this instance's disk only
        obj = mgr.allocate(CHUNK, torch.bfloat16)
        obj.tensor.copy_(tensors[2])
        mgr.put(keys[2], obj)
        obj.ref_down()
        assert mgr.flush(5)
        mgr.clear(lower_tiers=False)
    with StorageManager(cfg) as mgr:
        assert_chunks(pull(mgr, keys, prefill.source("r3")), tensors)
        assert metrics.value("chunk_hits", tier="peer") == 2
        assert metrics.value("chunk_hits", tier="local_disk") == 1
    assert metrics.value("pd_pull_failures", reason="missing") == 1


@pytest.mark.parametrize("case", ["unknown", "expired", "other_keys"])
def test_refusals_are_counted_misses_and_say_why(make_chunk, case, caplog):
    side = Prefill(lease_s=0.3 if case == "expired" else 30.0)
    try:
        tensors = [make_chunk(i, CHUNK) for i in range(2)]
        keys = [key(i) for i in range(2)]
        if case == "expired":
            side.holds.expect("r4")  # never filled: the decode instance came too late
            assert wait_until(lambda: len(side.holds) == 0)
        elif case == "other_keys":  # e.g. a prefill instance with another TP size or model fingerprint
            side.hold("r4", tensors, [key(i, model="other") for i in range(2)])
        with StorageManager(d_config()) as mgr, caplog.at_level("WARNING"):
            assert pull(mgr, keys, side.source("r4")) == []
        assert metrics.value("pd_pull_failures", reason="refused") == 1
        text = caplog.text
        assert {"unknown": "holds nothing", "expired": "expired", "other_keys": "other keys"}[case] in text
        if case == "other_keys":  # which part of the keys differs, never a key the prefill instance holds
            assert "differ in: model" in text and key(0, model="other") not in text
        if case == "expired":
            assert metrics.value("pd_holds_expired") == 1
    finally:
        side.close()


def test_mac_secrets_must_agree(make_chunk):
    tensors = [make_chunk(i, CHUNK) for i in range(2)]
    side = Prefill(mac=ChunkMac("secret"))
    try:
        keys = side.hold("a", tensors)
        side.hold("b", tensors)
        side.hold("c", tensors)
        with StorageManager(d_config()) as mgr:
            assert pull(mgr, keys, side.source("a"), mac=ChunkMac("other")) == []  # refused: auth
            assert pull(mgr, keys, side.source("b")) == []  # no secret at all
            assert metrics.value("pd_pull_failures", reason="refused") == 2
            assert_chunks(pull(mgr, keys, side.source("c"), mac=ChunkMac("secret")), tensors)
        side.holds.release("a")
        side.holds.release("b")
    finally:
        side.close()


def test_chunks_without_our_mac_are_rejected(prefill, make_chunk):
    """A prefill instance without the secret cannot feed a decode instance that has one."""
    tensors = [make_chunk(i, CHUNK) for i in range(2)]
    keys = prefill.hold("r5", tensors)
    with StorageManager(d_config()) as mgr:
        assert pull(mgr, keys, prefill.source("r5"), mac=ChunkMac("secret")) == []
    assert metrics.value("pd_pull_failures", reason="corrupt") == 1
    assert metrics.value("unauthenticated_chunks") == 1


class SilentPeer:
    """A TCP server that reads every request sent to it and never answers."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        with conn:
            try:
                while True:
                    self.requests.append(wire.parse_request(recv_request(conn)).op)
            except (OSError, wire.PeerProtocolError):
                return

    def close(self):
        self.listener.close()


def test_a_silent_peer_is_a_bounded_miss():
    peer = SilentPeer()
    try:
        with StorageManager(d_config()) as mgr:
            t0 = time.monotonic()
            assert pull(mgr, [key(0)], PeerSource("127.0.0.1", peer.port, "r6"), timeout_s=0.5) == []
            assert time.monotonic() - t0 < 3
        assert metrics.value("pd_pull_failures", reason="timeout") == 1
        # Done with it, the decode side still said so (RELEASE) after the PULL.
        assert wait_until(lambda: len(peer.requests) == 2)
        assert peer.requests == [wire.PULL, wire.RELEASE]
    finally:
        peer.close()


def test_an_unreachable_peer_is_a_counted_miss():
    port = free_port()  # nobody listens
    with StorageManager(d_config()) as mgr:
        assert pull(mgr, [key(0)], PeerSource("127.0.0.1", port, "r6b"), timeout_s=2.0) == []
    assert metrics.value("pd_pull_failures", reason="unreachable") == 1


def read_reply(sock: socket.socket) -> list[bytes]:
    """The parts of one reply message from a blocking socket (small parts only: no CHUNK payload)."""
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return buf
    count = wire.part_count(exactly(wire.COUNT_BYTES))
    lengths = wire.parse_lengths(exactly(8 * count), count, wire.MAX_SMALL_PART)
    return [exactly(n) for n in lengths]


def ask(port: int, payload: bytes) -> list[bytes]:
    """Sends raw bytes to a transfer server; the parts of its reply (or [] when it closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        try:
            return read_reply(sock)
        except (OSError, wire.PeerProtocolError):
            return []


def test_the_server_survives_garbage_and_answers_it(prefill, make_chunk):
    v3 = wire.PROTOCOL
    for garbage in ([b"x"], [v3, b"PULL"], [v3, b"PULL", b"", b"m@", b"\x01k", b""],
                    [v3, b"PULL", b"r", b"\xff\xfe@", b"\x01k", b""], [v3, b"NOPE", b"r", b"m@", b"\x01k", b""],
                    [v3, b"PULL", b"r", b"m@", b"\x02k", b""], [v3, b"PULL", b"r", b"m@", b"\x01@", b""],
                    [v3, b"RELEASE", b"r", b"m@", b"\x01k", b""], [b"LMVPD2", b"PULL", b"r", b"k", b""],
                    [b"LMVPD2", b"PULL", b"r", b"m@", b"\x01k", b""]):
        assert ask(prefill.server.port, wire.frame_bytes(garbage))[:3] == [v3, b"ERR", b"bad_request"], garbage
    # Not even framed: a part count or a length out of bounds is answered and the connection closed.
    assert ask(prefill.server.port, b"\xff" * 4)[:3] == [v3, b"ERR", b"bad_request"]
    too_long = struct.pack("<I6Q", 6, 6, 4, 1, 1, wire.MAX_KEYS * (wire.MAX_SUFFIX + 1) + 1, 0)
    assert ask(prefill.server.port, too_long)[:3] == [v3, b"ERR", b"bad_request"]
    assert metrics.value("pd_server_refusals", reason="bad_request") == 12
    tensors = [make_chunk(0, CHUNK)]
    keys = prefill.hold("r7", tensors)
    with StorageManager(d_config()) as mgr:
        assert_chunks(pull(mgr, keys, prefill.source("r7")), tensors)


def test_release_ends_a_hold_nobody_pulled(prefill, make_chunk):
    prefill.hold("r8", [make_chunk(0, CHUNK)])
    send_release(prefill.source("r8"))
    assert wait_until(lambda: len(prefill.holds) == 0)
    assert metrics.value("pd_holds_released") == 1


_CHILD = textwrap.dedent("""
    import sys, time, torch
    from lmcache_vllm.memory import HostAllocator
    from lmcache_vllm.storage.transfer.holds import PeerHolds
    from lmcache_vllm.storage.transfer.server import TransferServer
    n, shape = int(sys.argv[1]), (8, 2, 256, 512)  # 8 MiB of bf16 per chunk
    arena = HostAllocator(n * 8 * (1 << 20) + (1 << 20))
    holds = PeerHolds(60.0)
    objs = []
    for i in range(n):
        obj = arena.allocate(shape, torch.bfloat16)
        obj.tensor.fill_(i)
        objs.append(obj)
    holds.expect("big")
    holds.fill("big", [f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}" for i in range(n)], objs)
    server = TransferServer(holds, host="127.0.0.1", port=0)
    print(server.port, flush=True)
    time.sleep(600)
""")


def test_prefill_killed_mid_transfer_leaves_a_prefix_and_a_bounded_wait(tmp_path):
    n = 24
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(n)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        port = int(child.stdout.readline())
        cfg = d_config(max_local_cpu_size=(n * 8 + 8) * MiB / (1 << 30))
        with StorageManager(cfg) as mgr:
            first = threading.Event()
            real_alloc = mgr.l1.try_allocate

            def alloc(shape, dtype):  # the decode side's allocator, watched: the first chunk has arrived
                first.set()
                return real_alloc(shape, dtype)

            mgr.l1.try_allocate = alloc
            killer = threading.Thread(target=lambda: first.wait(30) and child.kill())
            killer.start()
            t0 = time.monotonic()
            keys = [key(i) for i in range(n)]
            objs = pull(mgr, keys, PeerSource("127.0.0.1", port, "big"), timeout_s=1.0)
            elapsed = time.monotonic() - t0
            killer.join()
            assert 1 <= len(objs) < n  # what arrived before the kill, verified; the rest a miss
            for i, obj in enumerate(objs):
                assert bool((obj.tensor == i).all())
                obj.ref_down()
            assert elapsed < 10
        assert metrics.value("pd_pull_failures", reason="unreachable") == 1  # its connection closed
    finally:
        child.kill()
        child.wait(10)


def test_nothing_to_pull_still_releases_the_hold(prefill, make_chunk):
    tensors = [make_chunk(i, CHUNK) for i in range(2)]
    keys = prefill.hold("r9", tensors)
    with StorageManager(d_config()) as mgr:
        assert_chunks(pull(mgr, keys, prefill.source("r9")), tensors)  # now in this instance's L1
        prefill.hold("r10", tensors)
        assert_chunks(pull(mgr, keys, prefill.source("r10")), tensors)  # from L1: the peer is not asked
    assert wait_until(lambda: len(prefill.holds) == 0)
    assert metrics.value("pd_served_chunks") == 2


# ---------------------------------------------------------------- what reaches a socket, what reaches a log
@pytest.mark.parametrize("host", ["localhost", "xn--zz.example", "\u00e9" * 70, "10.0.0.1:80", "", "[::1]"])
def test_a_source_is_an_address_and_a_checked_request_id(host):
    """Names are resolved (and checked against what D trusts) by the scheduler: a source never makes a
    thread look a name up (an IDNA error used to kill the one release thread)."""
    with pytest.raises(ValueError):
        PeerSource(host, 7000, "r")
    for req_id in ("r\r\nPING", "", "r" * 257, "r r"):
        with pytest.raises(ValueError):
            PeerSource("127.0.0.1", 7000, req_id)
    for port in (0, 65536, True):
        with pytest.raises(ValueError):
            PeerSource("127.0.0.1", port, "r")


def full_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listener whose accept queue is full: a connect to it hangs (its SYN is dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(listener.getsockname())
        except BlockingIOError:
            pass
        fillers.append(s)
    return listener, fillers


async def test_a_pull_cancelled_before_it_connected_still_releases(monkeypatch):
    import asyncio

    from lmcache_vllm.storage.transfer import client

    sent: list[PeerSource] = []
    monkeypatch.setattr(client, "send_release", lambda source, mac=None: sent.append(source))
    listener, fillers = full_listener()
    try:
        source = PeerSource("127.0.0.1", listener.getsockname()[1], "r-cancel", "loopback")
        task = asyncio.ensure_future(PeerTier(source, timeout_s=5.0).get_many([key(0)], lambda shape, dtype: None))
        await asyncio.sleep(0.3)  # connecting (the SYN waits for room in the accept queue)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sent == [source]  # the request was aborted: P may let its hold go now, not at its lease
    finally:
        for s in [listener, *fillers]:
            s.close()


def test_a_peers_error_text_is_escaped_in_the_log(caplog):
    """A fake prefill instance answers ERR with line breaks and terminal escapes: one log line, escaped."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            recv_request(conn)
            detail = "nope\r\n2026-01-01 WARNING forged line\x1b[2J"
            # A code we never send (`error_reply` builds only ours): what a lying peer can send.
            conn.sendall(wire.frame_bytes([wire.PROTOCOL, wire.ERR, b"evil\ncode", detail.encode()]))
            time.sleep(0.2)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with StorageManager(d_config()) as mgr, caplog.at_level("WARNING"):
            assert pull(mgr, [key(0)], PeerSource("127.0.0.1", listener.getsockname()[1], "r9")) == []
        refused = [r.getMessage() for r in caplog.records if "refused request" in r.getMessage()]
        assert len(refused) == 1 and "\n" not in refused[0] and "\r" not in refused[0] and "\x1b" not in refused[0]
        assert "forged line" in refused[0]  # shown, escaped
    finally:
        thread.join(5)
        listener.close()
