"""Tests for lmcache_vllm.memory: exact-size allocation, coalescing, refs/pins, LRU eviction, waiting."""

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_vllm.memory import ALIGNMENT, AllocationError, HostAllocator

KiB = 1024


def test_exact_size_view_and_alignment():
    alloc = HostAllocator(1 << 20, pin_memory=False)
    a = alloc.allocate((3, 5), torch.bfloat16)
    b = alloc.allocate(100, torch.uint8)
    assert a.tensor.shape == (3, 5) and a.tensor.dtype == torch.bfloat16
    assert a.nbytes == 30 and b.nbytes == 100
    assert a.offset % ALIGNMENT == 0 and b.offset % ALIGNMENT == 0
    assert alloc.used_bytes == 64 + 128  # rounded to the alignment, not to a power of two
    # The view really is arena memory.
    a.tensor.fill_(1.5)
    assert alloc.arena[a.offset:a.offset + 30].view(torch.bfloat16).eq(1.5).all()
    c = alloc.allocate((5 * KiB,), torch.uint8)
    assert c.reserved == 5 * KiB  # a non power of two stays exact
    for obj in (a, b, c):
        obj.ref_down()
    assert alloc.used_bytes == 0


def test_free_coalesces_into_one_block():
    alloc = HostAllocator(4 * KiB, pin_memory=False)
    objs = [alloc.allocate(KiB, torch.uint8) for _ in range(4)]
    with pytest.raises(AllocationError):
        alloc.allocate(1, torch.uint8)
    for i in (1, 3, 0, 2):  # free in an order that needs merging on both sides
        objs[i].ref_down()
    assert alloc.stats()["free_blocks"] == 1
    whole = alloc.allocate(4 * KiB, torch.uint8)  # only fits if everything coalesced
    whole.ref_down()


def test_refcount_double_free_and_use_after_free():
    alloc = HostAllocator(KiB, pin_memory=False)
    obj = alloc.allocate(10, torch.uint8)
    obj.ref_up()
    obj.ref_down()
    assert alloc.used_bytes == 64 and not obj.freed
    obj.ref_down()
    assert obj.freed and alloc.used_bytes == 0
    with pytest.raises(AllocationError, match="double free"):
        obj.ref_down()
    with pytest.raises(AllocationError, match="use after free"):
        _ = obj.tensor
    with pytest.raises(AllocationError):
        obj.unpin()


def test_unpin_without_pin_raises():
    alloc = HostAllocator(KiB, pin_memory=False)
    obj = alloc.allocate(10, torch.uint8)
    with pytest.raises(AllocationError, match="unpin"):
        obj.unpin()


def test_too_large_fails_at_once():
    alloc = HostAllocator(KiB, pin_memory=False)
    t0 = time.monotonic()
    with pytest.raises(AllocationError, match="larger than the whole arena"):
        alloc.allocate(2 * KiB, torch.uint8, timeout=10)
    assert time.monotonic() - t0 < 1


class Owner:
    """A tiny stand-in for the L1 index: holds one ref per entry and drops it on eviction."""

    def __init__(self):
        self.entries = {}
        self.evicted = []

    def add(self, name, obj):
        self.entries[name] = obj
        obj.set_evictor(lambda o, name=name: self.evict(name, o))

    def evict(self, name, obj):
        if self.entries.get(name) is obj:
            del self.entries[name]
            self.evicted.append(name)
            obj.ref_down()


def test_lru_eviction_order_and_touch():
    alloc = HostAllocator(4 * KiB, pin_memory=False)
    owner = Owner()
    for name in "abcd":
        owner.add(name, alloc.allocate(KiB, torch.uint8))
    owner.entries["a"].touch()  # a is now most recently used; b is the LRU
    e = alloc.allocate(KiB, torch.uint8)
    assert owner.evicted == ["b"]
    f = alloc.allocate(2 * KiB, torch.uint8)  # needs two more, and they must be adjacent
    # LRU order is now c, d, a; c and d sit next to each other, so evicting them is enough.
    assert owner.evicted == ["b", "c", "d"]
    assert set(owner.entries) == {"a"} and alloc.used_bytes == alloc.capacity
    for obj in (e, f):
        obj.ref_down()


