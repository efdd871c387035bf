"""P2P when something is wrong, with real processes and sockets: a directory that is down, frozen (SIGSTOP),
restarted empty or resharding (a 3-node Redis Cluster); a peer that answers garbage, another model's chunks
or nothing; MAC secrets that differ; untrusted peers. Each is a counted miss within a bounded time, never an
error, a hang or wrong bytes; a failing peer is skipped for a while and asked again after."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import p2p_helpers as h
import pytest
import torch
from redis.crc import key_slot
from redis_servers import Process, free_port, server_args

from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.p2p.directory import ServerInfo, chunk_id, chunks_key, info_key, servers_key
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.keyed import KeyedChunks
from lmcache_vllm.storage.transfer.server import recv_request


@pytest.fixture
def url(redis_server) -> str:
    redis_server.ensure_running()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test only (it is frozen, killed or restarted)."""
    port = free_port()
    proc = Process(server_args(port, tmp_path / "redis"), port)
    proc.start()
    yield proc
    if proc.proc is not None and proc.alive:
        os.kill(proc.proc.pid, signal.SIGCONT)
    proc.kill()


def fake_listing(url: str, prefix: str, sid: str, port: int, keys: list[str], host: str = "127.0.0.1",
                 key_space: str = "m@-@tp1.0@pp1.0@bfloat16@v2") -> None:
    """Writes a server into the directory as a peer would (host:port holding `keys`)."""
    c = h.client(url)
    p = f"{prefix}p2p:"
    c.hset(info_key(p, sid), mapping=ServerInfo(sid, host, port, sid, 0, 1, frozenset({key_space})).mapping())
    c.sadd(chunks_key(p, sid), *[chunk_id(k) for k in keys])
    c.sadd(servers_key(p), sid)
    c.close()


class FakePeer:
    """A TCP server that reads one request per connection and answers `reply(request)` (raw bytes)."""

    def __init__(self, reply):
        self.reply = reply
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    request = wire.parse_request(recv_request(conn))
                    conn.sendall(self.reply(request, conn))
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.sock.close()


def test_a_directory_that_is_down_is_a_counted_miss_and_stalls_nothing(redis_prefix):
    with h.manager(f"redis://127.0.0.1:{free_port()}", redis_prefix, "B") as b:
        t0 = time.monotonic()
        assert b.prefix_tiers([h.key(0)]) == []
        h.store(b, [h.key(1)])  # stores never wait on the directory
        assert time.monotonic() - t0 < 3
        assert metrics.value("p2p_lookup_failures", reason="error") == 1
        h.wait_until(lambda: metrics.value("p2p_directory_failures", op="advertise") >= 1)


def test_a_frozen_directory_costs_at_most_the_lookup_timeout(own_redis, redis_prefix, caplog):
    url = f"redis://127.0.0.1:{own_redis.port}"
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A") as a, \
            h.manager(url, redis_prefix, "B", p2p_lookup_timeout_secs=0.3) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        assert b.prefix_tiers(keys) == [Tier.P2P] * 2
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert b.prefix_tiers([h.key(5)]) == []
            assert time.monotonic() - t0 < 1.5
            assert metrics.value("p2p_lookup_failures", reason="timeout") == 1
            # the warning says where the lookup stood: in our directory's call, down to redis-py's read
            stalled = [r.getMessage() for r in caplog.records if "took longer than its bound" in r.getMessage()]
            assert len(stalled) == 1 and "directory.py" in stalled[0] and "pool: 1 in use" in stalled[0], stalled
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        h.wait_until(lambda: b.prefix_tiers(keys) == [Tier.P2P] * 2, what="lookups after the thaw")


def test_entries_come_back_after_the_directory_lost_them(own_redis, redis_prefix, tmp_path):
    url = f"redis://127.0.0.1:{own_redis.port}"
    keys = [h.key(i) for i in range(3)]
    with h.manager(url, redis_prefix, "A", p2p_lease_secs=1.5) as a:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 3)
        own_redis.kill()  # no persistence: it comes back empty
        own_redis.start()
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 3, timeout=10, what="the rewrite")


