"""P2P sharing between storage managers on a real redis-server and real sockets: what one instance stores is a
hit for another (pulled and verified), entries follow L1 (eviction withdraws them, a clean close removes
them, a killed instance's expire with its lease), never from itself, rank to rank, and what the directory
costs per chunk (`MEMORY USAGE`)."""
from __future__ import annotations

import signal

import p2p_helpers as h
import pytest

from lmcache_vllm.observability import kv_events, metrics
from lmcache_vllm.storage.p2p.directory import ServerInfo, chunk_id, chunks_key
from lmcache_vllm.storage.p2p.peers import Backoff, PeerTrust, plan_pulls
from lmcache_vllm.storage.tier import Tier


@pytest.fixture
def url(redis_server) -> str:
    redis_server.ensure_running()
    return redis_server.url


def test_b_loads_what_only_a_computed(url, redis_prefix):
    keys = [h.key(i) for i in range(4)]
    with h.manager(url, redis_prefix, "A") as a, h.manager(url, redis_prefix, "B") as b:
        h.store(a, keys[:3])
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 3, what="A's entries")
        assert b.prefix_tiers(keys) == [Tier.P2P] * 3
        assert h.get_all(b, keys) == [0.0, 1.0, 2.0]  # pulled and verified
        assert b.contains(keys) == [False] * 4  # not kept: each chunk stays where it was computed
        label = f"{h.p2p_tier(a).info.host}:{h.p2p_tier(a).server.port}"
        assert metrics.value("p2p_pulled_chunks", peer=label) == 3
        assert metrics.value("p2p_pulled_bytes", peer=label) == 3 * 8192
        assert metrics.value("chunk_hits", tier="p2p") == 3
        assert metrics.value("p2p_served_chunks") == 3
        assert metrics.value("pd_served_chunks") == 0  # disaggregated prefill's count is its own
        assert metrics.value("p2p_pull_failures", reason="missing") == 0
        assert h.entries(url, redis_prefix, b) == 0  # pulled chunks are not listed again, nor written through
    assert h.servers(url, redis_prefix) == set()  # a clean close withdraws every entry


def test_what_l1_evicts_is_withdrawn(url, redis_prefix):
    keys = [h.key(i) for i in range(40)]
    with h.manager(url, redis_prefix, "A", l1_mib=0.125) as a:  # 16 chunks of 8 KiB
        h.store(a, keys)
        held = sum(a.contains(keys))
        assert 0 < held < len(keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == held, what="withdrawals")
        assert metrics.value("p2p_directory_entries") == held
        a.clear(lower_tiers=True)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 0, what="the reset's withdrawals")


def test_with_serve_disk_what_l1_evicted_is_served_from_the_disk(url, redis_prefix, tmp_path):
    keys = [h.key(i) for i in range(40)]
    with h.manager(url, redis_prefix, "A", l1_mib=0.125, p2p_serve_disk=True, disk=tmp_path) as a, \
            h.manager(url, redis_prefix, "B") as b:
        h.store(a, keys)
        assert sum(a.contains(keys)) < len(keys)  # L1 evicted most; the disk has every one
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == len(keys), what="entries of disk chunks")
        assert h.get_all(b, keys[:8]) == [float(i) for i in range(8)]  # (read into A's small arena for the send)
        assert metrics.value("p2p_pull_failures", reason="missing") == 0


def test_with_serve_disk_a_clear_of_every_tier_withdraws_every_entry(url, redis_prefix, tmp_path):
    # vLLM's reset_prefix_cache(reset_external) empties L1 first, while the disk still holds each chunk (so L1's
    # listener keeps them listed), then the disk: left listed, every later pull of them was a "missing" one,
    # and each request that had planned that load recomputed all of it.
    keys = [h.key(i) for i in range(40)]
    with h.manager(url, redis_prefix, "A", l1_mib=0.125, p2p_serve_disk=True, disk=tmp_path) as a, \
            h.manager(url, redis_prefix, "B") as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == len(keys), what="entries of disk chunks")
        assert a.clear(lower_tiers=True)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 0, what="the clear's withdrawals")
        assert b.prefix_tiers(keys) == []
        assert metrics.value("p2p_pull_failures", reason="missing") == 0
        h.store(a, keys[:2])  # stored again: listed again
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2, what="entries of the new chunks")