def test_pinned_and_referenced_objects_are_not_evicted():
    alloc = HostAllocator(3 * KiB, pin_memory=False)
    owner = Owner()
    for name in "abc":
        owner.add(name, alloc.allocate(KiB, torch.uint8))
    owner.entries["a"].pin()
    owner.entries["b"].ref_up()  # a reader holds b
    x = alloc.allocate(KiB, torch.uint8)
    assert owner.evicted == ["c"]
    with pytest.raises(AllocationError) as info:
        alloc.allocate(KiB, torch.uint8, timeout=0.05)
    msg = str(info.value)
    assert "1024 bytes" in msg and "capacity 3072" in msg and "pinned 1024" in msg
    x.ref_down()


def test_an_eviction_looks_at_the_cold_end_of_the_lru_only():
    """A full L1 evicts on every store: picking the victims must not walk (or copy) every chunk it holds."""
    alloc = HostAllocator(1000 * KiB, pin_memory=False)
    owner = Owner()
    for i in range(1000):
        owner.add(i, alloc.allocate(KiB, torch.uint8))
    looked_at = []

    class CountingLru(type(alloc._lru)):
        def values(self):
            for obj in super().values():
                looked_at.append(obj)
                yield obj

        def items(self):
            for key, obj in super().items():
                looked_at.append(obj)
                yield key, obj

    alloc._lru = CountingLru(alloc._lru)
    owner.entries[0].pin()  # the coldest is in use: skipped, the next two go
    x = alloc.allocate(2 * KiB, torch.uint8)
    assert owner.evicted == [1, 2]
    assert len(looked_at) <= 4  # the pinned one, the two victims, and the one after them that ends the walk
    assert list(alloc._lru)[:2] == [id(owner.entries[0]), id(owner.entries[3])]
    x.ref_down()


def test_non_evictable_objects_are_never_evicted():
    alloc = HostAllocator(2 * KiB, pin_memory=False)
    a = alloc.allocate(KiB, torch.uint8)
    b = alloc.allocate(KiB, torch.uint8)
    with pytest.raises(AllocationError):
        alloc.allocate(KiB, torch.uint8)
    assert not a.freed and not b.freed


def test_wait_for_unpin_then_evict():
    alloc = HostAllocator(KiB, pin_memory=False)
    owner = Owner()
    owner.add("a", alloc.allocate(KiB, torch.uint8))
    owner.entries["a"].pin()
    obj_a = owner.entries["a"]
    timer = threading.Timer(0.1, obj_a.unpin)
    timer.start()
    t0 = time.monotonic()
    new = alloc.allocate(KiB, torch.uint8, timeout=5)
    assert 0.05 < time.monotonic() - t0 < 4
    assert owner.evicted == ["a"]
    new.ref_down()
    timer.join()


def test_wait_for_free_across_threads_and_timeout():
    alloc = HostAllocator(KiB, pin_memory=False)
    held = alloc.allocate(KiB, torch.uint8)
    threading.Timer(0.1, held.ref_down).start()
    got = alloc.allocate(KiB, torch.uint8, timeout=5)
    got_t0 = time.monotonic()
    with pytest.raises(AllocationError, match="within 0.2s"):
        alloc.allocate(KiB, torch.uint8, timeout=0.2)
    assert 0.15 < time.monotonic() - got_t0 < 3
    got.ref_down()


def test_concurrent_allocations_do_not_overlap():
    alloc = HostAllocator(64 * KiB, pin_memory=False)
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(200):
                n = int(torch.randint(1, 4 * KiB, (1,), generator=gen))
                obj = alloc.allocate(n, torch.uint8, timeout=5)
                obj.tensor.fill_(seed)
                if not bool(obj.tensor.eq(seed).all()):
                    errors.append("overwritten")
                obj.ref_down()
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert alloc.used_bytes == 0