def test_lookups_survive_a_resharding_directory(make_cluster, redis_prefix):
    cluster = make_cluster()
    keys = [h.key(i) for i in range(3)]
    with h.manager(cluster.url, redis_prefix, "A") as a, h.manager(cluster.url, redis_prefix, "B") as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(cluster.url, redis_prefix, a) == 3)
        results: list = []
        stop = threading.Event()

        def look() -> None:
            while not stop.is_set():
                results.append(b.prefix_tiers(keys))
                b.l1.clear_sync()

        looker = threading.Thread(target=look)
        looker.start()
        slot = key_slot(chunks_key(f"{redis_prefix}p2p:", h.p2p_tier(a).info.sid).encode())
        slot_map = cluster.wait_agreed()
        port = next(p for first, last, p in slot_map if first <= slot <= last)
        source = cluster.node_of_port(port)
        target = next(n for n in cluster.nodes if n is not source)
        try:  # every slot of the node holding A's chunk set moves, that set with them
            cluster.reshard(source, target, sum(last - first + 1 for first, last, p in slot_map if p == port))
        finally:
            stop.set()
            looker.join(30)
        assert next(p for first, last, p in cluster.wait_agreed() if first <= slot <= last) == target.port
        assert results and all(r in ([], [Tier.P2P] * 3) for r in results)  # a hit or a counted miss
        h.wait_until(lambda: h.get_all(b, keys) == [0.0, 1.0, 2.0], what="hits after the resharding")


@pytest.mark.parametrize("answer,reason", [
    (lambda req, conn: b"\x05\x00\x00\x00" + os.urandom(300), "corrupt"),
    (lambda req, conn: wire.frame_bytes(wire.chunk_reply(0, h.key(0, model="other"), torch.ones(h.CHUNK,
                                                          dtype=torch.bfloat16))), "corrupt"),
    (lambda req, conn: wire.frame_bytes(wire.error_reply(b"auth", "no")), "refused"),
])
def test_a_lying_peer_is_a_miss_and_skipped_for_a_while(url, redis_prefix, answer, reason):
    keys = [h.key(i) for i in range(2)]
    peer = FakePeer(answer)
    try:
        with h.manager(url, redis_prefix, "B", p2p_peer_backoff_secs=1.0, p2p_pull_timeout_secs=1.0) as b:
            fake_listing(url, redis_prefix, "liar.r0.000000", peer.port, keys)
            assert b.prefix_tiers(keys) == [Tier.P2P] * 2
            assert h.get_all(b, keys) == []
            assert metrics.value("p2p_pull_failures", reason=reason) == 1
            assert b.prefix_tiers(keys) == []  # backing off: not asked
            assert peer.connections == 1
            time.sleep(1.1)
            assert b.prefix_tiers(keys) == [Tier.P2P] * 2  # asked again after the backoff
    finally:
        peer.close()


def test_a_peer_killed_mid_pull_leaves_a_verified_prefix(url, redis_prefix):
    n, shape = 48, (8, 2, 256, 256)  # 96 MiB in 2 MiB chunks: far more than the sockets' buffers hold
    child, _sid = h.serve_in_child(url, redis_prefix, "A", n, lease_s=30.0, shape=shape)
    try:
        with h.manager(url, redis_prefix, "B", l1_mib=n * 2 + 8, p2p_pull_timeout_secs=2.0) as b:
            def kill_after_the_first_chunk() -> None:
                deadline = time.monotonic() + 30
                while not metrics.snapshot()["counters"].get("p2p_pulled_chunks") and time.monotonic() < deadline:
                    time.sleep(0.001)
                child.kill()

            killer = threading.Thread(target=kill_after_the_first_chunk)
            killer.start()
            keys = [h.key(i) for i in range(n)]
            t0 = time.monotonic()
            values = h.get_all(b, keys)
            killer.join()
            assert time.monotonic() - t0 < 10
            assert 1 <= len(values) < n and values == [float(i) for i in range(len(values))]
            assert metrics.value("p2p_pull_failures", reason="unreachable") == 1
    finally:
        child.kill()
        child.wait(10)


