"""Tests for lmcache_vllm.storage.local_cpu: the L1 index over the HostAllocator (refs, LRU, pins)."""

import torch

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.local_cpu import LocalCPUBackend

SHAPE = (4, 1024)  # 16 KiB of float32
NBYTES = 4 * 1024 * 4


def _stored(l1: LocalCPUBackend, key: str, value: float):
    obj = l1.allocate(SHAPE, torch.float32)
    obj.tensor.fill_(value)
    l1.put_sync(key, obj)
    obj.ref_down()  # the caller's ref; the index keeps its own
    return obj


def test_put_get_round_trip_and_refs():
    l1 = LocalCPUBackend(HostAllocator(4 * NBYTES))
    obj = l1.allocate(SHAPE, torch.float32)
    obj.tensor.fill_(3.0)
    assert l1.put_sync("a", obj)
    assert obj.ref_count == 2
    obj.ref_down()
    got = l1.get_sync("a")
    assert got is obj and got.ref_count == 2 and torch.all(got.tensor == 3.0)
    got.ref_down()
    assert l1.get_sync("b") is None
    assert l1.contains_sync("a") and not l1.contains_sync("b")


def test_second_put_of_same_key_keeps_first():
    l1 = LocalCPUBackend(HostAllocator(4 * NBYTES))
    first = _stored(l1, "a", 1.0)
    dup = l1.allocate(SHAPE, torch.float32)
    l1.put_sync("a", dup)
    assert dup.ref_count == 1  # not taken by the index
    dup.ref_down()
    got = l1.get_sync("a")
    assert got is first
    got.ref_down()


def test_lru_eviction_when_arena_is_full():
    l1 = LocalCPUBackend(HostAllocator(3 * NBYTES))
    _stored(l1, "a", 1.0)
    _stored(l1, "b", 2.0)
    _stored(l1, "c", 3.0)
    l1.get_sync("a").ref_down()  # a is now more recent than b
    _stored(l1, "d", 4.0)  # needs room: b is the least recently used
    assert [l1.contains_sync(k) for k in "abcd"] == [True, False, True, True]
    assert metrics.value("evictions", tier="local_cpu") == 1


def test_lip_evicts_the_newest_unused_entry_and_keeps_a_loop_partly():
    """cache_policy LIP (insert_cold): a new entry is the next to go until a get makes it recent, so a loop of
    chunks larger than L1 keeps some of them instead of evicting each just before its next use (LRU)."""
    for insert_cold, kept in ((False, "acd"), (True, "abd")):
        l1 = LocalCPUBackend(HostAllocator(3 * NBYTES, insert_cold=insert_cold))
        for key in "abc":
            _stored(l1, key, 1.0)
        l1.get_sync("a").ref_down()
        _stored(l1, "d", 4.0)  # LRU: b is the least recently used; LIP: c, never used since it came
        assert "".join(k for k in "abcd" if l1.contains_sync(k)) == kept
    hits = {}
    for insert_cold in (False, True):
        l1 = LocalCPUBackend(HostAllocator(3 * NBYTES, insert_cold=insert_cold))
        hits[insert_cold] = 0
        for _ in range(5):
            for key in "abcde":  # each chunk looked up (and loaded) in turn, stored again when missing
                got = l1.get_sync(key)
                if got is None:
                    _stored(l1, key, 1.0)
                else:
                    hits[insert_cold] += 1
                    got.ref_down()
    assert hits == {False: 0, True: 8}


def test_pinned_and_referenced_entries_are_not_evicted():
    l1 = LocalCPUBackend(HostAllocator(2 * NBYTES))
    a = _stored(l1, "a", 1.0)
    _stored(l1, "b", 2.0)
    a.pin()
    held_b = l1.get_sync("b")  # a reader holds b
    obj = l1.try_allocate(SHAPE, torch.float32)
    assert obj is None  # (the tier being read counts read_alloc_failures)
    assert l1.contains_sync("a") and l1.contains_sync("b")
    a.unpin()
    obj = l1.try_allocate(SHAPE, torch.float32)  # now a can go
    assert obj is not None and not l1.contains_sync("a") and l1.contains_sync("b")
    obj.ref_down()
    held_b.ref_down()


def test_remove_and_clear_free_memory():
    alloc = HostAllocator(4 * NBYTES)
    l1 = LocalCPUBackend(alloc)
    _stored(l1, "a", 1.0)
    _stored(l1, "b", 2.0)
    assert alloc.used_bytes == 2 * NBYTES
    assert l1.remove_sync("a") and not l1.remove_sync("a")
    assert alloc.used_bytes == NBYTES
    l1.clear_sync()
    assert alloc.used_bytes == 0 and len(l1) == 0


def test_staging_only_mode_keeps_nothing():
    alloc = HostAllocator(4 * NBYTES)
    l1 = LocalCPUBackend(alloc, keep_entries=False)
    obj = l1.allocate(SHAPE, torch.float32)
    assert not l1.put_sync("a", obj)
    obj.ref_down()
    assert not l1.contains_sync("a") and alloc.used_bytes == 0