def test_never_pulls_from_its_own_instance(url, redis_prefix):
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A") as a, h.manager(url, redis_prefix, "A", rank=0) as a_again:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        assert a_again.prefix_tiers(keys) == []  # another manager of the same instance: never a peer
        assert metrics.value("p2p_pulled_chunks", peer=f"{h.p2p_tier(a).info.host}:{h.p2p_tier(a).server.port}") == 0


def test_rank_to_rank_and_other_tp_sizes_named(url, redis_prefix, caplog):
    tp2 = [h.key(i, tp="tp2.1") for i in range(2)]
    with h.manager(url, redis_prefix, "A", rank=1, tp=2) as a, \
            h.manager(url, redis_prefix, "B", rank=1, tp=2) as b, \
            h.manager(url, redis_prefix, "C", rank=0, tp=1) as c:
        h.store(a, tp2)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        assert h.get_all(b, tp2) == [0.0, 1.0]  # rank 1 of B from rank 1 of A
        tp1 = [h.key(i, tp="tp1.0") for i in range(2)]  # the same model at TP 1: other keys, never A's
        assert c.prefix_tiers(tp1) == []
        assert metrics.value("p2p_skipped_peers", reason="tp_mismatch") >= 1
        assert "serves this model at tensor_parallel_size=2, this one runs 1" in caplog.text


def test_a_killed_instance_is_a_bounded_miss_and_its_entries_expire(url, redis_prefix):
    keys = [h.key(i) for i in range(3)]
    child, sid = h.serve_in_child(url, redis_prefix, "A", 3, lease_s=2.0)
    try:
        with h.manager(url, redis_prefix, "B", p2p_pull_timeout_secs=1.0) as b:
            assert h.get_all(b, keys[:1]) == [0.0]
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            b.l1.clear_sync()
            assert b.prefix_tiers(keys) == [Tier.P2P] * 3  # still listed: its lease runs
            assert h.get_all(b, keys) == []  # unreachable: a counted miss, recomputed
            assert metrics.value("p2p_pull_failures", reason="unreachable") == 1
            assert b.prefix_tiers(keys) == []  # skipped for a while
            assert metrics.value("p2p_skipped_peers", reason="backoff") >= 1
            c = h.client(url)
            h.wait_until(lambda: not c.exists(chunks_key(f"{redis_prefix}p2p:", sid)), timeout=10,
                         what="the dead instance's lease")
            c.close()
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.parametrize("keep", [True, False])
def test_kept_pulled_chunks_are_in_l1_and_announced_as_kv_events(url, redis_prefix, keep):
    keys = [h.key(i) for i in range(2)]
    with h.manager(url, redis_prefix, "A") as a, h.manager(url, redis_prefix, "B", p2p_keep_pulled=keep) as b:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == 2)
        kv_events.RECORDER.enabled = True
        kv_events.RECORDER.take()
        assert len(h.get_all(b, keys)) == 2
        assert b.contains(keys) == [keep, keep]
        stored = [e for e in kv_events.RECORDER.take() if e.stored]
        assert [e.tier for e in stored] == ([Tier.LOCAL_CPU] * 2 if keep else [])  # in B's L1, as any promotion
        assert h.entries(url, redis_prefix, b) == 0  # a copy is never listed


def test_directory_costs_bytes_not_chunks(url, redis_prefix, capsys):
    keys = [h.key(i) for i in range(2000)]
    with h.manager(url, redis_prefix, "A", l1_mib=20) as a:
        h.store(a, keys)
        h.wait_until(lambda: h.entries(url, redis_prefix, a) == len(keys), timeout=20)
        c = h.client(url)
        used = c.memory_usage(chunks_key(f"{redis_prefix}p2p:", h.p2p_tier(a).info.sid), samples=0)
        c.close()
        per_chunk = used / len(keys)
        with capsys.disabled():
            print(f"\nP2P directory: {per_chunk:.1f} bytes per chunk (MEMORY USAGE of a set of {len(keys)})")
        assert per_chunk < 64  # an 8-byte id in a set: no key string, no payload