def test_a_silent_peer_costs_the_pull_timeout(url, redis_prefix):
    peer = FakePeer(lambda req, conn: time.sleep(5) or b"")
    try:
        with h.manager(url, redis_prefix, "B", p2p_pull_timeout_secs=0.5) as b:
            fake_listing(url, redis_prefix, "mute.r0.000000", peer.port, [h.key(0)])
            t0 = time.monotonic()
            assert h.get_all(b, [h.key(0)]) == []
            assert time.monotonic() - t0 < 3
            assert metrics.value("p2p_pull_failures", reason="timeout") == 1
    finally:
        peer.close()


def test_what_a_peer_no_longer_holds_is_withdrawn(url, redis_prefix):
    keys = [h.key(i) for i in range(3)]
    with h.manager(url, redis_prefix, "A") as a, h.manager(url, redis_prefix, "B") as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 3)
        h.p2p_tier(a).adverts.add(h.key(7))  # a stale entry: listed, not in L1
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 4)
        assert h.get_all(b, [h.key(7)]) == []  # listed, not held: a miss (not the peer's fault)
        assert metrics.value("p2p_pull_failures", reason="missing") == 1
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 3, what="the stale entry's withdrawal")
        assert h.get_all(b, keys) == [0.0, 1.0, 2.0]  # not backed off


@pytest.mark.parametrize("secret_a,secret_b,pulled", [(h.S1, h.S1, 2), (h.S1, h.S2, 0), (h.S1, None, 0)])
def test_mac_secrets(url, redis_prefix, secret_a, secret_b, pulled):
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A", chunk_mac_key=secret_a) as a, \
            h.manager(url, redis_prefix, "B", chunk_mac_key=secret_b) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        assert len(h.get_all(b, keys)) == pulled
        if secret_b is not None and secret_b != secret_a:  # A's entry is not signed with B's key: not asked
            assert metrics.value("p2p_skipped_peers", reason="unsigned") >= 1
        elif not pulled:  # B without a key asks its listed peer, which refuses an unsigned request
            assert metrics.value("p2p_pull_failures", reason="refused") + \
                   metrics.value("p2p_pull_failures", reason="corrupt") == 1


def test_without_a_mac_only_trusted_peers_are_asked(url, redis_prefix):
    keys = [h.key(0)]
    with h.manager(url, redis_prefix, "B") as b:
        fake_listing(url, redis_prefix, "far.r0.000000", 9, keys, host="192.0.2.7")  # TEST-NET-1: unroutable
        t0 = time.monotonic()
        assert b.prefix_tiers(keys) == []
        assert time.monotonic() - t0 < 1  # never connected to
        assert metrics.value("p2p_skipped_peers", reason="untrusted") == 1
    with h.manager(url, redis_prefix, "C", chunk_mac_key=h.S1, p2p_pull_timeout_secs=0.3) as c:
        # With a MAC key only entries signed with it are asked (whoever writes the directory's Redis names the
        # addresses): the planted, unsigned one is never connected to either.
        t0 = time.monotonic()
        assert c.prefix_tiers(keys) == []
        assert time.monotonic() - t0 < 1
        assert metrics.value("p2p_skipped_peers", reason="unsigned") == 1


def test_the_server_refuses_untrusted_peers_without_a_mac(make_chunk):
    got: list = []
    keyed = KeyedChunks(lambda k: got.append(k), mac=None, trusted=lambda host: host == "127.0.0.1")
    assert keyed.checkout([h.key(0)], "192.0.2.7").objs == [] and got == []
    assert metrics.value("p2p_refused_fetches") == 1
    keyed.checkout([h.key(0)], "127.0.0.1")
    assert got == [h.key(0)]


# ---------------------------------------------------------------- what a directory writer can do (issue 39 #2, #5)
def test_without_a_key_or_pd_peers_a_loopback_peer_is_not_asked(url, redis_prefix):
    """Loopback is nobody's by default: before, any process on the host listed itself and served chunks."""
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A") as a, h.manager(url, redis_prefix, "B", pd_peers=[]) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        assert h.get_all(b, keys) == []
        assert metrics.value("p2p_skipped_peers", reason="untrusted") >= 1
        assert metrics.value("p2p_pulled_chunks", peer="other") == 0
        assert metrics.value("p2p_refused_fetches") == 0  # never even asked


