"""The pin ledger (`storage/pins.py`) on a real L1: owners (cache_salt), refcounts, per-tenant and total budgets
with a clear refusal, expiry, forced drops; and L1's per-tenant quotas (`storage/tenants.py`), which evict
within the tenant only and never a pinned chunk."""
from __future__ import annotations

import threading

import pytest
import torch

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.local_cpu import LocalCPUBackend
from lmcache_vllm.storage.pins import PinLedger, PinRefused

SHAPE = (4, 1024)  # 16 KiB of float32
NBYTES = 4 * 1024 * 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _store(l1: LocalCPUBackend, key: str, tenant: str = "") -> None:
    obj = l1.allocate(SHAPE, torch.float32)
    l1.put_sync(key, obj, tenant)
    obj.ref_down()  # the caller's ref; the index keeps its own


def _held(l1: LocalCPUBackend, *keys: str):
    return [l1.get_sync(k) for k in keys]


def test_pins_survive_l1_pressure_and_are_refcounted_per_owner():
    l1 = LocalCPUBackend(HostAllocator(6 * NBYTES))
    for key in "abcdef":
        _store(l1, key)
    ledger = PinLedger(4 * NBYTES, 4 * NBYTES, ttl_s=None)
    ledger.pin("t1", "ab", ["a", "b"], _held(l1, "a", "b"))
    ledger.pin("t1", "ab", ["a", "b"], _held(l1, "a", "b"))  # a second explicit pin: counted, no new refs
    (entry,) = ledger.entries()
    assert entry.count == 2 and entry.nbytes == 2 * NBYTES
    for key in "ghij":  # four new chunks: only c..f can make room
        _store(l1, key)
    assert l1.contains_sync("a") and l1.contains_sync("b") and ledger.pinned("a")
    assert ledger.unpin("t1", "ab") == 1 and l1.get_sync("a").ref_count == 3  # still pinned (and ours)
    assert ledger.unpin("t2", "ab") is None  # another tenant's unpin does not touch t1's pin
    assert ledger.unpin("t1", "ab") == 0 and not ledger.pinned("a") and len(ledger) == 0
    assert metrics.value("pins_released", reason="unpinned") == 1
    _store(l1, "k")
    _store(l1, "l")
    assert not l1.contains_sync("b")  # evictable again
    ledger.close()


def test_a_pin_past_a_budget_is_refused_and_keeps_nothing():
    l1 = LocalCPUBackend(HostAllocator(8 * NBYTES))
    for key in "abcdef":
        _store(l1, key)
    ledger = PinLedger(total_budget_bytes=4 * NBYTES, tenant_budget_bytes=2 * NBYTES, ttl_s=None)
    ledger.pin("x", "ab", ["a", "b"], _held(l1, "a", "b"))
    objs = _held(l1, "c")
    with pytest.raises(PinRefused, match="cache_salt 'x'") as refused:
        ledger.pin("x", "c", ["c"], objs)
    assert refused.value.reason == "tenant_budget" and objs[0].ref_count == 1  # the reference went back
    ledger.pin("y", "cd", ["c", "d"], _held(l1, "c", "d"))
    with pytest.raises(PinRefused) as refused:
        ledger.pin("z", "e", ["e"], _held(l1, "e"))
    assert refused.value.reason == "total_budget"
    assert sorted(e.tenant for e in ledger.entries()) == ["x", "y"]  # nobody's pin went
    assert metrics.value("pins_refused", reason="tenant_budget") == 1
    assert metrics.value("pins_refused", reason="total_budget") == 1
    with pytest.raises(ValueError):
        ledger.pin("y", "nothing", ["zz"], [])
    ledger.close()
    off = PinLedger(0, 0, ttl_s=None)
    objs = _held(l1, "f")
    with pytest.raises(PinRefused) as refused:
        off.pin("", "f", ["f"], objs)
    assert refused.value.reason == "off" and objs[0].ref_count == 1
    off.close()


