"""Tests for lmcache_vllm.memory.prefault: the L1 arena is populated in the background without touching data."""

import pytest
import torch

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.memory.prefault import ArenaPrefaulter


def test_populates_whole_arena_without_changing_its_bytes():
    arena = torch.empty(32 << 20, dtype=torch.uint8)
    arena[:4096].fill_(7)
    arena[-4096:].fill_(9)
    prefaulter = ArenaPrefaulter(arena)
    prefaulter.wait(30)
    if prefaulter.error is not None:
        pytest.skip(f"kernel refuses MADV_POPULATE_WRITE (errno {prefaulter.error})")
    assert not prefaulter.running
    # Every whole page of the arena was populated; what was written before is untouched.
    assert prefaulter.populated_bytes >= arena.numel() - 8192
    assert bool((arena[:4096] == 7).all()) and bool((arena[-4096:] == 9).all())


def test_allocator_prefaults_only_when_asked_and_stops_on_close():
    assert HostAllocator(1 << 20).prefaulter is None
    alloc = HostAllocator(256 << 20, prefault="background")
    obj = alloc.allocate((1 << 20,), torch.uint8)
    obj.tensor.fill_(3)  # allocations are usable while populating runs
    alloc.close()
    assert not alloc.prefaulter.running
    assert bool((obj.tensor == 3).all())
    obj.ref_down()


def test_pinned_or_empty_arenas_are_left_alone():
    prefaulter = ArenaPrefaulter(torch.empty(0, dtype=torch.uint8))
    assert not prefaulter.running and prefaulter.populated_bytes == 0


def test_sync_mode_populates_before_returning_and_bad_modes_are_named():
    alloc = HostAllocator(8 << 20, prefault="sync")
    assert not alloc.prefaulter.running
    assert alloc.prefaulter.populated_bytes > 0 or alloc.prefaulter.error is not None
    with pytest.raises(ValueError, match="'background', 'sync'"):
        HostAllocator(1 << 20, prefault="always")


def test_config_values_map_to_modes():
    from lmcache_vllm.config import ConfigError, LMCacheConfig
    from lmcache_vllm.storage.registry import build_allocator

    def mode(value):
        cfg = LMCacheConfig(max_local_cpu_size=1 / 1024, extra_config={"prefault_local_cpu": value})
        alloc = build_allocator(cfg)
        alloc.close()
        if alloc.prefaulter is None:
            return "off"
        return "sync" if alloc.prefaulter._thread is None else "background"

    assert mode(False) == mode("off") == "off"
    assert mode(True) == mode("background") == "background"
    assert mode("sync") == mode("SYNC") == "sync"
    with pytest.raises(ConfigError, match="extra_config.prefault_local_cpu='yes'.*'sync'"):
        mode("yes")