def test_a_listed_host_is_asked_only_at_its_listed_ports(url, redis_prefix):
    keys = [h.key(0)]
    asked = FakePeer(lambda request, conn: wire.frame_bytes(wire.end_reply(0)))
    try:
        with h.manager(url, redis_prefix, "B", pd_peers=[f"127.0.0.1:{asked.port + 1}"]) as b:
            fake_listing(url, redis_prefix, "other.r0.000000", asked.port, keys)
            assert b.prefix_tiers(keys) == []
            assert asked.connections == 0  # the directory named a port pd_peers does not list
            assert metrics.value("p2p_skipped_peers", reason="untrusted") == 1
    finally:
        asked.close()


def test_one_entry_with_a_bad_signature_is_skipped_and_every_lookup_still_works(url, redis_prefix):
    """A `sig` that is not ASCII made hmac.compare_digest raise on every P2P lookup of the fleet (one writer of
    the directory turned every lookup into an error); now signatures are compared as bytes, the entry
    skipped, the others used."""
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A", chunk_mac_key=h.S1) as a, \
            h.manager(url, redis_prefix, "B", chunk_mac_key=h.S1) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        for sid, sig in (("bad1.r0.000000", "é" * 64), ("bad2.r0.000000", "zz"), ("bad3.r0.000000", "00" * 32)):
            fake_listing(url, redis_prefix, sid, 9, keys)
            c = h.client(url)
            c.hset(info_key(f"{redis_prefix}p2p:", sid), mapping={"sig": sig, "expires": str(int(time.time()) + 60)})
            c.close()
        assert h.get_all(b, keys) == [0.0, 1.0]
        assert metrics.value("p2p_lookup_failures", reason="error") == 0
        assert metrics.value("p2p_skipped_peers", reason="unsigned") >= 3


def test_a_signed_entry_expires_with_its_signature(url, redis_prefix):
    """A signed entry copied from a server that went away was valid forever; now what is signed carries its
    end, renewed with the lease."""
    keys = [h.key(0)]
    with h.manager(url, redis_prefix, "A", chunk_mac_key=h.S1) as a, \
            h.manager(url, redis_prefix, "B", chunk_mac_key=h.S1) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 1)
        tier = h.p2p_tier(b)
        (listed,) = [s for s in h.on_loop(b, tier.directory.servers(fresh=True)) if s.instance == "A"]
        assert listed.expires > time.time() and tier._usable(listed)
        mac = tier.mac
        replayed = ServerInfo(listed.sid, listed.host, listed.port, listed.instance, listed.rank, listed.tp,
                              listed.spaces, expires=int(time.time() - 120))
        replayed = ServerInfo(**{**replayed.__dict__, "sig": mac.compute(replayed.signed_bytes(), b"").hex()})
        assert not tier._usable(replayed)


def test_directory_reads_are_bounded(url, redis_prefix):
    """Whoever can write the directory's Redis can make its set of servers huge or an info hash huge: a lookup
    reads at most 1024 server ids, and skips an info whose fields hold more than 64 KiB (before: SMEMBERS and
    HGETALL of whatever was there)."""
    p = f"{redis_prefix}p2p:"
    c = h.client(url)
    try:
        pipe = c.pipeline(transaction=False)
        for i in range(3000):
            sid = f"planted{i}.r0.000000"
            pipe.hset(info_key(p, sid), mapping=ServerInfo(sid, "192.0.2.7", 9, sid, 0, 1).mapping())
            pipe.sadd(servers_key(p), sid)
        pipe.execute()
        c.hset(info_key(p, "huge.r0.000000"), mapping={**ServerInfo("huge.r0.000000", "192.0.2.8", 9, "huge", 0,
                                                                    1).mapping(), "spaces": "x" * (1 << 20)})
        c.sadd(servers_key(p), "huge.r0.000000")
    finally:
        c.close()
    with h.manager(url, redis_prefix, "B") as b:
        servers = h.on_loop(b, h.p2p_tier(b).directory.servers(fresh=True))
        assert len(servers) <= 1024
        assert all(s.sid != "huge.r0.000000" for s in servers)
        assert b.prefix_tiers([h.key(0)]) == []  # a lookup still answers