def test_pins_expire_after_their_ttl_and_a_renewal_moves_the_expiry():
    l1 = LocalCPUBackend(HostAllocator(4 * NBYTES))
    for key in "abc":
        _store(l1, key)
    clock = Clock()
    ledger = PinLedger(4 * NBYTES, 4 * NBYTES, ttl_s=10.0, clock=clock)
    ledger.pin("", "a", ["a"], _held(l1, "a"))
    ledger.pin("", "b", ["b"], _held(l1, "b"))
    clock.now += 6
    ledger.pin("", "b", ["b"], _held(l1, "b"), counted=False)  # renewed: expires 10 s from now
    assert not ledger.due()
    clock.now += 5
    assert ledger.due() and ledger.expire() == 1
    assert [e.name for e in ledger.entries()] == ["b"] and l1.get_sync("a").ref_count == 2  # the index's, ours
    clock.now += 6
    assert ledger.expire() == 1 and len(ledger) == 0 and not ledger.due()
    assert metrics.value("pins_released", reason="expired") == 2
    ledger.close()


def test_a_forced_delete_drops_every_pin_holding_a_key():
    l1 = LocalCPUBackend(HostAllocator(4 * NBYTES))
    for key in "abc":
        _store(l1, key)
    ledger = PinLedger(8 * NBYTES, 8 * NBYTES, ttl_s=None)
    ledger.pin("s", "ab", ["a", "b"], _held(l1, "a", "b"))
    ledger.pin("t", "bc", ["b", "c"], _held(l1, "b", "c"))
    ledger.pin("t", "c", ["c"], _held(l1, "c"))
    assert ledger.drop_keys(["b"]) == 2
    assert [e.name for e in ledger.entries()] == ["c"] and not ledger.pinned("b") and ledger.pinned("c")
    assert ledger.usage() == {"t": NBYTES}
    ledger.clear()
    assert ledger.pinned_bytes == 0 and [o.ref_count for o in _held(l1, "a", "b", "c")] == [2, 2, 2]
    ledger.close()


def test_concurrent_pins_and_unpins_keep_the_books_straight():
    l1 = LocalCPUBackend(HostAllocator(64 * NBYTES))
    keys = [f"k{i}" for i in range(32)]
    for key in keys:
        _store(l1, key)
    ledger = PinLedger(64 * NBYTES, 64 * NBYTES, ttl_s=None)

    def work(tenant: str) -> None:
        for _ in range(50):
            for key in keys[:8]:
                ledger.pin(tenant, key, [key], _held(l1, key))
            for key in keys[:8]:
                ledger.unpin(tenant, key)

    threads = [threading.Thread(target=work, args=(t,)) for t in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger) == 0 and ledger.pinned_bytes == 0 and ledger.usage() == {}
    assert all(obj.ref_count == 2 for obj in _held(l1, *keys[:8]))  # the index's and ours
    ledger.close()


# ---------------------------------------------------------------------------------------- quotas of L1
def test_a_quota_evicts_its_own_tenants_least_recently_used_chunks_and_never_a_pinned_one():
    l1 = LocalCPUBackend(HostAllocator(16 * NBYTES))
    for key in ("a1", "a2", "a3"):
        _store(l1, key, "a")
    for key in ("b1", "b2"):
        _store(l1, key, "b")
    pinned = _held(l1, "a1")  # a1 is held (a pin, a load): never evicted while so
    l1.get_sync("a2").ref_down()  # a2 used: a3 is now a's least recently used unheld chunk
    assert l1.tenants.usage() == {"a": 3 * NBYTES, "b": 2 * NBYTES}
    l1.tenants.set_limit("a", 2 * NBYTES)
    assert l1.enforce_quota("a") == 1
    assert not l1.contains_sync("a3") and l1.contains_sync("a1") and l1.contains_sync("a2")
    assert l1.tenants.usage() == {"a": 2 * NBYTES, "b": 2 * NBYTES}
    _store(l1, "a4", "a")  # a store past the quota evicts within the tenant at once
    assert not l1.contains_sync("a2") and l1.contains_sync("a4") and l1.contains_sync("b1")
    l1.tenants.set_limit("a", 0)
    assert l1.enforce_quota("a") == 1 and l1.contains_sync("a1")  # held: stays
    assert metrics.value("quota_evictions", tier="local_cpu") == 3
    assert l1.tenants.delete_limit("a") and not l1.tenants.delete_limit("a")
    pinned[0].ref_down()
    l1.clear_sync()
    assert l1.tenants.usage() == {}