def test_plan_takes_the_longest_stretch_of_one_server():
    a, b, c = (ServerInfo(s, "127.0.0.1", 1000 + i, s, 0, 1) for i, s in enumerate("abc"))
    assert plan_pulls([(a, b), (b,), (b, c), (c,), ()]) == [(b, 0, 3), (c, 3, 4)]
    assert plan_pulls([(a,), (), (a,)]) == [(a, 0, 1)]
    assert plan_pulls([]) == []


def test_trust_is_the_allow_list_with_its_ports_and_loopback_is_nobodys():
    """Issue 39 #2: without a MAC a P2P peer is trusted by its address AND port in pd_peers (the directory is
    anyone's to write who reaches its Redis: before, every port of loopback and of a listed network was)."""
    trust = PeerTrust(["10.1.0.0/16:8200-8203", "192.0.2.9:8200", "gpu-7.lan:9000"],
                      resolve=lambda name: "198.51.100.7")
    assert trust.pulls("10.1.200.3", 8203) and trust.pulls("192.0.2.9", 8200) and trust.pulls("198.51.100.7", 9000)
    assert not trust.pulls("10.1.200.3", 6379) and not trust.pulls("192.0.2.9", 8201)  # other ports: refused
    assert not trust.pulls("127.0.0.1", 8200) and not trust.pulls("::1", 8200)  # loopback: not by default
    assert not trust.pulls("::ffff:127.0.0.1", 8200) and not trust.serves("127.0.0.1")
    assert not trust.pulls("10.2.0.1", 8200) and not trust.pulls("evil.example", 8200) and not trust.pulls("", 1)
    # The directory names addresses: a name (even an allowed one, even localhost) is connected to by nobody.
    assert not trust.pulls("localhost", 8200) and not trust.pulls("gpu-7.lan", 9000)
    # Serving: a listed host or network, from any source port.
    assert trust.serves("10.1.0.1") and trust.serves("198.51.100.7") and not trust.serves("10.2.0.1")
    listed = PeerTrust(["127.0.0.1:8200"])
    assert listed.pulls("::ffff:127.0.0.1", 8200) and listed.serves("127.0.0.1")  # the mapped form is the same


def test_backoff_skips_a_failed_peer_for_a_while():
    now = [0.0]
    backoff = Backoff(10.0, clock=lambda: now[0])
    backoff.failed("a")
    assert backoff.skipped("a") and not backoff.skipped("b")
    now[0] = 10.5
    assert not backoff.skipped("a")


def test_chunk_ids_are_8_bytes_of_the_key():
    assert len(chunk_id(h.key(1))) == 8 and chunk_id(h.key(1)) != chunk_id(h.key(2))


def test_a_fetch_withdraws_only_the_key_it_found_missing():
    """A peer names a key this instance never held, then keys it holds: only the first leaves the directory
    (before: every key after it was withdrawn, so any peer could empty this instance's entries)."""
    import torch

    from lmcache_vllm.memory import HostAllocator
    from lmcache_vllm.storage.transfer.holds import HoldState
    from lmcache_vllm.storage.transfer.keyed import KeyedChunks

    arena = HostAllocator(1 << 20)
    held = {h.key(i): arena.allocate((2, 2, 16, 64), torch.bfloat16) for i in (1, 2)}

    def get(key):
        obj = held.get(key)
        if obj is not None:
            obj.ref_up()
        return obj

    withdrawn: list[str] = []
    keyed = KeyedChunks(get, mac=None, trusted=lambda host: True, on_missing=withdrawn.extend)
    checkout = keyed.checkout(iter([h.key(0), h.key(1), h.key(2)]), "127.0.0.1")
    assert checkout.state == HoldState.READY and checkout.objs == [] and withdrawn == [h.key(0)]
    checkout = keyed.checkout(iter([h.key(1), h.key(9), h.key(2)]), "127.0.0.1")
    assert checkout.keys == (h.key(1),) and withdrawn == [h.key(0), h.key(9)]
    for obj in checkout.objs:
        obj.ref_down()