def test_callback_exception_does_not_wedge_allocator():
    alloc = HostAllocator(KiB, pin_memory=False)
    bad = alloc.allocate(KiB, torch.uint8)
    bad.set_evictor(lambda o: (_ for _ in ()).throw(RuntimeError("owner bug")))
    with pytest.raises(AllocationError):
        alloc.allocate(KiB, torch.uint8, timeout=0.05)
    assert not bad.evictable  # taken off the LRU list: not retried forever


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 3000), st.booleans()),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
        st.tuples(st.just("pin"), st.integers(0, 1 << 30)),
        st.tuples(st.just("unpin"), st.integers(0, 1 << 30)),
        st.tuples(st.just("touch"), st.integers(0, 1 << 30)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_sequences_never_overlap_and_end_empty(sequence):
    alloc = HostAllocator(8 * KiB, pin_memory=False)
    live = []  # objects the test holds a ref on (owner's ref for evictable ones)
    pins = []

    def on_evict(obj):
        live.remove(obj)
        obj.ref_down()

    for op in sequence:
        if op[0] == "alloc":
            try:
                obj = alloc.allocate(op[1], torch.uint8, timeout=0)
            except AllocationError:
                continue
            live.append(obj)
            if op[2]:
                obj.set_evictor(on_evict)
        elif live and op[0] == "free":
            obj = live.pop(op[1] % len(live))
            obj.clear_evictor()
            while obj in pins:
                pins.remove(obj)
                obj.unpin()
            obj.ref_down()
        elif live and op[0] == "pin":
            obj = live[op[1] % len(live)]
            obj.pin()
            pins.append(obj)
        elif pins and op[0] == "unpin":
            pins.pop(op[1] % len(pins)).unpin()
        elif live and op[0] == "touch":
            live[op[1] % len(live)].touch()
        # Invariants: live regions are disjoint, inside the arena, and add up to used_bytes.
        regions = sorted((o.offset, o.offset + o.reserved) for o in live)
        for (_s0, e0), (s1, _) in zip(regions, regions[1:]):
            assert e0 <= s1
        assert all(0 <= s and e <= alloc.capacity for s, e in regions)
        assert alloc.used_bytes == sum(e - s for s, e in regions)
        assert all(not o.freed for o in live)
    for obj in pins:
        obj.unpin()
    for obj in list(live):
        obj.clear_evictor()
        obj.ref_down()
    assert alloc.used_bytes == 0 and alloc.pinned_bytes == 0
    assert alloc.stats()["free_blocks"] == 1


def test_callback_that_keeps_its_ref_cannot_cause_an_endless_loop():
    alloc = HostAllocator(KiB, pin_memory=False)
    stubborn = alloc.allocate(KiB, torch.uint8)
    calls = []
    stubborn.set_evictor(calls.append)  # "forgets" to drop its reference
    t0 = time.monotonic()
    with pytest.raises(AllocationError):
        alloc.allocate(KiB, torch.uint8, timeout=0.2)
    assert calls == [stubborn] and time.monotonic() - t0 < 3
    assert alloc.stats()["evictions"] == 1 and not stubborn.freed


def test_arena_pinned_only_with_cuda():
    alloc = HostAllocator(KiB)
    assert alloc.pinned_arena == torch.cuda.is_available()
    assert alloc.arena.is_pinned() == alloc.pinned_arena


def test_arena_and_large_objects_start_on_a_page():
    alloc = HostAllocator(1 << 20, pin_memory=False)
    assert alloc.arena.data_ptr() % 4096 == 0
    # Large objects (>= 64 KiB) take whole pages, so in an arena of KV chunks each one starts on a
    # page and the disk tier can write it with O_DIRECT.
    big = [alloc.allocate((70_001,), torch.uint8) for _ in range(3)]
    assert [b.reserved % 4096 for b in big] == [0, 0, 0]
    assert all(b.tensor.data_ptr() % 4096 == 0 for b in big)
    small = alloc.allocate((100,), torch.uint8)
    assert small.reserved == 128  # small objects keep the 64-byte granularity
    for obj in [small, *big]:
        obj.ref_down()
    assert alloc.used_bytes == 0
